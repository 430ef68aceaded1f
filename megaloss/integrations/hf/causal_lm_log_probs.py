"""Any Hugging Face ``*ForCausalLM`` whose forward returns the per-token log-probabilities (and
entropies) of given labels, :func:`megaloss.linear_log_probs` on its last hidden states: the
``[tokens, vocab]`` logits are never built. The per-token quantities of policy-gradient and
preference losses (GRPO / PPO ratios, KL to a reference, DPO), for TRL-style and custom loops.

As :class:`~megaloss.integrations.hf.causal_lm.CausalLMWithLoss` (same label convention, same
``tp_group``, same handling of tied embeddings and of the model's logit transform,
:mod:`megaloss.integrations.head_config`), the lm_head is replaced in place by a head module
whose forward computes the log-probs, so ZeRO-3 gathers its weight there. Called without
labels the head is the plain lm_head again (``hidden @ W.T + b``; gathered over the
vocabulary under TP, without gradient): ``model(input_ids).logits`` and ``model.generate``
keep working on the very weights being trained, which is what an on-policy loop samples from.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ...losses.log_probs import linear_log_probs
from ...losses.router import RouterPool
from ...losses.vocab_parallel_head import VocabParallelLMHead
from ...ops.log_probs_options import LogProbsOptions
from ...parallel.groups import SINGLE_RANK, GroupLike
from ..lm_head import (
    GatheredLogits,
    LinearHead,
    linear_lm_head,
    shifted_targets,
    wrapper_options,
)
from .causal_lm import HeadWrapper, own_forward, token_grid
from .outputs import MoeLogProbsOutput

__all__ = ["CausalLMWithLogProbs", "LinearLogProbsHead"]


class LinearLogProbsHead(LinearHead):
    """The (unsharded) lm_head plus :func:`megaloss.linear_log_probs`, as one module
    (:class:`~megaloss.integrations.lm_head.LinearHead`).
    ``forward(hidden_states [..., H], labels=None [...], *, options)``: with *shifted* labels a
    :class:`megaloss.LogProbsOutput` under ``options`` (a
    :class:`~megaloss.LogProbsOptions`) of the model's logits (``logit_transform``'s scale,
    the options' soft-cap); without, the raw logits.

    Raises:
        TypeError: ``linear`` is not an ``nn.Linear``.
    """

    def loss(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
             options: Optional[LogProbsOptions] = None):
        h, b = self.scaled_inputs(hidden_states)  # the model's logit scale
        out = linear_log_probs(h, self.weight, labels, bias=b, options=options)
        # FSDP2 hooks the backward through this module's outputs; an in-place op on an output
        # that is a view (the [N] results reshaped to labels' shape) would bypass the hook
        # (torch/distributed/fsdp/_fully_shard/_fsdp_state.py warns), so views are copied
        # (a few [B, T] tensors).
        return out._replace(**{k: v.clone() for k, v in out._asdict().items()
                               if isinstance(v, torch.Tensor) and v._is_view()})


class _VocabParallelLogProbsHead(GatheredLogits, VocabParallelLMHead):
    """This TP rank's lm_head shard (:class:`megaloss.VocabParallelLMHead`'s layout and
    parameter tags) whose forward returns the vocab-parallel log-probs, or without labels the
    full logits gathered over the TP group (no gradient: for ``generate`` and evaluation)."""

    def loss(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
             options: Optional[LogProbsOptions] = None):
        h, b = self.scaled_inputs(hidden_states)  # the model's logit scale
        return linear_log_probs(h, self.weight, labels, bias=b, options=options,
                                vocab_parallel_options=self.parallel)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, "
                f"tp={self.tp_size}, rows=[{self.vocab_start}, {self.vocab_stop})")


class CausalLMWithLogProbs(HeadWrapper):
    """Wrap a ``transformers`` ``*ForCausalLM``: forward = decoder + chunked per-token
    log-probs (and entropy) of the labels, no logits.

    The decoder is ``model.base_model``; the lm_head ``model.get_output_embeddings()`` is
    replaced in place by the log-probs head (module docstring), which still returns logits when
    called without labels, so ``model.generate`` samples from the trained weights.

    Args:
        model: a ``PreTrainedModel`` with a base model and an ``nn.Linear`` output embedding.
        options: :class:`~megaloss.LogProbsOptions` (``temperature``,
            ``return_entropy``, ``chunk_size``, ...); default ``LogProbsOptions()``. Their
            ``logit_softcapping``, when ``None``, becomes the model's own final soft-cap (Gemma
            2's ``config.final_logit_softcapping``), and the model's logit scale (Cohere,
            Granite, Falcon-H1, ...) scales the head's inputs
            (:mod:`megaloss.integrations.head_config`), so the log-probs are those of
            ``log_softmax(model(input_ids).logits / temperature)``. A model z-loss term
            (Bamba's) belongs to its training loss, not to its distribution: not added here.
            A mixture-of-experts model's router term has no loss here to join: with router
            logits output the outputs carry the model's ``aux_loss`` (:meth:`forward`) for
            the caller's loss to add ``router_aux_loss_coef * aux_loss``, as TRL's trainers
            do with a model's own output.
        tp_group: tensor-parallel group (``Topology.tp_group``); default
            :data:`~megaloss.parallel.SINGLE_RANK`; ``None`` is torch's default group. With size
            > 1 the lm_head is split over the vocabulary as in
            :class:`~megaloss.integrations.hf.causal_lm.CausalLMWithLoss` (a tied input embedding
            becomes a :class:`megaloss.VocabParallelEmbedding` on the head's shard); the outputs
            are those of the full vocabulary, identical on every TP rank.

    Attributes:
        options: the resolved options; ``temperature`` reads and sets ``options.temperature``
            (a loop switches it between phases: the sampling temperature for the policy loss,
            as TRL does, 1 for SFT).

    The Hugging Face model API (:data:`~megaloss.integrations.hf.causal_lm.HF_MODEL_API`:
    ``config``, ``generation_config``, gradient checkpointing, ...) and :meth:`save_pretrained`
    reach the wrapped model (``wrapper.generate`` is the model's own); called without labels
    the wrapper is the model's own forward.

    Raises:
        TypeError: ``model`` has no base model or no ``nn.Linear`` output embedding; ``options``
            not a ``LogProbsOptions``; TP > 1 with a tied input embedding of unknown forward.
        ValueError: the model's forward transforms its logits in a way megaloss does not
            reproduce (:func:`~megaloss.integrations.head_config.model_logit_transform`) or
            cuts them; ``options.logit_softcapping`` set and different from the model's own
            soft-cap.
    """

    def __init__(self, model: nn.Module, *, options: Optional[LogProbsOptions] = None,
                 tp_group: GroupLike = SINGLE_RANK) -> None:
        super().__init__()
        lm_head = linear_lm_head(model)
        self._install_head(
            model, lm_head,
            wrapper_options(options if options is not None else LogProbsOptions(),
                            LogProbsOptions),
            tp_group, LinearLogProbsHead, _VocabParallelLogProbsHead)

    @property
    def temperature(self) -> float:
        return self.options.temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.options = self.options.replace(temperature=value)

    def forward(self, input_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, *,
                shift_labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                return_entropy: Optional[bool] = None,
                output_router_logits: Optional[bool] = None,
                router_loss: Optional[RouterPool] = None, **kwargs: Any) -> Any:
        """Decoder, then the chunked log-probs of its last hidden states; without labels, the
        wrapped model's own forward (its logits).

        Args:
            input_ids: ``[B, T]`` int64 (or ``inputs_embeds`` among ``kwargs``).
            labels: ``[B, T]`` Hugging Face labels, *unshifted* (``labels = input_ids`` with
                ``ignore_index`` where none), shifted here by :func:`megaloss.causal_shift`: the
                last position of each row gets none. Global vocab ids also under TP.
            shift_labels: ``[B, T]`` already shifted targets (``shift_labels[b, t]`` follows
                position ``t``), instead of ``labels``.
            attention_mask, position_ids: passed to the decoder (``[B, T]``).
            return_entropy: this call's ``options.return_entropy``; ``None``: the options'.
            output_router_logits: a mixture-of-experts model's router logits for this call
                (``None``: its config's); when output, the outputs carry its ``aux_loss``
                (:meth:`router_loss`) and ``router_logits``.
            router_loss: the calibrated step's router pool
                (:class:`megaloss.losses.router.RouterPool`): the output's ``router`` holds
                megaloss's calibrated router losses on the router logits
                (:class:`megaloss.losses.router.RouterLossOutput`), which the caller's loss
                adds (the calibrated step's NLL does); a statistics-only pool returns this
                rank's :class:`~megaloss.losses.router.RouterStatistics`.
            **kwargs: passed to the decoder (``use_cache`` defaults to ``False``), or to the
                model without labels.

        Returns:
            :class:`megaloss.LogProbsOutput` of shape ``[B, T]``, aligned with the shifted
            targets: ``log_probs`` of ``softmax(softcap(z) / temperature)`` (fp32, fp64 for a
            fp64 model; 0 where no target), ``entropy`` (``None`` unless asked), ``lse``,
            ``greedy_match``; with router logits output, a
            :class:`~megaloss.integrations.hf.outputs.MoeLogProbsOutput` (the same fields,
            then the model's own ``aux_loss``, unscaled and differentiable, and
            ``router_logits``): a loss that trains the model adds
            ``wrapper.router_aux_loss_coef * out.aux_loss``, as the model's own loss does.

            Without labels, what the wrapped model returns.

        Raises:
            ValueError: both ``labels`` and ``shift_labels``; a shape other than that of
                ``input_ids``; a label outside the vocabulary; router logits output for a
                model whose router term megaloss cannot reproduce.
        """
        labeled = labels is not None or shift_labels is not None
        pool = self.pool_router_kwargs(router_loss, labeled, kwargs)
        if pool is not None and router_loss.statistics_only:  # the "step" scope's pre-pass
            return self.pool_statistics(router_loss, input_ids, attention_mask, position_ids,
                                        pool)
        if not labeled:
            if output_router_logits is not None:
                kwargs["output_router_logits"] = output_router_logits
            return own_forward(self.model, input_ids, attention_mask, position_ids, kwargs)
        targets = shifted_targets(token_grid(input_ids, kwargs), labels, shift_labels,
                                  self.ignore_index, self.logit_transform.shifts_labels)
        options = self.options
        if return_entropy is not None and return_entropy != options.return_entropy:
            options = options.replace(return_entropy=return_entropy)
        routed = pool is not None or self.router_logits_requested(output_router_logits)
        if pool is None:
            if routed and self.router.refusal is not None:
                raise ValueError(self.router.refusal)
            kwargs.setdefault("use_cache", False)
            self.decoder_router_kwargs(routed, output_router_logits, kwargs)
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids, **(kwargs if pool is None else pool))
        result = self.head(out.last_hidden_state, targets, options=options)
        if not routed:
            return result
        router_logits = getattr(out, "router_logits", None)
        if pool is not None:
            router = self.pool_router_loss(router_loss, router_logits, attention_mask,
                                           position_ids)
            return MoeLogProbsOutput(*result, aux_loss=None, router_logits=router_logits,
                                     router=router)
        term = self.router_loss(router_logits, attention_mask)
        return MoeLogProbsOutput(*result, aux_loss=term.aux_loss, router_logits=router_logits)

    def extra_repr(self) -> str:
        return (f"tp_size={self.tp_size}, vocab_size={self.vocab_size}, tied={self.tied}, "
                f"temperature={self.temperature:g}")
