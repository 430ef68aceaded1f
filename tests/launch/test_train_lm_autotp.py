"""``launch/train_lm.py --deepspeed_config configs/autotp2.json``: DeepSpeed AutoTP shards the
tiny Llama itself (``"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": true}``,
``megaloss.tensor_parallel_size`` 1), megaloss's CE runs on AutoTP's lm_head shard, and the job
reads its layout from AutoTP's groups (DP 1 x TP 2 on 2 processes). One job of the launch
several test files share (``shared_launch`` in tests/helpers/shared_launches.py), shrunk as in
tests/launch/test_train_lm.py; the held-out cross-entropy and the train loss must fall and
``summary.json`` must record the layout.

Resume under AutoTP, in the same launch: a run of 2N steps and a run of N steps + ``--resume`` +
N steps give bitwise identical per-step metrics and final checkpoints (each TP rank's model
file holds its own shards, the ZeRO-2 optimizer files the DP x TP partitions), as
tests/launch/test_checkpoint_resume.py checks for megaloss's own TP.

The pre-flight check (``launch/jobs/preflight.py``, ``check_ds_config``) counts AutoTP's
``autotp_size`` as the TP size of the layout (fast tier).
"""
import csv
import json

import pytest

from launch.jobs import check_args
from launch.jobs.code_search import stdlib_root
from tests.helpers.launch_helpers import REPO
from tests.launch.test_checkpoint_resume import LM_EXACT, assert_checkpoints_equal

STEPS = 6
N = 3  # resume: steps before the interruption; the runs go to 2N


def _ds_config() -> dict:
    cfg = json.loads((REPO / "configs" / "autotp2.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    cfg.pop("scheduler")  # no warm-up: the loss must move within a few steps
    cfg["optimizer"]["params"]["lr"] = 1e-2
    cfg["megaloss"]["ce"]["chunk_size"] = 48  # several chunks per micro-batch
    cfg["csv_monitor"]["job_name"] = "test"
    return cfg


def shared_launch_jobs(tmp_path) -> list:
    """One job in the shared launch; output in ``out-autotp2``."""
    ds_config = tmp_path / "autotp2.json"
    ds_config.write_text(json.dumps(_ds_config()))
    argv = ["--deepspeed_config", str(ds_config), "--steps", str(STEPS), "--model_size", "tiny",
            "--seq_len", "32", "--vocab_size", "320", "--max_train_bytes", "200000",
            "--eval_blocks", "16", "--eval_every", "3", "--output_dir",
            str(tmp_path / "out-autotp2"), "--cache_dir", str(tmp_path / "cache"), "--no_progress"]
    return [{"job": "train_lm", "argv": argv}] + _resume_jobs(tmp_path)


def _resume_args(cfg, out, cache, steps: int, *extra: str) -> list:
    root = stdlib_root()
    return ["--deepspeed_config", str(cfg), "--train_data", str(root / "json"),
            str(root / "csv.py"), "--eval_data", str(root / "textwrap.py"), "--steps",
            str(steps), "--model_size", "tiny", "--seq_len", "32", "--vocab_size", "300",
            "--eval_blocks", "8", "--eval_every", "2", "--output_dir", str(out),
            "--cache_dir", str(cache), "--no_progress", *extra]


def _resume_jobs(tmp_path) -> list:
    """2N steps saved at 2N; N steps saved at N, then ``--resume`` to 2N (the warm-up of the LR
    schedule crosses the resume)."""
    cfg = json.loads((REPO / "configs" / "autotp2.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    cfg["megaloss"]["ce"]["chunk_size"] = 24
    cfg["scheduler"]["params"]["warmup_num_steps"] = 4
    path = tmp_path / "autotp2-resume.json"
    path.write_text(json.dumps(cfg))
    full, part, cache = tmp_path / "resume-full", tmp_path / "resume-part", tmp_path / "cache"
    return [{"job": "train_lm", "argv": _resume_args(path, full, cache, 2 * N, "--save_every",
                                                     str(2 * N))},
            {"job": "train_lm", "argv": _resume_args(path, part, cache, N, "--save_every",
                                                     str(N))},
            {"job": "train_lm", "argv": _resume_args(path, part, cache, 2 * N, "--resume",
                                                     "--save_every", str(N))}]


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.xdist_group("shared_launch")
@pytest.mark.timeout(900)
def test_train_lm_with_autotp_config(shared_launch):
    out = shared_launch["test_train_lm_autotp"].tmp_path / "out-autotp2"
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert float(r["num_tokens"]) > 0 and float(r["grad_norm"]) > 0
    summary = json.loads((out / "summary.json").read_text())
    layout = (summary["dp"], summary["tp"], summary["autotp"], summary["zero_stage"])
    assert layout == (1, 2, True, 2), summary
    assert summary["engine_loss_multiplier"] == 2  # GAS x DP, measured on AutoTP's groups
    assert summary["eval_after"]["loss"] < summary["eval_before"]["loss"] - 0.05, summary
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"]) - 0.05, rows


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.xdist_group("shared_launch")
@pytest.mark.timeout(900)
def test_resume_under_autotp_is_bitwise_identical_to_an_uninterrupted_run(shared_launch):
    tmp = shared_launch["test_train_lm_autotp"].tmp_path
    full, part = tmp / "resume-full", tmp / "resume-part"
    a, b = ((out / "metrics.csv").read_text().splitlines() for out in (full, part))
    a, b = list(csv.DictReader(a)), list(csv.DictReader(b))
    assert [int(r["step"]) for r in a] == list(range(1, 2 * N + 1))
    assert [[r[k] for k in LM_EXACT] for r in a] == [[r[k] for k in LM_EXACT] for r in b]
    step = f"checkpoints/step_{2 * N}"
    files = sorted(p.name for p in (full / step).glob("*.pt"))
    assert "mp_rank_01_model_states.pt" in files, files  # one model file per TP rank
    assert assert_checkpoints_equal(full / step, part / step) > 1000
    summary = json.loads((part / "summary.json").read_text())
    assert (summary["tp"], summary["autotp"]) == (2, True), summary
    assert summary["resumed_at_step"] == N and summary["steps"] == 2 * N


def test_preflight_counts_autotp_size_as_the_tp_of_the_layout(capsys, monkeypatch):
    monkeypatch.setenv("MEGALOSS_PROG", "train_lm.sh")
    config = str(REPO / "configs" / "autotp2.json")
    for world in (2, 4):  # TP 2 x DP 1, TP 2 x DP 2
        monkeypatch.setenv("MEGALOSS_WORLD_SIZE", str(world))
        check_args.main(["train_lm", "--deepspeed_config", config])  # accepted
    monkeypatch.setenv("MEGALOSS_WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as err:
        check_args.main(["train_lm", "--deepspeed_config", config])
    line = capsys.readouterr().err.strip().splitlines()
    assert err.value.code == 2 and len(line) == 1, line
    assert "tensor_parallel.autotp_size 2" in line[0] and "does not divide the 3" in line[0], line
