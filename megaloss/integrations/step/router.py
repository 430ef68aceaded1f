"""The router losses of a mixture-of-experts model inside the calibrated step: which pool of
tokens each micro-batch's router loss belongs to (:class:`RouterLossOptions`' ``scope``), the
``"step"`` scope's routing pre-pass, and the step's router metrics.

A family that trains a module with router losses (:class:`~.lm.LanguageModelLoss` with
``router=``) hands the module's forward ``router_loss=`` a
:class:`megaloss.losses.router.RouterPool` (:func:`router_pool`); the module adds that pool's
share (:func:`megaloss.losses.router.router_loss`) to its loss. The shares of every rank and
micro-batch add up to the definition of the scope, so the step's gradient is one device's:

- ``"micro_batch"``: a pool per micro-batch of each data-parallel rank (its sequence-parallel
  ranks together), weight ``1 / (G x dp)``: the mean of the micro-batches' losses, Hugging Face's
  and DeepSpeed-MoE's per-micro-batch numbers, without the engine's scaling mistakes;
- ``"global"``: a pool per micro-step over ``dp x sp``, weight ``1 / G``;
- ``"step"``: one pool, the whole optimizer step, its counts from a pre-pass (a forward of every
  micro-batch without gradients, before the first backward: :func:`step_statistics`), weight 1.

TP ranks of one DP rank see the same tokens: each computes the same share of its replicated
router, as for every replicated parameter.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ...losses.router import RouterLossOutput, RouterPool, RouterStatistics
from ...losses.router_options import RouterLossOptions
from ...parallel.comm import all_reduce_sum_
from ...parallel.topology import Topology

__all__ = ["StepRouter", "router_pool", "step_statistics", "router_stats", "router_metrics",
           "check_router_micro_batch"]


def _check_layout(options: RouterLossOptions, topology: Topology) -> None:
    """The sequence-wise loss needs each sequence's counts on one rank.

    Raises:
        ValueError: ``seq_aux_loss`` under sequence parallelism.
    """
    if options.seq_aux_loss and topology.sp_size > 1:
        raise ValueError("seq_aux_loss under sequence parallelism (sp > 1) is not supported: each "
                         "sequence's expert counts would be split over the SP ranks; use aux_loss "
                         "(load balancing over the pool) or sp = 1")


def router_pool(options: RouterLossOptions, topology: Topology, num_micro_batches: int,
                statistics: Optional[RouterStatistics] = None) -> RouterPool:
    """The pool of one micro-batch of a step of ``num_micro_batches`` under ``options.scope``
    (module docstring); ``statistics``: the ``"step"`` scope's, from :func:`step_statistics`.

    Raises:
        ValueError: the ``"step"`` scope without ``statistics``; the sequence-wise loss under
            sequence parallelism (a sequence's counts would be split over ranks).
    """
    _check_layout(options, topology)
    g = max(int(num_micro_batches), 1)
    if options.scope == "micro_batch":
        return RouterPool(options, topology.sp_group, 1.0 / (g * topology.dp_size))
    if options.scope == "global":
        return RouterPool(options, topology.dp_sp_group, 1.0 / g)
    if statistics is None:
        raise ValueError("the 'step' router scope needs the step's counts (step_statistics)")
    return RouterPool(options, weight=1.0, statistics=statistics)


@torch.no_grad()
def step_statistics(options: RouterLossOptions, topology: Topology,
                    forwards: Sequence[Callable[[RouterPool], Any]]) -> RouterStatistics:
    """The ``"step"`` scope's pre-pass: each micro-batch's forward without gradients (``forwards``:
    one call per micro-batch, given the statistics-only pool, returning this rank's
    :class:`RouterStatistics`), summed, then one all-reduce over ``dp x sp`` (every rank calls
    it, with any number of micro-batches)."""
    probe = RouterPool(options, statistics_only=True)
    total: Optional[RouterStatistics] = None
    for forward in forwards:
        stats = forward(probe)
        if not isinstance(stats, RouterStatistics):
            raise TypeError(f"a router pre-pass forward must return RouterStatistics, got "
                            f"{type(stats).__name__}: does the module take router_loss=?")
        total = stats if total is None else total + stats
    if total is None:
        raise ValueError("the 'step' router scope needs at least one micro-batch on every rank")
    flat = all_reduce_sum_(total.flat(), topology.dp_sp_group)
    return RouterStatistics.unflat(flat, tuple(total.counts.shape))


def router_stats(out: RouterLossOutput) -> Tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's router figures to reduce at the step's end (float64): the shares of
    the three terms and of their weighted sum (the part of the loss) ``[4]``, and this rank's
    expert counts ``[L, E]``."""
    terms = torch.stack([out.aux_loss, out.seq_aux_loss, out.z_loss, out.loss.detach()])
    return terms.to(torch.float64), out.local.counts


def router_metrics(stats: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                   topology: Topology) -> Dict[str, float]:
    """The step's router metrics from every micro-batch's :func:`router_stats`, global over
    ``dp x sp`` (one all-reduce; every rank calls it, with at least one micro-batch):
    ``router_aux_loss``, ``router_seq_aux_loss``, ``router_z_loss`` (each term of the step,
    before its coefficient) and ``expert_load_max`` (the most loaded expert's top-k selections
    over the mean expert's, the worst layer: 1 is perfect balance, ``E / top_k`` all tokens on
    the same experts)."""
    terms = sum(t for t, _ in stats)
    counts = sum(c for _, c in stats)
    flat = all_reduce_sum_(torch.cat([terms, counts.reshape(-1)]), topology.dp_sp_group)
    counts = flat[4:].reshape(counts.shape)
    load = counts.max(-1).values / counts.mean(-1).clamp_min(1e-30)
    return {"router_aux_loss": float(flat[0]), "router_seq_aux_loss": float(flat[1]),
            "router_z_loss": float(flat[2]), "expert_load_max": float(load.max())}


def check_router_micro_batch(i: int, mb: Mapping[str, Any], options: RouterLossOptions,
                             topology: Topology) -> None:
    """What router losses need of ``micro_batches[i]`` under sequence parallelism, where each
    SP rank routes its slice of the tokens without the attention mask: no padding (an
    ``attention_mask`` with zeros) and a length the SP size divides (the slices' own padding
    would be routed and counted); and the sequence-wise loss's own refusal under sequence
    parallelism.

    Raises:
        ValueError: naming the micro-batch and the fix.
    """
    if i == 0:
        _check_layout(options, topology)
    if topology.sp_size == 1:
        return
    mask = mb.get("attention_mask")
    if mask is not None and bool((mask == 0).any()):
        raise ValueError(f"micro_batches[{i}] has padding (attention_mask zeros): under sequence "
                         f"parallelism the router losses would count padded tokens; pack the "
                         f"sequences (position_ids / cu_seqlens) instead of padding")
    length = mb["input_ids"].shape[-1]
    if length % topology.sp_size:
        raise ValueError(f"micro_batches[{i}] has {length} tokens per row, not a multiple of "
                         f"sequence_parallel_size={topology.sp_size}: the router losses would "
                         f"count the SP slices' padding")


class StepRouter:
    """A loss family's router losses in the step: its checks, the ``"step"`` scope's pre-pass,
    the pool handed to each forward (``router_loss=``), the output's router losses and the
    step's router metrics (module docstring). Falsy without router options (or all
    coefficients 0): the family then passes nothing and reads nothing.

    Raises:
        TypeError: ``options`` is not a :class:`RouterLossOptions` or ``None``.
    """

    def __init__(self, options: Optional[RouterLossOptions]) -> None:
        if options is not None and not isinstance(options, RouterLossOptions):
            raise TypeError(f"router must be a megaloss RouterLossOptions or None, got "
                            f"{type(options).__name__}")
        self.options = options if options is not None and options.enabled else None
        self.statistics: Optional[RouterStatistics] = None

    def __bool__(self) -> bool:
        return self.options is not None

    def check(self, i: int, mb: Mapping[str, Any], topology: Topology) -> None:
        """:func:`check_router_micro_batch` (nothing without options)."""
        if self.options is not None:
            check_router_micro_batch(i, mb, self.options, topology)

    def prepare(self, topology: Topology,
                forwards: Sequence[Callable[[RouterPool], Any]]) -> None:
        """The ``"step"`` scope's pre-pass (:func:`step_statistics`; nothing for the other
        scopes): ``forwards``, one per micro-batch, each the module's forward of that
        micro-batch given a pool."""
        self.statistics = None
        if self.options is not None and self.options.scope == "step":
            self.statistics = step_statistics(self.options, topology, forwards)

    def kwargs(self, topology: Topology, num_micro_batches: int) -> Dict[str, Any]:
        """The forward's ``router_loss=`` (empty without options)."""
        if self.options is None:
            return {}
        return {"router_loss": router_pool(self.options, topology, num_micro_batches,
                                           self.statistics)}

    def output(self, out: Any) -> Optional[RouterLossOutput]:
        """The router losses the module's forward returned (its output's ``router``), ``None``
        without options.

        Raises:
            TypeError: the module returned none: it does not take ``router_loss=`` (the router
                losses would be dropped).
        """
        if self.options is None:
            return None
        router = getattr(out, "router", None)
        if router is None:
            raise TypeError(f"the module's forward returned {type(out).__name__} without router "
                            f"losses (a 'router' field): it does not compute the router losses "
                            f"the step's router options ask for")
        return router

    def metrics(self, stats: List[Optional[Tuple[torch.Tensor, torch.Tensor]]],
                topology: Topology) -> Dict[str, float]:
        """:func:`router_metrics` of the micro-batches' :func:`router_stats` (empty without
        options; collective with them)."""
        return {} if self.options is None else router_metrics(stats, topology)
