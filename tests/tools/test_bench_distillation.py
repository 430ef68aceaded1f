"""tools/bench_distillation.py end to end at a small size, one spawn per method (no TP table):
the three methods' losses equal a float64 JSD computed here from the tool's documented inputs,
and megaloss's memory is below the full logits' size (which the full path exceeds)."""
import csv
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))


SPEC = dict(tokens=1024, hidden=16, vocab=2000, chunk_size=64, seed=3)


def background_jobs(folder, env):
    """The tool's run, started with the session (tests/conftest.py)."""
    def bench():
        out = folder / "kd.csv"
        return out, subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", "bench_distillation.py"),
             "--sizes", str(SPEC["tokens"]), "--hidden", str(SPEC["hidden"]),
             "--vocab", str(SPEC["vocab"]), "--chunk", str(SPEC["chunk_size"]), "--repeats",
             "1", "--threads", "1", "--seed", str(SPEC["seed"]), "--csv", str(out)],
            cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
            timeout=800)
    return {"bench": bench}


@pytest.mark.slow
@pytest.mark.timeout(1500)  # it waits for the background jobs before its own (nice 10)
@pytest.mark.background("bench")
def test_bench_distillation_losses_and_memory(background):
    import torch.nn.functional as F
    from bench_distillation import BETA, METHODS, _inputs

    spec = SPEC
    out, proc = background
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["method"]: r for r in csv.DictReader(open(out, newline=""))}
    assert set(rows) == set(METHODS)

    h, w, th, tw, y = (t.detach().double() if t.is_floating_point() else t
                       for t in _inputs(spec))
    q, p = F.log_softmax(h @ w.t(), -1), F.log_softmax(th @ tw.t(), -1)  # student, teacher
    m = (BETA * p.exp() + (1 - BETA) * q.exp()).log()
    jsd = BETA * (p.exp() * (p - m)).sum(-1) + (1 - BETA) * (q.exp() * (q - m)).sum(-1)
    want = float(jsd.mean())
    for method, r in rows.items():
        assert float(r["loss"]) == pytest.approx(want, rel=1e-5), method
        assert math.isfinite(float(r["time_s"])), method
    if not rows["megaloss"]["mem_method"].startswith("VmHWM"):
        pytest.skip("peak RSS cannot be reset here (no /proc/self/clear_refs)")
    logits_mib = spec["tokens"] * spec["vocab"] * 4 / 2 ** 20  # one [N, V] fp32: 7.8 MiB
    assert float(rows["full_logits"]["extra_MiB"]) >= logits_mib
    assert float(rows["megaloss"]["extra_MiB"]) < 0.5 * logits_mib
