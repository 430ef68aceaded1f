"""Knowledge distillation through both lm_heads without either model's logits: the student's
``hidden_states @ weight.T`` against the teacher's ``teacher_hidden_states @ teacher_weight.T``
(or the teacher's stored top-k log-probs), chunk by chunk, on one device or with both heads
split over the vocabulary across tensor-parallel ranks.

Entry points: :func:`linear_distillation_loss` (with ``return_stats=True`` also the divergence,
the hard-label CE and the top-1 agreement) and the module :class:`LinearDistillationLoss`.
Math: :mod:`megaloss.ops.distillation_chunk`; schedule:
:mod:`megaloss.ops.chunk_driver`; options:
:class:`~megaloss.DistillationOptions`.

Vocab-parallel (``vocab_parallel_options``, the same :class:`VocabParallelOptions` as the
cross-entropy's): rank ``r`` holds rows ``[r*Vp, (r+1)*Vp)`` of *both* heads (``Vp =
ceil(V / tp)``, padded rows sliced off before the matmul, zero gradient); the statistics are
combined with three all-reduces of ``[stats, tokens]`` tensors per chunk, no logits gathered.
With ``sequence_parallel=True`` every token-indexed input (both hidden states, labels, weights,
the top-k) is this rank's shard of the tokens.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple, Optional

import torch
from torch import nn

from .._deprecation import ReturnStatsAliases
from ..ops.chunk_driver import chunked_head
from ..ops.distillation_chunk import DistillationKernel, Teacher
from ..ops.distillation_options import DistillationOptions
from ..ops.options import module_options, resolve_options
from ..ops.validation import (
    check_ce_tensors,
    check_finite,
    check_not_dtensor,
    first_bad_label,
    flagged,
)
from .token_coefficients import token_coefficients
from .vocab_parallel import VocabParallelOptions, check_vocab_parallel_options, vocab_layout

__all__ = ["DistillationOutput", "linear_distillation_loss", "LinearDistillationLoss"]


class DistillationOutput(NamedTuple):
    """What :func:`linear_distillation_loss` returns with ``return_stats=True``.

    Attributes:
        loss: as :func:`linear_distillation_loss` returns it (differentiable; fp32, fp64 for
            fp64 inputs; a scalar, or the shape of ``labels`` for ``reduction="none"``).
        divergence: the divergence ``D(P, Q)`` alone (before ``(1 - alpha) * T**2``), reduced
            like ``loss``; no gradient.
        ce_loss: the student's hard-label cross-entropy at temperature 1 (before ``alpha``;
            computed for logging also when ``alpha = 0``), reduced like ``loss``; no gradient.
        num_top1_matches: int64 scalar, valid tokens where the student's and the teacher's most
            likely tokens agree (with a top-k teacher: its top-1 id).
        num_valid_tokens: int64 scalar, tokens whose label is not ``ignore_index``.
    """

    loss: torch.Tensor
    divergence: torch.Tensor
    ce_loss: torch.Tensor
    num_top1_matches: torch.Tensor
    num_valid_tokens: torch.Tensor


def _check_teacher(hidden_states, weight, labels, teacher_hidden_states, teacher_weight,
                   teacher_bias, topk_ids, topk_log_probs, opts: DistillationOptions,
                   vocab_size: int) -> None:
    """The teacher's inputs: exactly one form, shapes matching the student's."""
    full = teacher_hidden_states is not None or teacher_weight is not None
    topk = topk_ids is not None or topk_log_probs is not None
    if full == topk:
        raise ValueError("give the teacher as teacher_hidden_states and teacher_weight, or as "
                         "teacher_topk_ids and teacher_topk_log_probs (exactly one of the two)")
    lead = tuple(labels.shape)
    if full:
        if teacher_hidden_states is None or teacher_weight is None:
            raise ValueError("teacher_hidden_states and teacher_weight go together")
        for name, t in (("teacher_hidden_states", teacher_hidden_states),
                        ("teacher_weight", teacher_weight), ("teacher_bias", teacher_bias)):
            check_not_dtensor(name, t)
        for name, t in (("teacher_hidden_states", teacher_hidden_states),
                        ("teacher_weight", teacher_weight)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"{name} must be a floating torch.Tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
        if tuple(teacher_hidden_states.shape[:-1]) != lead or teacher_hidden_states.dim() < 1:
            raise ValueError(f"teacher_hidden_states must have shape {lead} + (Ht,), got "
                             f"{tuple(teacher_hidden_states.shape)}")
        if teacher_weight.dim() != 2 or teacher_weight.shape[0] != weight.shape[0] \
                or teacher_weight.shape[1] != teacher_hidden_states.shape[-1]:
            raise ValueError(f"teacher_weight must have shape [{weight.shape[0]}, "
                             f"{teacher_hidden_states.shape[-1]}] (the student's vocab rows, the "
                             f"teacher's hidden size), got {tuple(teacher_weight.shape)}")
        if teacher_bias is not None:
            if not isinstance(teacher_bias, torch.Tensor) or not teacher_bias.is_floating_point():
                raise TypeError("teacher_bias must be a floating torch.Tensor or None")
            if tuple(teacher_bias.shape) != (weight.shape[0],):
                raise ValueError(f"teacher_bias must have shape [{weight.shape[0]}], got "
                                 f"{tuple(teacher_bias.shape)}")
        tensors = [teacher_hidden_states, teacher_weight] + (
            [] if teacher_bias is None else [teacher_bias])
    else:
        if topk_ids is None or topk_log_probs is None:
            raise ValueError("teacher_topk_ids and teacher_topk_log_probs go together")
        if teacher_bias is not None:
            raise ValueError("teacher_bias has no meaning with a top-k teacher")
        if opts.teacher_logit_softcapping is not None:
            raise ValueError("teacher_logit_softcapping has no meaning with a top-k teacher (its "
                             "log-probs are given); set it to None")
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.is_floating_point() \
                or topk_ids.dtype == torch.bool:
            raise TypeError("teacher_topk_ids must be an integer torch.Tensor")
        if not isinstance(topk_log_probs, torch.Tensor) or not topk_log_probs.is_floating_point():
            raise TypeError("teacher_topk_log_probs must be a floating torch.Tensor")
        if topk_ids.dim() < 1 or tuple(topk_ids.shape[:-1]) != lead or topk_ids.shape[-1] < 1:
            raise ValueError(f"teacher_topk_ids must have shape {lead} + (k,), k >= 1, got "
                             f"{tuple(topk_ids.shape)}")
        if topk_log_probs.shape != topk_ids.shape:
            raise ValueError(f"teacher_topk_log_probs must have the shape of teacher_topk_ids "
                             f"{tuple(topk_ids.shape)}, got {tuple(topk_log_probs.shape)}")
        _check_topk_values(topk_ids, topk_log_probs, vocab_size)
        tensors = [topk_ids, topk_log_probs]
    if len({t.device for t in tensors + [hidden_states]}) > 1:
        raise ValueError("the teacher's tensors must be on the student's device")


def _check_topk_values(ids: torch.Tensor, log_probs: torch.Tensor, vocab_size: int) -> None:
    """Used slots (finite log-prob): ids in range and distinct; log-probs <= 0, no NaN, summing
    to at most 1 (1% slack for rounding of stored half-precision values)."""
    lp = log_probs.to(torch.float32).reshape(-1, log_probs.shape[-1])
    message = ("teacher_topk_log_probs must be log-probabilities (<= 0, -inf for an unused "
               "slot, no NaN)")
    if flagged(torch.isnan(lp) | (lp > 0), message):
        raise ValueError(message)
    used = torch.isfinite(lp)
    flat = ids.reshape(-1, ids.shape[-1]).long()
    bad = used & ((flat < 0) | (flat >= vocab_size))
    message = (f"teacher_topk_ids must be in [0, {vocab_size}) (in the slots whose log-prob is "
               "finite)")
    if flagged(bad, message):
        raise ValueError(f"{message}, found {int(flat[bad][0])}")
    if flat.shape[1] > 1:
        unused_marks = -1 - torch.arange(flat.shape[1], device=flat.device)
        srt = torch.where(used, flat, unused_marks).sort(dim=1).values
        message = "teacher_topk_ids must be distinct within each position"
        if flagged(srt[:, 1:] == srt[:, :-1], message):
            raise ValueError(message)
    total = torch.logsumexp(lp, dim=1).exp()
    message = "teacher_topk_log_probs must sum to at most 1 per position (as probabilities)"
    if flagged(total > 1.0 + 1e-2, message):
        raise ValueError(f"{message}, found {float(total.max()):.4f}")


def _check_all(hidden_states, weight, labels, bias, loss_weights, teacher_hidden_states,
               teacher_weight, teacher_bias, topk_ids, topk_log_probs, opts,
               vocab_size) -> Optional[int]:
    """Every local check of a :func:`linear_distillation_loss` call (its ``vocab_layout``
    check): the first bad label, or None. Bound with ``functools.partial``: a closure over
    ``opts`` would leave its cell unset when ``resolve_options`` reads ``locals()`` (a graph
    break under ``torch.compile``)."""
    check_ce_tensors(hidden_states, weight, labels, bias, loss_weights)
    _check_teacher(hidden_states, weight, labels, teacher_hidden_states, teacher_weight,
                   teacher_bias, topk_ids, topk_log_probs, opts, vocab_size)
    if isinstance(teacher_hidden_states, torch.Tensor):
        check_finite("teacher_hidden_states", teacher_hidden_states)
    return first_bad_label(labels.reshape(-1), vocab_size, opts.ignore_index)


def linear_distillation_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    teacher_hidden_states: Optional[torch.Tensor] = None,
    teacher_weight: Optional[torch.Tensor] = None,
    teacher_topk_ids: Optional[torch.Tensor] = None,
    teacher_topk_log_probs: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    teacher_bias: Optional[torch.Tensor] = None,
    loss_weights: Optional[torch.Tensor] = None,
    kind: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    temperature_squared: bool = True,
    alpha: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    logit_softcapping: Optional[float] = None,
    teacher_logit_softcapping: Optional[float] = None,
    chunk_size: Optional[int] = None,
    accum_dtype: torch.dtype = torch.float32,
    return_stats: bool = False,
    options: Optional[DistillationOptions] = None,
    vocab_parallel_options: Optional[VocabParallelOptions] = None,
):
    """Distillation loss of the student ``hidden_states @ weight.T + bias`` towards a frozen
    teacher, chunked: neither model's ``[tokens, vocab]`` logits outlive a chunk.

    Per valid token (label != ``ignore_index``), with ``P`` / ``Q`` the teacher's / student's
    softmax of the (soft-capped) logits divided by ``temperature``::

        (1 - alpha) * T**2 * D(P, Q) + alpha * cross_entropy(student logits, label)

    (``T**2`` only with ``temperature_squared``), ``D`` chosen by ``kind``: ``"forward_kl"``
    ``KL(P || Q)``, ``"reverse_kl"`` ``KL(Q || P)``, ``"jsd"`` the generalised JSD of
    Liger-Kernel (linkedin/Liger-Kernel, ``src/liger_kernel/ops/jsd.py``):
    ``beta KL(P||M) + (1-beta) KL(Q||M)``, ``M = beta P + (1-beta) Q``, and as there
    ``beta=0`` is forward KL, ``beta=1`` reverse KL. Equal in value and gradients to that
    formula on the full logits (``F.kl_div`` / ``F.cross_entropy``), reduced as ``reduction``.

    The teacher comes in one of two forms:

    - full: ``teacher_hidden_states [..., Ht]`` and ``teacher_weight [V, Ht]`` (optional
      ``teacher_bias [V]``), its lm_head applied a chunk at a time;
    - top-k (what offline distillation pipelines store): ``teacher_topk_ids [..., k]`` (distinct
      ids in ``[0, V)``) and ``teacher_topk_log_probs [..., k]``, the teacher's log-probs of those
      ids at the distillation temperature. The tail mass ``1 - sum(exp(log_probs))`` is one more
      outcome: the divergence is between the teacher's and the student's distributions over
      ``k + 1`` outcomes (the k ids, and "any other token", whose student probability is the
      student's total mass outside the k ids); it is the full-vocabulary divergence when the
      top-k holds all the teacher's mass, and a lower bound otherwise. A zero tail (e.g. ``k =
      V``, up to rounding) is taken as the smallest normal number (so ``reverse_kl`` stays
      finite), or as 0 when the used slots hold all ``V`` ids; a slot of
      log-prob ``-inf`` is unused (its id is ignored, any value) and belongs to the tail.

    The teacher gets no gradient (its tensors are detached, whatever their ``requires_grad``).

    Args:
        hidden_states: ``[..., H]`` student hidden states (fp32 / bf16 / fp16 / fp64). With
            ``vocab_parallel_options``: replicated over the TP group, or with its
            ``sequence_parallel=True`` this rank's shard of the tokens.
        weight: ``[V, H]`` student lm_head (this rank's ``[Vp, H]`` shard, ``Vp = ceil(V/tp)``,
            with ``vocab_parallel_options``; padded rows get a zero gradient).
        labels: ``[...]`` shifted targets in ``[0, V)`` or ``ignore_index`` (masks positions;
            the targets of the hard-label CE).
        teacher_hidden_states, teacher_weight, teacher_bias: the full teacher (``teacher_weight``
            sharded as ``weight``, same rows).
        teacher_topk_ids, teacher_topk_log_probs: the top-k teacher (token-sharded as
            ``hidden_states`` under ``sequence_parallel``).
        bias: optional ``[V]`` student bias (``[Vp]`` shard).
        loss_weights: optional ``[...]`` per-token weights (e.g. from
            :class:`megaloss.LossCalibrator`, with ``reduction="sum"``).
        kind: this and ``beta``, ``temperature``, ``temperature_squared``, ``alpha``,
            ``ignore_index``, ``reduction``, ``logit_softcapping``,
            ``teacher_logit_softcapping``, ``chunk_size``, ``accum_dtype`` are the fields of
            :class:`~megaloss.DistillationOptions`, documented there.
        return_stats: return a :class:`DistillationOutput` (the loss, the divergence, the
            hard-label CE and the top-1 agreement) instead of the loss alone.
        options: those fields as one :class:`~megaloss.DistillationOptions`
            (e.g. ``MegalossConfig.distillation.options()``), instead of the keywords.
        vocab_parallel_options: a :class:`megaloss.VocabParallelOptions`: both heads are this
            rank's vocab shards; the loss is the full-vocabulary one, identical on every TP rank.

    Returns:
        The loss: fp32 scalar (fp64 for fp64 inputs), or ``[...]`` for ``reduction="none"``
        (with ``sequence_parallel=True``: ``[tp * N_local]``, the gathered tokens); with
        ``return_stats=True`` a :class:`DistillationOutput` holding it.

    Raises:
        ValueError: a label or top-k id outside ``[0, V)``; NaN or inf in ``hidden_states`` or
            ``teacher_hidden_states``; repeated top-k ids in a position;
            top-k log-probs > 0, NaN or summing above 1; both or neither teacher form; shape
            mismatches (teacher hidden states vs labels, ``teacher_weight`` rows vs ``weight``);
            inputs on different devices; ``teacher_logit_softcapping`` or ``teacher_bias`` with a
            top-k teacher; an option out of range. With ``vocab_parallel_options``: also
            differing token counts / sizes across TP ranks; raised on every TP rank alike.
        TypeError: non-tensor or wrongly typed inputs; ``options`` together with option keywords
            not at their default; ``options`` / ``vocab_parallel_options`` of the wrong type.
    """
    opts = resolve_options(DistillationOptions, options, locals())
    check_vocab_parallel_options(vocab_parallel_options)

    check = partial(_check_all, hidden_states, weight, labels, bias, loss_weights,
                    teacher_hidden_states, teacher_weight, teacher_bias, teacher_topk_ids,
                    teacher_topk_log_probs, opts)
    layout = vocab_layout(vocab_parallel_options, weight, hidden_states, labels, check,
                          ignore_index=opts.ignore_index, what="distillation")
    flat_labels = layout.tokens(labels.reshape(-1).long())
    weights = layout.tokens(None if loss_weights is None else loss_weights.reshape(-1))
    hidden = layout.hidden(hidden_states.reshape(-1, hidden_states.shape[-1]))
    t_hidden, ids, lp = teacher_hidden_states, teacher_topk_ids, teacher_topk_log_probs
    teacher = Teacher(
        layout.tokens(None if t_hidden is None
                      else t_hidden.detach().reshape(-1, t_hidden.shape[-1])),
        layout.rows(teacher_weight), layout.rows(teacher_bias),
        layout.tokens(None if ids is None else ids.reshape(-1, ids.shape[-1]).long()),
        layout.tokens(None if lp is None else lp.detach().reshape(-1, lp.shape[-1])))

    sdt = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    valid, coef = token_coefficients(flat_labels, opts.ignore_index, opts.reduction, weights,
                                     sdt)
    kernel = DistillationKernel(teacher, flat_labels, opts, layout.vocab_slice())
    loss, divergence, ce, match = chunked_head(
        kernel, hidden, layout.rows(weight), layout.rows(bias), coef=coef,
        reduction="none" if opts.reduction == "none" else "sum",
        chunk_size=layout.chunk_size(opts.chunk_size, hidden), accum_dtype=opts.accum_dtype)
    if not return_stats:
        return loss.view(labels.shape) if opts.reduction == "none" and not layout.gathered \
            else loss
    parts = torch.stack([divergence, ce]).detach() * coef.to(divergence.dtype)
    parts = parts.sum(dim=1) if opts.reduction != "none" else parts
    if opts.reduction == "none" and not layout.gathered:
        loss, parts = loss.view(labels.shape), parts.view(2, *labels.shape)
    return DistillationOutput(loss, parts[0], parts[1], (match.bool() & valid).sum(), valid.sum())


class LinearDistillationLoss(ReturnStatsAliases, nn.Module):
    """Module form of :func:`linear_distillation_loss`.

    Args:
        options: a :class:`~megaloss.DistillationOptions`; or, instead, its fields
            as keyword arguments (``kind="jsd", beta=0.5, temperature=2.0, ...``).
        vocab_parallel_options: optional :class:`megaloss.VocabParallelOptions`.

    ``forward(hidden_states, weight, labels, *, teacher_hidden_states=None,
    teacher_weight=None, teacher_topk_ids=None, teacher_topk_log_probs=None, bias=None,
    teacher_bias=None, loss_weights=None, return_stats=False)`` returns what
    :func:`linear_distillation_loss` does.

    Raises:
        ValueError / TypeError: bad options (at construction), bad tensors (in forward).
    """

    def __init__(self, options: Optional[DistillationOptions] = None, *,
                 vocab_parallel_options: Optional[VocabParallelOptions] = None,
                 **option_fields):
        super().__init__()
        self.options = module_options(DistillationOptions, options, option_fields)
        check_vocab_parallel_options(vocab_parallel_options)
        self.vocab_parallel_options = vocab_parallel_options

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                **tensors):
        return linear_distillation_loss(
            hidden_states, weight, labels, options=self.options,
            vocab_parallel_options=self.vocab_parallel_options, **tensors)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options.as_dict().items())
