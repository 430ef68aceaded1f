"""The comparison of ``megaloss-check-layout`` (:mod:`megaloss.cli.check_layout`): a layout's run
against the one-device reference, step by step (:func:`compare`), the likely cause of a
difference (:func:`diagnose`) and the printed report (:func:`report`).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List

from .check_layout_run import model_config
from .check_layout_spec import TOLERANCES

__all__ = ["compare", "diagnose", "report"]


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def _update_diff(lay: Dict[str, Any], ref: Dict[str, Any], p0: Dict[str, Any]):
    """(relative difference of the update over all parameters, worst parameter name, its
    relative difference, max abs difference of the parameters, norm of the reference update)."""
    import torch
    num = den = 0.0
    worst, worst_rel, max_abs = "", 0.0, 0.0
    for name, r in ref.items():
        if name not in lay or lay[name].shape != r.shape:
            return math.inf, name, math.inf, math.inf, math.nan
        dr = r.double() - p0[name].double()
        dl = lay[name].double() - p0[name].double()
        n, d = float(torch.linalg.vector_norm(dl - dr)), float(torch.linalg.vector_norm(dr))
        num, den = num + n * n, den + d * d
        rel = n / max(d, 1e-30) if n else 0.0
        if rel > worst_rel:
            worst, worst_rel = name, rel
        max_abs = max(max_abs, float((lay[name].double() - r.double()).abs().max()))
    rel = math.sqrt(num) / max(math.sqrt(den), 1e-30) if num else 0.0
    return rel, worst, worst_rel, max_abs, math.sqrt(den)


def _as_factor(ratio: float) -> str:
    """``"4"``, ``"1/4"`` or ``"1.37"``."""
    if ratio >= 1:
        k = round(ratio)
        return str(k) if abs(ratio - k) < 1e-3 * ratio else f"{ratio:.4g}"
    k = round(1 / ratio) if ratio > 0 else 0
    return f"1/{k}" if k and abs(1 / ratio - k) < 1e-3 / ratio else f"{ratio:.4g}"


def compare(lay: Dict[str, Any], ref: Dict[str, Any], dtype: str) -> Dict[str, Any]:
    tol = TOLERANCES[dtype]
    rows, failures = [], []
    for i, (l_lay, l_ref) in enumerate(zip(lay["loss"], ref["loss"])):
        g_lay, g_ref = lay["grad_norm"][i], ref["grad_norm"][i]
        upd, worst, worst_rel, max_abs, upd_norm = _update_diff(lay["params"][i], ref["params"][i],
                                                      ref["params0"])
        row = {"step": i + 1, "loss_layout": l_lay, "loss_ref": l_ref,
               "loss_rel": _rel(l_lay, l_ref), "gn_layout": g_lay, "gn_ref": g_ref,
               "gn_rel": _rel(g_lay, g_ref), "update_rel": upd, "worst_param": worst,
               "worst_param_rel": worst_rel, "param_max_abs": max_abs, "update_norm": upd_norm}
        for key, col in (("loss", "loss_rel"), ("grad_norm", "gn_rel"), ("params", "update_rel")):
            if not row[col] <= tol[key]:
                failures.append((i + 1, key, row[col]))
        rows.append(row)
    p0_rel = _update_diff(lay["params0"], ref["params0"], {k: v * 0 for k, v in
                                                            ref["params0"].items()})[0]
    if not p0_rel <= tol["params"]:
        failures.insert(0, (0, "params", p0_rel))
    return {"rows": rows, "failures": failures, "tolerance": tol, "dtype": dtype,
            "initial_param_rel": p0_rel, "diagnosis": diagnose(rows, failures, lay, ref, p0_rel,
                                                              tol)}


def diagnose(rows, failures, lay, ref, p0_rel, tol) -> List[str]:
    """Where the first difference is, and what usually causes it."""
    if not failures:
        return []
    used, measured = lay["used_scale"], lay["measured_scale"]
    expected = lay["gas"] * lay["dp"]
    out = []
    if p0_rel > tol["params"]:
        return ["the layout's initial parameters differ from one device's (before any step): "
                "ranks did not start from the same weights (seed every rank the same before "
                "building the model; TP shards must be rows of one full lm_head)"]
    first = rows[0]
    if first["loss_rel"] > tol["loss"]:
        out.append(
            f"the loss differs at step 1, before any update ({first['loss_layout']:.8g} vs "
            f"{first['loss_ref']:.8g} on one device): the forward or the loss weighting differs "
            "-- the calibration's global token/sample count (all-reduced over the dp x sp group "
            f"{lay['groups'][0]['dp_sp']} on rank 0), the data each DP rank gets (TP ranks of "
            "one DP rank must get the same batch), or the TP vocabulary split")
    elif first["gn_rel"] > tol["grad_norm"]:
        ratio = first["gn_layout"] / first["gn_ref"] if first["gn_ref"] else math.inf
        out.append(
            f"the loss matches at step 1 but the gradient is {_as_factor(ratio)} x one device's "
            f"(gradient norm {first['gn_layout']:.6g} vs {first['gn_ref']:.6g}): the engine's "
            "gradient scaling is not undone right. The loss multiplier in use is "
            f"{used['loss_multiplier']:g} (engine scale gradient_factor "
            f"{used['gradient_factor']:.6g}); the probe measured {measured['loss_multiplier']:g} "
            f"on this engine ({measured['engine']}, group {list(measured['group_ranks'])}), and "
            f"DeepSpeed's engine.backward with GAS {lay['gas']} x DP {lay['dp']} predicts "
            f"{expected}.")
        if abs(used["loss_multiplier"] - measured["loss_multiplier"]) > 1e-9:
            out.append("the calibrator does not use the measured engine scale: pass the "
                       "EngineScale that megaloss's probe measured (initialize does)")
    else:
        bad = next(f for f in failures)
        if bad[1] == "params":
            out.append(
                f"loss and gradient norm match at step {bad[0]} but the parameters after it "
                f"differ (update off by {bad[2]:.3g}, worst: {rows[bad[0] - 1]['worst_param']}): "
                "the optimizer step differs -- optimizer states partitioned over another group, "
                "gradient clipping counting TP shards twice or not at all, or a parameter "
                "missing from the optimizer")
        else:
            out.append(
                f"step 1 matches; the first difference is the {bad[1]} at step {bad[0]} "
                f"({bad[2]:.3g}): the update of an earlier step differed (see the parameter "
                "column), e.g. the learning-rate schedule or clipping")
    groups = lay["groups"]
    mismatched = [g["rank"] for g in groups if g["engine_reduce"] != g["dp_sp"]]
    if mismatched:
        out.append(f"on ranks {mismatched} DeepSpeed reduces gradients over another group than "
                   "the one megaloss calibrates over (dp x sp): build the engine with megaloss's "
                   "mpu (initialize does)")
    return out


def _fmt_groups(groups: List[Dict[str, Any]], key: str) -> str:
    seen = []
    for g in groups:
        if g[key] not in seen:
            seen.append(g[key])
    return " ".join(str(s) for s in seen)


def _autotp(lay: Dict[str, Any]) -> str:
    return " (DeepSpeed AutoTP)" if lay.get("autotp") else ""


def _tied_note(spec: Dict[str, Any]) -> str:
    tied = spec["job"] == "lm" and getattr(model_config(spec), "tie_word_embeddings", False)
    return " (tied embeddings)" if tied else ""


def report(spec: Dict[str, Any], lay: Dict[str, Any], ref: Dict[str, Any],
           result: Dict[str, Any], seconds: float) -> str:
    m, r = lay["measured_scale"], ref["measured_scale"]
    u = lay["used_scale"]
    tol = result["tolerance"]
    lines = [
        f"layout: {lay['world']} processes = DP {lay['dp']} x TP {lay['tp']}{_autotp(lay)}"
        + (f" x PP {lay['pp']}" if lay.get("pp", 1) > 1 else "") + ", "
        f"ZeRO-{lay['zero_stage']}, micro-batch {lay['micro']} x GAS {lay['gas']}, "
        f"{result['dtype']}; job {spec['job']}, model {spec['model']}{_tied_note(spec)}, "
        f"{spec['steps']} steps "
        f"({seconds:.0f} s)",
        f"one device: 1 process, ZeRO-0, micro-batch {ref['micro']} x GAS {ref['gas']}, "
        "the same global batches",
        "groups found (global ranks):",
        f"  tensor parallel:             {_fmt_groups(lay['groups'], 'tp')}",
        f"  data parallel:               {_fmt_groups(lay['groups'], 'dp')}",
        f"  calibration (dp x sp):       {_fmt_groups(lay['groups'], 'dp_sp')}",
        f"  DeepSpeed reduces grads over: {_fmt_groups(lay['groups'], 'engine_reduce')}",
        f"engine scale (measured on the engine, rank 0): {m['engine']}: gradient_factor "
        f"{_as_factor(m['gradient_factor'])} (raw {m['measured']:.6g}), loss_multiplier "
        f"{m['loss_multiplier']:g}, group ranks {list(m['group_ranks'])}; GAS x DP = "
        f"{lay['gas'] * lay['dp']}",
        f"one device's engine scale: {r['engine']}: gradient_factor "
        f"{_as_factor(r['gradient_factor'])}, loss_multiplier {r['loss_multiplier']:g}",
    ]
    if u != m:
        lines.append(f"!! the layout run used loss_multiplier {u['loss_multiplier']:g} "
                     "(--_inject_wrong_scale)")
    head = (f"{'step':>4}  {'loss layout':>13}  {'loss 1-dev':>13}  {'rel diff':>8}  "
            f"{'gnorm layout':>12}  {'gnorm 1-dev':>12}  {'rel diff':>8}  {'|dp| 1-dev':>10}  "
            f"{'update diff':>11}")
    lines += ["", head, "-" * len(head)]
    for row in result["rows"]:
        lines.append(
            f"{row['step']:>4}  {row['loss_layout']:>13.8f}  {row['loss_ref']:>13.8f}  "
            f"{row['loss_rel']:>8.1e}  {row['gn_layout']:>12.6g}  {row['gn_ref']:>12.6g}  "
            f"{row['gn_rel']:>8.1e}  {row['update_norm']:>10.3g}  {row['update_rel']:>11.1e}")
    lines.append(f"(gnorm: gradient norm before clipping; dp: parameters after the step minus the "
                 f"initial ones, all parameters; update diff = |dp_layout - dp_1dev| / |dp_1dev|"
                 f"; initial parameters differ by {result['initial_param_rel']:.1e})")
    if any(row["update_norm"] == 0 for row in result["rows"]):
        lines.append("(|dp| = 0: no update yet, e.g. a learning-rate warm-up from 0; the "
                     "parameters are then compared only after later steps)")
    verdict = "PASS" if not result["failures"] else "FAIL"
    lines += ["", f"tolerance ({result['dtype']}): loss {tol['loss']:g}, gradient norm "
              f"{tol['grad_norm']:g}, parameter update {tol['params']:g} (relative)"]
    if verdict == "PASS":
        pp = f" x PP {lay['pp']}" if lay.get("pp", 1) > 1 else ""
        lines.append(f"PASS: DP {lay['dp']} x TP {lay['tp']}{_autotp(lay)}{pp} "
                     f"ZeRO-{lay['zero_stage']} trains "
                     f"like one device over {spec['steps']} steps")
    else:
        worst = ", ".join(f"{k} at step {s}: {v:.2e}" for s, k, v in result["failures"][:4])
        lines.append(f"FAIL: {worst}")
        lines += [f"  cause: {d}" for d in result["diagnosis"]]
    return "\n".join(lines)
