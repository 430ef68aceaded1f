"""tools/bench_autotp_lm.py end to end at a tiny size (2 steps, TP 2): both methods train, the
table's columns are filled, and the two methods' step losses agree to fp32 rounding (the same
model, data and token-mean CE: DeepSpeed's loss on the head's logits and megaloss's on its
shard).

In tests/integrations, not tests/tools, to run on this folder's shared DeepSpeed ranks
(``deepspeed_pool``, conftest.py): the tool's AutoTP engines leave DeepSpeed's globals behind,
which that pool resets around every case.
"""
import csv
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.deepspeed_pool]


@pytest.mark.timeout(300)
def test_bench_autotp_lm_tiny(tmp_path, monkeypatch):
    from _bench_common import MALLOC_ENV
    from bench_autotp_lm import COLUMNS, METHODS, main

    for key in [*MALLOC_ENV, "OMP_NUM_THREADS"]:  # main() sets them for its ranks: undo after
        monkeypatch.setenv(key, os.environ.get(key, ""))
    out = tmp_path / "autotp_lm.csv"
    rc = main(["--model_size", "tiny", "--seq_len", "16", "--steps", "2", "--warmup", "1",
               "--cpus", "2", "--timeout", "240", "--csv", str(out)])
    assert rc == 0
    with open(out, newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert [r["method"] for r in rows] == list(METHODS)
    for r in rows:
        assert r["error"] == "", r
        for col in ("s_per_step", "peak_rss_MiB", "step_MiB", "time_ratio", "rss_ratio"):
            assert math.isfinite(float(r[col])) and float(r[col]) > 0, (col, r)
        assert float(r["peak_rss_MiB"]) > float(r["step_MiB"]), r
        assert float(r["max_loss_diff"]) < 1e-5, r
        assert float(r["first_loss"]) != float(r["last_loss"]), r  # it trained
