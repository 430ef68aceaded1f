"""End to end: ``launch/distill_lm.py`` under ``deepspeed --num_gpus 2`` on CPU with the default
``configs/zero2.json`` (TP=2: both lm_heads vocab-parallel; no warm-up, 48-token chunks), shrunk:
a tiny teacher, a smaller student, 32-token blocks, 200 kB of the built-in stdlib text. The
launch several test files share (``shared_launch`` in shared_launches.py) runs the job three times:
first without ``--teacher`` (it trains and saves its teacher, and caches it in ``--cache_dir``),
then with ``--teacher`` pointing at that checkpoint (another divergence and temperature), then
with the first run's teacher settings again (the teacher is copied from the cache, not trained).

Checks the summary table's fields (not that distillation wins at this size): three rows with
sizes, parameters, steps and finite held-out perplexity / CE; both students start from the same
weights (equal held-out CE before training); the teacher loaded back from its checkpoint (its
lm_head re-split over the TP ranks) scores what it scored when trained; per-phase outputs.
"""
import csv
import json
import math

import pytest

from tests.helpers.launch_helpers import REPO

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.xdist_group("shared_launch")]

TEACHER_STEPS, STEPS, REUSE_STEPS = 4, 3, 2
SHRUNK = ["--seq_len", "32", "--vocab_size", "320", "--max_train_bytes", "200000",
          "--eval_blocks", "16", "--eval_every", "0", "--no_progress",
          "--teacher_model_size", "tiny", "--hidden_size", "16", "--num_layers", "1"]


def shared_launch_jobs(tmp) -> list:
    """The three runs, in the shared launch (shared_launches.py): ``first`` trains its teacher,
    ``second`` reuses that teacher's checkpoint, ``third`` finds it in the cache."""
    first, second, third = tmp / "first", tmp / "second", tmp / "third"
    # the default config without its warm-up (the loss must move within a few steps), and
    # several chunks per micro-batch
    cfg = json.loads((REPO / "configs" / "zero2.json").read_text())
    cfg.pop("scheduler")
    cfg["optimizer"]["params"]["lr"] = 1e-2
    cfg["megaloss"]["ce"]["chunk_size"] = 48
    (tmp / "zero2.json").write_text(json.dumps(cfg))
    cache = ["--cache_dir", str(tmp / "cache"), "--deepspeed_config", str(tmp / "zero2.json")]
    return [
        {"job": "distill_lm", "argv": SHRUNK + cache + [
            "--teacher_steps", str(TEACHER_STEPS), "--steps", str(STEPS),
            "--output_dir", str(first)]},
        {"job": "distill_lm", "argv": SHRUNK + cache + [
            "--teacher", str(first / "teacher" / "checkpoints"), "--steps", str(REUSE_STEPS),
            "--kind", "jsd", "--temperature", "2", "--alpha", "0.25",
            "--output_dir", str(second)]},
        {"job": "distill_lm", "argv": SHRUNK + cache + [
            "--teacher_steps", str(TEACHER_STEPS), "--steps", str(REUSE_STEPS),
            "--output_dir", str(third)]},
    ]


@pytest.fixture(scope="module")
def runs(shared_launch):
    """The output folders of the first, the second and the third run."""
    tmp = shared_launch["test_distill_lm"].tmp_path
    return tmp / "first", tmp / "second", tmp / "third"


@pytest.mark.timeout(900)
def test_the_verdict_names_both_students(shared_launch, runs):
    """The closing line compares two students, not one model before -> after (it used to read
    ``distillation does NOT beat CE alone (126.2 -> 153.2)``)."""
    output = " ".join(shared_launch["test_distill_lm"].outputs[0].split())  # rich wraps it
    table = _summary(runs[0])["table"]
    ce, kd = table[1]["perplexity"], table[2]["perplexity"]
    verb = "beats" if kd < ce else "does NOT beat"
    assert (f"the distilled student ({kd:.1f}) {verb} the student trained on CE alone "
            f"({ce:.1f})") in output


def _summary(out):
    return json.loads((out / "summary.json").read_text())


def _check_table(summary, teacher_steps, steps):
    table = summary["table"]
    assert [r["model"] for r in table] == ["teacher", "student, CE only", "student, distilled"]
    assert [r["steps"] for r in table] == [teacher_steps, steps, steps]
    assert table[0]["size"] == "Llama 1L x 32" and table[1]["size"] == table[2]["size"] \
        == "Llama 1L x 16"
    assert table[0]["parameters"] > table[1]["parameters"] == table[2]["parameters"] > 0
    for r in table:
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1
        assert r["perplexity"] == pytest.approx(math.exp(r["loss"]), rel=1e-9)
    assert summary["distillation_beats_ce"] == (table[2]["perplexity"] < table[1]["perplexity"])
    assert summary["perplexity_ce_minus_distilled"] == pytest.approx(
        table[1]["perplexity"] - table[2]["perplexity"])
    assert (summary["dp"], summary["tp"], summary["zero_stage"]) == (1, 2, 2)
    ce, kd = summary["phases"]["ce"], summary["phases"]["distilled"]
    # the same initial student (scored by the CE head and by the distillation head's CE part)
    assert ce["eval_before"]["loss"] == pytest.approx(kd["eval_before"]["loss"], rel=1e-6)
    for p in (ce, kd):  # both train ...
        assert p["eval_after"]["loss"] < p["eval_before"]["loss"] - 0.01, p
    # ... and differently
    assert kd["eval_after"]["loss"] != pytest.approx(ce["eval_after"]["loss"], rel=1e-4)


@pytest.mark.timeout(900)
def test_distill_lm_trains_its_teacher(runs):
    first = runs[0]
    summary = _summary(first)
    _check_table(summary, TEACHER_STEPS, STEPS)
    assert summary["teacher"]["trained_here"] is True
    assert summary["teacher"]["cached_from"] is None
    assert summary["distillation"]["kind"] == "forward_kl"
    assert (first / "teacher" / "checkpoints" / "latest").read_text().strip() == \
        f"step_{TEACHER_STEPS}"
    for phase, steps in (("teacher", TEACHER_STEPS), ("ce", STEPS), ("distilled", STEPS)):
        with open(first / phase / "metrics.csv") as f:
            assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, steps + 1))
    assert (first / "loss_curve.png").stat().st_size > 0


@pytest.mark.timeout(900)
def test_distill_lm_reuses_a_teacher_checkpoint(runs):
    first, second = runs[:2]
    summary = _summary(second)
    _check_table(summary, TEACHER_STEPS, REUSE_STEPS)
    assert summary["teacher"]["trained_here"] is False
    assert summary["teacher"]["checkpoint"].endswith(f"step_{TEACHER_STEPS}")
    assert not (second / "teacher").exists()
    # the teacher read back (full lm_head from both TP ranks' files, split again) scores the same
    trained = _summary(first)["table"][0]
    assert summary["table"][0]["loss"] == pytest.approx(trained["loss"], rel=1e-6)
    assert (summary["distillation"]["kind"], summary["distillation"]["temperature"],
            summary["distillation"]["alpha"]) == ("jsd", 2.0, 0.25)


@pytest.mark.timeout(900)
def test_a_second_run_copies_its_teacher_from_the_cache(shared_launch, runs):
    first, _, third = runs
    s1, s3 = _summary(first), _summary(third)
    _check_table(s3, TEACHER_STEPS, REUSE_STEPS)
    cache = s1["teacher"]["cache"]
    assert cache is not None and s3["teacher"]["cache"] == cache
    assert s3["teacher"]["cached_from"] == cache
    assert "copied from the cache" in shared_launch["test_distill_lm"].outputs[2]
    assert "copied from the cache" not in shared_launch["test_distill_lm"].outputs[0]
    # the cache holds the finished phase with its last checkpoint only
    from pathlib import Path

    assert sorted(p.name for p in (Path(cache) / "checkpoints").glob("step_*")) == \
        [f"step_{TEACHER_STEPS}"]
    # the teacher phase of the third run is the first run's: its steps, its evaluation, and a
    # checkpoint in the third run's folder that the distilled student was taught by
    assert s3["table"][0] == s1["table"][0]
    assert (third / "teacher" / "metrics.csv").read_text() == \
        (first / "teacher" / "metrics.csv").read_text()
    assert s3["teacher"]["checkpoint"] == str(third / "teacher" / "checkpoints" /
                                              f"step_{TEACHER_STEPS}")
    assert (third / "teacher" / "checkpoints" / "latest").read_text().strip() == \
        f"step_{TEACHER_STEPS}"
