"""tools/bench_compile.py end to end at a toy size (backend ``aot_eager``: no code generation):
every method's loss against a float64 reference of the tool's documented inputs, its figures
finite, and the full-logits methods' memory above the chunked ones'."""
import math
import os
import subprocess
import sys

import pytest
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

N, HIDDEN, VOCAB, CHUNK, SEED = 512, 16, 4000, 64, 4


def background_jobs(folder, env):
    """The tool's run, started with the session (tests/conftest.py)."""
    def bench():
        out = folder / "compile.csv"
        return out, subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", "bench_compile.py"), "--tokens", str(N),
             "--hidden", str(HIDDEN), "--vocab", str(VOCAB), "--chunk-size", str(CHUNK),
             "--backend", "aot_eager", "--repeats", "1", "--threads", "1", "--seed", str(SEED),
             "--csv", str(out)],
            cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
            timeout=800)
    return {"bench": bench}


@pytest.mark.slow
@pytest.mark.timeout(1500)  # it waits for the background jobs before its own (nice 10)
@pytest.mark.background("bench")
def test_bench_compile_losses_and_memory(background):
    import csv

    from bench_compile import METHODS, inputs

    out, proc = background
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["method"]: r for r in csv.DictReader(open(out, newline=""))}
    assert sorted(rows) == sorted(METHODS)
    x, w1, w, labels = (t.double() if t.is_floating_point() else t
                        for t in inputs(N, HIDDEN, VOCAB, SEED))
    assert int((labels == -100).sum()) == math.ceil(N / 7)
    want = float(F.cross_entropy(F.linear(F.gelu(x @ w1.T), w), labels, ignore_index=-100))
    for m, r in rows.items():
        assert float(r["loss"]) == pytest.approx(want, rel=1e-5), m
        for key in ("time_s", "extra_MiB", "time_vs_eager_megaloss", "time_vs_compiled_ce"):
            assert math.isfinite(float(r[key])), (m, key)
    assert float(rows["eager_megaloss"]["time_vs_eager_megaloss"]) == 1.0
    if not rows["eager_megaloss"]["mem_method"].startswith("VmHWM"):
        pytest.skip("peak RSS cannot be reset here (no /proc/self/clear_refs)")
    logits_mib = N * VOCAB * 4 / 2 ** 20  # 7.8 MiB
    assert float(rows["eager_ce"]["extra_MiB"]) >= logits_mib
    for m in ("eager_megaloss", "compiled_megaloss"):
        assert float(rows[m]["extra_MiB"]) < 0.5 * logits_mib, m
