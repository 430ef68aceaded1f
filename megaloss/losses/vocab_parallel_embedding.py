r"""The input embedding split over the vocabulary across tensor-parallel (TP) ranks, with the
semantics of Megatron-core's ``VocabParallelEmbedding``
(``megatron/core/tensor_parallel/layers.py``), so that a tied lm_head can share its shard.

Rank ``r`` of ``tp`` holds rows ``[r * Vp, (r + 1) * Vp)`` of the vocabulary padded to
``tp * Vp >= V`` (:func:`megaloss.vocab_shard_range`, the rows of
:class:`megaloss.VocabParallelLMHead`). A token id outside the shard looks up zeros; one SUM
all-reduce over the TP group then gives every rank the full embedding (exactly one rank
contributes a non-zero row per token, so the sum is exact in any dtype). Backward is the identity
through that all-reduce (Megatron's ``reduce_from_tensor_model_parallel_region``): the layers
after the embedding are replicated over TP (or TP layers entered through
:func:`~megaloss.parallel.mappings.copy_to_region`), so every TP rank already holds the full
gradient of the embedding output, and each rank's shard gets the gradient of its own rows.

Tying. :meth:`VocabParallelEmbedding.tied_to` builds the embedding on the *same* ``Parameter``
as a :class:`~megaloss.VocabParallelLMHead`: autograd then sums the gradients of both uses into
that shard, which is the gradient of the tied ``[V, H]`` weight restricted to the shard's rows
(its padded rows get none). Under pipeline parallelism the embedding sits on the first stage and
the head on the last; tying across stages is the pipeline engine's job (DeepSpeed's
``TiedLayerSpec``), with this module as the first stage's layer.

Not here: Megatron's ``sequence_parallel`` output (a reduce-scatter over tokens instead of the
all-reduce); the output is always replicated over the TP group.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.groups import GroupLike, group_rank, group_size, resolve_group
from ..parallel.mappings import reduce_from_region
from ..parallel.param_tags import mark_tensor_parallel
from .vocab_parallel import vocab_shard_range
from .vocab_parallel_head import VocabParallelLMHead

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(nn.Module):
    """This TP rank's vocab shard of the input embedding; ``forward(input_ids)`` is
    ``nn.Embedding``'s on the full table.

    Args:
        num_embeddings: the real ``V`` (int >= 1); padded to a multiple of the TP size.
        embedding_dim: ``H`` (int >= 1).
        tp_group: tensor-parallel group; ``None`` is torch's default group.
        padding_idx: as ``nn.Embedding``'s: that row gets no gradient *from the lookup* (a tied
            head still trains it, as in the unsharded tied model).
        scale: a factor applied to the looked-up rows (Gemma 3's ``embed_scale``); ``None``: 1.
        weight: an existing ``[ceil(V / tp), H]`` Parameter to use as is (a tied head's shard);
            ``None``: a new one, drawn as :class:`~megaloss.VocabParallelLMHead` draws its own
            (the full ``[V, H]`` from ``N(0, init_std^2)`` seeded by ``seed``, rows kept), so any
            TP size starts from the same table.
        init_std / seed / dtype / device: of a new weight.

    Shapes: ``input_ids`` ``[...]`` integer, global vocab ids in ``[0, V)``; output
    ``[..., H]`` in the weight's dtype, the same on every TP rank.

    Raises:
        ValueError: ``num_embeddings`` / ``embedding_dim`` not a positive int; ``padding_idx``
            outside ``[-V, V)``; ``weight`` of another shape; in forward, an id outside
            ``[0, V)`` (raised on every TP rank alike: they hold the same ids).
        TypeError: ``weight`` not an ``nn.Parameter``; ``input_ids`` not integer.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: GroupLike = None,
                 padding_idx: Optional[int] = None, scale: Optional[float] = None,
                 weight: Optional[nn.Parameter] = None, init_std: float = 0.02, seed: int = 0,
                 dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        for name, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be in [-{num_embeddings}, {num_embeddings}), "
                                 f"got {padding_idx}")
            padding_idx %= num_embeddings
        self.tp_group = resolve_group(tp_group)
        self.tp_size, self.tp_rank = group_size(self.tp_group), group_rank(self.tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.scale = padding_idx, scale
        start, stop, rows = vocab_shard_range(num_embeddings, self.tp_size, self.tp_rank)
        self.vocab_start, self.vocab_stop = start, stop
        self._local_padding_idx = (padding_idx - start if padding_idx is not None
                                   and start <= padding_idx < stop else None)
        if weight is not None:
            if not isinstance(weight, nn.Parameter):
                raise TypeError(f"weight must be an nn.Parameter, got {type(weight).__name__}")
            if tuple(weight.shape) != (rows, embedding_dim):
                raise ValueError(f"weight must have shape (ceil(num_embeddings / tp), "
                                 f"embedding_dim) = {(rows, embedding_dim)}, got "
                                 f"{tuple(weight.shape)}")
            self.weight = weight
            return
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, dtype=dtype, device=device))
        mark_tensor_parallel(self.weight, partition_dim=0)
        with torch.no_grad():
            gen = torch.Generator(device="cpu").manual_seed(seed)
            self.load_full_weight(torch.randn(num_embeddings, embedding_dim, generator=gen)
                                  * init_std)

    @classmethod
    def tied_to(cls, head: VocabParallelLMHead, *, padding_idx: Optional[int] = None,
                scale: Optional[float] = None) -> "VocabParallelEmbedding":
        """The input embedding on ``head``'s own weight shard (same ``Parameter``, same TP group
        and vocabulary): the tied embedding of a vocab-parallel lm_head.

        Raises:
            TypeError: ``head`` is not a :class:`~megaloss.VocabParallelLMHead`.
        """
        if not isinstance(head, VocabParallelLMHead):
            raise TypeError(f"head must be a VocabParallelLMHead, got {type(head).__name__}")
        return cls(head.vocab_size, head.hidden_size, tp_group=head.tp_group,
                   padding_idx=padding_idx, scale=scale, weight=head.weight)

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows of a full ``[V, H]`` table; padded rows 0.

        Raises:
            ValueError: ``weight`` not of shape ``[V, H]``.
        """
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"weight must have shape {(self.num_embeddings, self.embedding_dim)}"
                             f", got {tuple(weight.shape)}")
        n = self.vocab_stop - self.vocab_start
        self.weight.zero_()
        self.weight[:n].copy_(weight[self.vocab_start:self.vocab_stop])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        if input_ids.numel() and bool(((input_ids < 0) | (input_ids >= self.num_embeddings))
                                      .any()):
            bad = input_ids[(input_ids < 0) | (input_ids >= self.num_embeddings)][0]
            raise ValueError(f"input_ids must be in [0, {self.num_embeddings}), got {int(bad)}")
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_stop)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, padding_idx=self._local_padding_idx)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        if self.scale is not None:
            out = out * self.scale
        return reduce_from_region(out, self.tp_group)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"tp={self.tp_size}, rows=[{self.vocab_start}, {self.vocab_stop})"
                + (f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""))
