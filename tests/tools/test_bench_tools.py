"""End-to-end tests of the benchmark and checker tools at small sizes. Every number checked is
compared with an expectation computed here independently of the tool and of megaloss: losses
against plain-torch float64 references on the same inputs (each tool's inputs are a documented
function of its seed), collective bytes against the known collectives of the vocab-parallel
loss, peak memory against the size of the full logits the eager path must hold and the chunked
path must not, and engine gradient factors against DDP's and DeepSpeed's documented reductions."""
from __future__ import annotations

import csv
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")
MIB = 2.0 ** 20


def _run(env: dict, script: str, *args: str) -> str:
    # a hang guard only: a background job runs at a low priority
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, script), *args], cwd=ROOT,
                          env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=800)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


CE = dict(n=1024, hidden=32, vocab=2000, chunk=64)
VP = dict(n=2048, hidden=16, vocab=1001, chunk=64)  # V odd: TP=2 pads one row
SCALE = dict(world=2, gas=2)


def background_jobs(folder, env):
    """The three tools' runs, started with the session (tests/conftest.py); each returns its
    stdout (and the folder of its files)."""
    def bench_ce():
        return folder, _run(env, "bench_ce.py", "--sizes", str(CE["n"]), "--hidden",
                            str(CE["hidden"]), "--vocab", str(CE["vocab"]), "--chunk-size",
                            str(CE["chunk"]), "--repeats", "1", "--threads", "1", "--no-cuda",
                            "--seed", "3", "--csv", str(folder / "ce.csv"), "--plot",
                            str(folder / "ce.png"))

    def bench_vocab_parallel():
        return folder, _run(env, "bench_vocab_parallel.py", "--tp", "1", "2", "--tokens",
                            str(VP["n"]), "--hidden", str(VP["hidden"]), "--vocab",
                            str(VP["vocab"]), "--chunk-size", str(VP["chunk"]), "--repeats",
                            "1", "--cpus", "1", "--seed", "5", "--csv", str(folder / "vp.csv"))

    def check_engine_scale():
        return _run(env, "check_engine_scale.py", "--world", str(SCALE["world"]), "--gas",
                    str(SCALE["gas"]))
    return {"bench_ce": bench_ce, "bench_vocab_parallel": bench_vocab_parallel,
            "check_engine_scale": check_engine_scale}


def _read_csv(path) -> list:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _finite(row: dict, keys) -> None:
    for k in keys:
        value = float(row[k])
        assert math.isfinite(value), f"{k} = {row[k]!r} is not finite"


def _reference_ce(n: int, hidden: int, vocab: int, seed: int, order: str) -> float:
    """Mean cross-entropy in float64 of a tool's inputs: one CPU generator seeded with ``seed``
    draws ``hidden [n, H]`` (h), ``weight [V, H] * 0.02`` (w) and ``labels [n]`` (y) in
    ``order``."""
    gen = torch.Generator().manual_seed(seed)
    draw = {"h": lambda: torch.randn(n, hidden, generator=gen),
            "w": lambda: torch.randn(vocab, hidden, generator=gen).mul_(0.02),
            "y": lambda: torch.randint(0, vocab, (n,), generator=gen)}
    t = {name: draw[name]() for name in order}
    return F.cross_entropy(t["h"].double() @ t["w"].double().T, t["y"]).item()


def _ce_grad_errors(n: int, hidden: int, vocab: int, seed: int) -> float:
    """bench_ce.py's float64 gradient error of eager fp32 (``F.linear`` + ``F.cross_entropy``)
    on its inputs (order h, w, y), computed here: max abs difference of d hidden and d weight."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen).mul_(0.02)
    y = torch.randint(0, vocab, (n,), generator=gen)

    def grads(h, w):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        return torch.autograd.grad(F.cross_entropy(F.linear(h, w), y), (h, w))

    return max((a.double() - b).abs().max().item()
               for a, b in zip(grads(h, w), grads(h.double(), w.double())))


@pytest.mark.slow
@pytest.mark.timeout(1500)  # it waits for the background jobs before its own (nice 10)
@pytest.mark.background("bench_ce")
def test_bench_ce_loss_and_memory(background):
    n, hidden, vocab = CE["n"], CE["hidden"], CE["vocab"]
    folder, stdout = background
    out_csv, out_png = folder / "ce.csv", folder / "ce.png"
    assert "megaloss_s" in stdout and "mem_ratio" in stdout
    rows = _read_csv(out_csv)
    assert [(r["device"], r["dtype"], r["tokens"]) for r in rows] == [("cpu", "float32", str(n))]
    row = rows[0]
    _finite(row, ["eager_s", "megaloss_s", "time_ratio", "gemm3_s", "roofline"])
    assert int(row["repeats"]) == 1

    # Both losses equal plain torch in float64 on the same inputs (fp32: ~1e-6 relative). A
    # wrong weight scale, label or reduction moves the loss far from ln(V) + tiny.
    want = _reference_ce(n, hidden, vocab, seed=3, order="hwy")
    assert float(row["loss_eager"]) == pytest.approx(want, rel=1e-5)
    assert float(row["loss_megaloss"]) == pytest.approx(want, rel=1e-5)
    # torch's own F.linear_cross_entropy, chunked, default options and acc_policy="accurate"
    # (the default --impls), on the same inputs.
    methods = ["eager", "megaloss", "torch_lce", "torch_lce_accurate"]
    for m in methods[2:]:
        assert row[f"{m}_note"] == "", row[f"{m}_note"]
        _finite(row, [f"{m}_s", f"{m}_MiB"])
        assert float(row[f"loss_{m}"]) == pytest.approx(want, rel=1e-5), m
    # The float64 error columns: the loss's is |loss - the float64 loss| (as computed here); the
    # gradients' is fp32 rounding (a wrong reference, e.g. a sum for a mean, is off by ~1e-3),
    # eager's as computed here.
    for m in methods:
        loss = float(row[f"loss_{m}"])
        assert float(row[f"{m}_loss_err"]) == pytest.approx(abs(loss - want), abs=1e-12), m
        assert 0 < float(row[f"{m}_grad_err"]) < 1e-7, m
    eager_grad_err = _ce_grad_errors(n, hidden, vocab, seed=3)
    assert float(row["eager_grad_err"]) == pytest.approx(eager_grad_err, rel=0.5)

    # Memory: eager materialises the [N, V] fp32 logits (and more: softmax, its gradient); the
    # chunked loss holds [chunk, V] blocks plus O((N + V) H) buffers, far below one logits copy.
    if not row["mem_method"].startswith("VmHWM"):
        pytest.skip("peak RSS cannot be reset here (no /proc/self/clear_refs)")
    logits_mib = n * vocab * 4 / MIB  # 7.8 MiB
    eager, mega = float(row["eager_MiB"]), float(row["megaloss_MiB"])
    assert eager >= logits_mib, (eager, logits_mib)
    assert mega < 0.25 * logits_mib, (mega, logits_mib)
    for m in ("torch_lce", "torch_lce_accurate"):  # chunked too: [chunk, V] blocks, [V, H] grads
        assert float(row[f"{m}_MiB"]) < 0.25 * logits_mib, (m, row[f"{m}_MiB"], logits_mib)
    assert float(row["mem_ratio"]) == pytest.approx(mega / eager)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1500)
@pytest.mark.background("bench_vocab_parallel")
def test_bench_vocab_parallel_comm_loss_and_memory(background):
    n, hidden, vocab, chunk = VP["n"], VP["hidden"], VP["vocab"], VP["chunk"]
    folder, stdout = background
    out_csv = folder / "vp.csv"
    assert "fwd_B_per_token" in stdout
    rows = _read_csv(out_csv)
    assert [r["tp"] for r in rows] == ["1", "2"]
    tp1, tp2 = rows

    # Loss: plain torch in float64 on the full (unsharded) lm_head, same at every TP size. A
    # padded row entering the softmax would shift it by log((V+1)/V) ~ 1e-3.
    want = _reference_ce(n, hidden, vocab, seed=5, order="hyw")
    for r in rows:
        assert float(r["loss"]) == pytest.approx(want, rel=1e-5), r["tp"]
        assert r["loss_same_on_all_ranks"] == "True"
        assert int(r["rows_per_rank"]) == math.ceil(vocab / int(r["tp"]))

    # Communication, from the algorithm: nothing at TP=1. At TP>1, per chunk of tokens one MAX
    # all-reduce of [C] fp32 and one SUM of [2, C] fp32 = 4 + 8 = 12 B/token in forward (2 calls
    # per chunk); backward one SUM all-reduce of d_hidden [N, H] fp32 = 4H B/token; plus the
    # cross-rank check (failed flag, shapes, first bad label, shard range), one all-gather of 8
    # int64 per call = 64 B.
    for key in ("fwd_B_per_token", "bwd_B_per_token", "fwd_calls", "bwd_calls", "other_B"):
        assert float(tp1[key]) == 0, key
    assert float(tp2["fwd_B_per_token"]) == 12.0
    assert int(tp2["fwd_calls"]) == 2 * math.ceil(n / chunk)
    assert float(tp2["bwd_B_per_token"]) == 4.0 * hidden
    assert int(tp2["bwd_calls"]) == 1
    assert int(tp2["other_B"]) == 8 * 8

    # Memory per rank: never one [N, V/TP] fp32 logits copy (chunks of [C, V/TP] only).
    for r in rows:
        if not r["mem_method"].startswith("VmHWM"):
            pytest.skip("peak RSS cannot be reset here (no /proc/self/clear_refs)")
        shard_logits_mib = n * int(r["rows_per_rank"]) * 4 / MIB  # 7.8 / 3.9 MiB
        assert float(r["extra_MiB"]) < 0.5 * shard_logits_mib, (r["tp"], r["extra_MiB"])
        _finite(r, ["time_s", "extra_MiB_min", "mem_vs_tp1"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(1500)
@pytest.mark.background("check_engine_scale")
def test_check_engine_scale_factors(background):
    world, gas = SCALE["world"], SCALE["gas"]
    stdout = background
    found = {}
    for line in stdout.splitlines():
        m = re.match(r"\s+(.+?)\s+c = (\S+) \(measured (\S+)\)\s+loss multiplier = (\S+)$", line)
        if m:
            found[m.group(1)] = tuple(float(v) for v in m.group(2, 3, 4))
    assert "FAILED" not in stdout and "ERROR" not in stdout, stdout
    # DDP averages over its W ranks and sums the micro-batches: c = 1/W. DeepSpeed's
    # engine.backward divides each micro-batch loss by G and averages over W: c = 1/(W G).
    want = {"ddp (no_sync accumulation)": 1 / world}
    want.update({f"zero{s} engine.backward": 1 / (world * gas) for s in range(4)})
    for name, c in want.items():
        assert name in found, f"no row {name!r} in:\n{stdout}"
        factor, measured, multiplier = found[name]
        assert factor == pytest.approx(c, rel=1e-6) and measured == pytest.approx(c, rel=1e-4)
        assert multiplier == pytest.approx(1 / c)
