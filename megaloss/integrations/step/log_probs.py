"""What the step's families on a *log-probs* module share (:mod:`.policy`, :mod:`.preference`).

The module's contract: ``module(input_ids, shift_labels=labels, **inputs)`` returns an object
with ``log_probs`` (shape of ``labels`` or flattened; e.g. a :class:`megaloss.LogProbsOutput` of
:func:`megaloss.linear_log_probs` on the decoder's hidden states) and, for an entropy bonus or
metric, ``entropy`` (same shape, or ``None``). ``labels`` are the shifted targets,
``ignore_index`` off the completion (:func:`completion_targets`).

Under sequence parallelism every SP rank of a DP rank passes the same *full* micro-batches and
forwards its contiguous slice of the tokens (:func:`sp_slices`); the families add the
sequence-level sums over the SP group.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from ...calibration.weights import split_for_sequence_parallel
from ...ops.labels import causal_shift
from ...parallel.topology import Topology
from .router import StepRouter

__all__ = ["completion_targets", "check_completion_keys", "check_sp_attention_mask", "sp_slices",
           "log_probs_forward", "LogProbsForward", "router_prepass"]


def completion_targets(mb: Mapping[str, Any], ignore_index: int) -> torch.Tensor:
    """The shifted targets of ``mb``'s rows: ``input_ids`` shifted, ``ignore_index`` where
    ``completion_mask`` (aligned with the shifted targets) is 0."""
    mask = mb["completion_mask"]
    shifted = causal_shift(mb["input_ids"], ignore_index)
    return torch.where(mask != 0, shifted, torch.full_like(shifted, ignore_index))


def check_completion_keys(i: int, mb: Mapping[str, Any], keys: Sequence[str]) -> None:
    """``micro_batches[i]`` holds ``keys``, else ``ValueError`` naming the missing ones."""
    missing = [k for k in keys if mb.get(k) is None]
    if missing:
        raise ValueError(f"micro_batches[{i}] lacks {', '.join(missing)}")


def check_sp_attention_mask(i: int, mb: Mapping[str, Any], topology: Topology) -> None:
    """Under sequence parallelism ``micro_batches[i]``'s ``attention_mask`` (if any) masks
    nothing, else ``ValueError``: Ulysses attends causally over the gathered sequence."""
    sp = topology.sp_size
    mask = mb.get("attention_mask")
    if sp != 1 and mask is not None and not bool((mask != 0).all()):
        raise ValueError(
            f"micro_batches[{i}]['attention_mask'] masks tokens, which sequence "
            f"parallelism (sp={sp}) cannot honour: Ulysses attends causally over the "
            "gathered sequence; right-pad the rows instead (padding after the "
            "completion is never attended to by a completion token)")


def sp_slices(topology: Topology, mb: Mapping[str, Any], labels: torch.Tensor,
              ignore_index: int) -> Tuple[Dict[str, Any], torch.Tensor]:
    """This SP rank's view of a micro-batch: its contiguous slice of every ``[B, T]`` tensor
    (cut and right-padded as the calibration cuts the labels:
    :func:`megaloss.calibration.weights.split_for_sequence_parallel`; the mask, log-probs and
    ``[B, T]`` advantages padded with 0, the labels with ``ignore_index``), the *global*
    ``position_ids`` Ulysses needs (``arange`` when not given), no attention mask (all ones,
    checked: Ulysses attends causally over the gathered sequence); ``advantages [B]`` as given.
    With ``sp = 1`` the micro-batch and labels as given."""
    if topology.sp_size == 1:
        return dict(mb), labels
    sp, rank = topology.sp_size, topology.sp_rank
    ids = mb["input_ids"]
    out = {k: v for k, v in mb.items() if k != "attention_mask"}
    if mb.get("position_ids") is None:
        out["position_ids"] = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    for k in ("input_ids", "position_ids", "completion_mask", "old_log_probs", "ref_log_probs",
              "advantages"):
        v = out.get(k)
        if v is not None and v.dim() == 2:
            out[k] = split_for_sequence_parallel(v, rank, sp, 0)
    return out, split_for_sequence_parallel(labels, rank, sp, ignore_index)


class LogProbsForward(NamedTuple):
    """:func:`log_probs_forward`'s result: ``log_probs`` and ``entropy`` (or ``None``) of the
    labels' shape, and the router losses the module returned (``None`` without router
    options)."""

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]
    router: Any


def log_probs_forward(forward, mb: Mapping[str, Any], labels: torch.Tensor,
                      router: Optional[StepRouter] = None, topology: Optional[Topology] = None,
                      num_micro_batches: int = 1) -> LogProbsForward:
    """The log-probs (and entropy) of ``mb``'s rows under ``forward`` (the module's). With a
    :class:`~.router.StepRouter` (and the step's ``topology`` and micro-batch count), the
    forward gets the router pool (``router_loss=``) and the router losses it returned come
    back too."""
    inputs = {k: mb[k] for k in ("attention_mask", "position_ids") if mb.get(k) is not None}
    if router:
        inputs.update(router.kwargs(topology, num_micro_batches))
    out = forward(mb["input_ids"], shift_labels=labels, **inputs)
    entropy = getattr(out, "entropy", None)
    return LogProbsForward(out.log_probs.reshape(labels.shape),
                           None if entropy is None else entropy.reshape(labels.shape),
                           router.output(out) if router else None)


def router_prepass(forward, topology: Topology, mb: Mapping[str, Any],
                   ignore_index: int) -> Any:
    """One micro-batch's forward for the router losses' ``"step"`` pre-pass
    (:meth:`~.router.StepRouter.prepare`): ``pool -> forward(this SP rank's rows,
    router_loss=pool)``."""
    rows, _ = sp_slices(topology, mb, completion_targets(mb, ignore_index), ignore_index)
    inputs = {k: rows[k] for k in ("attention_mask", "position_ids") if rows.get(k) is not None}
    return lambda pool: forward(rows["input_ids"], router_loss=pool, **inputs)
