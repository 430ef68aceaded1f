"""tools/bench_router.py end to end at its ``--quick`` sizes, every case in this process: both
tables have their rows and finite figures; megaloss's concatenated router loss equals
transformers' ``load_balancing_loss_func`` (1e-5 relative), its per-layer form the mean of that
function over single layers, both against a float64 value of the formula computed here; in the
step table the ``global`` scope's step loss equals the model's own loss (one rank: the pool of
the ``global`` scope is the micro-batch, Hugging Face's), and the ``step`` scope's differs
(its pool is the whole step). No timing is asserted."""
from __future__ import annotations

import csv
import math
import os
import sys

import pytest

pytest.importorskip("transformers")
TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "tools")


def _float64_loss(spec, form):
    """The load-balancing loss of the tool's inputs in float64, written from the formula
    (Switch Transformer eqs. 4-6, top-k counts, Hugging Face's normalisation)."""
    import torch
    import torch.nn.functional as F
    from bench_router import inputs

    xs, mask = inputs(spec)
    x = torch.stack(xs).double()                                      # [L, N, E]
    m = mask.reshape(1, -1, 1).double()
    sel = F.one_hot(x.topk(spec["top_k"], -1).indices, spec["experts"]).sum(-2).double()
    p = torch.softmax(x, -1)
    n = m.sum()
    if form == "per_layer":
        return float((spec["experts"] * ((sel * m).sum(1) / n * (p * m).sum(1) / n)
                      .sum(-1)).mean())
    total = x.shape[0] * n
    return float(spec["experts"] * ((sel * m).sum((0, 1)) / total
                                    * (p * m).sum((0, 1)) / total).sum())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_router_quick_tables_and_losses(tmp_path, capsys):
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    import bench_router

    loss_csv, step_csv = tmp_path / "loss.csv", tmp_path / "step.csv"
    rc = bench_router.main(["--quick", "--repeats", "1", "--threads", "1", "--same-process",
                            "--csv", str(loss_csv), "--step-csv", str(step_csv)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = {r["method"]: r for r in csv.DictReader(open(loss_csv, newline=""))}
    assert sorted(rows) == sorted(bench_router.METHODS)
    quick = bench_router.QUICK
    spec = {"tokens": quick["tokens"][0], "layers": quick["layers"][0], "experts": 64,
            "top_k": 8, "padding": 0.125, "seed": 0}
    want = {"concatenated": _float64_loss(spec, "concatenated"),
            "per_layer": _float64_loss(spec, "per_layer")}
    assert want["per_layer"] != pytest.approx(want["concatenated"], rel=1e-6)
    for m, r in rows.items():
        assert (int(r["tokens"]), int(r["layers"])) == (spec["tokens"], spec["layers"])
        form = "per_layer" if m == "megaloss_per_layer" else "concatenated"
        assert float(r["loss"]) == pytest.approx(want[form], rel=1e-5), m
        assert float(r["loss_rel_diff"]) < 1e-5, m
        assert float(r["grad_rel_diff"]) < 1e-4, m
        assert float(r["grad_err64"]) < 1e-4, m
        for key in ("time_s", "time_vs_hf", "extra_MiB"):
            assert math.isfinite(float(r[key])), (m, key)
    assert float(rows["hf"]["time_vs_hf"]) == 1.0
    assert float(rows["hf"]["loss_rel_diff"]) == 0.0

    steps = {r["case"]: r for r in csv.DictReader(open(step_csv, newline=""))}
    assert sorted(steps) == sorted(bench_router.STEP_CASES)
    for c, r in steps.items():
        assert math.isfinite(float(r["s_per_step"])) and float(r["s_per_step"]) > 0, c
    assert float(steps["global"]["time_vs_global"]) == 1.0
    assert 0 < float(steps["step"]["prepass_fraction"]) < math.inf
    hf, glob, step = (float(steps[c]["loss"]) for c in ("hf_loss", "global", "step"))
    assert glob == pytest.approx(hf, rel=1e-5)
    assert abs(step - glob) > 1e-6 * abs(glob)
    for line in ("megaloss_concatenated", "megaloss_per_layer", "prepass_fraction"):
        assert line in printed
