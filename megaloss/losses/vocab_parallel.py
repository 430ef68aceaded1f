r"""Vocab-parallel chunked cross-entropy: the lm_head split over the vocabulary across
tensor-parallel (TP) ranks, as Megatron-core's ``ColumnParallelLinear`` output layer with
``vocab_parallel_cross_entropy``, but chunked and without its known defects.

Rank ``r`` of ``tp`` holds rows ``[r * Vp, (r + 1) * Vp)`` of the lm_head, the vocabulary padded
to ``tp * Vp >= V``. Per chunk of tokens and per token, the log-sum-exp over the full vocabulary
is combined from the shards with two fp32 all-reduces of ``[tokens]``-sized tensors: a MAX of the
local maxima, then one SUM of the stacked ``[sum-exp, target logit, (sum of logits)]``; about
8-12 bytes per token, independent of V. No logits are gathered.

Differences from Megatron-core's ``tensor_parallel/cross_entropy.py``: padded vocab rows never
enter the softmax
(they are sliced off before the matmul, and get a zero gradient); label smoothing averages over
the *global* ``V`` so every TP rank computes the same loss; no input is modified in place; the
weight gradient accumulates in ``accum_dtype``.

``hidden_states`` is replicated over TP (identity forward, SUM all-reduce of its gradient in
backward, Megatron's ``copy_to_tensor_model_parallel_region``), or, with Megatron's
``sequence_parallel=True``, sharded along tokens *inside the TP group* (all-gather forward,
reduce-scatter backward). That flag is Megatron's sequence parallelism; it is unrelated to the
``sp`` dimension of :class:`megaloss.Topology` (DeepSpeed-Ulysses / XTuner sequence parallelism,
where each rank computes the loss of its own token shard and the calibration counts samples whole).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from .._deprecation import warn_renamed
from ..ops.chunked_linear_ce import chunked_linear_cross_entropy
from ..ops.options import CrossEntropyOptions, resolve_options
from ..ops.validation import check_ce_tensors, first_bad_label, label_range_error
from ..parallel.comm import all_gather_dim0, all_reduce_max_, all_reduce_sum_
from ..parallel.groups import GroupLike, group_rank, group_size, resolve_group
from ..parallel.mappings import copy_to_region, gather_from_region
from ..parallel.param_tags import mark_tensor_parallel
from .ce_output import CrossEntropyOutput

__all__ = ["VocabParallelOptions", "VocabParallelLMHead", "vocab_shard_range",
           "sharded_linear_cross_entropy", "vocab_parallel_linear_cross_entropy",
           "vocab_parallel_linear_cross_entropy_with_stats"]


@dataclass(frozen=True)
class VocabParallelOptions:
    """How the lm_head is split over tensor-parallel ranks, for
    :func:`megaloss.linear_cross_entropy` ``(..., vocab_parallel_options=...)``, after Cut
    Cross-Entropy's argument of that name (apple/ml-cross-entropy,
    ``cut_cross_entropy/linear_cross_entropy.py``; its ``VocabParallelOptions`` in
    ``cut_cross_entropy/vocab_parallel/utils.py``). With it, ``weight`` is this rank's shard.

    Attributes:
        tp_group: the tensor-parallel process group; ``None`` is torch's default group (every
            rank is a TP rank; one process without torch.distributed), as everywhere in megaloss.
        vocab_size: the real ``V``; ``None``: ``tp * Vp`` (no padding), ``Vp`` the shard's rows.
        sequence_parallel: Megatron-core's sequence parallelism inside the TP group: the
            tokens are sharded over the TP ranks (all-gather forward, reduce-scatter of their
            gradient backward); not the Topology's ``sp``. With ``reduction="none"`` the result
            then covers the gathered tokens ``[tp * N_local]`` (rank 0's tokens first).

    Raises:
        ValueError: ``vocab_size`` not ``None`` or a positive int.
        TypeError: ``sequence_parallel`` not a bool.
    """

    tp_group: GroupLike = None
    vocab_size: Optional[int] = None
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        v = self.vocab_size
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"vocab_size must be None or a positive int, got {v!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool, got {self.sequence_parallel!r}")


def _check_vocab_parallel_options(value) -> None:
    """The ``vocab_parallel_options=`` argument of an entry point: ``None`` or this class."""
    if value is not None and not isinstance(value, VocabParallelOptions):
        raise TypeError(f"vocab_parallel_options must be a VocabParallelOptions or None, got "
                        f"{type(value).__name__}")


def _shard_vocab_size(rows: int, tp: int, vocab_size: Optional[int],
                      weight_name: str = "weight") -> int:
    """The full vocabulary of a ``[rows, H]`` lm_head shard: ``vocab_size``, or ``rows * tp``
    when it is ``None``; ValueError unless ``rows == ceil(vocab_size / tp)``."""
    vocab = rows * tp if vocab_size is None else vocab_size
    if rows != math.ceil(vocab / tp):
        raise ValueError(f"{weight_name} must have ceil(vocab_size / tp) = "
                         f"{math.ceil(vocab / tp)} rows for vocab_size={vocab}, tp={tp}; "
                         f"got {rows}")
    return vocab


def vocab_shard_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple:
    """``(start, stop, rows_per_rank)`` of this rank's real vocab rows: the vocab is padded to a
    multiple of ``tp_size`` and split evenly; ``stop - start`` may be < rows (padding) or 0."""
    rows = math.ceil(vocab_size / tp_size)
    start = min(tp_rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


def _check_across_ranks(group, n_tokens: int, hidden: int, rows: int, vocab_size: int,
                        ignore_index: int, bad_label: Optional[int], device,
                        weight_name: str) -> None:
    """One small all-gather so that mismatched shapes or a bad label on any rank raise on every
    rank (instead of one rank raising while the others wait in a collective forever)."""
    flag = _NO_BAD_LABEL if bad_label is None else bad_label
    mine = torch.tensor([n_tokens, hidden, rows, vocab_size, flag], dtype=torch.long,
                        device=device)
    everyone = all_gather_dim0(mine, group).view(-1, mine.numel())
    names = ("token count", "hidden size", f"{weight_name} rows", "vocab_size")
    for i, name in enumerate(names):
        values = everyone[:, i].tolist()
        if len(set(values)) > 1:
            raise ValueError(f"{name} differs across tensor-parallel ranks: {values}")
    flagged = everyone[:, 4]
    if bool((flagged != _NO_BAD_LABEL).any()):
        raise label_range_error(int(flagged[flagged != _NO_BAD_LABEL][0]), vocab_size,
                                ignore_index)


_NO_BAD_LABEL = -(2 ** 62)  # "this rank's labels are fine" in the all-gathered check


def sharded_linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: Optional[torch.Tensor],
    loss_weights: Optional[torch.Tensor],
    options: CrossEntropyOptions,
    parallel: VocabParallelOptions,
    *,
    weight_name: str = "weight",
) -> CrossEntropyOutput:
    """The vocab-parallel path of :func:`megaloss.linear_cross_entropy_with_stats` (which
    validates the options and dispatches here when given ``vocab_parallel_options``); the
    arguments are that function's, ``weight`` and ``bias`` being this rank's shards
    (``[Vp, H]`` and ``[Vp]``, ``Vp = ceil(vocab_size / tp)``; padded rows get a zero gradient).

    Raises:
        ValueError: as :func:`megaloss.linear_cross_entropy`; also when the token count, hidden
            size, shard rows or ``vocab_size`` differ across TP ranks, or when ``weight`` does
            not have ``ceil(vocab_size / tp)`` rows. Raised on every TP rank alike.
    """
    opts = options
    ignore_index, reduction = opts.ignore_index, opts.reduction
    check_ce_tensors(hidden_states, weight, labels, bias, loss_weights, weight_name=weight_name)
    group = resolve_group(parallel.tp_group)
    tp, rank = group_size(group), group_rank(group)
    rows = weight.shape[0]
    vocab_size = _shard_vocab_size(rows, tp, parallel.vocab_size, weight_name)
    flat_labels = labels.reshape(-1).long()
    hidden_size = hidden_states.shape[-1]
    _check_across_ranks(group, flat_labels.numel(), hidden_size, rows, vocab_size, ignore_index,
                        first_bad_label(flat_labels, vocab_size, ignore_index),
                        hidden_states.device, weight_name)

    hidden = hidden_states.reshape(-1, hidden_size)
    weights = None if loss_weights is None else loss_weights.reshape(-1)
    gathered = parallel.sequence_parallel and tp > 1
    if gathered:
        hidden = gather_from_region(hidden, group)
        flat_labels = all_gather_dim0(flat_labels, group)
        weights = None if weights is None else all_gather_dim0(weights.detach(), group)
    else:
        hidden = copy_to_region(hidden, group)

    start, stop, _ = vocab_shard_range(vocab_size, tp, rank)
    n_real = stop - start
    loss, z = chunked_linear_cross_entropy(
        hidden, weight[:n_real], None if bias is None else bias[:n_real], flat_labels,
        weights, opts, vocab_size=vocab_size, vocab_start=start,
        reduce_max=lambda t: all_reduce_max_(t, group),
        reduce_sum=lambda t: all_reduce_sum_(t, group))
    if reduction == "none" and not gathered:
        loss, z = loss.view(labels.shape), z.view(labels.shape)
    return CrossEntropyOutput(loss, z, (flat_labels != ignore_index).sum())


# deprecated entry points (one release) ---------------------------------------------------------
def vocab_parallel_linear_cross_entropy_with_stats(
    hidden_states: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: GroupLike = None,
    vocab_size: Optional[int] = None,
    sequence_parallel: bool = False,
    bias: Optional[torch.Tensor] = None,
    loss_weights: Optional[torch.Tensor] = None,
    options: Optional[CrossEntropyOptions] = None,
) -> CrossEntropyOutput:
    """Deprecated: :func:`megaloss.linear_cross_entropy_with_stats` with
    ``vocab_parallel_options=VocabParallelOptions(tp_group, vocab_size, sequence_parallel)``."""
    warn_renamed("vocab_parallel_linear_cross_entropy_with_stats",
                 "linear_cross_entropy_with_stats(..., vocab_parallel_options="
                 "VocabParallelOptions(...))")
    opts = resolve_options(CrossEntropyOptions, options, {})
    return sharded_linear_cross_entropy(
        hidden_states, weight_shard, labels, bias, loss_weights, opts,
        VocabParallelOptions(tp_group, vocab_size, sequence_parallel), weight_name="weight_shard")


def vocab_parallel_linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: GroupLike = None,
    vocab_size: Optional[int] = None,
    sequence_parallel: bool = False,
    bias: Optional[torch.Tensor] = None,
    loss_weights: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcapping: Optional[float] = None,
    chunk_size: int = 1024,
    accum_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
) -> torch.Tensor:
    """Deprecated: :func:`megaloss.linear_cross_entropy` with
    ``vocab_parallel_options=VocabParallelOptions(tp_group, vocab_size, sequence_parallel)``."""
    warn_renamed("vocab_parallel_linear_cross_entropy",
                 "linear_cross_entropy(..., vocab_parallel_options=VocabParallelOptions(...))")
    opts = CrossEntropyOptions(ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing, z_loss=z_loss,
                               logit_softcapping=logit_softcapping, chunk_size=chunk_size,
                               accum_dtype=accum_dtype, impl=impl)
    return sharded_linear_cross_entropy(
        hidden_states, weight_shard, labels, bias, loss_weights, opts,
        VocabParallelOptions(tp_group, vocab_size, sequence_parallel),
        weight_name="weight_shard").loss


class VocabParallelLMHead(nn.Module):
    """The lm_head shard of this TP rank plus its vocab-parallel chunked cross-entropy.

    Owns ``weight [Vp, H]`` (and ``bias [Vp]``), ``Vp = ceil(vocab_size / tp)``, tagged with
    :func:`megaloss.parallel.mark_tensor_parallel` so that DeepSpeed and Megatron count it once
    per TP group in gradient norms. ``forward(hidden_states [..., H], labels [...], *,
    loss_weights=None)`` returns the loss; :meth:`forward_with_stats` a
    :class:`megaloss.CrossEntropyOutput`.

    Initialisation follows Megatron-core's CPU path (``_initialize_affine_weight_cpu``): the full
    ``[V, H]`` weight is drawn from ``N(0, init_std^2)`` with a generator seeded by ``seed`` and
    each rank keeps its rows, so any TP size starts from the same lm_head. Use
    :meth:`load_full_weight` to copy a trained head.

    Args:
        hidden_size: ``H`` (int >= 1).
        vocab_size: the real ``V`` (int >= 1); padded to a multiple of the TP size.
        tp_group: tensor-parallel group; ``None`` is torch's default group.
        bias: whether the head has a bias.
        sequence_parallel: Megatron-core's sequence parallelism inside the TP group (tokens
            sharded over TP ranks; see :class:`VocabParallelOptions`).
        init_std: standard deviation of the initial weight.
        seed: seed of the initial weight (the same on every TP rank).
        dtype / device: of the parameters.
        options: the CE options (:class:`~megaloss.ops.options.CrossEntropyOptions`); or,
            instead, its fields as keyword arguments (``z_loss=1e-4, chunk_size=2048, ...``).

    Raises:
        ValueError: ``hidden_size`` or ``vocab_size`` not a positive int; a bad option.
        TypeError: ``tp_group`` not a group; ``options`` given together with its fields.
    """

    def __init__(self, hidden_size: int, vocab_size: int, *, tp_group: GroupLike = None,
                 bias: bool = False, sequence_parallel: bool = False, init_std: float = 0.02,
                 seed: int = 0, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None,
                 options: Optional[CrossEntropyOptions] = None, **option_fields):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if options is not None and option_fields:
            raise TypeError("pass either options or its fields as keyword arguments, not both")
        self.options = options if options is not None else CrossEntropyOptions(**option_fields)
        self.tp_group = resolve_group(tp_group)
        self.tp_size, self.tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.sequence_parallel = sequence_parallel
        self.parallel = VocabParallelOptions(self.tp_group, vocab_size, sequence_parallel)
        start, stop, rows = vocab_shard_range(vocab_size, self.tp_size, self.tp_rank)
        self.vocab_start, self.vocab_stop = start, stop
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device))
        self.bias = (nn.Parameter(torch.zeros(rows, dtype=dtype, device=device)) if bias else None)
        for p in self.parameters():
            mark_tensor_parallel(p, partition_dim=0)
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
                           loss_weights: Optional[torch.Tensor] = None) -> CrossEntropyOutput:
        """Loss, z-loss part and valid-token count (:class:`megaloss.CrossEntropyOutput`)."""
        # The vocab-parallel path of megaloss.linear_cross_entropy_with_stats (called directly:
        # this module sits below the dispatching entry point in the import graph).
        return sharded_linear_cross_entropy(hidden_states, self.weight, labels, self.bias,
                                            loss_weights, self.options, self.parallel)

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
                loss_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.forward_with_stats(hidden_states, labels, loss_weights=loss_weights).loss

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, "
                f"tp={self.tp_size}, rows=[{self.vocab_start}, {self.vocab_stop}), "
                + ", ".join(f"{k}={v}" for k, v in self.options.as_dict().items()))
