"""End to end: the MoE job (``launch.train_moe``) under ``deepspeed --num_gpus 2`` on CPU,
shrunk (a 1-layer Qwen3-MoE 16 wide, 4 experts top-2, 32-token blocks, 200 kB of the built-in
stdlib text, 4 steps of micro-batch 2 x GAS 2 x DP 2), all three router-loss scopes; one job of
the launch several test files share (``shared_launch`` in shared_launches.py).

Checks what a user reads: the table on rank 0, ``summary.json``'s keys (one run per scope,
held-out perplexity, expert load per layer and specialisation per domain within their bounds),
``plot.png`` and each run's folder; that every run trained (held-out CE below the untrained
model's, from the same initial weights); and that the scope took effect (each run's folder
records its scope, and the runs' losses after the first step differ). A second, smaller job
runs one scope with ``--mtp 2``: each depth's CE per step in ``metrics.csv`` and the table.
"""
import json
import math

import pytest

from tests.helpers.launch_helpers import REPO

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.xdist_group("shared_launch")]

SCOPES = ("micro_batch", "global", "step")
EXPERTS, TOP_K, LAYERS, STEPS = 4, 2, 1, 4


def shared_launch_jobs(tmp_path) -> list:
    """The job, shrunk, with the default config less its warm-up (the loss must move within a
    few steps)."""
    cfg = json.loads((REPO / "configs" / "moe.json").read_text())
    cfg.pop("scheduler")
    cfg["optimizer"]["params"]["lr"] = 1e-2
    cfg["megaloss"]["router"]["aux_loss"] = 0.1  # the scopes' difference shows in 4 steps
    (tmp_path / "moe.json").write_text(json.dumps(cfg))
    common = ["--deepspeed_config", str(tmp_path / "moe.json"), "--seq_len", "32",
              "--vocab_size", "320", "--max_train_bytes", "200000", "--eval_blocks", "8",
              "--eval_every", "0", "--domain_blocks", "4", "--domains", "email,json,asyncio",
              "--hidden_size", "16", "--num_layers", str(LAYERS), "--num_experts",
              str(EXPERTS), "--top_k", str(TOP_K), "--moe_intermediate_size", "32",
              "--cache_dir", str(tmp_path / "cache"), "--no_progress"]
    return [{"job": "train_moe", "argv": common + [
                "--steps", str(STEPS), "--scopes", ",".join(SCOPES),
                "--output_dir", str(tmp_path / "out")]},
            {"job": "train_moe", "argv": common + [
                "--steps", "2", "--scopes", "step", "--mtp", "2",
                "--output_dir", str(tmp_path / "mtp")]}]


@pytest.fixture(scope="module")
def run(shared_launch):
    return shared_launch["test_train_moe"]


@pytest.mark.timeout(900)
def test_summary_table_and_plot(run):
    out = run.tmp_path / "out"
    assert (out / "summary.json").exists(), run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["runs"]) == list(SCOPES) and summary["stopped"] is None
    assert summary["domains"] == ["email", "json", "asyncio"]
    assert (summary["dp"], summary["gas"], summary["micro_batch"]) == (2, 2, 2)
    assert (out / "plot.png").stat().st_size > 0 and (out / "loss_curve.png").exists()
    assert not (out / "monitor").exists()
    text = " ".join(run.outputs[0].split())
    assert "megaloss MoE job" in text and "held-out perplexity" in text
    assert "specialisation: json" in text
    for scope, r in summary["runs"].items():
        assert (out / scope / "metrics.csv").exists()
        # each run's monitor in its own folder (DeepSpeed's csv_monitor), none shared
        rows = (out / scope / "monitor" / "megaloss" / "Train_megaloss_loss.csv").read_text()
        assert len(rows.strip().splitlines()) == STEPS + 1  # header + one row per step
        assert json.loads((out / scope / "summary.json").read_text())["router"]["scope"] == scope
        assert r["steps"] == STEPS and math.isfinite(r["eval_after"]["perplexity"])
        routing = r["routing"]
        assert len(routing["load_per_layer"]) == LAYERS
        assert all(1.0 <= v <= EXPERTS / TOP_K + 1e-9 for v in routing["load_per_layer"])
        assert set(routing["specialisation"]) == {"email", "json", "asyncio"}
        assert all(TOP_K / EXPERTS - 1e-9 <= v <= 1.0 + 1e-9
                   for v in routing["specialisation"].values())
        assert routing["uniform_share"] == TOP_K / EXPERTS


def test_every_run_trained_from_the_same_weights(run):
    summary = json.loads((run.tmp_path / "out" / "summary.json").read_text())
    runs = list(summary["runs"].values())
    before = {r["eval_before"]["loss"] for r in runs}
    assert len(before) == 1  # the same initial weights and held-out data
    for r in runs:
        assert r["eval_after"]["loss"] < r["eval_before"]["loss"]
        assert math.isfinite(r["last_loss"]) and r["last_loss"] < r["first_loss"]
        assert r["last_router_aux_loss"] > 0
    # the same first step but its router term (each scope's pool); then different routers
    firsts = [r["first_loss"] for r in runs]
    assert max(firsts) - min(firsts) < 0.05
    assert len({r["last_loss"] for r in runs}) == len(runs)


def test_mtp_depths_are_reported(run):
    import csv

    out = run.tmp_path / "mtp"
    summary = json.loads((out / "summary.json").read_text())
    step = summary["runs"]["step"]
    assert step["mtp_depths"] == 2 and len(step["last_mtp_losses"]) == 2
    with open(out / "step" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for r in rows:
        depths = [float(r["mtp_loss_1"]), float(r["mtp_loss_2"])]
        # each depth's global CE mean: about the main CE at this size (near log V at init)
        assert all(0 < d < 2 * math.log(320) for d in depths)
    assert step["last_mtp_losses"] == depths
    text = " ".join(run.outputs[1].split())
    assert "MTP depth 1 CE, last step" in text and "MTP depth 2 CE, last step" in text
