"""``launch/distill_lm.py``'s command line: out-of-range options and a missing ``--teacher`` are
refused by the parser (exit status 2, the option named) before any rank starts, and the
distillation options resolve as documented (flags over the job's defaults; reduction ``sum``)."""
import pytest

from launch import distill_lm
from megaloss.integrations.deepspeed import load_ds_config


@pytest.mark.parametrize("argv,message", [
    (["--alpha", "1.5"], "--alpha must be in"),
    (["--beta", "-0.1"], "--beta must be in"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--teacher_steps", "0"], "--teacher_steps must be >= 1"),
    (["--teacher", "no/such/checkpoint"], "--teacher no/such/checkpoint: no such file"),
    (["--kind", "kl"], "invalid choice"),
])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        distill_lm.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_options_flags_over_defaults():
    _, ml = load_ds_config(distill_lm.REPO / "configs" / "zero2.json")
    default = distill_lm.distillation_options(distill_lm.parse_args([]), ml)
    assert (default.kind, default.temperature, default.alpha, default.reduction) == (
        "forward_kl", 1.0, 0.5, "sum")
    assert default.chunk_size == ml.ce.chunk_size
    given = distill_lm.distillation_options(
        distill_lm.parse_args(["--kind", "jsd", "--beta", "0.3", "--alpha", "0"]), ml)
    assert (given.kind, given.beta, given.alpha, given.temperature) == ("jsd", 0.3, 0.0, 1.0)


def test_options_from_the_ds_config_section():
    import json

    cfg = json.loads((distill_lm.REPO / "configs" / "zero2.json").read_text())
    cfg["megaloss"].pop("ce")
    cfg["megaloss"]["distillation"] = {"kind": "reverse_kl", "temperature": 2.0, "alpha": 0.1}
    _, ml = load_ds_config(cfg)
    section = distill_lm.distillation_options(distill_lm.parse_args([]), ml)
    assert (section.kind, section.temperature, section.alpha, section.reduction) == (
        "reverse_kl", 2.0, 0.1, "sum")
    flag = distill_lm.distillation_options(distill_lm.parse_args(["--temperature", "3"]), ml)
    assert (flag.kind, flag.temperature) == ("reverse_kl", 3.0)
