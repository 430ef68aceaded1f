"""The monitors a user watches, end to end: a few steps of the LM job under ``deepspeed
--num_gpus 2`` (TP=2, ZeRO-2) with the ds_config's ``wandb`` (``WANDB_MODE=offline``),
``tensorboard`` and ``csv_monitor`` sections on (a job of the launch several test files share,
``shared_launch`` in shared_launches.py).

The offline W&B run is read back with wandb's own reader (``wandb leet inspect --json``, the
run's ``.wandb`` transaction log as JSON records): every megaloss series (loss, z-loss, tokens,
lr, grad norm, tokens/s, memory, step time, optimizer step, held-out CE and perplexity) is there
with the values of ``metrics.csv``, on one monotone x-axis shared with DeepSpeed's own
``Train/Samples/lr`` (the global sample count), and wandb dropped nothing. The W&B files are in
``<output_dir>/wandb``, not the working directory. TensorBoard's event files hold the same
series (read with tensorboard's ``EventAccumulator``).

Also: ``initialize`` without an ``output_dir`` puts the monitors' files in a fresh
``runs/<date>-<time>`` folder, not the current directory, and a second run its own (two runs in
one process).
"""
import csv
import json
import math
import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from launch.jobs.code_search import stdlib_root
from tests.helpers.launch_helpers import REPO

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.xdist_group("shared_launch")]

STEPS = 4
TRAIN_SERIES = ("loss", "z_loss", "num_tokens", "lr", "grad_norm", "tokens_per_s",
                "peak_memory_mib", "step_time_s")


def wandb_history(run_dir: Path) -> dict:
    """``{tag: {step: value}}`` of an offline W&B run, read with wandb's own reader, and the
    steps of its history records in file order."""
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                           str(run_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    series, steps = defaultdict(dict), []
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        if record.get("type") != "history":
            continue
        step = int(record["history"]["step"]["num"])
        steps.append(step)
        for tag, value in record["history"]["item"].items():
            if not tag.startswith("_"):
                series[tag][step] = value
    return series, steps


def tensorboard_scalars(log_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _repo_wandb() -> list:
    return sorted(str(p) for p in (REPO / "wandb").glob("*")) if (REPO / "wandb").exists() else []


def shared_launch_jobs(tmp_path) -> list:
    """The LM job with the monitors on, a job of the shared launch (shared_launches.py); W&B offline
    and its default cache folder (``XDG_CACHE_HOME``) in ``tmp_path``, for this job only."""
    cfg = json.loads((REPO / "configs" / "zero2.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    cfg["wandb"].update(enabled=True, project="megaloss-test")
    cfg["tensorboard"]["enabled"] = True
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    (tmp_path / "repo_wandb_before.json").write_text(json.dumps(_repo_wandb()))
    root = stdlib_root()
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": None,
           "WANDB_CACHE_DIR": None,
           "XDG_CACHE_HOME": str(tmp_path / "xdg-cache")}  # wandb-core's debug log by default
    return [{"job": "train_lm", "env": env, "argv": [
        "--deepspeed_config", str(tmp_path / "ds.json"), "--train_data", str(root / "json"),
        "--eval_data", str(root / "textwrap.py"), "--steps", str(STEPS), "--model_size", "tiny",
        "--seq_len", "32", "--vocab_size", "300", "--eval_blocks", "8", "--eval_every", "2",
        "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache"),
        "--no_progress"]}]


@pytest.mark.timeout(900)
def test_wandb_and_tensorboard_get_every_series(shared_launch, monkeypatch):
    run = shared_launch["test_monitors"]
    tmp_path = run.tmp_path
    home_cache = tmp_path / "xdg-cache"
    for name, value in run.jobs[0]["env"].items():  # wandb's reader below: the job's environment
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    output = run.stdout + run.stderr  # the whole launch: no job's wandb warnings
    assert "less than the current step" not in output  # wandb dropped nothing

    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    samples = [int(r["samples"]) for r in rows]
    assert samples == [4 * s for s in range(1, STEPS + 1)]  # micro 2 x GAS 2 x DP 1
    summary = json.loads((out / "summary.json").read_text())
    evals = {0: summary["eval_before"]}  # x = samples: 0 before training
    evals.update({int(r["samples"]): {"loss": float(r["eval_loss"]),
                                      "perplexity": float(r["eval_perplexity"])}
                  for r in rows if r["eval_loss"]})
    assert sorted(evals) == [0, 8, 16]  # before, step 2, after step 4

    # W&B: its files under the run's folder, none in the working directory (the repo)
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((out / "wandb").iterdir())
    assert _repo_wandb() == json.loads((tmp_path / "repo_wandb_before.json").read_text())
    assert list((out / "wandb" / "logs").glob("core-debug-*.log"))  # beside the run, not in ~
    assert not (home_cache / "wandb").exists(), list((home_cache / "wandb").rglob("*"))
    history, steps = wandb_history(runs[0])
    assert steps == sorted(set(steps)) and steps == [0] + samples  # one monotone axis
    assert history["Train/Samples/lr"].keys() == set(samples)  # DeepSpeed's own series
    for name in TRAIN_SERIES:
        assert history[f"Train/megaloss/{name}"] == {
            int(r["samples"]): pytest.approx(float(r[name]), rel=1e-12) for r in rows}, name
    assert history["Train/megaloss/optimizer_step"] == {
        int(r["samples"]): int(r["step"]) for r in rows}
    for name in ("loss", "perplexity"):
        assert history[f"Eval/megaloss/{name}"] == {
            x: pytest.approx(e[name], rel=1e-12) for x, e in evals.items()}, name

    # TensorBoard: the same series at the same x (float32 on disk)
    scalars = tensorboard_scalars(out / "monitor" / "megaloss")
    assert scalars["Train/Samples/lr"].keys() == set(samples)
    for name in TRAIN_SERIES + ("optimizer_step",):
        assert scalars[f"Train/megaloss/{name}"].keys() == set(samples), name
    for r in rows:
        x = int(r["samples"])
        for name in TRAIN_SERIES:
            assert scalars[f"Train/megaloss/{name}"][x] == pytest.approx(float(r[name]),
                                                                          rel=1e-6), name
    for x, e in evals.items():
        assert scalars["Eval/megaloss/loss"][x] == pytest.approx(e["loss"], rel=1e-6)
        assert math.isclose(scalars["Eval/megaloss/perplexity"][x], e["perplexity"],
                            rel_tol=1e-6)


SCRIPT = textwrap.dedent("""
    import os, torch, deepspeed
    from megaloss import Topology
    from megaloss.integrations.deepspeed import initialize, write_metrics
    from megaloss.integrations.deepspeed.compat import configure_launched_process
    from megaloss.testing import free_port
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    configure_launched_process()
    deepspeed.init_distributed()

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return (self.w * x).sum()

    for _ in range(2):  # a second run (here in the same second) gets a folder of its own
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
               "csv_monitor": {"enabled": True, "output_path": "", "job_name": "j"}}
        me = initialize(M(), cfg, topology=Topology.build(1))
        write_metrics(me.engine, {"x": 1.0})
        print("monitor:", me.ds_config["csv_monitor"]["output_path"])
        me.engine.destroy()
    torch.distributed.destroy_process_group()  # else gloo's threads can abort the exit (-6)
""")


@pytest.mark.timeout(240)
def test_initialize_without_output_dir_writes_under_a_fresh_run_folder(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True,
                          text=True, timeout=200,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing in the cwd itself
    folders = sorted((tmp_path / "runs").iterdir())
    assert len(folders) == 2
    for folder in folders:
        assert (folder / "monitor" / "j" / "Train_megaloss_x.csv").read_text().splitlines() == [
            "step,x", "0,1.0"]
