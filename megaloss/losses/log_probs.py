"""Per-token log-probabilities of the labels under the lm_head, ``log_softmax(F.linear(h, W, b) /
temperature).gather(labels)``, without ever holding the ``[tokens, vocab]`` logits: the primitive
under policy-gradient and preference losses (PPO/GRPO ratios, DPO), with the entropy, the
log-sum-exp and the greedy match alongside. On one device or, given ``vocab_parallel_options``,
over an lm_head split across tensor-parallel ranks (the layout of
:mod:`megaloss.losses.vocab_parallel`).

Math: :mod:`megaloss.ops.log_probs_chunk`; schedule (recompute in backward): the chunk driver,
:mod:`megaloss.ops.chunk_driver`. The full-logits formula it replaces is TRL's
``selective_log_softmax`` (``trl/trainer/utils.py``: ``logits.gather(labels) -
logsumexp(logits)``) on ``logits / temperature``.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple, Optional

import torch
from torch import nn

from ..ops.chunk_driver import chunked_head
from ..ops.log_probs_kernel import LogProbsKernel
from ..ops.log_probs_options import LogProbsOptions
from ..ops.options import module_options, resolve_options
from ..ops.validation import check_ce_tensors, first_bad_label
from .vocab_parallel import VocabParallelOptions, check_vocab_parallel_options, vocab_layout

__all__ = ["LogProbsOutput", "linear_log_probs", "LinearLogProbs"]


class LogProbsOutput(NamedTuple):
    """What :func:`linear_log_probs` returns; every field has the shape of ``labels`` (with
    ``sequence_parallel=True``: ``[tp * N_local]``, the gathered tokens, rank 0's first).

    Attributes:
        log_probs: ``log softmax(y)[label]`` of the scaled logits ``y = softcap(z) / T``; fp32
            (fp64 for fp64 inputs); 0 at ignored positions; differentiable.
        entropy: ``-sum_j p_j log p_j`` of ``softmax(y)``, same dtype, 0 at ignored positions,
            differentiable; ``None`` unless ``return_entropy=True``.
        lse: ``logsumexp(y)``, same dtype, for every token (ignored ones too); detached.
        greedy_match: bool, ``y[label]`` is the maximum of ``y`` (a tie counts as a match);
            False at ignored positions. ``greedy_match.sum() / valid`` is the token accuracy.
    """

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]
    lse: torch.Tensor
    greedy_match: torch.Tensor


def _check_all(hidden_states, weight, labels, bias, ignore_index: int,
               vocab_size: int) -> Optional[int]:
    """Every local check of a :func:`linear_log_probs` call (its ``vocab_layout`` check), bound
    with ``functools.partial``: a closure over ``opts`` would leave its cell unset when
    ``resolve_options`` reads ``locals()`` (a graph break under ``torch.compile``)."""
    check_ce_tensors(hidden_states, weight, labels, bias, None)
    return first_bad_label(labels.reshape(-1), vocab_size, ignore_index)


def linear_log_probs(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    logit_softcapping: Optional[float] = None,
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
    accum_dtype: torch.dtype = torch.float32,
    impl: str = "auto",
    options: Optional[LogProbsOptions] = None,
    vocab_parallel_options: Optional[VocabParallelOptions] = None,
) -> LogProbsOutput:
    """Per-token log-probabilities (and entropy) of ``labels`` under ``hidden_states @
    weight.T + bias``, chunked; on one device, or with the lm_head split over the vocabulary
    across tensor-parallel ranks.

    Equal in value and gradients to ``y = softcap(F.linear(hidden_states, weight, bias)) /
    temperature; y.log_softmax(-1).gather(-1, labels[..., None])[..., 0]`` (and
    ``-(y.softmax(-1) * y.log_softmax(-1)).sum(-1)``), 0 at ``ignore_index``. Soft-capping
    acts on the raw logits, the temperature on the capped ones (see
    :class:`~megaloss.LogProbsOptions`).

    Args:
        hidden_states: ``[..., H]`` float (fp32 / bf16 / fp16 / fp64). With
            ``vocab_parallel_options``: replicated over the TP group, or, with its
            ``sequence_parallel=True``, this rank's shard of the tokens.
        weight: ``[V, H]`` lm_head weight (may be frozen, e.g. a reference model); another
            floating dtype than ``hidden_states`` is promoted per chunk. With
            ``vocab_parallel_options``: this rank's shard ``[Vp, H]``, ``Vp = ceil(V / tp)``
            (see :func:`megaloss.losses.vocab_parallel.vocab_shard_range`).
        labels: ``[...]`` integer ids in ``[0, V)`` or ``ignore_index``, already shifted for
            causal LM (``labels[..., t]`` is the token that follows position ``t``).
        bias: optional ``[V]`` (``[Vp]`` with ``vocab_parallel_options``).
        ignore_index: this and ``temperature``, ``logit_softcapping``, ``return_entropy``,
            ``chunk_size``, ``accum_dtype``, ``impl`` are the fields of
            :class:`~megaloss.LogProbsOptions`, documented there
            (``impl="auto"``: the fused Triton kernels of
            :mod:`megaloss.ops.triton_log_probs` on CUDA, the torch epilogue elsewhere).
        options: these fields as one :class:`~megaloss.LogProbsOptions`, instead
            of the keywords.
        vocab_parallel_options: a :class:`~megaloss.losses.vocab_parallel.VocabParallelOptions`
            (TP group, real vocab size, Megatron's sequence parallelism), as
            :func:`megaloss.linear_cross_entropy` takes it: the outputs are those of the full
            vocabulary, identical on every TP rank (one MAX and one SUM all-reduce of
            ``[3, tokens]`` statistics per chunk, none in backward). The TP ranks must then
            back-propagate the same upstream gradients (a loss computed alike on each, as
            Megatron does), since each rank's gradient covers its vocab shard only.

    Returns:
        :class:`LogProbsOutput` ``(log_probs, entropy, lse, greedy_match)``.

    Raises:
        ValueError: a label outside ``[0, V)`` that is not ``ignore_index``; NaN or inf in
            ``hidden_states`` (the first bad token named); shape mismatches;
            inputs on different devices; an option out of range; ``impl="triton"`` where it
            cannot run (float64, no triton, CPU without Triton's interpreter). With
            ``vocab_parallel_options`` also: token count, hidden size, shard rows or vocab
            size differing across TP ranks, or ``weight`` without ``ceil(V / tp)`` rows.
            Under ``vocab_parallel_options`` every such error is raised on every TP rank alike,
            before any collective: the error of the first rank at fault, naming the TP ranks
            at fault.
        TypeError: non-tensor inputs, non-floating hidden states/weight, non-integer labels;
            ``options`` together with option keywords not at their default;
            ``options`` / ``vocab_parallel_options`` of the wrong type.

    Gradients flow into ``hidden_states``, ``weight`` and ``bias`` through ``log_probs`` and
    ``entropy`` with any per-token upstream gradients: backward recomputes the logits chunk by
    chunk (:mod:`megaloss.ops.chunk_driver`).
    """
    opts = resolve_options(LogProbsOptions, options, locals())
    check_vocab_parallel_options(vocab_parallel_options)

    check = partial(_check_all, hidden_states, weight, labels, bias, opts.ignore_index)
    layout = vocab_layout(vocab_parallel_options, weight, hidden_states, labels, check,
                          ignore_index=opts.ignore_index, what="log-probs")
    flat_labels = layout.tokens(labels.reshape(-1).long())
    hidden = layout.hidden(hidden_states.reshape(-1, hidden_states.shape[-1]))
    kernel = LogProbsKernel(flat_labels, opts, layout.vocab_slice())
    log_probs, entropy, lse, _, greedy = chunked_head(
        kernel, hidden, layout.rows(weight), layout.rows(bias),
        chunk_size=layout.chunk_size(opts.chunk_size, hidden), accum_dtype=opts.accum_dtype)
    shape = flat_labels.shape if layout.gathered else labels.shape
    return LogProbsOutput(log_probs.view(shape),
                          entropy.view(shape) if opts.return_entropy else None,
                          lse.detach().view(shape), greedy.bool().view(shape))


class LinearLogProbs(nn.Module):
    """Module form of :func:`linear_log_probs`.

    Args:
        options: a :class:`~megaloss.LogProbsOptions`; or, instead, its fields as
            keyword arguments (``temperature=0.7, return_entropy=True, ...``), validated here.
        vocab_parallel_options: optional
            :class:`~megaloss.losses.vocab_parallel.VocabParallelOptions` (``weight`` is then
            this rank's shard).

    ``forward(hidden_states [..., H], weight [V, H], labels [...], bias=None)`` returns a
    :class:`LogProbsOutput`.

    Raises:
        ValueError / TypeError: bad options (at construction), bad tensors (in forward).
    """

    def __init__(self, options: Optional[LogProbsOptions] = None, *,
                 vocab_parallel_options: Optional[VocabParallelOptions] = None,
                 **option_fields):
        super().__init__()
        self.options = module_options(LogProbsOptions, options, option_fields)
        check_vocab_parallel_options(vocab_parallel_options)
        self.vocab_parallel_options = vocab_parallel_options

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> LogProbsOutput:
        return linear_log_probs(hidden_states, weight, labels, bias=bias, options=self.options,
                                vocab_parallel_options=self.vocab_parallel_options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options.as_dict().items())
