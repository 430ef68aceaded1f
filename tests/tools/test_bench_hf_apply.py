"""tools/bench_hf_apply.py end to end at a toy size (one round, both methods in this process):
TRL's SFTTrainer with and without ``megaloss.integrations.hf.apply`` logs the same loss and
entropy every step (both float32: to 1e-5 relative), the first loss is the random-init model's
near-uniform ``log V`` (the token mean, not a sum), and where the peak RSS can be reset, megaloss's
steps' peak stays below TRL's fused head's, whose float32 tile alone is ``tokens x V`` (about
1000 x 8000 x 4 bytes = 31 MiB; megaloss's chunks are a fraction of it). The patched model's loss
against float64 is tested in tests/integrations/test_hf_apply_trl.py."""
from __future__ import annotations

import csv
import math
import os
import sys

import pytest

pytest.importorskip("trl")
TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "tools")
VOCAB = 8000


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_hf_apply_same_losses_and_less_memory(tmp_path, capsys):
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import bench_hf_apply

    out = tmp_path / "hf_apply.csv"
    rc = bench_hf_apply.main(["--vocab", str(VOCAB), "--hidden", "32", "--min-len", "200",
                              "--max-len", "255", "--steps", "2", "--repeats", "1",
                              "--threads", "1", "--same-process", "--csv", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    with open(out, newline="") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert sorted(rows) == ["megaloss", "trl"]
    mega, trl = rows["megaloss"], rows["trl"]
    assert float(mega["max_loss_rel_diff"]) < 1e-5
    assert float(mega["max_entropy_rel_diff"]) < 1e-5
    assert float(trl["max_loss_rel_diff"]) == 0.0
    for r in rows.values():
        assert abs(float(r["first_loss"]) - math.log(VOCAB)) < 0.1, r
        assert math.isfinite(float(r["s_per_step"])) and int(r["repeats"]) == 1
    if not mega["mem_method"].startswith("VmHWM"):
        pytest.skip("peak RSS cannot be reset here (no /proc/self/clear_refs)")
    assert float(mega["step_MiB"]) < float(trl["step_MiB"]) - 0.5 * 1000 * VOCAB * 4 / 2 ** 20
