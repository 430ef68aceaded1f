"""``launch/train_moe.py``'s command line: bad options and a ds_config the comparison cannot run
on are refused by the parser (exit status 2, one line naming the option) before any rank
starts; the runs' router options are the ds_config's section with ``--aux_loss`` over it."""
import json

import pytest

from launch import train_moe
from megaloss.integrations.deepspeed import load_ds_config


@pytest.mark.parametrize("argv,message", [
    (["--scopes", "micro_batch,globl"], "--scopes micro_batch,globl: each must be one of"),
    (["--scopes", "step,step"], "a scope is named twice"),
    (["--aux_loss", "0"], "--aux_loss must be > 0"),
    (["--top_k", "9"], "--top_k 9 must be <= --num_experts 8"),
    (["--hidden_size", "72"], "--hidden_size must be a multiple of 16"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_moe.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_configs_without_a_router_loss_or_data_parallel_only_are_refused(tmp_path, capsys):
    cfg = json.loads((train_moe.REPO / "configs" / "moe.json").read_text())
    cfg["megaloss"].pop("router")
    (tmp_path / "no_router.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit):
        train_moe.parse_args(["--deepspeed_config", str(tmp_path / "no_router.json")])
    assert "megaloss.router.aux_loss must be > 0" in capsys.readouterr().err
    # --aux_loss supplies the coefficient; TP > 1 is still refused
    train_moe.parse_args(["--deepspeed_config", str(tmp_path / "no_router.json"),
                          "--aux_loss", "0.01"])
    with pytest.raises(SystemExit):
        train_moe.parse_args(["--deepspeed_config", str(train_moe.REPO / "configs" / "zero2.json"),
                              "--aux_loss", "0.01"])
    assert "megaloss.tensor_parallel_size is 2" in capsys.readouterr().err


def test_router_options_flag_over_the_section():
    _, ml = load_ds_config(train_moe.REPO / "configs" / "moe.json")
    default = train_moe.router_options(train_moe.parse_args([]), ml)
    assert (default.aux_loss, default.layers, default.z_loss) == (0.1, "per_layer", 0.0)
    given = train_moe.router_options(train_moe.parse_args(["--aux_loss", "0.05"]), ml)
    assert given.aux_loss == 0.05
    assert train_moe.parse_args([]).scopes == ["micro_batch", "step"]
