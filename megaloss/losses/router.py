"""Router losses of mixture-of-experts models, layer by layer, over a chosen pool of tokens.

Three terms on each MoE layer's router logits ``x [N, E]`` (``N`` tokens, ``E`` experts,
router probabilities ``p = softmax(x)``, ``m_t`` 1 for a counted token, 0 for padding):

- the load-balancing loss (Switch Transformer, arXiv:2101.03961 eqs. 4-6; top-k routing as
  GShard, arXiv:2006.16668): ``E * sum_e f_e * P_e`` with ``f_e = c_e / n`` (``c_e``: top-k
  selections of expert ``e`` among the ``n`` counted tokens; ``sum_e f_e = top_k``, Hugging
  Face's normalisation, ``transformers/models/mixtral/modeling_mixtral.py:
  load_balancing_loss_func``) and ``P_e = sum_t m_t p_te / n``;
- DeepSeek's sequence-wise balance loss (arXiv:2405.04434; arXiv:2412.19437 eqs. 17-20): the
  same product per sequence ``s`` of ``T_s`` tokens, ``E / (top_k T_s) c_se * s_se / T_s``,
  averaged over sequences;
- the router z-loss (ST-MoE, arXiv:2202.08906 eq. 5): ``logsumexp(x_t) ** 2`` averaged over
  counted tokens.

**Pools.** ``f`` is a count, without gradient; ``P`` is a sum over tokens, linear. So a pool of
tokens spread over ranks and micro-batches (:class:`RouterLossOptions`' ``scope``) has one loss
``E * sum_e f_e^pool * P_e^pool``, and each rank's share of it is ``E * sum_e f_e^pool *
(sum over its own tokens of p_te) / n^pool``: the shares add up to the pool's loss and their
gradients to its gradient, exactly, once the pool's counts are known. :func:`router_loss`
computes one share: the counts are this rank's, all-reduced over ``group`` (the pool's ranks:
one all-reduce of ``[layers x experts + 2]`` float64 numbers), or given (``statistics``: a
``"step"`` scope's pre-pass). The calibrated step (:mod:`megaloss.integrations.step.router`)
picks the group and the pool's weight (:func:`scope_pool`).

**Memory.** One layer at a time, ``O(N x E)``: no ``[tokens x layers, experts]`` one-hot (the
counts are ``index_add`` of the top-k indices) and nothing saved for the backward but the
logits the model already holds (the probabilities are recomputed there).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..parallel.comm import all_reduce_sum_
from ..parallel.groups import SINGLE_RANK, GroupLike
from .router_options import RouterLossOptions

__all__ = ["router_loss", "router_statistics", "RouterStatistics", "RouterLossOutput",
           "RouterLossOptions", "RouterPool"]

RouterLogits = Union[torch.Tensor, Sequence[torch.Tensor]]


class RouterStatistics(NamedTuple):
    """The counts of a pool of tokens (float64, no gradient).

    Attributes:
        counts: ``[L, E]``: top-k selections of each expert per layer among counted tokens.
        num_tokens: ``[]``: counted tokens (per layer).
        num_sequences: ``[]``: sequences with a counted token.
    """

    counts: torch.Tensor
    num_tokens: torch.Tensor
    num_sequences: torch.Tensor

    def flat(self) -> torch.Tensor:
        """``[L * E + 2]``: what one all-reduce sums."""
        return torch.cat([self.counts.reshape(-1), self.num_tokens.reshape(1),
                          self.num_sequences.reshape(1)])

    @classmethod
    def unflat(cls, flat: torch.Tensor, shape: Tuple[int, int]) -> "RouterStatistics":
        n = shape[0] * shape[1]
        return cls(flat[:n].reshape(shape), flat[n], flat[n + 1])

    def __add__(self, other: "RouterStatistics") -> "RouterStatistics":  # type: ignore[override]
        return RouterStatistics(self.counts + other.counts, self.num_tokens + other.num_tokens,
                                self.num_sequences + other.num_sequences)


class RouterLossOutput(NamedTuple):
    """What :func:`router_loss` returns.

    Attributes:
        loss: ``[]``, differentiable: ``aux_loss * options.aux_loss + seq_aux_loss *
            options.seq_aux_loss + z_loss * options.z_loss``, this rank's share.
        aux_loss / seq_aux_loss / z_loss: ``[]``, detached: each term's share (no coefficient;
            a term whose coefficient is 0 is not computed and reads 0).
        statistics: the pool's :class:`RouterStatistics` the shares used.
        local: this rank's own :class:`RouterStatistics` (its tokens' counts).
    """

    loss: torch.Tensor
    aux_loss: torch.Tensor
    seq_aux_loss: torch.Tensor
    z_loss: torch.Tensor
    statistics: RouterStatistics
    local: RouterStatistics


def _layers(router_logits: RouterLogits) -> Tuple[torch.Tensor, ...]:
    if isinstance(router_logits, torch.Tensor):
        if router_logits.dim() != 3:
            raise ValueError(f"router_logits must be [layers, tokens, experts] or a sequence of "
                             f"[tokens, experts] tensors, got shape "
                             f"{tuple(router_logits.shape)}")
        layers = tuple(router_logits.unbind(0))
    elif isinstance(router_logits, (list, tuple)) and router_logits:
        layers = tuple(router_logits)
    else:
        raise TypeError(f"router_logits must be a [layers, tokens, experts] tensor or a non-empty "
                        f"sequence of [tokens, experts] tensors, got "
                        f"{type(router_logits).__name__}")
    first = layers[0]
    for i, x in enumerate(layers):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"router_logits[{i}] must be a floating tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() != 2 or x.shape != first.shape:
            raise ValueError(f"router_logits[{i}] must be [tokens, experts] like layer 0 "
                             f"{tuple(first.shape)}, got {tuple(x.shape)}")
    return layers


def _token_mask(mask: Optional[torch.Tensor], n: int, device: torch.device) -> torch.Tensor:
    if mask is None:
        return torch.ones(n, dtype=torch.float64, device=device)
    if not isinstance(mask, torch.Tensor) or mask.numel() != n:
        raise ValueError(f"mask must be a tensor of {n} elements (one per routed token, e.g. the "
                         f"attention mask [batch, seq]), got "
                         f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else mask!r}")
    return mask.reshape(-1).to(device=device, dtype=torch.float64)


def _sequence_ids(sequence_ids: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
    if sequence_ids is None:
        return None
    if (not isinstance(sequence_ids, torch.Tensor) or sequence_ids.numel() != n
            or sequence_ids.is_floating_point()):
        raise ValueError(f"sequence_ids must be an integer tensor of {n} elements (the sequence "
                         f"index of each routed token), got {sequence_ids!r}")
    ids = sequence_ids.reshape(-1).long()
    if n and int(ids.min()) < 0:
        raise ValueError("sequence_ids must be >= 0")
    return ids


def _check_top_k(top_k: int, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, {num_experts}] (the experts per token), "
                         f"got {top_k!r}")


@torch.no_grad()
def router_statistics(router_logits: RouterLogits, top_k: int, *,
                      mask: Optional[torch.Tensor] = None,
                      sequence_ids: Optional[torch.Tensor] = None) -> RouterStatistics:
    """This rank's counts of the routed tokens (no collective, no gradient).

    Args:
        router_logits: ``[L, N, E]`` or ``L`` tensors ``[N, E]`` (Hugging Face's
            ``router_logits``, tokens flattened as ``[batch * seq]``), any floating dtype.
        top_k: experts per token (the model's ``num_experts_per_tok``).
        mask: ``N`` elements (any shape), nonzero where a token is counted (the attention
            mask: padding is not); default all.
        sequence_ids: ``N`` integers >= 0, the sequence of each token (for ``num_sequences``);
            default one sequence.

    Returns:
        :class:`RouterStatistics` (float64).

    Raises:
        TypeError / ValueError: naming the argument (shapes, ``top_k``).
    """
    layers = _layers(router_logits)
    n, num_experts = layers[0].shape
    _check_top_k(top_k, num_experts)
    device = layers[0].device
    selected = [x.topk(top_k, dim=-1).indices for x in layers]
    return _statistics(selected, num_experts, _token_mask(mask, n, device),
                       _sequence_ids(sequence_ids, n))


def _statistics(selected: Sequence[torch.Tensor], num_experts: int, m: torch.Tensor,
                ids: Optional[torch.Tensor]) -> RouterStatistics:
    """:func:`router_statistics` of the layers' top-k indices ``[N, k]``, token mask ``m``
    (float64) and sequence indices (or ``None``)."""
    n, top_k = selected[0].shape
    device = m.device
    counts = torch.zeros(len(selected), num_experts, dtype=torch.float64, device=device)
    weights = m.repeat_interleave(top_k)
    for layer, indices in enumerate(selected):
        counts[layer].index_add_(0, indices.reshape(-1), weights)
    if ids is None:
        num_sequences = (m.sum() > 0).to(torch.float64)
    else:
        per_sequence = torch.zeros(int(ids.max()) + 1 if n else 0, dtype=torch.float64,
                                   device=device).index_add_(0, ids, m)
        num_sequences = (per_sequence > 0).sum().to(torch.float64)
    return RouterStatistics(counts, m.sum(), num_sequences)


class _LayerShares(torch.autograd.Function):
    """``[3]``: one layer's ``sum_t m_t sum_e a_e p_te``, ``sum_t m_t sum_e b_{s(t)e} p_te``,
    ``sum_t m_t z lse_t ** 2``; the backward recomputes ``p`` from the logits (nothing new
    saved): ``d/dx_t = m_t (p_t * (W_t - p_t . W_t) + 2 z lse_t p_t)``, ``W = g0 a + g1 b``.
    ``W`` is centred per token in float64 before the cast (softmax's Jacobian ignores a
    constant, and a nearly uniform ``W``, a balanced router's, would otherwise cancel in
    ``W_t - p_t . W_t``)."""

    @staticmethod
    def forward(ctx, x, m, a, b, seq, z):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        xs = x.to(acc)
        p = torch.softmax(xs, dim=-1)
        mask = m.to(acc)
        out = torch.zeros(3, dtype=acc, device=x.device)
        if a is not None:
            out[0] = (mask @ p) @ a.to(acc)
        if b is not None:
            out[1] = (mask[:, None] * p * b.to(acc)[seq]).sum()
        if z:
            out[2] = (mask * torch.logsumexp(xs, dim=-1).square()).sum() * z
        ctx.save_for_backward(x, m, a, b, seq)
        ctx.z = z
        return out

    @staticmethod
    def backward(ctx, grad):
        x, m, a, b, seq = ctx.saved_tensors
        acc = grad.dtype
        xs = x.to(acc)
        p = torch.softmax(xs, dim=-1)
        g = grad.to(torch.float64)
        gx = torch.zeros_like(p)
        if a is not None:
            wa = (g[0] * (a - a.mean())).to(acc)  # [E]
            gx = p * (wa[None, :] - (p @ wa)[:, None])
        if b is not None:
            wb = (g[1] * (b - b.mean(-1, keepdim=True))).to(acc)[seq]  # [N, E]
            gx = gx + p * (wb - (p * wb).sum(-1, keepdim=True))
        if ctx.z:
            lse = torch.logsumexp(xs, dim=-1)
            gx = gx + (2 * ctx.z * grad[2]) * lse[:, None] * p
        gx = gx * m.to(acc)[:, None]
        return gx.to(x.dtype), None, None, None, None, None


def router_loss(router_logits: RouterLogits, top_k: int, *, options: RouterLossOptions,
                mask: Optional[torch.Tensor] = None,
                sequence_ids: Optional[torch.Tensor] = None,
                group: GroupLike = SINGLE_RANK,
                statistics: Optional[RouterStatistics] = None,
                weight: float = 1.0) -> RouterLossOutput:
    """This rank's share of the router losses of a pool of tokens (module docstring).

    Every term is averaged over the layers (``options.layers``: per layer, or transformers'
    concatenated form) and multiplied by ``weight`` (the pool's weight in the step, e.g.
    ``1 / micro-batches``). With one rank, ``group`` trivial and ``weight`` 1, ``aux_loss`` with
    ``layers="concatenated"`` is transformers' ``load_balancing_loss_func(router_logits,
    num_experts, top_k, attention_mask)``.

    Args:
        router_logits: ``[L, N, E]`` or ``L`` tensors ``[N, E]`` (one per MoE layer; Hugging
            Face's ``router_logits``), fp32 / bf16 / fp16 / fp64 (probabilities in fp32, fp64
            for fp64 logits).
        top_k: experts per token.
        options: :class:`RouterLossOptions` (coefficients and layer form; its ``scope`` is the
            caller's choice of ``group`` / ``statistics``).
        mask: ``N`` elements, nonzero where a token counts (padding does not); default all.
        sequence_ids: ``N`` integers, each token's sequence within this rank's batch (the
            sequence-wise loss; default: one sequence). Sequences must not be split across
            ranks (not under sequence parallelism).
        group: the other ranks of the pool: this rank's counts are all-reduced over it (every
            rank of it must call). Ignored with ``statistics``.
        statistics: the pool's counts, already summed (a pre-pass); default: this rank's,
            all-reduced over ``group``.
        weight: the pool's weight, ``>= 0``.

    Returns:
        :class:`RouterLossOutput` (loss in fp32, fp64 for fp64 logits).

    Raises:
        TypeError / ValueError: naming the argument (shapes, ``top_k``, ``options``,
            ``statistics`` of another shape, ``weight``).
    """
    if not isinstance(options, RouterLossOptions):
        raise TypeError(f"options must be a megaloss RouterLossOptions, got "
                        f"{type(options).__name__}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
        raise ValueError(f"weight must be a float >= 0, got {weight!r}")
    layers = _layers(router_logits)
    n, num_experts = layers[0].shape
    num_layers = len(layers)
    _check_top_k(top_k, num_experts)
    device = layers[0].device
    m = _token_mask(mask, n, device)
    ids = _sequence_ids(sequence_ids, n)
    # the top-k selections once: this rank's counts and, per sequence, the sequence-wise loss's
    selected = [x.detach().topk(top_k, dim=-1).indices for x in layers]
    local = _statistics(selected, num_experts, m, ids)
    if statistics is None:
        pool = RouterStatistics.unflat(all_reduce_sum_(local.flat(), group), local.counts.shape)
    else:
        if (not isinstance(statistics, RouterStatistics)
                or tuple(statistics.counts.shape) != (num_layers, num_experts)):
            raise ValueError(f"statistics must be RouterStatistics with counts of shape "
                             f"{(num_layers, num_experts)}, got {statistics!r}")
        pool = statistics
    tokens = pool.num_tokens.clamp_min(1.0)
    scale = float(weight) / num_layers
    if options.layers == "per_layer":
        a_layers = [num_experts * pool.counts[i] / tokens ** 2 * scale if options.aux_loss else None
                    for i in range(num_layers)]
    else:
        shared = num_experts * pool.counts.sum(0) / (num_layers * tokens) ** 2 * float(weight)
        a_layers = [shared if options.aux_loss else None] * num_layers
    seq = b = None
    seq_counts = seq_tokens = None
    if options.seq_aux_loss:
        seq = ids if ids is not None else torch.zeros(n, dtype=torch.long, device=device)
        size = int(seq.max()) + 1 if n else 1
        seq_tokens = torch.zeros(size, dtype=torch.float64, device=device).index_add_(0, seq, m)
        seq_counts = torch.zeros(num_layers, size, num_experts, dtype=torch.float64,
                                 device=device)
        factor = (num_experts / top_k) * scale / pool.num_sequences.clamp_min(1.0)
    z = scale / float(tokens) if options.z_loss else 0.0
    shares = []
    for i, x in enumerate(layers):
        if seq_counts is not None:
            flat = seq[:, None] * num_experts + selected[i]
            seq_counts[i].view(-1).index_add_(0, flat.reshape(-1), m.repeat_interleave(top_k))
            b = seq_counts[i] / seq_tokens.clamp_min(1.0)[:, None] ** 2 * factor
        shares.append(_LayerShares.apply(x, m, a_layers[i], b, seq, z))
    terms = torch.stack(shares).sum(0)
    coefficients = torch.tensor([options.aux_loss, options.seq_aux_loss, options.z_loss],
                                dtype=terms.dtype, device=device)
    detached = terms.detach()
    return RouterLossOutput((terms * coefficients).sum(), detached[0], detached[1], detached[2],
                            pool, local)


@dataclass(frozen=True)
class RouterPool:
    """How a module's forward computes its router losses inside a calibrated step: the pool
    its tokens belong to (what the step hands the forward as ``router_loss=``; the module knows
    its ``top_k`` and router logits).

    Attributes:
        options: :class:`RouterLossOptions`.
        group: the pool's other ranks (this rank's counts all-reduced over it).
        weight: the pool's weight in the step.
        statistics: the pool's counts, when known before the forward (the ``"step"`` scope).
        statistics_only: a pre-pass: the forward returns this rank's
            :class:`RouterStatistics` and computes no loss.
    """

    options: RouterLossOptions
    group: GroupLike = SINGLE_RANK
    weight: float = 1.0
    statistics: Optional[RouterStatistics] = None
    statistics_only: bool = False

    def __call__(self, router_logits: RouterLogits, top_k: int, *,
                 mask: Optional[torch.Tensor] = None,
                 sequence_ids: Optional[torch.Tensor] = None
                 ) -> Union[RouterLossOutput, RouterStatistics]:
        """:func:`router_loss` of this pool (:func:`router_statistics` with
        ``statistics_only``)."""
        if self.statistics_only:
            return router_statistics(router_logits, top_k, mask=mask, sequence_ids=sequence_ids)
        return router_loss(router_logits, top_k, options=self.options, mask=mask,
                           sequence_ids=sequence_ids, group=self.group,
                           statistics=self.statistics, weight=self.weight)
