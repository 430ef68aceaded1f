"""``megaloss.cli.comm_model`` (``megaloss-comm-model``): the communication model of megaloss's
losses against counts measured on
real gloo processes, and the scaling tables of the README.

Slow tier (per world size 1-4, spawned gloo processes): every layout ``TP x DP x SP = world``
runs the vocab-parallel CE (fp32 in 3 chunks, bf16 with label smoothing, Megatron sequence
parallelism), the calibration of a step, the gathered MNR (even, uneven with hard negatives,
symmetric and duplicate ids, bf16 dot-product without ``local_loss``) and a step of the embedding
job with and without GradCache; a ``TorchDispatchMode`` counts every collective, forward and
backward, and each rank's counts (calls and payload bytes per kind and group size) must EQUAL
the model's.

Fast tier: the model's closed forms (the figures ``tools/bench_vocab_parallel.py`` checks), the
ring volumes, GradCache's gradient, the committed measurements, the README tables and the plot.
"""
import json
import math
import re
from pathlib import Path

import pytest
import torch

import megaloss.cli.comm_model as cm

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_measured_counts_equal_the_model(world):
    records = cm.measure([world], timeout=170)
    layouts = cm.layouts(world)
    cases = len(cm.CE_CASES) + 1 + len(cm.MNR_CASES) + 2
    assert len(records) == world * len(layouts) * cases
    problems = cm.check(records)
    assert not problems, "\n".join(problems[:10])
    if world == 1:  # one process: nothing at all
        assert all(not r["measured"] for r in records)
        return
    # not vacuous: the collectives the model names were seen, over the right groups
    by = {(r["case"], r["tp"], r["dp"], r["sp"], r["rank"]): r["measured"] for r in records}
    tp_only = by[("ce-fp32-3chunks", world, 1, 1, 0)]
    assert tp_only["fwd"][f"all_reduce@{world}"] == [6, 12 * 300]      # 3 chunks x 2, 12 B/token
    assert tp_only["bwd"][f"all_reduce@{world}"] == [1, 4 * 48 * 300]  # d_hidden, 4H B/token
    dp_only = by[("mnr-step", 1, world, 1, 0)]["step"]
    cached = by[("mnr-step-cached", 1, world, 1, 0)]["step"]
    assert sum(c for c, _ in cached.values()) < sum(c for c, _ in dp_only.values())
    rs = f"reduce_scatter@{world}"  # GradCache: the same gradient bytes in one call, not G
    assert cached[rs] == [1, dp_only[rs][1]] and dp_only[rs][0] == cm.STEP_GAS
    assert by[("calibration", 1, world, 1, 0)]["step"] == {f"all_reduce@{world}": [2, 32]}


# fast -------------------------------------------------------------------------------------------
def test_vocab_parallel_ce_closed_forms():
    """The figures bench_vocab_parallel.py checks: 12 B/token forward (MAX [C] + SUM [2, C] fp32,
    16 with label smoothing), independent of V; 4H B/token backward; nothing at TP 1."""
    for tp in (2, 4, 8):
        t = cm.vocab_parallel_ce(4096, 512, tp, chunk_size=1024)
        fwd = t["fwd"].counts
        assert fwd[("all_reduce", tp)] == [2 * 4, 12 * 4096]
        assert fwd[("all_gather", tp)] == [1, 64]  # the cross-rank check: 8 int64
        assert t["bwd"].counts == {("all_reduce", tp): [1, 4 * 512 * 4096]}
        ls = cm.vocab_parallel_ce(4096, 512, tp, label_smoothing=True)["fwd"]
        assert ls.counts[("all_reduce", tp)][1] == 16 * 4096
        bf16 = cm.vocab_parallel_ce(4096, 512, tp, hidden_bytes=2)["bwd"]
        assert bf16.payload == 2 * 512 * 4096
    one = cm.vocab_parallel_ce(4096, 512, 1)
    assert one["fwd"].calls == one["bwd"].calls == 0
    # collectives per micro-batch: 2 per chunk + the shape check; 1 backward
    assert cm.vocab_parallel_ce(3000, 64, 2, chunk_size=1024)["fwd"].calls == 2 * 3 + 1


def test_calibration_and_mnr_closed_forms():
    assert cm.calibration_step(1).calls == 0
    assert cm.calibration_step(4, 2).counts == {("all_reduce", 8): [2, 32]}
    call = cm.mnr_call([8, 8], 16)
    assert call["fwd"].counts == {("all_gather", 2): [2, 88 + 8 * 16 * 4],
                                  ("all_reduce", 2): [2, 4 + 16]}
    assert call["bwd"].counts == {("reduce_scatter", 2): [1, 2 * 8 * 16 * 4],
                                  ("all_reduce", 2): [1, 4]}
    # uneven batches are padded to the largest rank's rows
    assert cm.mnr_call([1, 5, 2], 4, negatives=1)["fwd"].counts[("all_gather", 3)][1] == \
        88 + 5 * 2 * 4 * 4
    # GradCache: the same embedding bytes, G-fold fewer calls
    plain = cm.mnr_step([8] * 4, 32, 4)
    cached = cm.mnr_step([8] * 4, 32, 4, cached=True)
    assert cached.calls == 6 and plain.calls == 1 + 4 * 6
    emb = ("reduce_scatter", 4)
    assert plain.counts[emb] == [4, 4 * 4 * 8 * 32 * 4] and cached.counts[emb] == [1, 4 * 8 * 32
                                                                                  * 4 * 4]


def test_ring_volumes():
    t = cm.Traffic().add("all_reduce", 4, 100).add("all_gather", 4, 10).add(
        "reduce_scatter", 4, 40)
    assert t.wire_bytes() == pytest.approx(2 * 3 / 4 * 100 + 3 * 10 + 3 / 4 * 40)
    assert cm.Traffic().add("all_reduce", 1, 100).calls == 0
    assert cm.gradient_allreduce(7e9, tp=1, dp=1) == 0
    assert cm.gradient_allreduce(7e9, tp=2, dp=512) == pytest.approx(2 * 511 / 512 * 7e9)
    s = cm.Scenario()
    n = cm.ce_crossing_tokens(s, 8, math.inf)
    per_token = 2 * 7 / 8 * (12 + 2 * s.hidden)
    assert n == pytest.approx(2 * s.params / 8 * 2 / per_token, rel=1e-3)
    dp = cm.mnr_crossing_dp(s, s.params, s.mnr_dim)
    mnr = lambda d: cm.mnr_row(s, d)["mnr"]  # noqa: E731
    assert mnr(dp) >= cm.gradient_allreduce(s.params, tp=1, dp=dp) > mnr(dp - 1)


def test_gradcache_step_gives_the_full_batch_gradient():
    from megaloss import mnr_loss
    torch.manual_seed(0)
    enc = torch.nn.Linear(8, 16).double()
    xq = [torch.randn(3, 8, dtype=torch.float64) for _ in range(3)]
    xd = [torch.randn(3, 8, dtype=torch.float64) for _ in range(3)]
    loss = cm.gradcache_mnr_step(enc, xq, xd)
    grads = [p.grad.clone() for p in enc.parameters()]
    enc.zero_grad()
    ref = mnr_loss(enc(torch.cat(xq)), enc(torch.cat(xd)))
    ref.backward()
    assert float(loss) == pytest.approx(float(ref.detach()), rel=1e-12)
    for g, p in zip(grads, enc.parameters()):
        assert torch.allclose(g, p.grad, rtol=1e-10, atol=1e-12)


def test_committed_measurements_match_the_model():
    records = json.loads((REPO / "docs" / "comm_measured.json").read_text())
    assert {r["tp"] * r["dp"] * r["sp"] for r in records} == {1, 2, 3, 4}
    assert cm.check(records) == []


def test_readme_tables_are_the_models():
    text = (REPO / "docs" / "communication.md").read_text()
    section = text.split("# Communication at scale", 1)[1].split("\n## ", 1)[0]
    tables = cm.markdown()
    for line in tables.splitlines():
        if line.startswith("|"):
            assert line in section, line
    assert "docs/comm_scaling.png" in section
    for sentence in re.findall(r"rivals the gradient all-reduce at DP \d+", tables):
        assert sentence in section


def test_plot(tmp_path):
    records = json.loads((REPO / "docs" / "comm_measured.json").read_text())
    path = tmp_path / "comm.png"
    cm.plot(str(path), records)
    assert path.stat().st_size > 10_000
