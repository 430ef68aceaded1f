"""Per-token loss weights for one optimizer step, normalised by one global denominator.

Math (XTuner v1's global loss calibration, ``xtuner/v1/loss/base_loss_ctx.py`` and
``ce_loss.py``, whose option is ``loss_reduction``). For the valid
tokens ``t`` (label != ``ignore_index``, labels already shifted for causal LM) of all micro-batches
of one optimizer step on all ``dp x sp`` ranks, with ``s(t)`` the sample holding ``t`` and ``n_s``
the number of valid tokens of sample ``s`` (counted over the *whole* sample, also when packed with
others or split over sequence-parallel ranks)::

    raw weight   u_t = 1            ("token":  global token mean)
                 u_t = 1 / n_s(t)   ("sample": mean over samples of the sample's token mean)
                 u_t = 1 / sqrt(n_s(t))  ("square")
    denominator  D   = sum over all valid tokens of all ranks of u_t
                     = N_tokens | N_samples | sum_s sqrt(n_s)
    weight       w_t = u_t / D       (0 for ignored tokens; all 0 when D == 0)

so that ``sum over ranks, micro-batches and tokens of w_t * l_t`` is the global loss one device
would compute on the whole step's batch. ``D`` is the only global quantity: each rank adds the
``u_t`` of the tokens it holds and one SUM all-reduce over the ``dp x sp`` group gives it (TP
replicas hold the same tokens and are not in that group, so nothing is counted twice).

``N_samples`` counts the samples with at least one valid token; with ``count_empty_samples``
it counts every sample, also those whose tokens are all ignored (then ``D = N_samples`` of all
samples for ``"sample"``, TRL's ``grpo`` mean over every row; ``"token"`` and ``"square"`` are
unchanged, an empty sample adds nothing to them).

Sequence parallelism. A sample split over SP ranks must count whole, so ``n_s`` must be known on
every piece. As in XTuner, every rank of an SP group is given the *full* (unsplit) labels of its
micro-batches: ``n_s`` is then exact locally, and only the rank's own slice (see
:func:`split_for_sequence_parallel`) adds to ``D``, so each token is counted once. No extra
collective is needed for this.

Samples. Each row of a ``[B, T]`` labels tensor is one sample, unless ``cu_seqlens`` (flash-attn
varlen convention: ``[S + 1]`` int offsets into the flattened labels, from 0 to ``labels.numel()``)
or ``position_ids`` (same shape as labels; a sample starts where the position is 0, and at each
row start) mark packed samples.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from ..parallel.comm import all_reduce_sum_
from ..parallel.groups import SINGLE_RANK, GroupLike, group_rank, group_size

__all__ = ["LOSS_REDUCTIONS", "LossWeights", "compute_loss_weights", "loss_weight_dtype",
           "sample_ids_from_boundaries",
           "split_for_sequence_parallel", "raw_token_weights"]

LOSS_REDUCTIONS = ("token", "sample", "square")

SpSplitFn = Callable[[torch.Tensor, int, int, float], torch.Tensor]


def loss_weight_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype loss weights of ``module``'s loss are built in: float64 when any floating
    parameter is float64 (the chunk kernel then accumulates in float64, and a float32 ``1 / D``
    would round the global normaliser to 7 digits), float32 otherwise (bf16 / fp16 / fp32 models:
    the kernel accumulates in float32)."""
    for p in module.parameters():
        if p.dtype == torch.float64:
            return torch.float64
    return torch.float32


def split_for_sequence_parallel(x: torch.Tensor, sp_rank: int, sp_size: int,
                                pad_value: float = 0, *, dim: int = -1) -> torch.Tensor:
    """This SP rank's contiguous slice of ``x`` along the sequence dim ``dim``.

    The sequence is right-padded with ``pad_value`` to a multiple of ``sp_size`` (XTuner's
    ``split_for_sequence_parallel``; DeepSpeed Ulysses's adapter splits the same way when the
    length divides evenly), then cut into ``sp_size`` equal chunks; chunk ``sp_rank`` is returned.
    Use it for the model inputs (``dim=1`` of ``[B, T, H]``), labels and weights alike, so they
    line up.

    Args:
        x: ``[..., T, ...]`` any dtype.
        sp_rank, sp_size: position in and size of the SP group.
        pad_value: value of the padding (``ignore_index`` for labels, 0 for weights).
        dim: the sequence dim (default the last, as in ``labels [B, T]``).

    Returns:
        ``x`` with ``ceil(T / sp_size)`` positions along ``dim`` (a view when no padding is
        needed).

    Raises:
        ValueError: ``sp_rank`` outside ``[0, sp_size)``.
    """
    if sp_size == 1:
        return x
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank must be in [0, {sp_size}), got {sp_rank}")
    dim = dim % x.dim()
    length = x.shape[dim]
    chunk = -(-length // sp_size)
    pad = chunk * sp_size - length
    if pad:
        # F.pad's tuple runs from the last dim backwards: (0, 0) for each dim after `dim`.
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1 - dim) + (0, pad), value=pad_value)
    return x.narrow(dim, sp_rank * chunk, chunk)


def sample_ids_from_boundaries(labels: torch.Tensor, *, cu_seqlens: Optional[torch.Tensor] = None,
                               position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sample index (0, 1, ...) of every token of ``labels``, flattened: int64 ``[labels.numel()]``.

    Rows are samples by default; ``cu_seqlens`` ``[S + 1]`` (offsets into the flattened labels,
    starting at 0 and ending at ``labels.numel()``) or ``position_ids`` (shape of ``labels``; 0
    starts a sample, as does every row start) mark packed samples. At most one of the two.

    Raises:
        ValueError: both given, or either does not fit ``labels``.
    """
    n = labels.numel()
    device = labels.device
    if cu_seqlens is not None and position_ids is not None:
        raise ValueError("give at most one of cu_seqlens and position_ids")
    if cu_seqlens is not None:
        cu = torch.as_tensor(cu_seqlens, device=device).long().reshape(-1)
        # These are host-side checks on a tiny [S+1] tensor, done once per step, not per token.
        if cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing offsets from 0 to labels.numel()="
                             f"{n}, got {cu.tolist()}")
        starts = torch.zeros(n + 1, dtype=torch.long, device=device)
        starts.index_add_(0, cu[1:-1], torch.ones_like(cu[1:-1]))
        return torch.cumsum(starts[:n], 0)
    if position_ids is not None:
        pos = torch.as_tensor(position_ids, device=device)
        if pos.shape != labels.shape:
            raise ValueError(f"position_ids must have the shape of labels {tuple(labels.shape)}, "
                             f"got {tuple(pos.shape)}")
        start = pos == 0
        if labels.dim() >= 1 and labels.shape[-1] > 0:
            start = start.clone()
            start[..., 0] = True
        return torch.cumsum(start.reshape(-1).long(), 0) - 1
    row = labels.shape[-1] if labels.dim() >= 1 else 1
    return torch.arange(n, device=device) // max(row, 1)


def raw_token_weights(labels: torch.Tensor, loss_reduction: str, *, ignore_index: int = -100,
                      cu_seqlens: Optional[torch.Tensor] = None,
                      position_ids: Optional[torch.Tensor] = None,
                      dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Unnormalised weights ``u_t`` (module docstring) of one micro-batch, shape of ``labels``.

    ``u_t`` is 0 for ignored tokens. Pure single-device math: no collective.
    """
    valid = labels != ignore_index
    if loss_reduction == "token":
        return valid.to(dtype)
    sid = sample_ids_from_boundaries(labels, cu_seqlens=cu_seqlens, position_ids=position_ids)
    flat_valid = valid.reshape(-1)
    if sid.numel() == 0:
        return valid.to(dtype)
    # Sample ids are < numel: sizing by numel avoids reading sid[-1] back to the host.
    n_s = torch.zeros(sid.numel(), dtype=dtype, device=labels.device)
    n_s.index_add_(0, sid, flat_valid.to(dtype))
    n_t = n_s[sid].clamp_min(1)  # invalid tokens may sit in an all-ignored sample (n_s = 0)
    per_token = n_t.reciprocal() if loss_reduction == "sample" else n_t.rsqrt()
    return (per_token * flat_valid).reshape(labels.shape)


def _sample_count(labels: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                  position_ids: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """float64 scalar: the samples of one micro-batch, with or without a valid token (the rows,
    or the packed samples ``cu_seqlens`` / ``position_ids`` mark)."""
    if cu_seqlens is not None:
        n = torch.as_tensor(cu_seqlens).reshape(-1).numel() - 1
    elif position_ids is not None and labels.numel() > 0:
        sid = sample_ids_from_boundaries(labels, position_ids=position_ids)
        return (sid[-1] + 1).to(torch.float64)
    else:
        n = math.prod(labels.shape[:-1]) if labels.numel() > 0 or labels.dim() > 1 else 0
    return torch.tensor(float(n), dtype=torch.float64, device=device)


@dataclass
class LossWeights:
    """Result of :func:`compute_loss_weights` (every tensor stays on the labels' device).

    Attributes:
        weights: per micro-batch, this rank's ``w_t`` (its SP slice), ``dtype`` as requested.
        denominator: float64 scalar ``D`` (identical on all ``dp x sp`` ranks).
        num_tokens: float64 scalar, global number of valid tokens of the step.
        num_samples: float64 scalar, global number of samples with >= 1 valid token (of every
            sample, also without one, with ``count_empty_samples``).
    """

    weights: List[torch.Tensor]
    denominator: torch.Tensor
    num_tokens: torch.Tensor
    num_samples: torch.Tensor


def _as_list(x, n: int, name: str) -> List[Optional[torch.Tensor]]:
    if x is None:
        return [None] * n
    if isinstance(x, torch.Tensor):
        x = [x]
    x = list(x)
    if len(x) != n:
        raise ValueError(f"{name} must have one entry per micro-batch ({n}), got {len(x)}")
    return x


def compute_loss_weights(
    labels: Sequence[torch.Tensor],
    loss_reduction: str = "token",
    *,
    group: GroupLike = None,
    sp_group: GroupLike = SINGLE_RANK,
    ignore_index: int = -100,
    cu_seqlens: Optional[Sequence[Optional[torch.Tensor]]] = None,
    position_ids: Optional[Sequence[Optional[torch.Tensor]]] = None,
    dtype: torch.dtype = torch.float32,
    sp_split: SpSplitFn = split_for_sequence_parallel,
    count_empty_samples: bool = False,
) -> LossWeights:
    """Global per-token loss weights for all micro-batches of one optimizer step.

    One SUM all-reduce of 3 float64 numbers over ``group`` (entered by every rank, also with no
    valid token); no host sync besides the tiny ``cu_seqlens`` checks.

    Args:
        labels: one int tensor per micro-batch (``[B, T]`` or ``[T]``), already shifted (the
            target of position t at t; ``ignore_index`` where no loss). With ``sp_group`` of size
            > 1: the *full* sequences of the SP group (same on all its ranks).
        loss_reduction: ``"token"``, ``"sample"`` or ``"square"`` (module docstring).
        group: the ``dp x sp`` group (``Topology.dp_sp_group``); ``None`` is torch's default
            group; :data:`~megaloss.parallel.SINGLE_RANK` for one rank.
        sp_group: the sequence-parallel group (``Topology.sp_group``); default: no SP.
        ignore_index: label value of tokens without loss.
        cu_seqlens / position_ids: optional, one per micro-batch (entries may be ``None``),
            marking packed samples (see :func:`sample_ids_from_boundaries`).
        dtype: floating dtype of the returned weights (statistics are float64).
        sp_split: ``fn(x, sp_rank, sp_size, pad_value) -> local slice`` along the sequence; the
            default is :func:`split_for_sequence_parallel`.
        count_empty_samples: count samples without a valid token too, in ``num_samples`` and in
            the ``"sample"`` denominator (module docstring; bool).

    Returns:
        :class:`LossWeights`; ``weights[i]`` has the shape of this rank's slice of ``labels[i]``
        and feeds ``loss_weights=`` of a CE loss with ``reduction="sum"``.

    Raises:
        ValueError: unknown ``loss_reduction``, empty ``labels``, mismatched per-micro-batch lists.
        TypeError: labels not integer tensors, ``dtype`` not floating, ``count_empty_samples``
            not a bool.
    """
    if not isinstance(count_empty_samples, bool):
        raise TypeError(f"count_empty_samples must be a bool, got {count_empty_samples!r}")
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got "
                         f"{loss_reduction!r}")
    if isinstance(labels, torch.Tensor):
        labels = [labels]
    labels = list(labels)
    if not labels:
        raise ValueError("labels must hold at least one micro-batch")
    for i, y in enumerate(labels):
        if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.is_complex():
            raise TypeError(f"labels[{i}] must be an integer torch.Tensor, got "
                            f"{getattr(y, 'dtype', type(y).__name__)}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    cus = _as_list(cu_seqlens, len(labels), "cu_seqlens")
    poss = _as_list(position_ids, len(labels), "position_ids")
    sp_size, sp_rank = group_size(sp_group), group_rank(sp_group)

    device = labels[0].device
    stats = torch.zeros(3, dtype=torch.float64, device=device)  # [sum u, n_tokens, n_samples]
    local_raw = []
    for y, cu, pos in zip(labels, cus, poss):
        u = raw_token_weights(y, loss_reduction, ignore_index=ignore_index, cu_seqlens=cu,
                              position_ids=pos, dtype=torch.float64)
        # 1/n_s summed over a sample's valid tokens is 1: that counts samples, also split over SP.
        inv_n = raw_token_weights(y, "sample", ignore_index=ignore_index, cu_seqlens=cu,
                                  position_ids=pos, dtype=torch.float64)
        u = sp_split(u, sp_rank, sp_size, 0.0)
        inv_n = sp_split(inv_n, sp_rank, sp_size, 0.0)
        if count_empty_samples:
            # Every SP rank holds the full labels: the first one counts their samples, once.
            samples = _sample_count(y, cu, pos, device) if sp_rank == 0 else stats.new_zeros(())
        else:
            samples = inv_n.sum()
        stats += torch.stack([u.sum(), (inv_n > 0).sum().to(torch.float64), samples])
        local_raw.append(u)
    all_reduce_sum_(stats, group)
    # "sample" with empty samples: D is the count of every sample, not sum u (which skips them).
    denom = stats[2] if count_empty_samples and loss_reduction == "sample" else stats[0]
    # D == 0 only when no rank has a valid token: every u_t is 0 then, and so is every weight.
    scale = torch.where(denom > 0, denom, torch.ones_like(denom)).reciprocal()
    weights = [(u * scale).to(dtype) for u in local_raw]
    return LossWeights(weights=weights, denominator=denom, num_tokens=stats[1],
                       num_samples=stats[2])
