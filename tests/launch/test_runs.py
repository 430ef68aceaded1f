"""``launch/jobs/runs.py``, one process: the output folder is never shared by two runs, what
``--resume`` loads, failures reported (single process: re-raised), a signal turned into a stop
request, the run options' checks; and ``StepBatches.iter_from``, the data position a resumed job
continues from. Fast (no DeepSpeed)."""
import argparse
import os
import signal
from itertools import islice
from pathlib import Path

import pytest
import torch

from launch import train_embed, train_embed_hf, train_lm, train_lm_hf
from launch.jobs.runs import (
    StopRequest,
    add_run_arguments,
    agreed,
    check_run_arguments,
    checkpoint_stats,
    follow_branch,
    prepare_output_dir,
    progress_bar,
    resume_source,
    step_boundary,
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
    assert str(err.value) == (
        f"{out} already holds a run (metrics.csv, summary.json, monitor) but no checkpoint to "
        "continue it from; pass --overwrite to replace it, or another --output_dir")
    (out / "checkpoints" / "step_4").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step_4")
    with pytest.raises(SystemExit) as err:  # with a checkpoint: --resume too
        prepare_output_dir(out, overwrite=False, resuming=False)
    assert str(err.value) == (
        f"{out} already holds a run (metrics.csv, summary.json, monitor, checkpoints; its latest "
        "checkpoint is step_4); pass --resume to continue it from there, --overwrite to replace "
        "it, or another --output_dir")
    prepare_output_dir(out, overwrite=False, resuming=True)  # continued: untouched
    prepare_output_dir(out, overwrite=False, resuming=False, eval_only=True)
    assert (out / "metrics.csv").exists()
    prepare_output_dir(out, overwrite=True, resuming=False)  # replaced: only the job's files
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def _crashed_before_the_first_checkpoint(out):
    """What a run that died before its first checkpoint leaves: DeepSpeed's csv_monitor files,
    wandb's folder, an empty checkpoints folder."""
    (out / "monitor" / "megaloss").mkdir(parents=True)
    (out / "monitor" / "megaloss" / "Train_megaloss_loss.csv").write_text("step,loss\n1,5.6\n")
    (out / "wandb").mkdir()
    (out / "checkpoints").mkdir()
    (out / "notes.txt").write_text("mine")


@pytest.mark.parametrize("how", ["fresh", "resume latest", "trainer job"])
def test_a_folder_left_by_a_crash_before_any_checkpoint_starts_over(tmp_path, capsys, how):
    """A rerun into it starts, saying what it clears, and never asks for --resume (it used to
    refuse with "already holds a run (monitor); pass --resume", and --resume then refused too:
    "holds a run saved without checkpoints")."""
    from launch.jobs.checkpoints import open_fresh_run, output_dir_refusal

    out = tmp_path / "runs" / "lm"
    _crashed_before_the_first_checkpoint(out)
    assert output_dir_refusal(out, overwrite=False, resuming=False) is None
    if how == "trainer job":  # the Hugging Face trainer jobs and GRPO: no --resume at all
        open_fresh_run(out, overwrite=False)
    else:
        args = _args("--resume") if how == "resume latest" else _args()
        assert resume_source(args, out) is None  # nothing to continue: a fresh run
        prepare_output_dir(out, overwrite=False, resuming=False)
    assert capsys.readouterr().out == (
        f"[megaloss] {out} holds no checkpoint from an earlier run (only monitor/, wandb/, "
        "checkpoints/): starting over\n")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # the user's own file kept


def test_a_checkpoints_folder_with_a_save_cut_short_is_not_cleared(tmp_path):
    """A step folder without ``latest`` (a save cut short): not resumable, not thrown away
    unasked either."""
    out = tmp_path / "run"
    _crashed_before_the_first_checkpoint(out)
    (out / "checkpoints" / "step_2").mkdir()
    with pytest.raises(SystemExit) as err:
        prepare_output_dir(out, overwrite=False, resuming=False)
    assert "no checkpoint to continue it from; pass --overwrite" in str(err.value)
    assert "--resume" not in str(err.value)
    with pytest.raises(SystemExit, match="holds a run saved without checkpoints"):
        resume_source(_args("--resume"), out)


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
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop = StopRequest().install()
    try:
        assert not stop.should_stop()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.should_stop() and stop.received == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # repeated SIGTERM (a launcher forwarding): merged
        assert stop.received == "SIGTERM"
    finally:
        stop.restore()
    # the handlers the process had before (pytest's own, or SIG_IGN when run in the background
    # of a shell without job control)
    assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_repeated_requests_are_one_request(first):
    """A scheduler's signal to the process group, then the launcher's forwarded SIGTERM, then a
    Ctrl-C: all one stop request until the checkpoint's save starts."""
    stop = StopRequest(grace=0).install()
    try:
        assert signal.getsignal(signal.SIGUSR1) == stop._handler
        for sig in (first, first, signal.SIGTERM, signal.SIGINT, signal.SIGINT):
            os.kill(os.getpid(), sig)
        assert stop.should_stop() and stop.received == signal.Signals(first).name
    finally:
        stop.restore()


def test_sigint_aborts_only_once_the_save_started_and_the_grace_is_over():
    stop = StopRequest(grace=3600).install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        stop.saving = True
        os.kill(os.getpid(), signal.SIGINT)  # within the grace: merged
        stop.grace = 0
        with pytest.raises(KeyboardInterrupt):  # the save started, no grace left: abort
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()


def _boundary_saves(steps, save_every=0, resume=None, stop_at=None):
    """The steps at which step_boundary saves over a run of ``steps``."""
    args = argparse.Namespace(steps=steps, save_every=save_every, resume=resume)
    saved, stop = [], StopRequest()
    for step in range(1, steps + 1):
        if step == stop_at:
            stop.received = "SIGTERM"
        if step_boundary(stop, "cpu", step, args, saved.append, lambda msg: None):
            assert stop.saving
            break
    return saved


def test_the_last_step_is_saved_with_save_every_or_resume():
    assert _boundary_saves(7) == []
    assert _boundary_saves(7, save_every=3) == [3, 6, 7]
    assert _boundary_saves(7, resume="runs/lm/checkpoints/step_100") == [7]
    assert _boundary_saves(7, resume="latest") == [7]
    assert _boundary_saves(7, stop_at=2) == [2]


def _fake_checkpoint(ckpts, tag):
    (ckpts / tag).mkdir(parents=True)
    (ckpts / tag / "mp_rank_00_model_states.pt").write_bytes(b"")


def test_a_branch_moves_latest_to_the_checkpoint_it_continues(tmp_path, capsys):
    ckpts = tmp_path / "run" / "checkpoints"
    for tag in ("step_50", "step_100", "step_150"):
        _fake_checkpoint(ckpts, tag)
    (ckpts / "latest").write_text("step_150")
    (tmp_path / "run" / "metrics.csv").write_text("x")
    follow_branch(ckpts / "step_100", ckpts)
    assert (ckpts / "latest").read_text() == "step_100"
    assert "not from latest (step_150)" in capsys.readouterr().out
    follow_branch(ckpts, ckpts)  # --resume latest: nothing to move
    assert (ckpts / "latest").read_text() == "step_100"
    other = tmp_path / "other" / "checkpoints"
    _fake_checkpoint(other, "step_7")
    follow_branch(other / "step_7", ckpts)  # another run's checkpoint: this run's latest stays
    assert (ckpts / "latest").read_text() == "step_100"


def test_progress_without_a_terminal_is_a_line_per_n_steps(capsys):
    import io

    stream = io.StringIO()  # a file, a scheduler's log: not a terminal
    args = argparse.Namespace(steps=40, no_progress=False)
    bar = progress_bar(args, 0, stream)
    for _ in range(40):
        bar.set_postfix(loss="1.000")
        bar.update(1)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 20, stream.getvalue()[:300]
    assert lines[0].startswith("train 2/40 steps loss=1.000 ")
    assert lines[-1].startswith("train 40/40 steps")


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
    # a resumed run: only its own saves (the first came with the checkpoint it resumed)
    assert checkpoint_stats(saves, since=1) == {"saves": 1, "seconds_per_save": 2.0,
                                                "mib_per_save": 5.0, "last": "b"}
    assert checkpoint_stats(saves, since=2) is None


def test_deepspeed_noise_is_dropped():
    import logging

    from launch.jobs.runs import quiet_job_environment

    quiet_job_environment()
    quiet_job_environment()  # idempotent: one filter
    logger = logging.getLogger("DeepSpeed")

    def shown(msg):
        return bool(logger.filter(logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 1,
                                                    msg, None, None)))

    assert not shown("Setting accelerator to CPU. If you have GPU or other accelerator, we were "
                     "unable to detect it.")
    assert not shown("**** You are using ZeRO with an untested optimizer, proceed with caution "
                     "*****")
    assert not shown("Attempting to get learning rate from scheduler before it has started")
    assert shown("Overflow detected. Skipping step.")
    assert len(logger.filters) == 1


def test_accelerate_gas_notice_is_dropped_in_trainer_jobs():
    import logging

    from launch.jobs.quiet_logs import quiet_accelerate_logger

    quiet_accelerate_logger()
    quiet_accelerate_logger()
    logger = logging.getLogger("accelerate.accelerator")

    def shown(msg):
        return bool(logger.filter(logging.LogRecord(logger.name, logging.WARNING, __file__, 1,
                                                    msg, None, None)))

    # accelerate 1.15's text (accelerator.py, _prepare_deepspeed)
    assert not shown("Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1, "
                     "DeepSpeed config has 2. Using DeepSpeed's value.")
    assert shown("Gradient accumulation steps mismatch: GradientAccumulationPlugin has 4, "
                 "DeepSpeed config has 2. Using DeepSpeed's value.")  # a user's real mismatch
    assert len(logger.filters) == 1


def test_the_tests_cache_is_not_the_users(_megaloss_cache):
    from pathlib import Path

    cache = Path(train_lm.parse_args([]).cache_dir)
    assert cache == Path(_megaloss_cache)
    assert Path.home() / ".cache" not in cache.parents


def _saved_checkpoint(ckpts, tag):
    (ckpts / tag).mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        torch.save({"w": torch.arange(4096.0)}, ckpts / tag / name)
    return ckpts / tag


def test_a_damaged_checkpoint_file_is_refused_with_its_path(tmp_path):
    from megaloss.integrations.deepspeed.checkpoint import check_checkpoint_files

    ckpts = tmp_path / "checkpoints"
    good = _saved_checkpoint(ckpts, "step_2")
    (ckpts / "latest").write_text("step_2")
    assert check_checkpoint_files(ckpts) == good
    cut = good / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = cut.read_bytes()
    cut.write_bytes(data[: len(data) // 2])  # a save cut short
    with pytest.raises(ValueError, match=f"checkpoint file {cut} is truncated or corrupted"):
        check_checkpoint_files(good)
    cut.write_bytes(data)
    model = good / "mp_rank_00_model_states.pt"
    raw = bytearray(model.read_bytes())
    at = raw.find(torch.arange(4096.0)[100:101].numpy().tobytes())
    raw[at] ^= 0xFF  # one damaged byte in the tensor data
    model.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"checkpoint file {model} is truncated or corrupted "
                                         r"\(entry .* fails its CRC-32 check\)"):
        check_checkpoint_files(ckpts)


def test_a_save_that_fails_half_way_leaves_latest_on_the_last_complete_one(tmp_path):
    from megaloss.integrations.deepspeed import save_checkpoint

    class HalfSaving:  # DeepSpeed's engine, failing after its first file
        module = torch.nn.Linear(2, 2)
        global_steps, global_samples = 4, 32

        def zero_optimization_stage(self):
            return 2

        def save_checkpoint(self, save_dir, tag, client_state, save_latest):
            assert save_latest is False  # megaloss writes latest itself, last
            folder = Path(save_dir) / tag
            folder.mkdir(parents=True)
            (folder / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04 half")
            raise OSError(28, "No space left on device")

    ckpts = tmp_path / "checkpoints"
    _saved_checkpoint(ckpts, "step_2")
    (ckpts / "latest").write_text("step_2")
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(HalfSaving(), ckpts)
    assert (ckpts / "latest").read_text() == "step_2"
