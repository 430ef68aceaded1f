"""End to end: ``bash launch/train_lm_fsdp.sh`` (torchrun, 2 CPU processes, gloo, FSDP2) shrunk to
the sizes of tests/launch/test_train_lm.py: tiny Llama, 32-token blocks, 200 kB of the built-in
stdlib text, micro-batch 4 x GAS 2 x DP 2, no warm-up.

- The job: exit status 0, ``metrics.csv`` with one row per optimizer step, ``loss_curve.png``,
  ``summary.json`` (FSDP2 over 2 processes, the loss multiplier measured by ``probe_fsdp``: 2,
  FSDP2's mean over the ranks), and training works: held-out CE and the train loss fall.
- Checkpoints: the run saves DCP checkpoints (``--save_every 3``: steps 3, 6, 9 and the last,
  10).
- Preemption, as a scheduler delivers it: a second run resumed from the step-3 checkpoint folder
  (``--resume PATH``, into another ``--output_dir``) gets SIGTERM at every process of the script
  (bash, torchrun, both ranks) once its first step is logged: it stops at the next step boundary
  k (4 <= k < 10), saves ``step_k``, writes ``metrics.csv`` / ``summary.json`` (``"stopped":
  {"signal": "SIGTERM", "step": k}``) / the plot for steps 1..k, and the script exits 75 with
  the LM job's messages. A third run, ``--resume`` (latest) in that folder, reaches step 10 with
  every metric of every step and the final evaluation equal to the uninterrupted run's, bitwise.
- ``--eval_only --resume`` on that folder, as one plain process (``python -m
  launch.train_lm_fsdp``: the 2-rank DCP checkpoint loaded on 1 rank) writes
  ``eval_step10.json`` with the uninterrupted run's final held-out CE (rel 1e-6: fp32, the eval
  batches summed in another grouping; measured 5e-8) over the same tokens.
- FSDP2 x TP: 4 processes, ``--tensor_parallel_size 2`` (DP=2 x TP=2, the lm_head a
  ``ColwiseParallel`` DTensor, megaloss's vocab-parallel CE through
  ``VocabParallelOptions.from_dtensor``): the same global batches, so every step's loss and
  gradient norm equal the DP=2 run's (rel 1e-5: fp32, the vocab-parallel reduction's order;
  measured within 3e-8).
- Refused before any rank starts (``python -m launch.jobs.check_args``, one line, status 2): a
  world size the TP size does not divide, tied embeddings under TP, a folder holding a run,
  ``--eval_only`` without ``--resume``, ``--overwrite`` with ``--resume`` (the LM job's
  messages).
- Same as DeepSpeed: the LM job (``launch/train_lm.py``, ZeRO-2, DP=2 x TP=1, the same data,
  seed, micro-batches and CE options) in the launch several test files share
  (``shared_launch``, shared_launches.py). Before any optimizer step both hold the same weights
  (``build_llama`` seeds them), so the first step's global loss and the held-out CE before
  training agree, and so does the first step's gradient norm (rel 1e-5: fp32, the engines'
  summation order; measured equal to the last bit on CPU).
"""
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from launch.jobs import check_args
from tests.helpers.launch_helpers import REPO, script_env, wait_until

STEPS = 10
DATA = ["--model_size", "tiny", "--seq_len", "32", "--vocab_size", "320",
        "--max_train_bytes", "200000", "--eval_blocks", "16", "--eval_every", "3"]
COMMON = [*DATA, "--no_progress"]
FSDP = ["--micro_batch_size", "4", "--gradient_accumulation_steps", "2", "--lr", "1e-2",
        "--warmup_steps", "0", "--chunk_size", "48"]


def _run_script(*args: str, num_procs: int = 2,
                timeout: float = 420) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(REPO / "launch" / "train_lm_fsdp.sh"), *args], cwd=REPO,
                          env=script_env(NUM_PROCS=str(num_procs)), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def _run_and_sigterm(*args: str, after: str, timeout: float = 420) -> tuple:
    """``bash launch/train_lm_fsdp.sh *args`` (2 processes, its own session), SIGTERM to every
    process of the session once rank 0's progress line starting with ``after`` is out (the
    progress is on: one line per step), then wait until all have exited. Returns ``(exit
    status, output)``."""
    proc = subprocess.Popen(["bash", str(REPO / "launch" / "train_lm_fsdp.sh"), *args],
                            cwd=REPO, env=script_env(NUM_PROCS="2"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until(lambda: any(ln.startswith(after) for ln in list(lines)), timeout,
                   f"progress line {after!r}", alive=lambda: proc.poll() is None)
        os.killpg(proc.pid, signal.SIGTERM)
        reader.join(timeout)
        proc.wait(30)
    finally:
        if proc.poll() is None or reader.is_alive():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    return proc.returncode, "".join(lines)


def _rows(out: Path) -> list:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """The job's run (checkpoints at steps 3, 6, 9, 10); one resumed from its step 3 elsewhere and
    stopped by SIGTERM (the stopped folder copied to ``stopped``, its output and exit status
    in ``stopped.json``), continued with ``--resume`` to step 10 and evaluated with
    ``--eval_only``; the TP=2 run."""
    tmp = tmp_path_factory.mktemp("fsdp")
    cache = str(tmp / "cache")
    _run_script(*COMMON, *FSDP, "--steps", str(STEPS), "--save_every", "3",
                "--output_dir", str(tmp / "out"), "--cache_dir", cache)
    resumed = ["--steps", str(STEPS), "--output_dir", str(tmp / "resumed"), "--cache_dir", cache]
    rc, output = _run_and_sigterm(*DATA, *FSDP, *resumed, "--resume",
                                  str(tmp / "out" / "checkpoints" / "step_3"), after="train 4/")
    if (tmp / "resumed").is_dir():
        shutil.copytree(tmp / "resumed", tmp / "stopped")
    (tmp / "stopped.json").write_text(json.dumps({"returncode": rc, "output": output}))
    if rc == 75:
        _run_script(*COMMON, *FSDP, *resumed, "--resume")
        evaluated = subprocess.run(
            [sys.executable, "-m", "launch.train_lm_fsdp", *COMMON, *FSDP, *resumed, "--resume",
             "--eval_only"], cwd=REPO, env=script_env(), capture_output=True, text=True,
            timeout=300)
        assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
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
    assert summary["checkpoints"]["saves"] == 4
    for step in (3, 6, 9, STEPS):
        ckpt = out / "checkpoints" / f"step_{step}"
        assert (ckpt / "dcp" / ".metadata").is_file() and (ckpt / "tokenizer.json").is_file()
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS}"


def _stopped(fsdp: Path) -> tuple:
    """The SIGTERM-stopped run: ``(exit status, output, folder as it was when it stopped)``."""
    record = json.loads((fsdp / "stopped.json").read_text())
    return record["returncode"], record["output"], fsdp / "stopped"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_sigterm_to_every_process_saves_and_exits_75(fsdp):
    rc, output, stopped = _stopped(fsdp)
    assert rc == 75, output[-4000:]
    summary = json.loads((stopped / "summary.json").read_text())
    k = summary["stopped"]["step"]
    assert summary["stopped"] == {"signal": "SIGTERM", "step": k} and 4 <= k < STEPS, summary
    assert summary["steps"] == k and summary["resumed_at_step"] == 3
    assert [int(r["step"]) for r in _rows(stopped)] == list(range(1, k + 1))
    assert (stopped / "checkpoints" / "latest").read_text() == f"step_{k}"
    assert (stopped / "checkpoints" / f"step_{k}" / "dcp" / ".metadata").is_file()
    assert (stopped / "loss_curve.png").stat().st_size > 0
    # the LM job's messages: each rank's stop request, the stop, the script's status line last
    assert output.count("SIGTERM: stopping at the next step boundary") >= 2, output[-4000:]
    assert f"stopped by SIGTERM after step {k}; continue with --resume" in output
    assert output.rstrip().endswith("stopped on request after a checkpoint on every rank: exit "
                                    "status 75 (continue with --resume)"), output[-2000:]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_train_lm_fsdp_resumes_bitwise(fsdp):
    """Resumed from step 3 of another folder, stopped by SIGTERM at k, resumed from k: every
    metric of every step but the timings equals the uninterrupted run's."""
    assert _stopped(fsdp)[0] == 75, _stopped(fsdp)[1][-4000:]
    plain, resumed = _rows(fsdp / "out"), _rows(fsdp / "resumed")
    exact = ("step", "loss", "z_loss", "num_tokens", "lr", "grad_norm", "samples", "eval_loss")
    assert [[r[c] for c in exact] for r in resumed] == [[r[c] for c in exact] for r in plain]
    summary = json.loads((fsdp / "resumed" / "summary.json").read_text())
    k = json.loads((fsdp / "stopped" / "summary.json").read_text())["stopped"]["step"]
    assert summary["resumed_at_step"] == k and summary["stopped"] is None
    plain_summary = json.loads((fsdp / "out" / "summary.json").read_text())
    assert summary["eval_after"] == plain_summary["eval_after"]
    assert summary["eval_before"] == plain_summary["eval_before"]
    assert (fsdp / "resumed" / "checkpoints" / "latest").read_text() == f"step_{STEPS}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_eval_only_reproduces_the_final_evaluation(fsdp):
    assert _stopped(fsdp)[0] == 75, _stopped(fsdp)[1][-4000:]
    report = json.loads((fsdp / "resumed" / f"eval_step{STEPS}.json").read_text())
    final = json.loads((fsdp / "out" / "summary.json").read_text())["eval_after"]
    assert report["step"] == STEPS
    assert report["checkpoint"] == str(fsdp / "resumed" / "checkpoints" / f"step_{STEPS}")
    assert report["eval"]["num_tokens"] == final["num_tokens"]
    assert report["eval"]["loss"] == pytest.approx(final["loss"], rel=1e-6)


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
    (["--eval_only"], 2, "--eval_only needs --resume"),
    (["--overwrite", "--resume"], 2, "--overwrite and --resume exclude each other"),
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
