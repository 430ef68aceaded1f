"""``tools/gpu_check.sh --dry-run``: every step of the GPU check, on the CPU with tiny shapes, so
the script cannot rot between the rare sessions that have a GPU. The numbers it writes are
checked against expectations computed here: the losses of the benchmarked implementations
against plain torch in float64 on the same inputs (``bench_ce.py``'s inputs are a documented
function of its seed)."""
from __future__ import annotations

import csv
import math
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")
IMPLS = ["eager", "megaloss", "torch_lce", "torch_lce_accurate", "megaloss_torch",
         "megaloss_triton", "megaloss_compile", "liger", "cce"]


def _rows(path) -> list:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _reference_ce(n: int, hidden: int, vocab: int, seed: int) -> float:
    """bench_ce.py's inputs: one CPU generator seeded with ``seed`` draws ``hidden [n, H]``,
    ``weight [V, H] * 0.02`` and ``labels [n]``, in that order."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen, dtype=torch.float32)
    w = torch.randn(vocab, hidden, generator=gen).mul_(0.02)
    y = torch.randint(0, vocab, (n,), generator=gen)
    return F.cross_entropy(h.double() @ w.double().T, y).item()


def test_needs_an_output_folder():
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(["bash", SCRIPT, "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and "no output folder" in proc.stderr


def background_jobs(folder, env):
    """The dry run, started with the session (tests/conftest.py): a single process most of its
    44 s, beside the single-process tests."""
    def dry_run():
        wheels = folder / "wheels"
        wheels.mkdir()
        (wheels / "fake_pkg-0.0-py3-none-any.whl").write_bytes(b"")  # listed, never installed
        out = folder / "out"  # from $OUT, as on the GPU machine
        return out, subprocess.run(["bash", SCRIPT, "--dry-run", "--wheels", str(wheels)],
                                   cwd=ROOT, env=dict(env, OUT=str(out)), capture_output=True,
                                   text=True, timeout=800)
    return {"dry_run": dry_run}


@pytest.mark.slow
@pytest.mark.timeout(1500)  # it waits for the background jobs before its own (nice 10)
@pytest.mark.background("dry_run")
def test_dry_run_writes_every_table(background):
    out, proc = background
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]

    steps = {r["step"]: r for r in _rows(out / "summary.csv")}
    assert list(steps) == ["env", "wheels", "pytest_cuda", "bench_ce", "bench_vp_mnr"]
    assert all(r["status"] == "ok" for r in steps.values()), steps
    assert "1 files not installed" in steps["wheels"]["detail"]
    assert "fake_pkg" in log

    tests = _rows(out / "pytest_cuda.csv")
    assert len(tests) >= 10 and all(".test_cuda_" in t["test"] for t in tests)
    assert {t["test"].split("::")[0] for t in tests} == {"tests.ops.test_cuda_epilogue",
                                                         "tests.ops.test_cuda_log_probs"}
    if not torch.cuda.is_available():
        assert {t["outcome"] for t in tests} == {"skipped"}

    impl_rows = _rows(out / "bench_ce_impls.csv")
    assert [r["impl"] for r in impl_rows] == IMPLS
    want = _reference_ce(64, 16, 256, seed=0)
    for r in impl_rows:
        assert r["device"] == "cpu" and r["tokens"] == "64"
        if r["impl"] in ("liger", "cce"):
            assert r["note"] == "CUDA only" and math.isnan(float(r["time_s"]))
            continue
        assert r["note"] == "", r
        assert math.isfinite(float(r["time_s"])) and float(r["time_s"]) > 0
        assert float(r["extra_MiB"]) >= 0
        assert float(r["loss"]) == pytest.approx(want, rel=1e-5), r["impl"]
    epilogue = {r["impl"]: r["epilogue"] for r in impl_rows}
    assert epilogue["megaloss"] == "torch" and epilogue["megaloss_triton"] == "triton"
    (wide,) = _rows(out / "bench_ce.csv")
    assert float(wide["loss_megaloss_triton"]) == pytest.approx(want, rel=1e-5)

    vp_mnr = _rows(out / "bench_vp_mnr.csv")
    assert [r["bench"] for r in vp_mnr] == ["vocab_parallel"] * 3 + ["mnr"] * 2
    for r in vp_mnr:
        if r["loss_diff_vs_first"]:
            assert float(r["loss_diff_vs_first"]) < 1e-5, r

    summary = (out / "summary.txt").read_text()
    assert "DRY RUN" in summary and "megaloss_compile" in summary and "mnr_loss" in summary
    assert (out / "environment.txt").exists() and (out / "gpu_check.log").exists()
