"""Any Hugging Face ``*ForCausalLM`` whose forward returns the chunked cross-entropy of its last
hidden states: the ``[tokens, vocab]`` logits are never built.

Why the loss lives *inside* this module's forward (FIELD-NOTES, measured on DeepSpeed 0.19.8):

- with ZeRO-3 every parameter is an empty shard outside the forward of the module that owns it,
  so the lm_head weight must be used by a module whose forward DeepSpeed runs. The wrapper
  replaces ``model.lm_head`` by a head module (:class:`LinearCrossEntropyHead` for TP = 1,
  :class:`megaloss.VocabParallelLMHead` for TP > 1) whose forward computes the loss;
- with a direct ``loss.backward()`` DeepSpeed divides by the gradient-accumulation steps only
  the gradients that flow through the outputs of ``engine.forward``.

So ``engine(input_ids=..., labels=..., loss_weights=...)`` returns the loss itself.

Label convention (megaloss-wide): ``labels`` are already *shifted*, ``labels[b, t]`` is the target
of position ``t`` (use :func:`causal_shift` on Hugging Face style labels). Loss weights from
:func:`megaloss.calibration.weights.compute_loss_weights` have the same shape.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..distributed.topology import group_size
from ..linear_cross_entropy import CrossEntropyOutput, linear_cross_entropy_with_stats
from ..vocab_parallel import VocabParallelLMHead
from .config import CEConfig

__all__ = ["CausalLMWithLoss", "LinearCrossEntropyHead", "causal_shift"]


def causal_shift(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Hugging Face labels (``labels[b, t]`` = token at ``t``) -> shifted targets.

    ``out[b, t] = labels[b, t + 1]`` and ``out[b, T - 1] = ignore_index``, so ``out`` keeps the
    shape ``[B, T]`` of the hidden states (counting valid tokens *after* the shift, one fewer per
    row, as the calibration requires).

    Raises:
        TypeError: ``labels`` is not an integer tensor.
        ValueError: ``labels`` has no sequence dim.
    """
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point():
        raise TypeError(f"labels must be an integer tensor, got {getattr(labels, 'dtype', labels)}")
    if labels.dim() < 1:
        raise ValueError("labels must have a sequence dimension [..., T]")
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)


class LinearCrossEntropyHead(nn.Module):
    """The (unsharded) lm_head plus :func:`megaloss.linear_cross_entropy`, as one module.

    Keeps the original ``nn.Linear``'s ``weight [V, H]`` (and ``bias [V]``) Parameter objects, so
    tied input embeddings stay tied. ``forward(hidden_states [..., H], labels [...],
    loss_weights=None [...])`` returns :class:`megaloss.CrossEntropyOutput` with
    ``reduction="sum"``: ``sum_t w_t * l_t`` over valid tokens (``w_t = 1`` without weights).
    """

    def __init__(self, linear: nn.Linear, ce: CEConfig, ignore_index: int = -100) -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear lm_head, got {type(linear).__name__}")
        self.weight = linear.weight
        self.bias = linear.bias
        self.ce = ce
        self.ignore_index = ignore_index

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
                loss_weights: Optional[torch.Tensor] = None) -> CrossEntropyOutput:
        return linear_cross_entropy_with_stats(
            hidden_states, self.weight, labels, bias=self.bias, ignore_index=self.ignore_index,
            reduction="sum", label_smoothing=self.ce.label_smoothing, z_loss=self.ce.z_loss,
            logit_softcapping=self.ce.logit_softcapping, loss_weights=loss_weights,
            chunk_size=self.ce.chunk_size)

    def extra_repr(self) -> str:
        v, h = self.weight.shape
        return f"vocab_size={v}, hidden_size={h}, {self.ce!r}"


class _VocabParallelHead(VocabParallelLMHead):
    """:class:`megaloss.VocabParallelLMHead` whose module call returns the stats too (the
    z-loss part is logged), so ZeRO-3's hooks around the call gather the shard."""

    def forward(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
                loss_weights: Optional[torch.Tensor] = None) -> CrossEntropyOutput:
        return self.forward_with_stats(hidden_states, labels, loss_weights=loss_weights)


class CausalLMWithLoss(nn.Module):
    """Wrap a ``transformers`` ``*ForCausalLM``: forward = decoder + fused CE, no logits.

    The decoder is ``model.base_model`` (``model.model`` for Llama, Qwen, Mistral...); the lm_head
    is ``model.get_output_embeddings()``, replaced in place by the loss head (so
    ``model.lm_head`` is the head afterwards; the wrapper owns ``model``).

    Args:
        model: a ``PreTrainedModel`` with a base model and an ``nn.Linear`` output embedding.
        ce: cross-entropy options (:class:`~megaloss.integrations.config.CEConfig`); default
            options when ``None``. ``ce.reduction`` is a calibration option, not used here.
        tp_group: tensor-parallel group (``Topology.tp_group``). With size > 1 the lm_head is
            split over the vocabulary (:class:`megaloss.VocabParallelLMHead`, rows of the
            original weight copied, parameters marked ``tensor_model_parallel``); the decoder
            stays replicated and gets the full hidden-state gradient on every TP rank.
        ignore_index: label value without loss.

    Raises:
        TypeError: ``model`` has no base model or no ``nn.Linear`` output embedding.
        ValueError: TP > 1 with the lm_head tied to the input embedding (a vocab shard cannot
            also be the replicated embedding).
    """

    def __init__(self, model: nn.Module, *, ce: Optional[CEConfig] = None,
                 tp_group: Optional[ProcessGroup] = None, ignore_index: int = -100) -> None:
        super().__init__()
        base = getattr(model, "base_model", None)
        if base is None or base is model:
            raise TypeError(f"model must be a *ForCausalLM with a base model, got "
                            f"{type(model).__name__}")
        lm_head = model.get_output_embeddings()
        if not isinstance(lm_head, nn.Linear):
            raise TypeError(f"model's output embedding must be an nn.Linear, got "
                            f"{type(lm_head).__name__}")
        self.ce = ce if ce is not None else CEConfig()
        self.ignore_index = ignore_index
        self.tp_size = group_size(tp_group)
        vocab_size, hidden_size = lm_head.weight.shape
        if self.tp_size > 1:
            inp = model.get_input_embeddings()
            if inp is not None and inp.weight is lm_head.weight:
                raise ValueError("tensor parallelism needs an untied lm_head "
                                 "(tie_word_embeddings=False)")
            head: nn.Module = _VocabParallelHead(
                hidden_size, vocab_size, tp_group=tp_group, bias=lm_head.bias is not None,
                dtype=lm_head.weight.dtype, device=lm_head.weight.device,
                ignore_index=ignore_index, reduction="sum", label_smoothing=self.ce.label_smoothing,
                z_loss=self.ce.z_loss, logit_softcapping=self.ce.logit_softcapping,
                chunk_size=self.ce.chunk_size)
            head.load_full_weight(lm_head.weight.detach(),
                                  None if lm_head.bias is None else lm_head.bias.detach())
        else:
            head = LinearCrossEntropyHead(lm_head, self.ce, ignore_index)
        model.set_output_embeddings(head)
        self.model = model
        self.vocab_size = vocab_size

    @property
    def decoder(self) -> nn.Module:
        return self.model.base_model

    @property
    def head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, *,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                loss_weights: Optional[torch.Tensor] = None) -> CrossEntropyOutput:
        """Decoder, then the fused CE of its last hidden states.

        Args:
            input_ids: ``[B, T]`` int64.
            labels: ``[B, T]`` *shifted* targets (:func:`causal_shift`), ``ignore_index`` where no
                loss. Global vocab ids also under TP.
            attention_mask, position_ids: passed to the decoder (``[B, T]``).
            loss_weights: ``[B, T]`` per-token weights (the calibration's); ``None``: 1.

        Returns:
            :class:`megaloss.CrossEntropyOutput`: ``loss`` = ``sum_t w_t * l_t`` (fp32 scalar,
            differentiable; z-loss included), ``z_loss`` its z-loss part (no grad),
            ``num_valid_tokens`` (int64 scalar).
        """
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids "
                             f"{tuple(input_ids.shape)}")
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids, use_cache=False)
        return self.head(out.last_hidden_state, labels, loss_weights=loss_weights)

    def extra_repr(self) -> str:
        return f"tp_size={self.tp_size}, vocab_size={self.vocab_size}"
