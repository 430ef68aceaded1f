"""tools/bench_log_probs.py end to end at a small size (the full-logits path vs megaloss, no TP
table): the losses against a float64 full-logits reference computed here
from the tool's documented inputs, and megaloss's memory against the full logits' size."""
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))


N, HIDDEN, VOCAB, CHUNK = 1024, 16, 2000, 64


def background_jobs(folder, env):
    """The tool's run, started with the session (tests/conftest.py)."""
    def bench():
        out = folder / "lp.csv"
        return out, subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", "bench_log_probs.py"), "--sizes",
             str(N), "--hidden", str(HIDDEN), "--vocab", str(VOCAB), "--chunk-size", str(CHUNK),
             "--methods", "full_log_softmax", "megaloss",  # 3 processes: the suite's budget
             "--tp", "--repeats", "1", "--threads", "1", "--seed", "2", "--csv", str(out)],
            cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
            timeout=800)
    return {"bench": bench}


@pytest.mark.slow
@pytest.mark.timeout(1500)  # it waits for the background jobs before its own (nice 10)
@pytest.mark.background("bench")
def test_bench_log_probs_losses_and_memory(background):
    import csv

    from bench_log_probs import TEMPERATURE, _inputs

    n, hidden, vocab = N, HIDDEN, VOCAB
    out, proc = background
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["method"]: r for r in csv.DictReader(open(out, newline=""))}
    h, w, y, a, c = (t.double() if t.is_floating_point() else t
                     for t in _inputs(n, hidden, vocab, 2))
    logp = ((h @ w.t()) / TEMPERATURE).log_softmax(-1)
    lp = logp.gather(-1, y[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    want = float((a * lp).sum() + (c * ent).sum())
    for m in ("full_log_softmax", "megaloss"):
        assert float(rows[m]["loss"]) == pytest.approx(want, rel=1e-5), m
    for r in rows.values():
        assert math.isfinite(float(r["time_s"])) and int(r["repeats"]) == 1
    if not rows["megaloss"]["mem_method"].startswith("VmHWM"):
        pytest.skip("peak RSS cannot be reset here (no /proc/self/clear_refs)")
    logits_mib = n * vocab * 4 / 2 ** 20  # 7.8 MiB
    assert float(rows["full_log_softmax"]["extra_MiB"]) >= logits_mib
    assert float(rows["megaloss"]["extra_MiB"]) < 0.25 * logits_mib
