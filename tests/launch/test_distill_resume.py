"""The distillation job's checkpoints and resume, end to end under ``deepspeed --num_gpus 2`` on
CPU (TP=2, ZeRO-2), shrunk as tests/launch/test_distill_lm.py shrinks it: a run of its three
phases (a teacher of 4 steps, two students of 3) against the same run stopped the way SIGTERM
stops it (the stop request injected at a step boundary, ``stop_after``) in each phase in turn,
then continued with ``--resume``: the finished phases are kept, the stopped one continues from
its checkpoint, the rest run. Every phase's per-step losses (and z-loss, tokens, lr, gradient
norm, samples) and the table of held-out perplexities must be bitwise those of the uninterrupted
run. Also: the stopped run's ``summary.json`` names the phase and step, and a rerun into its
folder without ``--resume`` is refused, offering it.

The jobs are a part of the launch several test files share (``shared_launch`` in
shared_launches.py)."""
import csv
import json

import pytest

from tests.helpers.launch_helpers import REPO

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.xdist_group("shared_launch")]

TEACHER_STEPS, STEPS = 4, 3
SHRUNK = ["--seq_len", "32", "--vocab_size", "320", "--max_train_bytes", "200000",
          "--eval_blocks", "16", "--eval_every", "2", "--no_progress",
          "--teacher_model_size", "tiny", "--hidden_size", "16", "--num_layers", "1",
          "--teacher_steps", str(TEACHER_STEPS), "--steps", str(STEPS),
          # every run trains its teacher (the runs share --cache_dir: the first would cache it)
          "--no_teacher_cache"]
# phase stopped in -> (the job's step boundary it stops at, that phase's own step)
STOPS = {"teacher": (2, 2), "ce": (TEACHER_STEPS + 2, 2),
         "distilled": (TEACHER_STEPS + STEPS + 1, 1)}
PHASES = ("teacher", "ce", "distilled")
EXACT = ("step", "loss", "z_loss", "num_tokens", "lr", "grad_norm", "samples")


def _args(tmp_path, out: str, *extra: str) -> list:
    return SHRUNK + ["--cache_dir", str(tmp_path / "cache"), "--deepspeed_config",
                     str(tmp_path / "zero2.json"), "--output_dir", str(tmp_path / out), *extra]


def shared_launch_jobs(tmp_path) -> list:
    """The uninterrupted run; per phase a run stopped in it and its resume (the first also
    rerun without --resume in between: refused)."""
    cfg = json.loads((REPO / "configs" / "zero2.json").read_text())
    cfg.pop("scheduler")
    cfg["optimizer"]["params"]["lr"] = 1e-2
    cfg["megaloss"]["ce"]["chunk_size"] = 48
    (tmp_path / "zero2.json").write_text(json.dumps(cfg))
    jobs = [{"job": "distill_lm", "argv": _args(tmp_path, "full")}]
    for phase, (k, _) in STOPS.items():
        jobs.append({"job": "distill_lm", "argv": _args(tmp_path, phase), "stop_after": k})
        if phase == "teacher":
            jobs.append({"job": "distill_lm", "argv": _args(tmp_path, phase),
                         "expect_exit": str(tmp_path / "refused.txt")})
        jobs.append({"job": "distill_lm", "argv": _args(tmp_path, phase, "--resume")})
    return jobs


@pytest.fixture(scope="module")
def run(shared_launch):
    return shared_launch["test_distill_resume"]


def _rows(out) -> list:
    with open(out / "metrics.csv") as f:
        return [[r[k] for k in EXACT] for r in csv.DictReader(f)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stopped_in", PHASES)
def test_a_resumed_run_equals_the_uninterrupted_one(run, stopped_in):
    full, part = run.tmp_path / "full", run.tmp_path / stopped_in
    for phase, steps in zip(PHASES, (TEACHER_STEPS, STEPS, STEPS)):
        a, b = _rows(full / phase), _rows(part / phase)
        assert [int(r[0]) for r in a] == list(range(1, steps + 1)), phase
        assert a == b, (stopped_in, phase)
        summary = json.loads((part / phase / "summary.json").read_text())
        assert summary["stopped"] is None, phase
        # the stopped phase continued from its checkpoint; the earlier ones were kept as
        # they were; the later ones ran from their start
        step = STOPS[stopped_in][1] if phase == stopped_in else 0
        assert summary["resumed_at_step"] == step, (stopped_in, phase)
    s_full, s_part = (json.loads((p / "summary.json").read_text()) for p in (full, part))
    assert s_part["table"] == s_full["table"]
    assert s_part["stopped"] is None
    resumed = run.stdout + run.stderr
    assert f"resumed from {part / stopped_in / 'checkpoints' / f'step_{STOPS[stopped_in][1]}'}" \
        in resumed


@pytest.mark.timeout(900)
def test_a_stopped_run_says_where_and_a_rerun_is_refused(run):
    for phase, (_, step) in STOPS.items():
        assert f"stopped in phase {phase} after its step {step}" in run.stdout + run.stderr
    refused = (run.tmp_path / "refused.txt").read_text()
    folder = run.tmp_path / "teacher"
    assert refused.startswith(f"{folder} already holds a run ("), refused
    assert "pass --resume to continue it (checkpoints of teacher), --overwrite to replace it" \
        in refused
