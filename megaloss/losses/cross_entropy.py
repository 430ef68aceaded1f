"""The chunked fused linear cross-entropy ``F.cross_entropy(F.linear(h, W, b), y)`` without ever
holding the ``[tokens, vocab]`` logits: the one entry point :func:`linear_cross_entropy`, on one
device or, given ``vocab_parallel_options``, over an lm_head split across tensor-parallel ranks
(the layout of :mod:`megaloss.losses.vocab_parallel`), and its module form.

Math (:mod:`megaloss.ops.cross_entropy_chunk`): torch's cross-entropy with label smoothing and
class weights, plus the PaLM z-loss ``z_loss * logsumexp(logits)**2`` per valid token, on logits
optionally soft-capped as ``c * tanh(logits / c)`` (Gemma 2). Schedule (XTuner v1's chunked CE,
``xtuner/v1/loss/ce_loss.py``; Liger-Kernel's ``ops/fused_linear_cross_entropy.py``): the chunk
driver, :mod:`megaloss.ops.chunk_driver`.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple, Optional

import torch
from torch import nn

from .._deprecation import ReturnStatsAliases
from ..ops.chunk_driver import chunked_head
from ..ops.cross_entropy_chunk import CrossEntropyKernel
from ..ops.cross_entropy_options import CrossEntropyOptions
from ..ops.options import module_options, resolve_options
from ..ops.validation import check_ce_tensors, first_bad_label, flagged
from .token_coefficients import token_coefficients
from .vocab_parallel import VocabParallelOptions, check_vocab_parallel_options, vocab_layout

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss", "CrossEntropyOutput"]


class CrossEntropyOutput(NamedTuple):
    """What :func:`linear_cross_entropy` returns with ``return_stats=True``.

    Attributes:
        loss: the loss, as returned without ``return_stats`` (differentiable; fp32, fp64 for
            fp64 inputs; a scalar, or the shape of ``labels`` for ``reduction="none"``).
        z_loss: the z-loss part of ``loss``, same reduction and shape, no gradient (for logging).
        num_valid_tokens: int64 scalar, tokens whose label is not ``ignore_index``.
        num_correct_tokens: int64 scalar, valid tokens whose label has the largest logit (a tie
            counts): the token accuracy is ``num_correct_tokens / num_valid_tokens``. Exact
            under any vocabulary split (the label's own logit is compared with the global max).
    """

    loss: torch.Tensor
    z_loss: torch.Tensor
    num_valid_tokens: torch.Tensor
    num_correct_tokens: torch.Tensor


def _check_ce_weight(ce_weight: Optional[torch.Tensor], vocab_size: int, device,
                     opts: CrossEntropyOptions) -> None:
    if ce_weight is None:
        return
    if not isinstance(ce_weight, torch.Tensor) or not ce_weight.is_floating_point():
        got = ce_weight.dtype if isinstance(ce_weight, torch.Tensor) else type(ce_weight).__name__
        raise TypeError(f"ce_weight must be a floating torch.Tensor or None, got {got}")
    if tuple(ce_weight.shape) != (vocab_size,):
        raise ValueError(f"ce_weight must have shape [{vocab_size}] (one weight per class of the "
                         f"whole vocabulary), got {tuple(ce_weight.shape)}")
    if ce_weight.device != device:
        raise ValueError(f"ce_weight is on {ce_weight.device} but hidden_states on {device}")
    message = "ce_weight must hold finite weights >= 0"
    if flagged((ce_weight < 0) | ~torch.isfinite(ce_weight), message):
        raise ValueError(message)
    if opts.impl == "triton":
        raise ValueError("ce_weight runs on the torch epilogue; impl='triton' does not take it "
                         "(use impl='auto' or 'torch')")


def _check_all(hidden_states, weight, labels, bias, loss_weights, ce_weight,
               opts: CrossEntropyOptions, vocab_size: int) -> Optional[int]:
    """Every local check of a :func:`linear_cross_entropy` call (its ``vocab_layout`` check): a
    module-level function bound with ``functools.partial``, not a closure over ``opts``, whose
    cell ``locals()`` would read unset in ``resolve_options`` (a graph break under
    ``torch.compile`` when the call is inlined)."""
    check_ce_tensors(hidden_states, weight, labels, bias, loss_weights)
    _check_ce_weight(ce_weight, vocab_size, hidden_states.device, opts)
    return first_bad_label(labels.reshape(-1), vocab_size, opts.ignore_index)


def linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    loss_weights: Optional[torch.Tensor] = None,
    ce_weight: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_softcapping: Optional[float] = None,
    chunk_size: Optional[int] = None,
    accum_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
    return_stats: bool = False,
    options: Optional[CrossEntropyOptions] = None,
    vocab_parallel_options: Optional[VocabParallelOptions] = None,
):
    """Cross-entropy of ``hidden_states @ weight.T + bias`` against ``labels``, chunked; on one
    device, or with the lm_head split over the vocabulary across tensor-parallel ranks.

    Equal in value and gradients to
    ``F.cross_entropy(softcap(F.linear(hidden_states, weight, bias)), labels, weight=ce_weight,
    ignore_index=..., label_smoothing=..., reduction=...)`` plus ``z_loss *
    logsumexp(logits)**2`` per valid token (times its class weight with ``ce_weight``).

    Args:
        hidden_states: ``[..., H]`` float (fp32 / bf16 / fp16 / fp64), any strides. With
            ``vocab_parallel_options``: replicated over the TP group, or, with its
            ``sequence_parallel=True``, this rank's shard of the tokens (every rank the same
            count).
        weight: ``[V, H]`` lm_head weight (may be tied to the input embedding, may be frozen);
            another floating dtype than ``hidden_states`` is promoted per chunk (autocast).
            With ``vocab_parallel_options``: this rank's shard ``[Vp, H]``, rows
            ``[r*Vp, (r+1)*Vp)`` of the lm_head padded to ``tp*Vp``, ``Vp = ceil(V / tp)``
            (padded rows get a zero gradient; see
            :func:`megaloss.losses.vocab_parallel.vocab_shard_range`).
        labels: ``[...]`` integer class ids in ``[0, V)`` or ``ignore_index``, already shifted
            for causal LM (``labels[..., t]`` is the target of position ``t``).
        bias: optional ``[V]`` (``[Vp]``, this rank's shard, with ``vocab_parallel_options``).
        loss_weights: optional ``[...]`` float per-token weights (shape of ``labels``), e.g.
            from :class:`megaloss.LossCalibrator`; ``"mean"`` is then ``sum(w l) / sum(w)``.
        ce_weight: optional ``[V]`` float class weights >= 0, torch's ``weight=`` (Liger-Kernel's
            ``ce_weight``): each token's loss is scaled by its label's weight, label smoothing
            weights the classes it averages over, and ``"mean"`` divides by the sum of the
            labels' weights (times ``loss_weights``). The whole ``[V]`` vector on every TP
            rank. Runs on the torch epilogue (``impl="auto"`` picks it).
        ignore_index: label without loss or gradient; this and the keywords below are the
            fields of :class:`~megaloss.CrossEntropyOptions`, documented there.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (torch's meanings).
        label_smoothing, z_loss, logit_softcapping, chunk_size, accum_dtype: see
            :class:`~megaloss.CrossEntropyOptions`.
        impl: the chunk epilogue: the Triton kernels on CUDA, the torch one elsewhere.
        return_stats: return a :class:`CrossEntropyOutput` (the loss and its parts and counts)
            instead of the loss alone.
        options: these fields as one :class:`~megaloss.CrossEntropyOptions`
            (e.g. from a ds_config, ``MegalossConfig.ce.options()``), instead of the keywords.
        vocab_parallel_options: a :class:`VocabParallelOptions` (TP group, real vocab size,
            Megatron's sequence parallelism): ``weight`` is then this rank's vocab shard and
            the loss is the one over the full vocabulary, identical on every TP rank (two
            all-reduces of ``[tokens]``-sized statistics per chunk, no logits gathered; see
            :mod:`megaloss.losses.vocab_parallel`). ``None``: one device, no collective.

    Returns:
        The loss: fp32 scalar (fp64 for fp64 inputs), or ``[...]`` for ``reduction="none"``
        (with ``sequence_parallel=True``: ``[tp * N_local]``, the gathered tokens, rank 0's
        first); with ``return_stats=True`` a :class:`CrossEntropyOutput` holding it.

    Raises:
        ValueError: a label outside ``[0, V)`` that is not ``ignore_index``; NaN or inf in
            ``hidden_states`` (the first bad token named); shape mismatches
            (``labels`` vs ``hidden_states[..., :-1]``, ``weight`` hidden size, ``bias``,
            ``loss_weights``, ``ce_weight``); inputs on different devices; negative or
            non-finite ``ce_weight``, or ``ce_weight`` with ``impl="triton"``; an option out of
            range. With ``vocab_parallel_options`` also: token count, hidden size, shard rows
            or vocab size differing across TP ranks, or ``weight`` without ``ceil(V / tp)``
            rows. Under ``vocab_parallel_options`` every such error is raised on every TP rank
            alike, before any collective: the error of the first rank at fault, naming the TP
            ranks at fault.
        TypeError: non-tensor inputs, non-floating hidden states/weight, non-integer labels;
            ``options`` together with option keywords not at their default (naming them);
            ``options`` / ``vocab_parallel_options`` of the wrong type.

    Gradients of ``hidden_states``, ``weight`` and ``bias`` are computed chunk by chunk in the
    forward pass (``"mean"``/``"sum"``) and scaled by ``grad_output`` in backward; with
    ``"none"`` backward recomputes the logits chunk by chunk and honours a per-token
    ``grad_output``. Inputs without ``requires_grad`` cost no gradient work.
    """
    opts = resolve_options(CrossEntropyOptions, options, locals())
    check_vocab_parallel_options(vocab_parallel_options)
    check = partial(_check_all, hidden_states, weight, labels, bias, loss_weights, ce_weight, opts)
    layout = vocab_layout(vocab_parallel_options, weight, hidden_states, labels, check,
                          ignore_index=opts.ignore_index, what="cross-entropy")
    flat_labels = layout.tokens(labels.reshape(-1).long())
    weights = layout.tokens(None if loss_weights is None else loss_weights.reshape(-1))
    hidden = layout.hidden(hidden_states.reshape(-1, hidden_states.shape[-1]))

    sdt = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    class_of_label = None
    if ce_weight is not None:
        label_ids = flat_labels.clamp(0, ce_weight.shape[0] - 1)  # ignored ids masked below
        class_of_label = torch.where(flat_labels != opts.ignore_index,
                                     ce_weight.to(sdt)[label_ids], 0.0)
    valid, coef = token_coefficients(flat_labels, opts.ignore_index, opts.reduction, weights,
                                     sdt, class_of_label)

    kernel = CrossEntropyKernel(flat_labels, opts, layout.vocab_slice(), ce_weight)
    loss, lse, correct = chunked_head(
        kernel, hidden, layout.rows(weight), layout.rows(bias), coef=coef,
        reduction="none" if opts.reduction == "none" else "sum",
        chunk_size=layout.chunk_size(opts.chunk_size, hidden), accum_dtype=opts.accum_dtype)
    lse = lse.detach()
    z = opts.z_loss * lse * lse * coef.to(lse.dtype)
    if class_of_label is not None:
        z = z * class_of_label.to(lse.dtype)
    if opts.reduction != "none":
        z = z.sum()
    elif not layout.gathered:
        loss, z = loss.view(labels.shape), z.view(labels.shape)
    if not return_stats:
        return loss
    return CrossEntropyOutput(loss, z, valid.sum(), (correct > 0).sum())


class LinearCrossEntropyLoss(ReturnStatsAliases, nn.Module):
    """Module form of :func:`linear_cross_entropy`.

    Args:
        options: a :class:`~megaloss.CrossEntropyOptions`; or, instead, its fields
            as keyword arguments (``reduction="sum", z_loss=1e-4, ...``), validated here.
        ce_weight: optional ``[V]`` class weights (a buffer of the module).
        vocab_parallel_options: optional :class:`VocabParallelOptions` (``weight`` is then this
            rank's shard).

    ``forward(hidden_states [..., H], weight [V, H], labels [...], *, bias=None,
    loss_weights=None, return_stats=False)`` returns what :func:`linear_cross_entropy` does.

    Raises:
        ValueError / TypeError: bad options (at construction), bad tensors (in forward).
    """

    def __init__(self, options: Optional[CrossEntropyOptions] = None, *,
                 ce_weight: Optional[torch.Tensor] = None,
                 vocab_parallel_options: Optional[VocabParallelOptions] = None,
                 **option_fields):
        super().__init__()
        self.options = module_options(CrossEntropyOptions, options, option_fields)
        check_vocab_parallel_options(vocab_parallel_options)
        self.vocab_parallel_options = vocab_parallel_options
        self.register_buffer("ce_weight", ce_weight)

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                bias: Optional[torch.Tensor] = None, loss_weights: Optional[torch.Tensor] = None,
                return_stats: bool = False):
        return linear_cross_entropy(hidden_states, weight, labels, bias=bias,
                                    loss_weights=loss_weights, ce_weight=self.ce_weight,
                                    options=self.options, return_stats=return_stats,
                                    vocab_parallel_options=self.vocab_parallel_options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options.as_dict().items())
