"""The communication model at scale (:mod:`megaloss.cli.comm_costs`): a :class:`Scenario`'s rows,
tables and crossing points, the markdown of docs/communication.md and the scaling plot.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

from .comm_costs import (
    Traffic,
    gradient_allreduce,
    lm_step,
    mnr_step,
    vocab_parallel_ce,
)
from .comm_measure import (
    predict,
)

__all__ = ["Scenario", "TABLE_TP", "TABLE_DP", "MEASURED_WORLDS", "lm_row", "mnr_row",
           "ce_crossing_tokens", "mnr_crossing_dp", "human", "lm_table", "mnr_table", "crossings",
           "plot", "markdown"]


@dataclass(frozen=True)
class Scenario:
    """The stated sizes of the scaling tables (docs/communication.md)."""

    params: float = 7e9              # model parameters (Llama-2-7B class)
    grad_bytes: int = 2              # bf16 gradients
    hidden: int = 4096               # LM hidden size H (the CE's traffic does not depend on V)
    hidden_bytes: int = 2            # bf16 hidden states
    tokens_per_micro: int = 8192     # tokens per DP rank per micro-batch (2 x 4096)
    gas: int = 4                     # micro-batches per step: 32768 tokens per DP rank per step
    chunk_size: int = 1024
    mnr_batch: int = 64              # pairs per rank per micro-batch (embedding job)
    mnr_dim: int = 4096              # embedding size D (e.g. a 7B decoder as embedder)
    mnr_negatives: int = 1           # hard negatives per pair
    small_params: float = 335e6      # a BERT-large class embedder ...
    small_dim: int = 1024            # ... and its embedding size


TABLE_TP = (1, 2, 4, 8)
TABLE_DP = (1, 2, 8, 64, 512)
MEASURED_WORLDS = (1, 2, 3, 4)


def lm_row(s: Scenario, tp: int, dp: int) -> Dict[str, Any]:
    step = lm_step(s.tokens_per_micro, s.hidden, s.gas, tp=tp, dp=dp, chunk_size=s.chunk_size,
                   hidden_bytes=s.hidden_bytes)
    grad = gradient_allreduce(s.params, tp=tp, dp=dp, grad_bytes=s.grad_bytes)
    loss = sum(t.wire_bytes() for t in step.values())
    return {"tp": tp, "dp": dp, "ce_fwd": step["ce_fwd"].wire_bytes(),
            "ce_bwd": step["ce_bwd"].wire_bytes(), "calibration": step["calibration"].wire_bytes(),
            "loss": loss, "calls": sum(t.calls for t in step.values()), "gradient": grad,
            "ratio": loss / grad if grad else math.inf,
            "measured": tp * dp in MEASURED_WORLDS}


def mnr_row(s: Scenario, dp: int) -> Dict[str, Any]:
    kw = dict(negatives=s.mnr_negatives, embedding_bytes=2)
    plain = mnr_step([s.mnr_batch] * dp, s.mnr_dim, s.gas, **kw)
    cached = mnr_step([s.mnr_batch] * dp, s.mnr_dim, s.gas, cached=True, **kw)
    small = mnr_step([s.mnr_batch] * dp, s.small_dim, s.gas, **kw)
    return {"dp": dp, "mnr": plain.wire_bytes(), "mnr_calls": plain.calls,
            "cached": cached.wire_bytes(), "cached_calls": cached.calls,
            "gradient": gradient_allreduce(s.params, tp=1, dp=dp, grad_bytes=s.grad_bytes),
            "small": small.wire_bytes(),
            "small_gradient": gradient_allreduce(s.small_params, tp=1, dp=dp,
                                                 grad_bytes=s.grad_bytes),
            "measured": dp in MEASURED_WORLDS}


def ce_crossing_tokens(s: Scenario, tp: int, dp: int) -> float:
    """Tokens per DP rank per step at which the vocab-parallel CE's wire bytes equal the
    gradient reduction's (``dp``; the large-``dp`` limit for ``dp = inf``)."""
    if tp <= 1:
        return math.inf
    per_token = vocab_parallel_ce(s.chunk_size, s.hidden, tp, chunk_size=s.chunk_size,
                                  hidden_bytes=s.hidden_bytes)
    per_token = (per_token["fwd"] + per_token["bwd"]).wire_bytes() / s.chunk_size
    grad = (2.0 * s.params / tp * s.grad_bytes if math.isinf(dp)
            else gradient_allreduce(s.params, tp=tp, dp=dp, grad_bytes=s.grad_bytes))
    return grad / per_token


def mnr_crossing_dp(s: Scenario, params: float, dim: int, limit: int = 1 << 20) -> int:
    """Smallest DP at which a step of the gathered MNR sends as much as the gradient reduction
    of a ``params`` model (bisection; MNR grows ~linearly in DP, the gradient's saturates)."""
    def excess(dp):
        m = mnr_step([s.mnr_batch] * dp, dim, s.gas, negatives=s.mnr_negatives,
                     embedding_bytes=2).wire_bytes()
        return m - gradient_allreduce(params, tp=1, dp=dp, grad_bytes=s.grad_bytes)
    lo, hi = 2, limit
    if excess(hi) < 0:
        return -1
    while lo < hi:
        mid = (lo + hi) // 2
        if excess(mid) >= 0:
            hi = mid
        else:
            lo = mid + 1
    return lo


def human(n: float) -> str:
    if n == 0:
        return "0"
    if math.isinf(n):
        return "-"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.0f} B"


def _percent(x: float) -> str:
    return f"{x:.2%}" if x >= 1e-4 else f"{x * 100:.1g} %"


def lm_table(s: Scenario = Scenario()) -> str:
    lines = ["| TP | DP | CE forward (statistics) | CE backward (d_hidden) | calibration + log | "
             "loss total (collectives) | gradient all-reduce | loss / gradient | measured |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for tp in TABLE_TP:
        for dp in TABLE_DP:
            r = lm_row(s, tp, dp)
            ratio = "-" if math.isinf(r["ratio"]) else _percent(r["ratio"])
            lines.append(f"| {tp} | {dp} | {human(r['ce_fwd'])} | {human(r['ce_bwd'])} | "
                         f"{human(r['calibration'])} | {human(r['loss'])} ({r['calls']}) | "
                         f"{human(r['gradient'])} | {ratio} | "
                         f"{'yes' if r['measured'] else ''} |")
    return "\n".join(lines)


def mnr_table(s: Scenario = Scenario()) -> str:
    lines = [f"| DP | gathered MNR (collectives) | GradCache MNR (collectives) | gradient "
             f"all-reduce {s.params / 1e9:g}B | MNR / gradient | D={s.small_dim}: MNR | "
             f"gradient {s.small_params / 1e6:g}M | measured |",
             "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for dp in TABLE_DP:
        r = mnr_row(s, dp)
        ratio = "-" if not r["gradient"] else _percent(r["mnr"] / r["gradient"])
        lines.append(f"| {dp} | {human(r['mnr'])} ({r['mnr_calls']}) | {human(r['cached'])} "
                     f"({r['cached_calls']}) | {human(r['gradient'])} | {ratio} | "
                     f"{human(r['small'])} | {human(r['small_gradient'])} | "
                     f"{'yes' if r['measured'] else ''} |")
    return "\n".join(lines)


def crossings(s: Scenario = Scenario()) -> Dict[str, Any]:
    return {"ce_tokens": {tp: ce_crossing_tokens(s, tp, math.inf) for tp in TABLE_TP[1:]},
            "mnr_dp": mnr_crossing_dp(s, s.params, s.mnr_dim),
            "mnr_dp_small": mnr_crossing_dp(s, s.small_params, s.small_dim)}


def plot(path: str, records: Optional[Sequence[Dict[str, Any]]] = None,
         s: Scenario = Scenario()) -> None:
    """Left: bytes per rank per step against DP at the stated sizes (model), the measured layouts
    marked. Right: the counts measured at world 2-4 (circles) on the model (lines)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dps = [1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.6),
                                 gridspec_kw={"width_ratios": [1.4, 1]})
    colors = {1: "tab:gray", 2: "tab:blue", 4: "tab:green", 8: "tab:red"}
    for tp in TABLE_TP:
        ax.plot(dps[1:], [lm_row(s, tp, d)["gradient"] for d in dps[1:]], "-", color=colors[tp],
                lw=3, alpha=0.3, label=f"gradient all-reduce, {s.params / 1e9:g}B bf16, TP {tp}")
    for tp in TABLE_TP[1:]:
        ax.plot(dps, [lm_row(s, tp, d)["loss"] for d in dps], "--", color=colors[tp],
                label=f"vocab-parallel CE + calibration, TP {tp}")
    ax.plot(dps[1:], [lm_row(s, 1, d)["loss"] for d in dps[1:]], ":", color="k",
            label="calibration + log only (TP 1)")
    ax.plot(dps[1:], [mnr_row(s, d)["mnr"] for d in dps[1:]], "-", color="tab:purple",
            label=f"gathered MNR, B {s.mnr_batch}, D {s.mnr_dim}, G {s.gas} "
                  "(GradCache: same bytes)")
    meas = [d for d in dps if d in MEASURED_WORLDS]
    ax.plot(meas[1:], [mnr_row(s, d)["mnr"] for d in meas[1:]], "o", color="tab:purple",
            mfc="none", ms=9)
    for tp in TABLE_TP[1:]:
        pts = [d for d in meas if tp * d in MEASURED_WORLDS]
        ax.plot(pts, [lm_row(s, tp, d)["loss"] for d in pts], "o", color=colors[tp], mfc="none",
                ms=9)
    ax.plot([1, 2, 3, 4], [lm_row(s, 1, d)["loss"] or math.nan for d in (1, 2, 3, 4)], "o",
            color="k", mfc="none", ms=9, label="layout measured (world <= 4, small sizes)")
    cross = mnr_crossing_dp(s, s.params, s.mnr_dim)
    if cross > 0:
        y = mnr_row(s, cross)["mnr"]
        ax.plot([cross], [y], "*", color="tab:purple", ms=14)
        ax.annotate(f"MNR = {s.params / 1e9:g}B gradient\nat DP {cross}", (cross, y),
                    textcoords="offset points", xytext=(-150, -6), fontsize=8)
    ax.axvspan(1, 4, color="k", alpha=0.06)
    ax.axvline(512, color="k", lw=0.8, alpha=0.4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("data-parallel size DP (table: up to 512)")
    ax.set_ylabel("bytes sent per rank per optimizer step (ring algorithms)")
    ax.set_title(f"model at scale: {s.tokens_per_micro * s.gas} tokens per DP rank per step, "
                 f"H {s.hidden}, bf16")
    ax.legend(fontsize=7, loc="center right", framealpha=0.9)
    ax.grid(True, which="both", alpha=0.3)

    if records:
        series = defaultdict(dict)  # case -> world -> (model, measured) total payload
        for r in records:
            if r["rank"] != 0 or r["sp"] != 1:
                continue
            case = r["case"]
            axis_tp = case.startswith("ce-")
            if (axis_tp and r["dp"] != 1) or (not axis_tp and r["tp"] != 1):
                continue
            world = r["tp"] * r["dp"]
            pred = predict(case, r["options"], r["tp"], r["dp"], r["sp"])
            model = sum(t.payload for t in pred.values())
            got = sum(Traffic.from_dict(m).payload for m in r["measured"].values())
            series[case][world] = (model, got)
        markers = "osD^vP*Xh"
        for i, (case, pts) in enumerate(sorted(series.items())):
            xs = [w for w in sorted(pts) if w > 1]
            line, = bx.plot(xs, [pts[w][0] for w in xs], "-", lw=1.2,
                            label=f"{case} ({'TP' if case.startswith('ce-') else 'DP'})")
            bx.plot(xs, [pts[w][1] for w in xs], markers[i % len(markers)],
                    color=line.get_color(), mfc="none", ms=8)
        bx.set_yscale("log")
        bx.set_ylim(1, 3e5)
        bx.set_xticks([2, 3, 4])
        bx.set_xlabel("TP (ce-* cases) or DP (the others): world size")
        bx.set_ylabel("payload bytes per rank, forward + backward / per step")
        bx.set_title("model (lines) vs counted on gloo (markers); world 1: none")
        bx.legend(fontsize=7, loc="lower right", ncol=2)
        bx.grid(True, which="both", alpha=0.3)
    else:
        bx.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _count(n: float) -> str:
    return f"{n / 1e6:.3g} M" if n >= 1e6 else f"{n / 1e3:.3g} k" if n >= 1e3 else f"{n:.0f}"


def markdown(s: Scenario = Scenario()) -> str:
    """The tables of docs/communication.md."""
    c = crossings(s)
    ce = ", ".join(f"TP {tp}: {_count(n)} tokens" for tp, n in c["ce_tokens"].items())
    return "\n".join([
        lm_table(s), "",
        f"CE traffic equals the {s.params / 1e9:g}B model's gradient all-reduce (large DP) at "
        f"{ce} per DP rank per step.", "",
        mnr_table(s), "",
        f"The gathered MNR (B {s.mnr_batch}, K {s.mnr_negatives}, G {s.gas}, bf16 embeddings) "
        f"rivals the gradient all-reduce at DP {c['mnr_dp']} for {s.params / 1e9:g}B / D "
        f"{s.mnr_dim}, and at DP {c['mnr_dp_small']} for {s.small_params / 1e6:g}M / D "
        f"{s.small_dim}.",
    ])
