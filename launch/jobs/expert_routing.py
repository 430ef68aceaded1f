"""Where a mixture-of-experts LM routes held-out text (the MoE job, ``launch/train_moe.py``):
the text's data domains, each domain's held-out blocks, and two figures per trained model,
from the top-k expert counts of every MoE layer (:func:`megaloss.losses.router.router_statistics`):

- **expert load** per layer: the most used expert's top-k selections over the mean expert's,
  on all held-out blocks (1: balanced; ``E / top_k``: every token on the same experts);
- **specialisation** per domain (arXiv:2501.11873, sec. 4 and its figures of expert selection
  per domain): the share of a domain's top-k selections that go to the domain's ``top_k`` most
  used experts of each layer, averaged over the layers; ``top_k / E`` when the domain's tokens
  spread evenly over all experts, 1 when they all go to the same ``top_k`` experts;
- **lift** per domain: that share minus the share of *all* held-out selections on the same
  experts. An unbalanced router raises every domain's share on its popular experts; the lift
  is what a domain concentrates beyond that (0: it routes like the whole corpus).

A domain is the top-level package of a file of the built-in corpus (``email/``, ``asyncio/``,
...; :func:`domain_of`), or the first directory under a named ``--eval_data`` /
``--train_data`` folder. The figures are global over the data-parallel ranks (each rank routes
its share of the blocks; one all-reduce of the counts per domain).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from .lm_data import eval_batches
from .text_data import encode_stream, lm_blocks, read_texts

__all__ = ["DOMAINS", "TOP_LEVEL", "domain_of", "domain_blocks", "routing_counts",
           "expert_load", "specialisation", "lift", "routing_report", "plot_routing"]

# Top-level standard-library packages of distinct subject matter that hold held-out files
# (crc32 split, launch.jobs.code_search.is_held_out) in CPython 3.11 to 3.13.
DOMAINS = ("email", "asyncio", "json", "tkinter", "urllib", "multiprocessing")
TOP_LEVEL = "(top level)"


def domain_of(path: Path, root: Path) -> str:
    """The domain of ``path``: the first directory of its path relative to ``root``, or
    :data:`TOP_LEVEL` for a file directly in ``root`` (or outside it)."""
    try:
        parts = Path(path).resolve().relative_to(Path(root).resolve()).parts
    except ValueError:
        return TOP_LEVEL
    return parts[0] if len(parts) > 1 else TOP_LEVEL


def domain_blocks(tokenizer: Any, files: Sequence[Path], root: Path, domains: Sequence[str],
                  seq_len: int, max_blocks: int) -> Dict[str, Dict[str, torch.Tensor]]:
    """Each domain's held-out text (its ``files`` under ``root``, :func:`domain_of`) tokenized
    and cut into at most ``max_blocks`` evenly spaced blocks of ``seq_len`` tokens
    (:func:`launch.jobs.text_data.lm_blocks`). Domains of ``domains`` whose text does not fill
    one block are left out (the caller reports which).

    Returns:
        ``{domain: {"input_ids", "shift_labels"}}`` in the order of ``domains``.
    """
    by_domain: Dict[str, List[Path]] = {d: [] for d in domains}
    for f in files:
        d = domain_of(f, root)
        if d in by_domain:
            by_domain[d].append(f)
    out = {}
    for d, fs in by_domain.items():
        if not fs:
            continue
        stream = encode_stream(tokenizer, read_texts(fs))
        if stream.numel() >= seq_len + 1:
            out[d] = lm_blocks(stream, seq_len, max_blocks)
    return out


@torch.no_grad()
def routing_counts(decoder: torch.nn.Module, top_k: int,
                   batches: Sequence[Mapping[str, torch.Tensor]], device: Any,
                   group: Any = None) -> torch.Tensor:
    """float64 ``[layers, experts]``: the top-k selections of every MoE layer of ``decoder``
    (a ``transformers`` MoE base model, whose forward takes ``output_router_logits=True``) over
    ``batches`` (``input_ids`` ``[B, T]``), summed over the ranks of ``group`` (a megaloss
    group: ``Topology.dp_group``; None: torch's default group). Collective: every rank of the
    group calls it, with the same number of batches. Eval mode, no gradient."""
    from megaloss.losses.router import router_statistics
    from megaloss.parallel.comm import all_reduce_sum_

    was_training = decoder.training
    decoder.eval()
    try:
        total: Optional[torch.Tensor] = None
        for mb in batches:
            out = decoder(input_ids=mb["input_ids"].to(device), output_router_logits=True,
                          use_cache=False)
            counts = router_statistics(out.router_logits, top_k).counts
            total = counts if total is None else total + counts
    finally:
        decoder.train(was_training)
    if total is None:
        raise ValueError("routing_counts needs at least one batch on every rank")
    return all_reduce_sum_(total, group)


def expert_load(counts: torch.Tensor) -> List[float]:
    """Per layer of ``counts [layers, experts]``: the most used expert's count over the mean."""
    return (counts.max(-1).values / counts.mean(-1).clamp_min(1e-30)).tolist()


def specialisation(counts: torch.Tensor, top_k: int) -> List[float]:
    """Per layer of one domain's ``counts [layers, experts]``: the share of its selections on
    its ``top_k`` most used experts (``top_k / experts``: none; 1: all)."""
    top = counts.topk(top_k, dim=-1).values.sum(-1)
    return (top / counts.sum(-1).clamp_min(1e-30)).tolist()


def lift(counts: torch.Tensor, reference: torch.Tensor, top_k: int) -> List[float]:
    """Per layer: :func:`specialisation` of ``counts [layers, experts]`` minus the share of
    ``reference`` (all the text's counts) on the same ``top_k`` experts."""
    idx = counts.topk(top_k, dim=-1).indices
    ref = reference.gather(-1, idx).sum(-1) / reference.sum(-1).clamp_min(1e-30)
    return [s - float(r) for s, r in zip(specialisation(counts, top_k), ref)]


def plot_routing(path: Path, reports: Mapping[str, Mapping[str, Any]], *, title: str) -> None:
    """Save a PNG of three panels, one bar per run: the held-out expert load per layer, the
    specialisation per domain (the even-spread share dashed) and the lift per domain.
    ``reports``: ``{run name: routing_report(...)}``."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(reports)
    width = 0.8 / max(len(names), 1)
    offset = width * (len(names) - 1) / 2
    first = reports[names[0]]
    layers, domains = len(first["load_per_layer"]), list(first["specialisation"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [1, 2, 2]})
    panels = [("load_per_layer", [f"layer {i}" for i in range(layers)], 1.0,
               "held-out expert load (max / mean)", "expert load (1 = balanced)"),
              ("specialisation", domains, first["uniform_share"],
               "share on the domain's top-k experts", "specialisation per domain"),
              ("lift", domains, 0.0, "share minus the corpus' share on them",
               "lift over the whole held-out text")]
    for ax, (key, ticks, line, ylabel, panel_title) in zip(axes, panels):
        for j, name in enumerate(names):
            values = reports[name][key]
            values = list(values.values()) if isinstance(values, Mapping) else list(values)
            ax.bar([i + j * width for i in range(len(values))], values, width, label=name)
        ax.set_xticks([i + offset for i in range(len(ticks))], ticks, fontsize=8)
        ax.axhline(line, color="grey", linestyle="--", linewidth=1)
        ax.set_ylabel(ylabel)
        ax.set_title(panel_title)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper left", ncol=len(names),
               fontsize=9, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def routing_report(decoder: torch.nn.Module, top_k: int, held: Sequence[Mapping[str, Any]],
                   domains: Mapping[str, Mapping[str, torch.Tensor]], *, micro: int, dp: int,
                   dp_rank: int, device: Any, group: Any = None) -> Dict[str, Any]:
    """The routing figures of a trained model (module docstring). Collective over the
    data-parallel ``group``.

    Args:
        decoder, top_k, device: as :func:`routing_counts`.
        held: this rank's held-out micro-batches (:func:`launch.jobs.lm_data.eval_batches`).
        domains: every domain's blocks (:func:`domain_blocks`, the same on every rank), split
            here over the ``dp`` ranks in micro-batches of ``micro``.

    Returns:
        ``{"load_per_layer": [..], "load_max": float, "specialisation": {domain: float},
        "specialisation_per_layer": {domain: [..]}, "specialisation_mean": float,
        "lift": {domain: float}, "lift_mean": float,
        "uniform_share": top_k / experts, "domain_tokens": {domain: int}}``.
    """
    counts = routing_counts(decoder, top_k, held, device, group)
    load = expert_load(counts)
    spec, per_layer, lifts, tokens = {}, {}, {}, {}
    for name, blocks in domains.items():
        if blocks["input_ids"].shape[0] < dp:  # too few blocks to give every rank one
            continue
        c = routing_counts(decoder, top_k, eval_batches(blocks, micro, dp, dp_rank), device,
                           group)
        per_layer[name] = specialisation(c, top_k)
        spec[name] = sum(per_layer[name]) / len(per_layer[name])
        lifts[name] = sum(lift(c, counts, top_k)) / len(per_layer[name])
        tokens[name] = int(round(float(c[0].sum()) / top_k))
    return {"load_per_layer": load, "load_max": max(load), "specialisation": spec,
            "specialisation_per_layer": per_layer,
            "specialisation_mean": sum(spec.values()) / len(spec) if spec else None,
            "lift": lifts, "lift_mean": sum(lifts.values()) / len(lifts) if lifts else None,
            "uniform_share": top_k / counts.shape[-1], "domain_tokens": tokens}
