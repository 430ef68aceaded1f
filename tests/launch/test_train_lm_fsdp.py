"""End to end: ``bash launch/train_lm_fsdp.sh`` (torchrun, 2 CPU processes, gloo, FSDP2) shrunk to
the sizes of tests/launch/test_train_lm.py: tiny Llama, 32-token blocks, 200 kB of the built-in
stdlib text, micro-batch 4 x GAS 2 x DP 2, no warm-up.

- The job: exit status 0, ``metrics.csv`` with one row per optimizer step, ``loss_curve.png``,
  ``summary.json`` (FSDP2 over 2 processes, the loss multiplier measured by ``probe_fsdp``: 2,
  FSDP2's mean over the ranks), and training works: held-out CE and the train loss fall.
- Checkpoints: the run saves DCP checkpoints (``--save_every 3``); a second run resumed from
  the step-3 checkpoint folder (``--resume PATH``, into another ``--output_dir``) reaches step 6
  with the same losses, bitwise.
- FSDP2 x TP: 4 processes, ``--tensor_parallel_size 2`` (DP=2 x TP=2, the lm_head a
  ``ColwiseParallel`` DTensor, megaloss's vocab-parallel CE through
  ``VocabParallelOptions.from_dtensor``): the same global batches, so every step's loss and
  gradient norm equal the DP=2 run's (rel 1e-5: fp32, the vocab-parallel reduction's order;
  measured within 3e-8).
- Refused before any rank starts (``python -m launch.jobs.check_args``, one line, status 2): a
  world size the TP size does not divide, tied embeddings under TP, a folder holding a run.
- Same as DeepSpeed: the LM job (``launch/train_lm.py``, ZeRO-2, DP=2 x TP=1, the same data,
  seed, micro-batches and CE options) in the launch several test files share
  (``shared_launch``, shared_launches.py). Before any optimizer step both hold the same weights
  (``build_llama`` seeds them), so the first step's global loss and the held-out CE before
  training agree, and so does the first step's gradient norm (rel 1e-5: fp32, the engines'
  summation order; measured equal to the last bit on CPU).
"""
import csv
import json
import subprocess
from pathlib import Path

import pytest

from launch.jobs import check_args
from tests.helpers.launch_helpers import REPO, script_env

STEPS = 6
COMMON = ["--model_size", "tiny", "--seq_len", "32", "--vocab_size", "320",
          "--max_train_bytes", "200000", "--eval_blocks", "16", "--eval_every", "3",
          "--no_progress"]
FSDP = ["--micro_batch_size", "4", "--gradient_accumulation_steps", "2", "--lr", "1e-2",
        "--warmup_steps", "0", "--chunk_size", "48"]


def _run_script(*args: str, num_procs: int = 2,
                timeout: float = 420) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(REPO / "launch" / "train_lm_fsdp.sh"), *args], cwd=REPO,
                          env=script_env(NUM_PROCS=str(num_procs)), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def _rows(out: Path) -> list:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """The job's run (checkpoints at steps 3 and 6), then one resumed from step 3 elsewhere."""
    tmp = tmp_path_factory.mktemp("fsdp")
    cache = str(tmp / "cache")
    _run_script(*COMMON, *FSDP, "--steps", str(STEPS), "--save_every", "3",
                "--output_dir", str(tmp / "out"), "--cache_dir", cache)
    _run_script(*COMMON, *FSDP, "--steps", str(STEPS), "--output_dir", str(tmp / "resumed"),
                "--resume", str(tmp / "out" / "checkpoints" / "step_3"), "--cache_dir", cache)
    _run_script(*COMMON, *FSDP, "--steps", str(STEPS), "--tensor_parallel_size", "2",
                "--output_dir", str(tmp / "tp2"), "--cache_dir", cache, num_procs=4)
    return tmp


def shared_launch_jobs(tmp_path) -> list:
    """The DeepSpeed LM job on the FSDP run's data and settings (shared_launches.py)."""
    cfg = json.loads((REPO / "configs" / "zero2.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    cfg.pop("scheduler")
    cfg["optimizer"]["params"]["lr"] = 1e-2
    cfg["megaloss"]["tensor_parallel_size"] = 1
    cfg["megaloss"]["ce"]["chunk_size"] = 48
    cfg["csv_monitor"]["enabled"] = False
    path = tmp_path / "zero2-tp1.json"
    path.write_text(json.dumps(cfg))
    return [{"job": "train_lm", "argv": ["--deepspeed_config", str(path), *COMMON,
                                         "--steps", "1", "--output_dir", str(tmp_path / "ds"),
                                         "--cache_dir", str(tmp_path / "cache")]}]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_train_lm_fsdp_trains_on_two_processes(fsdp):
    out = fsdp / "out"
    rows = _rows(out)
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert float(r["num_tokens"]) == 4 * 2 * 2 * 32  # every target of the global batch
        assert float(r["lr"]) == pytest.approx(1e-2)
        assert float(r["grad_norm"]) > 0 and float(r["tokens_per_s"]) > 0
        assert float(r["peak_memory_mib"]) > 0 and float(r["z_loss"]) > 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["engine"], summary["dp"], summary["gas"]) == ("fsdp2", 2, 2)
    assert summary["engine_loss_multiplier"] == 2.0  # measured: FSDP2 averages over 2 ranks
    assert summary["engine_scale"].startswith("fsdp2/no_sync/")
    assert summary["eval_after"]["loss"] < summary["eval_before"]["loss"] - 0.05, summary
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"]) - 0.05, rows
    assert [e for e in (r["eval_loss"] for r in rows) if e] != []  # --eval_every 3
    assert (out / "loss_curve.png").stat().st_size > 0
    assert summary["checkpoints"]["saves"] == 2
    for step in (3, 6):
        ckpt = out / "checkpoints" / f"step_{step}"
        assert (ckpt / "dcp" / ".metadata").is_file() and (ckpt / "tokenizer.json").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_6"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_train_lm_fsdp_resumes_bitwise(fsdp):
    plain, resumed = _rows(fsdp / "out"), _rows(fsdp / "resumed")
    assert [r["step"] for r in resumed] == [r["step"] for r in plain]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in plain]
    summary = json.loads((fsdp / "resumed" / "summary.json").read_text())
    assert summary["resumed_at_step"] == 3
    assert summary["eval_after"] == json.loads((fsdp / "out" / "summary.json").read_text())[
        "eval_after"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_tensor_parallel_2_equals_data_parallel(fsdp):
    plain, tp = _rows(fsdp / "out"), _rows(fsdp / "tp2")
    assert [r["step"] for r in tp] == [r["step"] for r in plain]
    for key in ("loss", "grad_norm", "z_loss"):
        assert [float(r[key]) for r in tp] == pytest.approx([float(r[key]) for r in plain],
                                                            rel=1e-5), key
    summary = json.loads((fsdp / "tp2" / "summary.json").read_text())
    assert (summary["dp"], summary["tp"], summary["engine_loss_multiplier"]) == (2, 2, 2.0)
    plain_eval = json.loads((fsdp / "out" / "summary.json").read_text())["eval_after"]
    assert summary["eval_after"]["loss"] == pytest.approx(plain_eval["loss"], rel=1e-5)
    assert summary["eval_after"]["num_tokens"] == plain_eval["num_tokens"]


@pytest.mark.deepspeed
@pytest.mark.xdist_group("shared_launch")
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_first_step_loss_equals_deepspeed_job(fsdp, shared_launch):
    ds_out = shared_launch["test_train_lm_fsdp"].tmp_path / "ds"
    ds, mine = _rows(ds_out), _rows(fsdp / "out")
    assert float(mine[0]["loss"]) == pytest.approx(float(ds[0]["loss"]), rel=1e-5)
    assert float(mine[0]["z_loss"]) == pytest.approx(float(ds[0]["z_loss"]), rel=1e-4)
    assert float(mine[0]["num_tokens"]) == float(ds[0]["num_tokens"])
    # the first step's gradient (its global norm before clipping) is the same gradient too
    assert float(mine[0]["grad_norm"]) == pytest.approx(float(ds[0]["grad_norm"]), rel=1e-5)
    before = [json.loads((d / "summary.json").read_text())["eval_before"]
              for d in (ds_out, fsdp / "out")]
    assert before[1]["loss"] == pytest.approx(before[0]["loss"], rel=1e-5)
    assert before[1]["num_tokens"] == before[0]["num_tokens"]


@pytest.mark.parametrize("argv,world,expected", [
    (["--tensor_parallel_size", "2"], 3, "does not divide the 3 processes"),
    (["--tensor_parallel_size", "2", "--tie_word_embeddings"], 4, "--tie_word_embeddings"),
    (["--micro_batch_size", "0"], 2, "--micro_batch_size must be >= 1"),
])
def test_preflight_refusals(argv, world, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEGALOSS_PROG", "train_lm_fsdp.sh")
    monkeypatch.setenv("MEGALOSS_WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as err:
        check_args.main(["train_lm_fsdp", *argv, "--output_dir", str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert err.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("train_lm_fsdp.sh: error: ") and expected in lines[0], lines


def test_preflight_refuses_a_folder_holding_a_run(tmp_path, capsys, monkeypatch):
    (tmp_path / "metrics.csv").write_text("step,loss\n1,2.0\n")
    monkeypatch.setenv("MEGALOSS_PROG", "train_lm_fsdp.sh")
    monkeypatch.setenv("MEGALOSS_WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as err:
        check_args.main(["train_lm_fsdp", "--output_dir", str(tmp_path)])
    line = capsys.readouterr().err.strip()
    assert err.value.code == 2 and "already holds a run" in line and "--overwrite" in line, line
