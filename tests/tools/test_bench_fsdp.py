"""tools/bench_fsdp.py end to end at a tiny size, both layouts (FSDP2 world 2, DTensor TP 2), in
this process (its ranks come from the session's process-group pools, tests/conftest.py): every
case has a row with the CSV's columns, finite figures, a weight sharded into ``V / 2`` rows per
rank, and losses and hidden-state gradients within fp32 rounding of the float64 reference
(megaloss and torch alike)."""
import csv
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

V = 64


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_bench_fsdp_tiny(tmp_path, monkeypatch):
    from _bench_common import MALLOC_ENV
    from bench_fsdp import COLUMNS, LAYOUTS, _cases, main

    for key in [*MALLOC_ENV, "OMP_NUM_THREADS"]:  # main() sets them for its ranks: undo after
        monkeypatch.setenv(key, os.environ.get(key, ""))
    out = tmp_path / "fsdp.csv"
    rc = main(["--sizes", "32", "--hidden", "16", "--vocab", str(V), "--chunk-size", "16",
               "--repeats", "1", "--cpus", "2", "--no-cuda", "--csv", str(out)])
    assert rc == 0
    with open(out, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    want = [k for layout in LAYOUTS for k in _cases(layout)]
    assert [f"{r['layout']}/{r['method']}" for r in rows] == want
    assert want == ["fsdp2/megaloss", "fsdp2/torch", "tp2/megaloss", "tp2/torch"]
    for r in rows:
        assert r["error"] == "", r
        assert r["world"] == "2" and r["weight_rows"] == f"{V // 2}/{V // 2}", r
        for col in ("time_s", "extra_MiB", "time_ratio", "loss_err", "grad_err"):
            assert math.isfinite(float(r[col])), (col, r)
        assert float(r["time_s"]) > 0, r
        assert float(r["loss_err"]) < 1e-5 and float(r["grad_err"]) < 1e-6, r
        if r["method"] == "megaloss":
            assert float(r["time_ratio"]) == 1.0
            # a tiny step may touch no new page: then the ratio is nan
            assert float(r["mem_ratio"]) == 1.0 or float(r["extra_MiB"]) == 0.0, r
