"""``launch/jobs/runs.py``, one process: the output folder is never shared by two runs, what
``--resume`` loads, failures reported (single process: re-raised), a signal turned into a stop
request, the run options' checks; and ``StepBatches.iter_from``, the data position a resumed job
continues from. Fast (no DeepSpeed)."""
import argparse
import os
import signal
from itertools import islice

import pytest
import torch

from launch import train_embed, train_embed_hf, train_lm, train_lm_hf
from launch.jobs.runs import (
    StopRequest,
    add_run_arguments,
    agreed,
    check_run_arguments,
    checkpoint_stats,
    prepare_output_dir,
    resume_source,
)
from launch.jobs.text_data import StepBatches


def _args(*argv):
    p = argparse.ArgumentParser()
    add_run_arguments(p)
    args = p.parse_args(argv)
    check_run_arguments(p, args)
    return args


def test_run_options():
    assert _args("--resume").resume == "latest"
    assert _args("--resume", "/x/checkpoints").resume == "/x/checkpoints"
    assert _args().resume is None and _args().save_every == 0
    for bad in (["--eval_only"], ["--overwrite", "--resume"], ["--save_every", "-1"]):
        with pytest.raises(SystemExit):
            _args(*bad)


def test_output_dir_refused_replaced_or_continued(tmp_path):
    out = tmp_path / "run"
    prepare_output_dir(out, overwrite=False, resuming=False)  # new: created
    assert out.is_dir()
    for name in ("metrics.csv", "summary.json"):
        (out / name).write_text("x")
    (out / "monitor" / "megaloss").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as err:
        prepare_output_dir(out, overwrite=False, resuming=False)
    msg = str(err.value)
    assert msg.startswith(f"{out} already holds a run (metrics.csv, summary.json, monitor)")
    assert "--resume" in msg and "--overwrite" in msg and "another --output_dir" in msg
    prepare_output_dir(out, overwrite=False, resuming=True)  # continued: untouched
    prepare_output_dir(out, overwrite=False, resuming=False, eval_only=True)
    assert (out / "metrics.csv").exists()
    prepare_output_dir(out, overwrite=True, resuming=False)  # replaced: only the job's files
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_resume_source(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    assert resume_source(_args(), out) is None
    assert resume_source(_args("--resume"), out) is None  # nothing yet: a fresh start
    (out / "metrics.csv").write_text("x")
    with pytest.raises(SystemExit, match="holds a run saved without checkpoints"):
        resume_source(_args("--resume"), out)
    ckpt = out / "checkpoints" / "step_3"
    ckpt.mkdir(parents=True)
    (ckpt / "mp_rank_00_model_states.pt").write_bytes(b"")
    (out / "checkpoints" / "latest").write_text("step_3")
    assert resume_source(_args("--resume"), out) == out / "checkpoints"
    assert resume_source(_args("--resume", str(ckpt)), tmp_path / "elsewhere") == ckpt
    with pytest.raises(SystemExit, match="--resume /nowhere: no checkpoint at /nowhere"):
        resume_source(_args("--resume", "/nowhere"), out)
    with pytest.raises(SystemExit, match="no checkpoint in"):
        resume_source(_args("--resume", "--eval_only"), tmp_path)


def test_agreed_single_process():
    assert agreed(lambda: 3) == 3
    with pytest.raises(ValueError, match="boom"):
        agreed(lambda: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(SystemExit, match="named cause"):
        agreed(lambda: (_ for _ in ()).throw(SystemExit("named cause")))


def test_stop_request_from_real_signals():
    stop = StopRequest().install()
    try:
        assert not stop.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.should_stop() and stop.received == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # repeated SIGTERM (a launcher forwarding): ignored
        assert stop.received == "SIGTERM"
    finally:
        stop.restore()
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C aborts at once
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("start", [0, 1, 4, 5, 11])
def test_step_batches_iter_from_continues_the_stream(start):
    data = {"input_ids": torch.arange(44).view(22, 2)}
    batches = StepBatches(data, micro=2, gas=2, dp_size=1, dp_rank=0, seed=3)  # 5 steps/epoch
    expected = list(islice(iter(batches), start, start + 7))
    got = list(islice(batches.iter_from(start), 7))
    assert all(torch.equal(a["input_ids"], b["input_ids"])
               for sa, sb in zip(expected, got) for a, b in zip(sa, sb))
    with pytest.raises(ValueError, match="start_step"):
        next(batches.iter_from(-1))


def test_relative_default_output_dirs_follow_the_current_directory():
    for job, default in ((train_lm, "lm"), (train_embed, "embed"), (train_lm_hf, "lm_hf"),
                         (train_embed_hf, "embed_hf")):
        assert job.parse_args([]).output_dir == os.path.join("runs", default)


def test_checkpoint_stats():
    assert checkpoint_stats([]) is None
    saves = [{"step": 2, "seconds": 1.0, "mib": 3.0, "path": "a"},
             {"step": 4, "seconds": 2.0, "mib": 5.0, "path": "b"}]
    assert checkpoint_stats(saves) == {"saves": 2, "seconds_per_save": 1.5, "mib_per_save": 4.0,
                                       "last": "b"}
