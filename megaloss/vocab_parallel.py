r"""Vocab-parallel chunked cross-entropy: the lm_head split over the vocabulary across
tensor-parallel (TP) ranks, as Megatron-core's ``ColumnParallelLinear`` output layer with
``vocab_parallel_cross_entropy``, but chunked and without its known defects.

Rank ``r`` of ``tp`` holds rows ``[r * Vp, (r + 1) * Vp)`` of the lm_head, the vocabulary padded
to ``tp * Vp >= V``. Per chunk of tokens and per token, the log-sum-exp over the full vocabulary
is combined from the shards with two fp32 all-reduces of ``[tokens]``-sized tensors: a MAX of the
local maxima, then one SUM of the stacked ``[sum-exp, target logit, (sum of logits)]``; about
8-12 bytes per token, independent of V. No logits are gathered.

Differences from Megatron-core (see FIELD-NOTES): padded vocab rows never enter the softmax
(they are sliced off before the matmul, and get a zero gradient); label smoothing averages over
the *global* ``V`` so every TP rank computes the same loss; no input is modified in place; the
weight gradient accumulates in ``accum_dtype``.

``hidden_states`` is replicated over TP (identity forward, SUM all-reduce of its gradient in
backward, Megatron's ``copy_to_tensor_model_parallel_region``), or with
``sequence_parallel=True`` sharded along tokens (all-gather forward, reduce-scatter backward).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ._validation import (check_ce_options, check_ce_tensors, first_bad_label,
                          label_range_error)
from .chunked_linear_ce import chunked_linear_cross_entropy
from .distributed.collectives import (all_gather_dim0, all_reduce_max_, all_reduce_sum_,
                                      copy_to_group, gather_along_dim0)
from .distributed.topology import group_rank, group_size
from .linear_cross_entropy import CrossEntropyOutput
from .ops.cross_entropy_chunk import CrossEntropyOptions

__all__ = ["vocab_parallel_linear_cross_entropy", "vocab_parallel_linear_cross_entropy_with_stats",
           "VocabParallelLMHead", "vocab_shard_range"]


def _resolve_group(tp_group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
    """torch.distributed's convention: None is WORLD (or no group without torch.distributed)."""
    if tp_group is None and dist.is_initialized():
        return dist.group.WORLD
    return tp_group


def vocab_shard_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple:
    """``(start, stop, rows_per_rank)`` of this rank's real vocab rows: the vocab is padded to a
    multiple of ``tp_size`` and split evenly; ``stop - start`` may be < rows (padding) or 0."""
    rows = math.ceil(vocab_size / tp_size)
    start = min(tp_rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


def _check_across_ranks(group, n_tokens: int, hidden: int, rows: int, vocab_size: int,
                        ignore_index: int, bad_label: Optional[int], device) -> None:
    """One small all-gather so that mismatched shapes or a bad label on any rank raise on every
    rank (instead of one rank raising while the others wait in a collective forever)."""
    flag = _NO_BAD_LABEL if bad_label is None else bad_label
    mine = torch.tensor([n_tokens, hidden, rows, vocab_size, flag], dtype=torch.long,
                        device=device)
    everyone = all_gather_dim0(mine, group).view(-1, mine.numel())
    names = ("token count", "hidden size", "weight_shard rows", "vocab_size")
    for i, name in enumerate(names):
        values = everyone[:, i].tolist()
        if len(set(values)) > 1:
            raise ValueError(f"{name} differs across tensor-parallel ranks: {values}")
    flagged = everyone[:, 4]
    if bool((flagged != _NO_BAD_LABEL).any()):
        raise label_range_error(int(flagged[flagged != _NO_BAD_LABEL][0]), vocab_size,
                                ignore_index)


_NO_BAD_LABEL = -(2 ** 62)  # "this rank's labels are fine" in the all-gathered check


def vocab_parallel_linear_cross_entropy_with_stats(
    hidden_states: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: Optional[ProcessGroup] = None,
    vocab_size: Optional[int] = None,
    sequence_parallel: bool = False,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcapping: Optional[float] = None,
    loss_weights: Optional[torch.Tensor] = None,
    chunk_size: int = 1024,
    accum_dtype: torch.dtype = torch.float32,
) -> CrossEntropyOutput:
    """:func:`vocab_parallel_linear_cross_entropy` that also returns the z-loss part and the
    valid-token count (see :class:`megaloss.CrossEntropyOutput`)."""
    check_ce_options(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
                     logit_softcapping=logit_softcapping, chunk_size=chunk_size,
                     accum_dtype=accum_dtype, ignore_index=ignore_index)
    check_ce_tensors(hidden_states, weight_shard, labels, bias, loss_weights,
                     weight_name="weight_shard")
    group = _resolve_group(tp_group)
    tp, rank = group_size(group), group_rank(group)
    rows = weight_shard.shape[0]
    if vocab_size is None:
        vocab_size = rows * tp
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if rows != math.ceil(vocab_size / tp):
        raise ValueError(f"weight_shard must have ceil(vocab_size / tp) = "
                         f"{math.ceil(vocab_size / tp)} rows for vocab_size={vocab_size}, tp={tp}; "
                         f"got {rows}")
    flat_labels = labels.reshape(-1).long()
    hidden_size = hidden_states.shape[-1]
    _check_across_ranks(group, flat_labels.numel(), hidden_size, rows, vocab_size, ignore_index,
                        first_bad_label(flat_labels, vocab_size, ignore_index),
                        hidden_states.device)

    hidden = hidden_states.reshape(-1, hidden_size)
    weights = None if loss_weights is None else loss_weights.reshape(-1)
    if sequence_parallel and tp > 1:
        hidden = gather_along_dim0(hidden, group)
        flat_labels = all_gather_dim0(flat_labels, group)
        weights = None if weights is None else all_gather_dim0(weights.detach(), group)
    else:
        hidden = copy_to_group(hidden, group)

    start, stop, _ = vocab_shard_range(vocab_size, tp, rank)
    opts = CrossEntropyOptions(vocab_size=vocab_size, vocab_start=start, ignore_index=ignore_index,
                               label_smoothing=label_smoothing, z_loss=z_loss,
                               logit_softcapping=logit_softcapping)
    n_real = stop - start
    loss, z = chunked_linear_cross_entropy(
        hidden, weight_shard[:n_real], None if bias is None else bias[:n_real], flat_labels,
        weights, opts, reduction=reduction, chunk_size=chunk_size, accum_dtype=accum_dtype,
        reduce_max=lambda t: all_reduce_max_(t, group),
        reduce_sum=lambda t: all_reduce_sum_(t, group))
    if reduction == "none" and not (sequence_parallel and tp > 1):
        loss, z = loss.view(labels.shape), z.view(labels.shape)
    return CrossEntropyOutput(loss, z, (flat_labels != ignore_index).sum())


def vocab_parallel_linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: Optional[ProcessGroup] = None,
    vocab_size: Optional[int] = None,
    sequence_parallel: bool = False,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcapping: Optional[float] = None,
    loss_weights: Optional[torch.Tensor] = None,
    chunk_size: int = 1024,
    accum_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Exact cross-entropy over the full vocabulary from this rank's lm_head shard, chunked.

    Same value and options as :func:`megaloss.linear_cross_entropy` on the unsharded lm_head;
    the value is identical on every TP rank.

    Args:
        hidden_states: ``[..., H]``, replicated over the TP group; with
            ``sequence_parallel=True``, this rank's shard of the tokens (every rank the same
            count).
        weight_shard: ``[Vp, H]``, rows ``[r*Vp, (r+1)*Vp)`` of the lm_head padded to ``tp*Vp``,
            ``Vp = ceil(vocab_size / tp)``; padded rows are ignored (their gradient is 0).
        labels: ``[...]`` *global* vocab ids or ``ignore_index`` (same layout as the tokens).
        tp_group: tensor-parallel process group; ``None`` is the default group (every rank is
            a TP rank), or a single process when torch.distributed is not initialised.
        vocab_size: real ``V``; defaults to ``tp * Vp`` (no padding).
        sequence_parallel: Megatron sequence parallelism (gather tokens forward, reduce-scatter
            their gradient backward). With ``reduction="none"`` the result then covers the
            gathered tokens ``[tp * N_local]`` (rank 0's tokens first).
        bias: optional ``[Vp]`` bias shard.
        Others: as :func:`megaloss.linear_cross_entropy`.

    Returns:
        fp32 scalar (fp64 for fp64 inputs), or per-token losses for ``reduction="none"``.

    Raises:
        ValueError: as :func:`megaloss.linear_cross_entropy`; also when the token count, hidden
            size, shard rows or ``vocab_size`` differ across TP ranks, or when ``weight_shard``
            does not have ``ceil(vocab_size / tp)`` rows. Raised on every TP rank alike.
    """
    return vocab_parallel_linear_cross_entropy_with_stats(
        hidden_states, weight_shard, labels, tp_group=tp_group, vocab_size=vocab_size,
        sequence_parallel=sequence_parallel, bias=bias, ignore_index=ignore_index,
        reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
        logit_softcapping=logit_softcapping, loss_weights=loss_weights, chunk_size=chunk_size,
        accum_dtype=accum_dtype).loss


class VocabParallelLMHead(nn.Module):
    """The lm_head shard of this TP rank plus its vocab-parallel chunked cross-entropy.

    Owns ``weight [Vp, H]`` (and ``bias [Vp]`` if ``bias=True``), marked
    ``tensor_model_parallel = True`` (with ``partition_dim = 0``) so that DeepSpeed and Megatron
    count it once per TP group in gradient norms. ``forward(hidden_states, labels, *,
    loss_weights=None)`` returns the loss; ``forward_with_stats`` also the z-loss and valid-token
    count.

    Initialisation follows Megatron's CPU path: the full ``[V, H]`` weight is drawn from
    ``N(0, init_std^2)`` with a generator seeded by ``seed`` and each rank keeps its rows, so any
    TP size starts from the same lm_head. Use :meth:`load_full_weight` to copy a trained head.
    """

    def __init__(self, hidden_size: int, vocab_size: int, *, tp_group: Optional[ProcessGroup] = None,
                 bias: bool = False, sequence_parallel: bool = False, init_std: float = 0.02,
                 seed: int = 0, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                 logit_softcapping: Optional[float] = None, chunk_size: int = 1024,
                 accum_dtype: torch.dtype = torch.float32):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_ce_options(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
                         logit_softcapping=logit_softcapping, chunk_size=chunk_size,
                         accum_dtype=accum_dtype, ignore_index=ignore_index)
        self.tp_group = _resolve_group(tp_group)
        self.tp_size, self.tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.sequence_parallel = sequence_parallel
        start, stop, rows = vocab_shard_range(vocab_size, self.tp_size, self.tp_rank)
        self.vocab_start, self.vocab_stop = start, stop
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device))
        self.bias = (nn.Parameter(torch.zeros(rows, dtype=dtype, device=device)) if bias else None)
        for p in self.parameters():
            p.tensor_model_parallel = True
            p.partition_dim = 0
            p.partition_stride = 1
        self.ce_options = dict(ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing, z_loss=z_loss,
                               logit_softcapping=logit_softcapping, chunk_size=chunk_size,
                               accum_dtype=accum_dtype)
        self.init_std, self.seed = init_std, seed
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        full = torch.randn(self.vocab_size, self.hidden_size, generator=gen) * self.init_std
        self.load_full_weight(full)

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Copy this rank's rows of a full ``[V, H]`` weight (and ``[V]`` bias); padded rows 0."""
        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"weight must have shape {(self.vocab_size, self.hidden_size)}, "
                             f"got {tuple(weight.shape)}")
        n = self.vocab_stop - self.vocab_start
        self.weight.zero_()
        self.weight[:n].copy_(weight[self.vocab_start:self.vocab_stop])
        if bias is not None:
            if self.bias is None:
                raise ValueError("bias given but the head was built with bias=False")
            self.bias.zero_()
            self.bias[:n].copy_(bias[self.vocab_start:self.vocab_stop])

    def forward_with_stats(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
                           loss_weights: Optional[torch.Tensor] = None,
                           **overrides) -> CrossEntropyOutput:
        opts = {**self.ce_options, **overrides}
        return vocab_parallel_linear_cross_entropy_with_stats(
            hidden_states, self.weight, labels, tp_group=self.tp_group,
            vocab_size=self.vocab_size, sequence_parallel=self.sequence_parallel, bias=self.bias,
            loss_weights=loss_weights, **opts)

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
                loss_weights: Optional[torch.Tensor] = None, **overrides) -> torch.Tensor:
        return self.forward_with_stats(hidden_states, labels, loss_weights=loss_weights,
                                       **overrides).loss

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, "
                f"tp={self.tp_size}, rows=[{self.vocab_start}, {self.vocab_stop}), "
                + ", ".join(f"{k}={v}" for k, v in self.ce_options.items()))
