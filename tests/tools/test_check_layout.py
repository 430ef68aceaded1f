"""``megaloss-check-layout`` (``megaloss.cli.check_layout``): "does my layout train like one
device?".

Slow tier: the tool runs twice as a user runs it, from a directory outside the checkout (the
layouts through the ``deepspeed`` launcher on CPU, the one-device references in the tool's
process, two steps of the tiny model), both started with the session as background jobs
(tests/conftest.py). The 4-process run checks four layouts in ONE launch
(``--deepspeed_config a.json b.json ...``, an override per config), the tests read its report
per layout:

- PASS on DP 2 x TP 2 under ZeRO-2 and ZeRO-3 (tied embeddings), the LM job;
- FAIL, naming the cause, when the calibration is deliberately wrong (``--_inject_wrong_scale 3``
  multiplies the third layout's engine-scale loss multiplier by the world size), and the run's
  exit status 1 with the summary naming that layout only;
- PASS on DP 1 x TP 2 x PP 2 (DeepSpeed's pipeline engine; the ZeRO-2 config at ZeRO-1), tied
  embeddings (the weight on the first and the last stage).
- DeepSpeed AutoTP (``"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": true}``,
  ``megaloss.tensor_parallel_size`` 1): PASS on DP 2 x TP 2 under ZeRO-2 (TP read from
  ``autotp_size``, AutoTP's shards gathered for the comparison), and FAIL naming the cause with
  the wrong scale injected (ZeRO-1).

The 2-process run: PASS (exit status 0) for the embedding job (gathered MNR) on DP 2.

Fast tier: the comparison and the diagnosis on hand-made records.
"""
import json
import math
import re
import subprocess
import sys

import pytest

from megaloss.cli import check_layout
from megaloss.configs import config_path

TIED = '{"tie_word_embeddings": true}'


def FOUR_PROCS(test):
    """The tests reading the 4-process run (a background job, tests/conftest.py), on one
    pytest-xdist worker so that it runs once."""
    return pytest.mark.xdist_group("check_layout_four_procs")(
        pytest.mark.background("four_procs")(test))


def _config(tmp_path, stage: int, tp: int = 2) -> str:
    """A shipped config, shrunk (micro-batch 2, GAS 2) and without the lr warm-up from 0, so the
    first step already moves the parameters."""
    cfg = json.loads(config_path(f"zero{stage}").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    cfg.pop("scheduler")
    cfg["megaloss"]["tensor_parallel_size"] = tp
    path = tmp_path / f"zero{stage}-tp{tp}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _run_tool(tmp_path, env, *args):
    # from the test's own directory, as a user runs it on their config (paths relative to it);
    # a hang guard only: a background job runs at a low priority
    proc = subprocess.run([sys.executable, "-m", "megaloss.cli.check_layout", *args,
                           "--steps", "2"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=800)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _sections(out: str):
    """{layout number: its report} of a several-layout run."""
    parts = re.split(r"^=== layout (\d+) of \d+: .* ===$", out, flags=re.M)
    return {int(n): text for n, text in zip(parts[1::2], parts[2::2])}


def background_jobs(folder, env):
    """The tool's runs, started with the session (tests/conftest.py).

    ``help``: ``--help`` from a directory outside the checkout (fast tier: its ~2.5 s of
    importing torch run on the core the single-process tests leave idle); the process.
    ``four_procs``: one launch of 4 processes: 1 ZeRO-2, 2 ZeRO-3 tied, 3 ZeRO-2 with the wrong
    scale injected, 4 DP 1 x TP 2 x PP 2 tied, 5 AutoTP ZeRO-2, 6 AutoTP ZeRO-1 with the wrong
    scale injected; (the process, its report per layout).
    ``embed``: the embedding job on 2 processes; the process."""
    def four_procs():
        tmp_path = folder / "four_procs"
        tmp_path.mkdir()
        zero2 = _config(tmp_path, 2)
        proc = _run_tool(tmp_path, env, "--deepspeed_config", zero2, _config(tmp_path, 3),
                         zero2, _pipeline_config(tmp_path), _autotp_config(tmp_path, 2),
                         _autotp_config(tmp_path, 1), "--config_override", "{}", TIED, "{}",
                         TIED, "{}", "{}", "--num_procs", "4", "--_inject_wrong_scale", "3", "6")
        return proc, _sections(proc.stdout)

    def embed():
        tmp_path = folder / "embed"
        tmp_path.mkdir()
        return _run_tool(tmp_path, env, "--deepspeed_config", _config(tmp_path, 2),
                         "--num_procs", "2", "--job", "embed")

    def help_text():
        return subprocess.run([sys.executable, "-m", "megaloss.cli.check_layout", "--help"],
                              cwd=folder, env=env, capture_output=True, text=True, timeout=120)
    return {"help": help_text, "four_procs": four_procs, "embed": embed}


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(1500)  # it waits for the background jobs before its own (nice 10)
@FOUR_PROCS
@pytest.mark.parametrize("stage", [2, 3])
def test_dp2_tp2_trains_like_one_device(background, stage):
    # ZeRO-3 with the input embedding tied to the lm_head (the embedding on the head's shard)
    proc, sections = background
    out = sections[stage - 1]
    assert f"PASS: DP 2 x TP 2 ZeRO-{stage}" in out, proc.stdout + proc.stderr[-5000:]
    assert ("model tiny (tied embeddings)" in out) == (stage == 3), out
    # the groups and the measured engine scale are reported
    assert "tensor parallel:             [0, 1] [2, 3]" in out
    assert "data parallel:               [0, 2] [1, 3]" in out
    assert f"deepspeed-zero{stage}/engine.backward: gradient_factor 1/4" in out
    assert "loss_multiplier 4, group ranks [0, 2]; GAS x DP = 4" in out
    assert "tolerance (fp32): loss 1e-05" in out


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(1500)
@FOUR_PROCS
def test_wrong_calibration_fails_and_names_the_cause(background):
    proc, sections = background
    out = sections[3]
    assert "FAIL: grad_norm at step 1" in out, proc.stdout + proc.stderr[-5000:]
    # x world size: the gradient is 4 x one device's while the loss is right
    assert "the loss matches at step 1 but the gradient is 4 x one device's" in out
    assert "The loss multiplier in use is 16" in out and "the probe measured 4" in out
    assert "predicts 4" in out
    # the run fails for the layouts with the wrong scale only (3, and 6 under AutoTP)
    assert proc.returncode == 1, proc.stdout
    assert re.search(r"summary: 4 of 6 layouts PASS; FAIL: layout 3 \(\S*zero2-tp2.json\), "
                     r"layout 6 \(\S*autotp2-zero1.json\)$", proc.stdout.strip()), \
        proc.stdout[-500:]


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(1500)
@pytest.mark.background("embed")
def test_embedding_job_trains_like_one_device(background):
    proc = background
    out = proc.stdout
    assert proc.returncode == 0 and "PASS: DP 2 x TP 1 ZeRO-2" in out, out
    assert "data parallel:               [0, 1]" in out and "job embed" in out
    assert "summary" not in out and "=== layout" not in out  # one layout: one plain report


# fast: comparison and diagnosis ------------------------------------------------------------------
def _record(losses, norms, updates, multiplier=4.0, measured=4.0):
    import torch
    p0 = {"w": torch.zeros(3)}
    scale = {"engine": "deepspeed-zero2/engine.backward", "gradient_factor": 1 / multiplier,
             "loss_multiplier": multiplier, "gradient_accumulation_steps": 2, "group_size": 2,
             "measured": 1 / multiplier, "group_ranks": (0, 2)}
    return {"loss": losses, "grad_norm": norms, "params0": p0,
            "params": [{"w": torch.full((3,), u)} for u in updates],
            "used_scale": scale, "measured_scale": {**scale, "loss_multiplier": measured,
                                                    "gradient_factor": 1 / measured},
            "gas": 2, "dp": 2, "tp": 2, "world": 4, "zero_stage": 2, "micro": 2,
            "groups": [{"rank": r, "tp": [r - r % 2, r - r % 2 + 1], "dp": [r % 2, r % 2 + 2],
                        "dp_sp": [r % 2, r % 2 + 2], "engine_reduce": [r % 2, r % 2 + 2]}
                       for r in range(4)]}


def test_compare_passes_within_tolerance():
    ref = _record([2.0, 1.9], [1.0, 0.9], [0.1, 0.2])
    lay = _record([2.0 * (1 + 1e-7), 1.9], [1.0, 0.9 * (1 + 1e-6)], [0.1, 0.2 * (1 + 1e-5)])
    result = check_layout.compare(lay, ref, "fp32")
    assert result["failures"] == [] and result["diagnosis"] == []
    assert result["rows"][1]["update_rel"] == pytest.approx(1e-5, rel=1e-2)


def test_diagnosis_gradient_scale():
    ref = _record([2.0, 1.9], [1.0, 0.9], [0.1, 0.2])
    lay = _record([2.0, 1.9], [4.0, 3.6], [0.1, 0.2], multiplier=16.0, measured=4.0)
    result = check_layout.compare(lay, ref, "fp32")
    assert [f[:2] for f in result["failures"]] == [(1, "grad_norm"), (2, "grad_norm")]
    text = " ".join(result["diagnosis"])
    assert "gradient is 4 x one device's" in text and "in use is 16" in text
    assert "does not use the measured engine scale" in text
    lay = _record([2.0, 1.9], [0.25, 0.225], [0.1, 0.2])
    assert "gradient is 1/4 x" in " ".join(check_layout.compare(lay, ref, "fp32")["diagnosis"])


def test_diagnosis_loss_and_update_and_groups():
    ref = _record([2.0, 1.9], [1.0, 0.9], [0.1, 0.2])
    lay = _record([2.1, 1.9], [1.0, 0.9], [0.1, 0.2])
    assert "the loss differs at step 1" in check_layout.compare(lay, ref, "fp32")["diagnosis"][0]
    lay = _record([2.0, 1.9], [1.0, 0.9], [0.1, 0.25])
    result = check_layout.compare(lay, ref, "fp32")
    assert result["failures"][0][:2] == (2, "params")
    assert "parameters after it differ" in result["diagnosis"][0]
    lay["groups"][1]["engine_reduce"] = [0, 1, 2, 3]
    assert "reduces gradients over another group" in check_layout.compare(
        lay, ref, "fp32")["diagnosis"][-1]
    # the same differences pass the bf16 tolerances where they are rounding
    lay = _record([2.0 * (1 + 1e-3), 1.9], [1.0, 0.9 * 1.01], [0.1, 0.2 * 1.2])
    assert check_layout.compare(lay, ref, "bf16")["failures"] == []
    assert not math.isnan(check_layout.TOLERANCES["bf16"]["params"])


def test_reference_config_is_one_plain_process():
    layout = check_layout.layout_config(json.loads(config_path("zero3").read_text()),
                                        "lm")
    assert all(not layout[k]["enabled"] for k in ("csv_monitor", "wandb", "tensorboard"))
    ref = check_layout.reference_config(layout, dp=4)
    assert ref["zero_optimization"] == {"stage": 0}
    assert ref["megaloss"]["tensor_parallel_size"] == 1
    assert ref["train_micro_batch_size_per_gpu"] == 4 * layout["train_micro_batch_size_per_gpu"]
    assert ref["gradient_accumulation_steps"] == layout["gradient_accumulation_steps"]
    assert ref["optimizer"] == layout["optimizer"] and ref["scheduler"] == layout["scheduler"]
    assert check_layout.layout_config(layout, "embed")["megaloss"]["tensor_parallel_size"] == 1
    assert check_layout.training_dtype({"bf16": {"enabled": True}}) == "bf16"
    assert check_layout.training_dtype(layout) == "fp32"


def test_config_defaults_to_the_shipped_one_and_errors_name_the_file(tmp_path):
    assert check_layout.read_user_config(None) == json.loads(config_path("zero2").read_text())
    missing = tmp_path / "nope.json"
    with pytest.raises(SystemExit, match=f"--deepspeed_config {missing}: No such file"):
        check_layout.read_user_config(str(missing))
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 2,}')
    with pytest.raises(SystemExit, match=f"--deepspeed_config {bad}: not valid JSON"):
        check_layout.read_user_config(str(bad))


@pytest.mark.timeout(1500)  # it waits for the background jobs before its own (nice 10)
@pytest.mark.background("help")
def test_help_runs_from_any_directory(background):
    proc = background
    assert proc.returncode == 0, proc.stderr
    assert "Does my layout train like one device?" in proc.stdout
    assert "--deepspeed_config" in proc.stdout and "exit status: 0 PASS, 1 FAIL" in proc.stdout
    assert proc.stdout.startswith("usage: megaloss-check-layout")


def _pipeline_config(tmp_path) -> str:
    with open(_config(tmp_path, 2), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["megaloss"]["pipeline_parallel_size"] = 2
    path = tmp_path / "zero2-tp2-pp2.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(1500)
@FOUR_PROCS
def test_pipeline_layout_trains_like_one_device(background):
    # tied: the embedding on stage 0 and the lm_head on stage 1 share one weight (TiedLayerSpec)
    proc, sections = background
    out = sections[4]
    assert "PASS: DP 1 x TP 2 x PP 2 ZeRO-1" in out, proc.stdout + proc.stderr[-5000:]
    assert "model tiny (tied embeddings)" in out, out
    assert "note: DeepSpeed's pipeline engine supports ZeRO stages" in proc.stdout
    assert "the config's ZeRO-2 runs at ZeRO-1" in proc.stdout
    assert "deepspeed-pipeline-zero1/train_batch: gradient_factor 1/2" in out


def test_pipeline_spec_lowers_zero_and_keeps_the_reference_plain(tmp_path):
    path = _pipeline_config(tmp_path)
    spec = check_layout.make_spec(check_layout.parse_args(
        ["--deepspeed_config", path, "--num_procs", "4"]), tmp_path)
    assert (spec["dp"], spec["tp"], spec["pp"]) == (1, 2, 2)
    assert spec["layout_config"]["zero_optimization"]["stage"] == 1
    assert any("runs at ZeRO-1" in n for n in spec["notes"])
    assert "pipeline_parallel_size" not in spec["reference_config"]["megaloss"]
    with pytest.raises(SystemExit, match="x pipeline_parallel_size=2"):
        check_layout.make_spec(check_layout.parse_args(
            ["--deepspeed_config", path, "--num_procs", "2"]), tmp_path)


def test_several_configs_get_a_spec_each_and_the_overrides_must_match(tmp_path):
    zero2, zero3 = _config(tmp_path, 2), _config(tmp_path, 3)
    specs = check_layout.make_specs(check_layout.parse_args(
        ["--deepspeed_config", zero2, zero3, "--num_procs", "4", "--config_override", TIED,
         "--_inject_wrong_scale", "2"]), tmp_path)
    assert [s["config_name"] for s in specs] == [zero2, zero3]
    assert [s["config_override"] for s in specs] == [{"tie_word_embeddings": True}] * 2
    assert [s["inject_wrong_scale"] for s in specs] == [False, True]
    assert len({s["result"] for s in specs}) == 2
    # the same reference for both ZeRO stages (stage 0 either way), another for another batch
    assert check_layout.reference_key(specs[0]) == check_layout.reference_key(specs[1])
    other = check_layout.make_specs(check_layout.parse_args(
        ["--deepspeed_config", zero2, "--num_procs", "2"]), tmp_path)[0]
    assert check_layout.reference_key(other) != check_layout.reference_key(specs[0])
    with pytest.raises(SystemExit, match="once per --deepspeed_config \\(2\\), got 3"):
        check_layout.make_specs(check_layout.parse_args(
            ["--deepspeed_config", zero2, zero3, "--config_override", "{}", "{}", "{}"]),
            tmp_path)
    with pytest.raises(SystemExit, match="--_inject_wrong_scale 3: a layout number 1..2"):
        check_layout.make_specs(check_layout.parse_args(
            ["--deepspeed_config", zero2, zero3, "--_inject_wrong_scale", "3"]), tmp_path)


def _autotp_config(tmp_path, stage: int) -> str:
    """The shrunk shipped config with DeepSpeed AutoTP instead of megaloss's TP (its one-device
    reference is the ZeRO-2 TP 2 layout's: stage 0, TP 1, the same batches)."""
    with open(_config(tmp_path, stage, tp=1), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["tensor_parallel"] = {"autotp_size": 2, "vocab_parallel_lm_head": True}
    path = tmp_path / f"autotp2-zero{stage}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(1500)
@FOUR_PROCS
def test_autotp_layout_trains_like_one_device(background):
    proc, sections = background
    out = sections[5]
    assert "PASS: DP 2 x TP 2 (DeepSpeed AutoTP) ZeRO-2" in out, proc.stdout + proc.stderr[-5000:]
    assert "tensor parallel:             [0, 1] [2, 3]" in out  # AutoTP's groups
    assert "data parallel:               [0, 2] [1, 3]" in out
    assert "loss_multiplier 4, group ranks [0, 2]; GAS x DP = 4" in out
    assert "initial parameters differ by 0.0e+00" in out  # AutoTP's shards gathered
    assert "note: DeepSpeed AutoTP (tensor_parallel.autotp_size 2) shards the model" in proc.stdout


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(1500)
@FOUR_PROCS
def test_autotp_wrong_calibration_fails_and_names_the_cause(background):
    proc, sections = background
    out = sections[6]
    assert "layout: 4 processes = DP 2 x TP 2 (DeepSpeed AutoTP), ZeRO-1" in out, out
    assert "FAIL: grad_norm at step 1" in out, out
    assert "the loss matches at step 1 but the gradient is 4 x one device's" in out


def test_autotp_spec_reads_tp_from_autotp_size_and_the_reference_drops_it(tmp_path):
    """Before AutoTP was read, the spec said TP 1 (``megaloss.tensor_parallel_size``), DP = all
    processes, and the one-device reference kept ``tensor_parallel`` (initialize then refused
    its topology)."""
    path = _autotp_config(tmp_path, 2)
    spec = check_layout.make_spec(check_layout.parse_args(
        ["--deepspeed_config", path, "--num_procs", "4"]), tmp_path)
    assert (spec["dp"], spec["tp"], spec["autotp"]) == (2, 2, True)
    assert "tensor_parallel" in spec["layout_config"]
    assert "tensor_parallel" not in spec["reference_config"]
    assert spec["reference_config"]["train_micro_batch_size_per_gpu"] == 2 * spec["micro"]
    # the reference is the one of megaloss's own TP 2 on the same batches
    tp2 = check_layout.make_spec(check_layout.parse_args(
        ["--deepspeed_config", _config(tmp_path, 2), "--num_procs", "4"]), tmp_path)
    assert check_layout.reference_key(spec) == check_layout.reference_key(tp2)
    with pytest.raises(SystemExit, match="multiple of tensor_parallel.autotp_size=2"):
        check_layout.make_spec(check_layout.parse_args(
            ["--deepspeed_config", path, "--num_procs", "3"]), tmp_path)
    # the embedding job is data parallel only: AutoTP's section left out, with a note
    spec = check_layout.make_spec(check_layout.parse_args(
        ["--deepspeed_config", path, "--num_procs", "4", "--job", "embed"]), tmp_path)
    assert (spec["dp"], spec["tp"], spec["autotp"]) == (4, 1, False)
    assert "tensor_parallel" not in spec["layout_config"]
    assert any("AutoTP's tensor_parallel section left out" in n for n in spec["notes"])


def test_autotp_spec_refuses_what_megaloss_refuses_under_autotp(tmp_path):
    for stage, tp, head, message in [(3, 1, True, "with ZeRO-3"), (2, 2, True, "not both"),
                                     (2, 1, False, "vocab_parallel_lm_head=true")]:
        with open(_autotp_config(tmp_path, stage), encoding="utf-8") as f:
            cfg = json.load(f)
        cfg["megaloss"]["tensor_parallel_size"] = tp
        cfg["tensor_parallel"]["vocab_parallel_lm_head"] = head
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(cfg))
        with pytest.raises(SystemExit, match=f"--deepspeed_config {path}: .*{message}"):
            check_layout.make_spec(check_layout.parse_args(
                ["--deepspeed_config", str(path), "--num_procs", "4"]), tmp_path)
