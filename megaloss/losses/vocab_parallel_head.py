"""The lm_head shard of a tensor-parallel rank with its vocab-parallel chunked cross-entropy: the
module form of :func:`megaloss.linear_cross_entropy` ``(..., vocab_parallel_options=...)``
(layout: :mod:`megaloss.losses.vocab_parallel`)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .._deprecation import ReturnStatsAliases
from ..ops.cross_entropy_options import CrossEntropyOptions
from ..ops.options import module_options
from ..parallel.groups import GroupLike, group_rank, group_size, resolve_group
from ..parallel.param_tags import mark_tensor_parallel
from .cross_entropy import linear_cross_entropy
from .vocab_parallel import VocabParallelOptions, vocab_shard_range

__all__ = ["VocabParallelLMHead"]


class VocabParallelLMHead(ReturnStatsAliases, nn.Module):
    """The lm_head shard of this TP rank plus its vocab-parallel chunked cross-entropy.

    Owns ``weight [Vp, H]`` (and ``bias [Vp]``), ``Vp = ceil(vocab_size / tp)``, tagged with
    :func:`megaloss.parallel.mark_tensor_parallel` so that DeepSpeed and Megatron count it once
    per TP group in gradient norms. ``forward(hidden_states [..., H], labels [...], *,
    loss_weights=None, ce_weight=None, return_stats=False)`` returns what
    :func:`megaloss.linear_cross_entropy` does.

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
        options: the CE options (:class:`~megaloss.CrossEntropyOptions`); or,
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
        self.options = module_options(CrossEntropyOptions, options, option_fields)
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

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
                loss_weights: Optional[torch.Tensor] = None,
                ce_weight: Optional[torch.Tensor] = None, return_stats: bool = False):
        return linear_cross_entropy(hidden_states, self.weight, labels, bias=self.bias,
                                    loss_weights=loss_weights, ce_weight=ce_weight,
                                    options=self.options, return_stats=return_stats,
                                    vocab_parallel_options=self.parallel)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, "
                f"tp={self.tp_size}, rows=[{self.vocab_start}, {self.vocab_stop}), "
                + ", ".join(f"{k}={v}" for k, v in self.options.as_dict().items()))
