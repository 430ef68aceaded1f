"""tools/bench_mtp.py end to end at a toy size (one round, both methods in this process): both
methods' losses against a float64 reference computed here from the tool's documented inputs
(labels rolled by hand inside each packed sample; to 1e-5 relative, both run in float32), and,
where the peak RSS can be reset, megaloss's extra memory below the materialised logits'."""
from __future__ import annotations

import csv
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "tools")
N, HIDDEN, VOCAB, SAMPLE, DEPTH = 512, 16, 4000, 128, 2


def reference(n, hidden, vocab, depth, sample, seed):
    from bench_mtp import SCALING, _inputs
    hs, w, y, _ = _inputs(n, hidden, vocab, depth, sample, seed)
    terms = []
    for k, h in enumerate(hs):
        target = torch.full_like(y, -100)
        for t in range(n):
            if t % sample + k < sample and t + k < n:
                target[t] = y[t + k]
        terms.append(F.cross_entropy(h.double() @ w.double().T, target, ignore_index=-100))
    return float(terms[0] + SCALING / depth * sum(terms[1:]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_mtp_losses_and_memory(tmp_path, capsys):
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import bench_mtp

    out = tmp_path / "mtp.csv"
    # each method in its own process (the tool's default): inside the suite's long-lived process
    # the allocator's cached pages hide a new peak from the resident set
    rc = bench_mtp.main(["--tokens", str(N), "--hidden", str(HIDDEN), "--vocab", str(VOCAB),
                         "--depths", str(DEPTH), "--sample-len", str(SAMPLE), "--chunk-size",
                         "64", "--repeats", "1", "--threads", "1", "--seed", "3",
                         "--csv", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    with open(out, newline="") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    want = reference(N, HIDDEN, VOCAB, DEPTH, SAMPLE, 3)
    for m in ("materialised", "megaloss"):
        assert float(rows[m]["loss"]) == pytest.approx(want, rel=1e-5), m
        assert math.isfinite(float(rows[m]["time_s"])) and int(rows[m]["repeats"]) == 1
    if not rows["megaloss"]["mem_method"].startswith("VmHWM"):
        pytest.skip("peak RSS cannot be reset here (no /proc/self/clear_refs)")
    logits_mib = (DEPTH + 1) * N * VOCAB * 4 / 2 ** 20  # 23 MiB
    assert float(rows["materialised"]["extra_MiB"]) >= logits_mib
    assert float(rows["megaloss"]["extra_MiB"]) < 0.5 * logits_mib
