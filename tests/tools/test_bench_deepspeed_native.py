"""tools/bench_deepspeed_native.py end to end at a tiny size, TP 1 and 2, in this process (its
ranks come from the session's process-group pools, tests/conftest.py): every case of both TP
sizes has a row with the table's columns, finite figures, and losses and hidden-state gradients
within fp32 rounding of the float64 reference (megaloss and DeepSpeed alike)."""
import csv
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

pytest.importorskip("deepspeed")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_bench_deepspeed_native_tiny(tmp_path, monkeypatch):
    from _bench_common import MALLOC_ENV
    from bench_deepspeed_native import COLUMNS, _cases, main

    for key in [*MALLOC_ENV, "OMP_NUM_THREADS"]:  # main() sets them for its ranks: undo after
        monkeypatch.setenv(key, os.environ.get(key, ""))
    out = tmp_path / "ds.csv"
    rc = main(["--sizes", "32", "--hidden", "16", "--vocab", "64", "--chunk-size", "16",
               "--tp", "1", "2", "--repeats", "1", "--cpus", "1", "--csv", str(out)])
    assert rc == 0
    with open(out, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    want = [(tp, k) for tp in (1, 2) for k in _cases(tp)]
    assert [(int(r["tp"]), f"{r['task']}/{r['method']}") for r in rows] == want
    assert {k.split("/")[1] for _, k in want} >= {"megaloss", "deepspeed", "ds_autotp", "eager",
                                                  "ds_chunked_lm"}
    for r in rows:
        assert r["error"] == "", r
        for col in ("time_s", "extra_MiB", "time_ratio", "loss_err", "grad_err"):
            assert math.isfinite(float(r[col])), (col, r)
        assert float(r["time_s"]) > 0, r
        assert float(r["loss_err"]) < 1e-5 and float(r["grad_err"]) < 1e-5, r
        if r["method"] == "megaloss":
            assert float(r["time_ratio"]) == 1.0
