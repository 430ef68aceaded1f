"""Checkpoints and resume, end to end under ``deepspeed --num_gpus 2`` on CPU: a run of 2N steps
and a run of N steps + ``--resume`` + N steps give bitwise identical per-step metrics and final
checkpoints (parameters, optimizer states), for the LM job under ZeRO-2 (DP=2), ZeRO-3 (DP=2)
and ZeRO-2 with TP=2 (vocab-parallel head), and for the embedding job (ZeRO-2, DP=2, dropout on:
the per-rank RNG states must be restored). The embedding job's cosine LR schedule depends on
``--steps``, so its first half is a 2N-step run stopped after step N the way SIGTERM stops it
(the stop request is injected at that step boundary). Also: ``--eval_only --resume`` reproduces the
uninterrupted run's final evaluation exactly, a rerun into a folder holding a run is refused,
and a resume from a checkpoint whose file was cut short (as a crash while saving leaves it) is
refused on every rank with a message naming the file.

One launcher run drives every job (``launch_helpers.run_jobs_in_one_launch`` calls the jobs'
``main`` in turn, in the same processes: start-up costs more than these tiny jobs), the launch
other test files share (``shared_launch`` in shared_launches.py); the tests below assert on its
outputs. A fresh process per run is covered by test_preemption.py, which
resumes in a new launcher run.
"""
import csv
import json
import subprocess
import sys

import pytest
import torch

from launch.jobs.code_search import stdlib_root
from tests.helpers.launch_helpers import REPO, run_jobs_in_one_process

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.xdist_group("shared_launch")]

N = 3  # steps before the interruption; the runs go to 2N
LM_LAYOUTS = [(2, 1), (3, 1), (2, 2)]  # (ZeRO stage, TP) on 2 processes
# metrics that must match bitwise (the others are timings and memory)
LM_EXACT = ("step", "loss", "z_loss", "num_tokens", "lr", "grad_norm", "samples")
EMBED_EXACT = ("step", "loss", "accuracy", "lr", "grad_norm", "samples")


def _lm_config(stage: int, tp: int) -> dict:
    cfg = json.loads((REPO / "configs" / f"zero{stage}.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    cfg["megaloss"]["tensor_parallel_size"] = tp
    cfg["megaloss"]["ce"]["chunk_size"] = 24
    cfg["scheduler"]["params"]["warmup_num_steps"] = 4  # the LR schedule crosses the resume
    return cfg


def _lm_args(cfg, out, cache, steps: int, *extra: str) -> list:
    root = stdlib_root()
    return ["--deepspeed_config", str(cfg), "--train_data", str(root / "json"),
            str(root / "csv.py"), "--eval_data", str(root / "textwrap.py"), "--steps",
            str(steps), "--model_size", "tiny", "--seq_len", "32", "--vocab_size", "300",
            "--eval_blocks", "8", "--eval_every", "2", "--output_dir", str(out),
            "--cache_dir", str(cache), "--no_progress", *extra]


def _embed_args(out, cache, steps: int, *extra: str) -> list:
    root = stdlib_root()
    return ["--train_data", str(root / "email"), str(root / "json"), "--eval_fraction", "0.2",
            "--max_eval", "24", "--steps", str(steps), "--micro_batch_size", "4",
            "--gradient_accumulation_steps", "2", "--model_size", "tiny", "--vocab_size", "300",
            "--max_doc_len", "32", "--max_query_len", "16", "--warmup_steps", "2",
            "--dropout", "0.1", "--output_dir", str(out), "--cache_dir", str(cache),
            "--no_progress", *extra]


def _rows(out) -> list:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _tensors(obj, prefix=""):
    """Every tensor in a checkpoint file's nested dicts / lists, by path; the job's own client
    state (timings) left out."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if k != "job":
                yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}")


def assert_checkpoints_equal(a, b) -> int:
    """Same files, and every tensor in them bitwise equal (model, optimizer, RNG states).
    Returns the number of tensor elements compared."""
    files = sorted(p.name for p in a.glob("*.pt"))
    assert files and files == sorted(p.name for p in b.glob("*.pt")), (a, b)
    compared = 0
    for name in files:
        ta = dict(_tensors(torch.load(a / name, weights_only=False)))
        tb = dict(_tensors(torch.load(b / name, weights_only=False)))
        assert ta.keys() == tb.keys(), name
        for key in ta:
            assert ta[key].dtype == tb[key].dtype and ta[key].shape == tb[key].shape, key
            assert torch.equal(ta[key], tb[key]), f"{name}{key} differs"
            compared += ta[key].numel()
    return compared


def _cases(tmp_path) -> list:
    return [("lm", stage, tp, tmp_path / f"lm{stage}{tp}-full", tmp_path / f"lm{stage}{tp}-part")
            for stage, tp in LM_LAYOUTS] + [("embed", 2, 1, tmp_path / "embed-full",
                                              tmp_path / "embed-part")]


def shared_launch_jobs(tmp_path) -> list:
    """The jobs of the shared launch (shared_launches.py): every layout's uninterrupted and
    interrupted + resumed runs, the ZeRO-3 checkpoint evaluated and a rerun refused, the
    embedding job stopped and resumed, a branch."""
    cache, jobs = tmp_path / "cache", []
    for stage, tp in LM_LAYOUTS:
        cfg = tmp_path / f"zero{stage}-tp{tp}.json"
        cfg.write_text(json.dumps(_lm_config(stage, tp)))
        full, part = tmp_path / f"lm{stage}{tp}-full", tmp_path / f"lm{stage}{tp}-part"
        jobs += [
            {"job": "train_lm", "argv": _lm_args(cfg, full, cache, 2 * N, "--save_every",
                                                 str(2 * N))},
            {"job": "train_lm", "argv": _lm_args(cfg, part, cache, N, "--save_every", str(N))},
            {"job": "train_lm", "argv": _lm_args(cfg, part, cache, 2 * N, "--resume",
                                                 "--save_every", str(N))},
        ]
    # the ZeRO-3 layout: evaluate the resumed run's checkpoint; rerun without --resume: refused
    cfg3 = tmp_path / "zero3-tp1.json"
    part3 = tmp_path / "lm31-part"
    jobs += [
        {"job": "train_lm", "argv": _lm_args(cfg3, part3, cache, 2 * N, "--eval_only",
                                             "--resume", str(part3 / "checkpoints"))},
        {"job": "train_lm", "argv": _lm_args(cfg3, part3, cache, 2 * N),
         "expect_exit": str(tmp_path / "refused.txt")},
    ]
    full, part = tmp_path / "embed-full", tmp_path / "embed-part"
    jobs += [
        {"job": "train_embed", "argv": _embed_args(full, cache, 2 * N, "--save_every",
                                                   str(2 * N))},
        {"job": "train_embed", "argv": _embed_args(part, cache, 2 * N), "stop_after": N},
        {"job": "train_embed", "argv": _embed_args(part, cache, 2 * N, "--resume",
                                                   "--save_every", str(N))},
        {"job": "train_embed", "argv": _embed_args(part, cache, 2 * N, "--resume",
                                                   "--eval_only")},
    ]
    # the ZeRO-2 layout's step N (read by no test once resumed from), its model file cut in half
    # on local rank 0 just before the job: every rank exits naming the file
    step = tmp_path / "lm21-part" / "checkpoints" / f"step_{N}"
    jobs += [{"job": "train_lm", "argv": _lm_args(tmp_path / "zero2-tp1.json",
                                                  tmp_path / "lm21-part", cache, 2 * N,
                                                  "--resume", str(step)),
              "truncate": str(step / "mp_rank_00_model_states.pt"),
              "expect_exit": str(tmp_path / "truncated.txt")}]
    # a branch: 4 steps saved every 2, then resumed from step_2 to step 3 without --save_every,
    # then --eval_only --resume (latest)
    cfg2 = tmp_path / "zero2-tp1.json"
    branch = tmp_path / "lm-branch"
    jobs += [
        {"job": "train_lm", "argv": _lm_args(cfg2, branch, cache, 4, "--save_every", "2")},
        {"job": "train_lm", "argv": _lm_args(cfg2, branch, cache, 3, "--resume",
                                             str(branch / "checkpoints" / "step_2"))},
        {"job": "train_lm", "argv": _lm_args(cfg2, branch, cache, 3, "--resume",
                                             "--eval_only")},
    ]
    return jobs


@pytest.fixture(scope="module")
def runs(shared_launch):
    run = shared_launch["test_checkpoint_resume"]
    (run.tmp_path / "launch.log").write_text(run.stdout + run.stderr)
    return run.tmp_path, {case[:3]: case[3:] for case in _cases(run.tmp_path)}


CASES = [("lm", stage, tp) for stage, tp in LM_LAYOUTS] + [("embed", 2, 1)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("job,stage,tp", CASES, ids=lambda v: str(v))
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(runs, job, stage, tp):
    full, part = runs[1][job, stage, tp]
    exact = LM_EXACT if job == "lm" else EMBED_EXACT
    a, b = _rows(full), _rows(part)
    assert [int(r["step"]) for r in a] == list(range(1, 2 * N + 1))
    assert [[r[k] for k in exact] for r in a] == [[r[k] for k in exact] for r in b], \
        (job, stage, tp)
    n = assert_checkpoints_equal(full / "checkpoints" / f"step_{2 * N}",
                                 part / "checkpoints" / f"step_{2 * N}")
    assert n > 1000, (job, stage, tp, n)
    summary = json.loads((part / "summary.json").read_text())
    assert summary["resumed_at_step"] == N and summary["steps"] == 2 * N
    assert summary["stopped"] is None and summary["eval_after"] is not None
    assert summary["checkpoints"]["saves"] >= 1 and summary["checkpoints"]["mib_per_save"] > 0
    # the monitor files continue the first half: one header, steps 1..2N once each
    name = "Train_megaloss_loss.csv" if job == "lm" else "Train_megaloss_mnr_loss.csv"
    lines = (part / "monitor" / "megaloss" / name).read_text().splitlines()
    assert lines[0].startswith("step,") and sum(ln.startswith("step,") for ln in lines) == 1
    assert [float(ln.split(",")[1]) for ln in lines[1:]] == [float(r["loss"]) for r in a]


@pytest.mark.timeout(900)
def test_eval_only_reproduces_the_final_evaluation_and_a_rerun_is_refused(runs):
    tmp_path = runs[0]
    part3, full3 = tmp_path / "lm31-part", tmp_path / "lm31-full"
    report = json.loads((part3 / f"eval_step{2 * N}.json").read_text())
    assert report["eval"]["loss"] == json.loads(
        (full3 / "summary.json").read_text())["eval_after"]["loss"]
    report = json.loads((tmp_path / "embed-part" / f"eval_step{2 * N}.json").read_text())
    assert report["eval"] == json.loads(
        (tmp_path / "embed-full" / "summary.json").read_text())["eval_after"]
    refused = (tmp_path / "refused.txt").read_text()
    assert "already holds a run" in refused and "--resume" in refused and "--overwrite" in refused


@pytest.mark.timeout(900)
def test_a_truncated_checkpoint_file_is_refused_with_its_path_on_every_rank(runs):
    tmp_path = runs[0]
    cut = tmp_path / "lm21-part" / "checkpoints" / f"step_{N}" / "mp_rank_00_model_states.pt"
    # rank 0 checked the files with the run folder, before anything in it changed; rank 1 exits
    # with rank 0's message (launch.jobs.agreement.agreed)
    out_dir = cut.parents[2]
    for rank, start in ((0, f"--resume {cut.parent}: "),
                        (1, f"error on rank 0 (--output_dir {out_dir}): --resume {cut.parent}: ")):
        message = (tmp_path / f"truncated.txt.rank{rank}").read_text()
        assert message.startswith(start + f"checkpoint file {cut} is truncated or corrupted"), \
            (rank, message)


@pytest.mark.timeout(900)
def test_universal_checkpoint_from_tp2_resumes_on_one_process(runs):
    """TP=2 (2 processes) -> universal checkpoint -> TP=1 (1 process, plain ``python``, the
    jobs' single-process mode): evaluation and training continue where the TP=2 run stopped."""
    tmp_path = runs[0]
    cache = tmp_path / "cache"
    src = tmp_path / "lm22-full" / "checkpoints"
    conv = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                           "--input_folder", str(src / f"step_{2 * N}"), "--output_folder",
                           str(src / "universal"), "--num_extract_workers", "1",
                           "--num_merge_workers", "1"], capture_output=True, text=True,
                          timeout=120)
    assert conv.returncode == 0, conv.stdout[-3000:] + conv.stderr[-3000:]
    cfg = _lm_config(2, 1)
    cfg["checkpoint"] = {"load_universal": True}
    cfg1 = tmp_path / "universal-tp1.json"
    cfg1.write_text(json.dumps(cfg))
    one = tmp_path / "lm-universal"
    run_jobs_in_one_process([
        {"job": "train_lm", "argv": _lm_args(cfg1, one, cache, 2 * N, "--eval_only",
                                             "--resume", str(src / "universal"))},
        {"job": "train_lm", "argv": _lm_args(cfg1, one, cache, 2 * N + 2, "--resume",
                                             str(src / "universal"))}],
        tmp_path / "universal.json", timeout=300)
    full = json.loads((tmp_path / "lm22-full" / "summary.json").read_text())
    report = json.loads((one / f"eval_step{2 * N}.json").read_text())
    assert report["eval"]["loss"] == full["eval_after"]["loss"]
    summary = json.loads((one / "summary.json").read_text())
    assert (summary["dp"], summary["tp"], summary["resumed_at_step"]) == (1, 1, 2 * N)
    rows = _rows(one)
    assert [int(r["step"]) for r in rows] == list(range(1, 2 * N + 3))
    assert [r["loss"] for r in rows[:2 * N]] == [r["loss"] for r in _rows(tmp_path / "lm22-full")]


@pytest.mark.timeout(900)
def test_a_branch_saves_its_last_step_and_latest_follows_it(runs):
    """``--resume .../step_2 --steps 3`` in a folder whose latest is step_4, without
    ``--save_every``: the resumed run saves step 3, ``latest`` names it (not the abandoned
    step_4), summary.json's ``checkpoints`` are this run's, ``--eval_only`` evaluates step 3 and
    says so."""
    tmp_path = runs[0]
    ckpts = tmp_path / "lm-branch" / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_3"
    summary = json.loads((tmp_path / "lm-branch" / "summary.json").read_text())
    assert summary["resumed_at_step"] == 2 and summary["steps"] == 3
    assert summary["checkpoints"]["saves"] == 1
    assert summary["checkpoints"]["last"] == str(ckpts / "step_3")
    report = json.loads((tmp_path / "lm-branch" / "eval_step3.json").read_text())
    assert report["checkpoint"] == str(ckpts / "step_3") and report["step"] == 3
    log = (tmp_path / "launch.log").read_text()
    assert f"not from latest (step_4): {ckpts / 'latest'} now names step_2" in log
    assert f"evaluating checkpoint {ckpts / 'step_3'} (step 3)" in log
