r"""The vocab-parallel layout every vocabulary-level loss shares (cross-entropy,
log-probabilities, distillation): the lm_head split over the vocabulary across tensor-parallel
(TP) ranks, as Megatron-core's ``ColumnParallelLinear`` output layer with
``vocab_parallel_cross_entropy``, but chunked and without its known defects.
:class:`VocabParallelOptions` says how the head is split; :func:`vocab_layout` is the one set-up
of a call (its checks agreed on by every TP rank, the rank's vocabulary slice, the combiners,
the tokens replicated or gathered); :class:`megaloss.VocabParallelLMHead` is the module.

Rank ``r`` of ``tp`` holds rows ``[r * Vp, (r + 1) * Vp)`` of the lm_head, the vocabulary padded
to ``tp * Vp >= V``; or, with ``VocabParallelOptions(shard_range=(start, stop))``, the rows of a
split made elsewhere (DeepSpeed AutoTP's ``VocabParallelLinear``: 19 + 18 rows of 37).
Per chunk of tokens and per token, the log-sum-exp over the full vocabulary
is combined from the shards with two fp32 all-reduces of ``[tokens]``-sized tensors: a MAX of the
local maxima, then one SUM of the stacked per-token sums (for the cross-entropy ``[sum-exp,
target logit, (sum of logits)]``: 8-12 bytes per token, independent of V). No logits are
gathered.

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
from typing import Callable, Optional, Tuple

import torch

from ..ops.chunk_driver import auto_chunk_size
from ..ops.chunk_kernel import VocabSlice
from ..ops.options import OptionsBase
from ..ops.validation import label_range_error
from ..parallel.comm import (
    all_gather_dim0,
    all_reduce_max_,
    all_reduce_sum_,
    raise_first_error,
)
from ..parallel.groups import GroupLike, group_rank, group_size, resolve_group
from ..parallel.mappings import copy_to_region, gather_from_region

__all__ = ["VocabParallelOptions", "vocab_shard_range", "VocabLayout", "vocab_layout",
           "check_vocab_parallel_options"]


@dataclass(frozen=True)
class VocabParallelOptions(OptionsBase):
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
        shard_range: this rank's rows ``(start, stop)`` of the vocabulary when the head was split
            by someone else's rule (DeepSpeed AutoTP's ``VocabParallelLinear``, whose
            ``vocab_start_index`` / ``vocab_end_index`` they are); the shard then has exactly
            ``stop - start`` rows, ``vocab_size`` must be given, and the ranges of the TP ranks
            must tile ``[0, vocab_size)`` in rank order (checked on every call, by every rank).
            ``None``: megaloss's split, ``ceil(V / tp)`` rows per rank (:func:`vocab_shard_range`).

    Raises:
        ValueError: ``vocab_size`` not ``None`` or a positive int; ``shard_range`` not two ints
            ``0 <= start <= stop <= vocab_size``, or given without ``vocab_size``.
        TypeError: ``sequence_parallel`` not a bool.
    """

    tp_group: GroupLike = None
    vocab_size: Optional[int] = None
    sequence_parallel: bool = False
    shard_range: Optional[Tuple[int, int]] = None

    def __post_init__(self) -> None:
        v = self.vocab_size
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"vocab_size must be None or a positive int, got {v!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool, got {self.sequence_parallel!r}")
        r = self.shard_range
        if r is not None:
            ok = (isinstance(r, (tuple, list)) and len(r) == 2
                  and all(isinstance(i, int) and not isinstance(i, bool) for i in r))
            if not ok or v is None or not 0 <= r[0] <= r[1] <= v:
                raise ValueError(f"shard_range must be (start, stop) with 0 <= start <= stop <= "
                                 f"vocab_size (given), got {r!r} with vocab_size={v!r}")
            object.__setattr__(self, "shard_range", (int(r[0]), int(r[1])))

    @classmethod
    def from_dtensor(cls, weight, *, mesh_dim=None, sequence_parallel: bool = False
                     ) -> Tuple[torch.Tensor, "VocabParallelOptions"]:
        """The local shard and the options of an lm_head weight that is a PyTorch tensor-parallel
        ``DTensor`` split over the vocabulary (``parallelize_module(lm_head, tp_mesh,
        ColwiseParallel())``: ``Shard(0)`` over the TP mesh dimension, torch.chunk's uneven split
        without padding), via :func:`megaloss.parallel.dtensor.dtensor_vocab_shard`::

            w, opts = VocabParallelOptions.from_dtensor(lm_head.weight)
            loss = linear_cross_entropy(hidden, w, labels, vocab_parallel_options=opts)

        ``w`` is ``weight.to_local()``: its gradient reaches ``lm_head.weight.grad`` (a
        ``Shard(0)`` DTensor). ``hidden`` is the plain tensor replicated over the TP group (what
        ``ColwiseParallel`` feeds the linear); with ``sequence_parallel=True`` it is this rank's
        sequence shard (``SequenceParallel``'s ``Shard(1)`` output ``.to_local()``, labels
        sharded alike), gathered by the loss. A ``Shard(0)`` bias goes in as ``bias.to_local()``.

        Args:
            weight: the DTensor ``[V, H]``.
            mesh_dim: the TP mesh dimension (index or name); ``None``: the one ``Shard(0)`` dim.
            sequence_parallel: as the field.

        Returns:
            ``(local shard [stop - start, H], VocabParallelOptions(tp_group, V,
            sequence_parallel, shard_range=(start, stop)))``.

        Raises:
            TypeError / ValueError: as :func:`~megaloss.parallel.dtensor.dtensor_vocab_shard`
                (not a DTensor; ``Replicate()``, ``Shard(1)``, ``Partial()`` or a data-parallel
                shard instead of ``Shard(0)`` over one dimension).
        """
        from ..parallel.dtensor import dtensor_vocab_shard

        shard = dtensor_vocab_shard(weight, mesh_dim=mesh_dim)
        return shard.local, cls(shard.group, shard.vocab_size, sequence_parallel,
                                shard_range=shard.shard_range)


def check_vocab_parallel_options(value) -> None:
    """The ``vocab_parallel_options=`` argument of an entry point: ``None`` or that class.

    Raises:
        TypeError: anything else.
    """
    if value is not None and not isinstance(value, VocabParallelOptions):
        raise TypeError(f"vocab_parallel_options must be a VocabParallelOptions or None, got "
                        f"{type(value).__name__}")


def vocab_shard_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple:
    """``(start, stop, rows_per_rank)`` of this rank's real vocab rows: the vocab is padded to a
    multiple of ``tp_size`` and split evenly; ``stop - start`` may be < rows (padding) or 0."""
    rows = math.ceil(vocab_size / tp_size)
    start = min(tp_rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


def _shard_vocab_size(rows: int, tp: int, vocab_size: Optional[int], weight_name: str) -> int:
    """The full vocabulary of a ``[rows, H]`` lm_head shard: ``vocab_size``, or ``rows * tp``
    when it is ``None``; ValueError unless ``rows == ceil(vocab_size / tp)``."""
    vocab = rows * tp if vocab_size is None else vocab_size
    if rows != math.ceil(vocab / tp):
        raise ValueError(f"{weight_name} must have ceil(vocab_size / tp) = "
                         f"{math.ceil(vocab / tp)} rows for vocab_size={vocab}, tp={tp}; "
                         f"got {rows}")
    return vocab


@dataclass(frozen=True)
class VocabLayout:
    """Where one call's vocabulary lives: this rank's real rows ``[start, stop)`` of
    ``vocab_size``, the TP group (``None`` on one device) and whether the tokens are gathered
    over it (Megatron's sequence parallelism)."""

    vocab_size: int
    start: int = 0
    stop: Optional[int] = None
    group: GroupLike = None
    gathered: bool = False
    shard_rows: Optional[int] = None  # the largest rank's real rows: one figure on every rank

    def chunk_size(self, chunk_size: Optional[int], hidden: torch.Tensor) -> int:
        """The tokens per chunk of this call on every rank alike: ``chunk_size``, or
        :func:`~megaloss.ops.chunk_driver.auto_chunk_size` of the largest shard. Not of this
        rank's own rows, which differ by the padding or an uneven split: ranks with different
        chunk counts would mismatch the per-chunk all-reduces of the log-sum-exp."""
        if chunk_size is not None:
            return chunk_size
        rows = self.vocab_size if self.shard_rows is None else self.shard_rows
        return auto_chunk_size(hidden.shape[0], rows, hidden.shape[-1])

    @property
    def parallel(self) -> bool:
        return self.group is not None

    def vocab_slice(self) -> VocabSlice:
        """The ops-level :class:`~megaloss.ops.chunk_kernel.VocabSlice` (MAX / SUM all-reduces
        over the TP group as its combiners)."""
        if self.group is None:
            return VocabSlice(self.vocab_size)
        group = self.group
        return VocabSlice(self.vocab_size, self.start, lambda t: all_reduce_max_(t, group),
                          lambda t: all_reduce_sum_(t, group))

    def rows(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The real vocab rows of a shard (``weight [Vp, H]``, ``bias [Vp]``): padding sliced
        off before the matmul (so it gets a zero gradient)."""
        if t is None or self.group is None or t.shape[0] == self.stop - self.start:
            # no padding: the shard itself, not a view of it, whose backward (SliceBackward)
            # would copy the weight gradient into a new shard-sized buffer (+62.5 MiB per rank
            # at V 32000, H 1024, TP 2, fp32)
            return t
        return t[:self.stop - self.start]

    def hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, H]`` hidden states as this rank's loss sees them: gathered over the TP group
        (reduce-scatter of the gradient) under sequence parallelism, else replicated (SUM
        all-reduce of the gradient)."""
        if self.group is None:
            return hidden
        if self.gathered:
            return gather_from_region(hidden, self.group)
        return copy_to_region(hidden, self.group)

    def tokens(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A token-indexed input without gradient (labels, weights, a teacher), gathered over
        the TP group under sequence parallelism."""
        if t is None or not self.gathered:
            return t
        return all_gather_dim0(t.detach(), self.group)


_NO_BAD_LABEL = -(2 ** 62)  # "this rank's labels are fine" in the all-gathered check


def vocab_layout(parallel: Optional[VocabParallelOptions], weight, hidden_states, labels,
                 check: Callable[[int], Optional[int]], *, ignore_index: int,
                 what: str = "loss", weight_name: str = "weight") -> VocabLayout:
    """The one set-up of a vocabulary-level loss call, on one device or vocab-parallel.

    ``check(vocab_size)`` runs the call's local checks (shapes, dtypes, devices, options against the
    tensors), raising ``ValueError`` / ``TypeError``, and returns the first label outside ``[0,
    vocab_size)`` that is not ``ignore_index`` (or ``None``). On one device its error is raised as
    it is. Under ``parallel``, every TP rank runs its checks, then one small all-gather of
    ``[failed, tokens, hidden size, rows, vocab_size, bad label, shard_range]`` lets every rank
    raise the same error: that of the first failed rank (its message, naming the argument, sent to
    the others by :func:`megaloss.parallel.comm.raise_first_error`, with the failed ranks appended);
    likewise a token count, hidden size, shard rows or vocab size that differ across ranks, or a bad
    label on any rank (naming the ranks). No rank is left waiting in a collective for one that
    raised.

    Args:
        parallel: the call's :class:`VocabParallelOptions`, or ``None`` (one device).
        weight, hidden_states, labels: the call's tensors (any type: checked by ``check``).
        check: the local checks (see above).
        ignore_index: for the label-range error.
        what: the loss's name in the errors about values differing across ranks.
        weight_name: the weight's argument name in errors.

    Raises:
        ValueError / TypeError: see above.
    """
    rows = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() > 0 else 0
    if parallel is None:
        vocab_size = rows
        bad = check(vocab_size)
        if bad is not None:
            raise label_range_error(bad, vocab_size, ignore_index)
        return VocabLayout(vocab_size, 0, vocab_size)
    group = resolve_group(parallel.tp_group)
    tp, rank = group_size(group), group_rank(group)
    error: Optional[Exception] = None
    vocab_size, bad = 0, None
    explicit = parallel.shard_range
    try:
        if explicit is None:
            vocab_size = _shard_vocab_size(rows, tp, parallel.vocab_size, weight_name)
        else:
            vocab_size = parallel.vocab_size
            if rows != explicit[1] - explicit[0]:
                raise ValueError(f"{weight_name} must have stop - start = "
                                 f"{explicit[1] - explicit[0]} rows for shard_range={explicit}; "
                                 f"got {rows}")
        bad = check(vocab_size)
    except (ValueError, TypeError) as err:
        error = err
    is_tensor = isinstance(hidden_states, torch.Tensor)
    device = hidden_states.device if is_tensor else "cpu"
    n_tokens = labels.numel() if isinstance(labels, torch.Tensor) else -1
    hidden = hidden_states.shape[-1] if is_tensor and hidden_states.dim() > 0 else -1
    start, stop = explicit if explicit is not None else (-1, -1)
    mine = torch.tensor([error is not None, n_tokens, hidden, rows, vocab_size,
                         _NO_BAD_LABEL if bad is None else bad, start, stop], dtype=torch.long,
                        device=device)
    everyone = all_gather_dim0(mine, group).view(-1, mine.numel())
    failed = everyone[:, 0].nonzero().flatten().tolist()
    if failed:  # every rank raises the first failed rank's own error (its message travels)
        raise_first_error(error, failed, group, ranks="tensor-parallel")
    starts, stops = everyone[:, 6].tolist(), everyone[:, 7].tolist()
    given = [s >= 0 for s in starts]
    if any(given) and not all(given):
        raise ValueError(f"{what}: shard_range is given on tensor-parallel rank(s) "
                         f"{[r for r, g in enumerate(given) if g]} only; give it on every rank "
                         "or on none")
    names = ("token count", "hidden size", f"{weight_name} rows", "vocab_size")
    for i, name in enumerate(names, 1):
        if i == 3 and explicit is not None:  # rows follow the given ranges (checked below)
            continue
        values = everyone[:, i].tolist()
        if len(set(values)) > 1:
            raise ValueError(f"{what}: {name} differs across tensor-parallel ranks: {values} "
                             "(rank order)")
    flagged = everyone[:, 5]
    bad_ranks = (flagged != _NO_BAD_LABEL).nonzero().flatten().tolist()
    if bad_ranks:
        err = label_range_error(int(flagged[bad_ranks[0]]), vocab_size, ignore_index)
        raise err if tp == 1 else ValueError(f"{err} (on tensor-parallel rank(s) {bad_ranks})")
    if explicit is not None and (starts[0] != 0 or stops[-1] != vocab_size
                                 or starts[1:] != stops[:-1]):
        raise ValueError(f"{what}: the shard_range of the tensor-parallel ranks must tile "
                         f"[0, {vocab_size}) in rank order, got "
                         f"{list(zip(starts, stops))} (rank order)")
    if explicit is None:
        start, stop, shard_rows = vocab_shard_range(vocab_size, tp, rank)
    else:
        start, stop = explicit
        shard_rows = max(b - a for a, b in zip(starts, stops))
    return VocabLayout(vocab_size, start, stop, group, parallel.sequence_parallel and tp > 1,
                       shard_rows)
