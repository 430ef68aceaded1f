"""tools/bench_mnr.py end to end on 2 ranks (one spawn): the loss it reports, for megaloss and
for the plain-autograd comparison, local_loss on and off, equals the float64 InfoNCE of the
same global batch computed here with plain torch; and at a batch where the full score matrix is
large, the plain path's peak holds at least one such matrix while megaloss's chunked path stays
well below it. Exactness across world sizes is tested in tests/losses/test_mnr_distributed.py."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIM, CHUNK, SMALL, LARGE = 8, 64, 32, 2048


def _bench(folder, env, *args):
    out = folder / "mnr.csv"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_mnr.py"),
                           "--worlds", "2", "--dim", str(DIM), "--chunk-size", str(CHUNK),
                           "--csv", str(out), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=800, env=dict(env, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out, newline="") as f:
        return list(csv.DictReader(f))


def background_jobs(folder, env):
    """The tool's run, started with the session (tests/conftest.py)."""
    return {"bench": lambda: _bench(folder, env, "--batches", str(SMALL), str(LARGE),
                                    "--impl", "both")}


def _reference_loss(n: int, temperature: float = 0.05) -> float:
    """The bench's global batch (generator seeded with N: q ~ randn [N, D], p = q + randn) and
    its cosine InfoNCE with in-batch negatives, in float64 with plain torch."""
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, DIM, generator=gen)
    p = q + torch.randn(n, DIM, generator=gen)
    q, p = F.normalize(q.double(), dim=-1), F.normalize(p.double(), dim=-1)
    return F.cross_entropy(q @ p.T / temperature, torch.arange(n)).item()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(1500)  # it waits for the background jobs before its own (nice 10)
@pytest.mark.background("bench")
def test_bench_mnr_loss_and_memory(background):
    rows = background
    assert [(r["world"], r["N"], r["B_per_rank"], r["impl"], r["local_loss"]) for r in rows] == [
        ("2", str(n), str(n // 2), impl, local) for n in (SMALL, LARGE)
        for impl in ("megaloss", "naive") for local in ("True", "False")]
    for r in rows:
        n = int(r["N"])
        # float32 end to end against float64: ~1e-6 relative
        assert float(r["loss"]) == pytest.approx(_reference_loss(n), rel=1e-5), r
        rows_x_c = (n // 2 if r["local_loss"] == "True" else n) * n * 4 / 2 ** 20
        assert float(r["rows_x_C_MiB"]) == pytest.approx(rows_x_c, abs=1e-3)

    large = [r for r in rows if int(r["N"]) == LARGE]
    if any(r["peak_method"] != "VmHWM" for r in large):
        pytest.skip("peak RSS cannot be reset here (no /proc/self/clear_refs)")
    for r in large:
        peak, full = float(r["peak_MiB"]), float(r["rows_x_C_MiB"])  # full: 8 or 16 MiB
        if r["impl"] == "naive":  # materialises the rows x C score matrix (and its softmax)
            assert peak >= full, r
        else:  # blocks of CHUNK x C scores (0.5 MiB) and O((rows + C) D) buffers
            assert peak < 0.5 * full, r
