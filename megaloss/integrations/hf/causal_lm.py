"""Any Hugging Face ``*ForCausalLM`` whose forward returns the chunked cross-entropy of its last
hidden states: the ``[tokens, vocab]`` logits are never built.

Why the loss lives *inside* this module's forward (measured on DeepSpeed 0.19.8; see
``deepspeed/runtime/engine.py`` and ``runtime/zero/stage3.py``):

- with ZeRO-3 every parameter is an empty shard outside the forward of the module that owns it,
  so the lm_head weight must be used by a module whose forward DeepSpeed runs. The wrapper
  replaces ``model.lm_head`` by a head module (:class:`LinearCrossEntropyHead` for TP = 1,
  :class:`megaloss.VocabParallelLMHead` for TP > 1) whose forward computes the loss;
- with a direct ``loss.backward()`` DeepSpeed divides by the gradient-accumulation steps only
  the gradients that flow through the outputs of ``engine.forward``.

So ``engine(input_ids=..., labels=..., loss_weights=...)`` returns the loss itself.

The same design covers PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``, see
``torch/distributed/fsdp/_fully_shard/_fully_shard.py``): a parameter is a ``Shard(0)`` DTensor
except inside the forward / backward of its FSDP unit, whose hooks unshard it (in the
``MixedPrecisionPolicy``'s ``param_dtype``) and reduce-scatter its gradient. Because the loss is
the head module's own ``forward`` (called as a module, never ``head.weight`` read from outside),
the head may sit in the root unit (``fully_shard`` per decoder layer, then on the wrapper) or be
its own unit (``fully_shard(wrapper.model.lm_head)``), with ``reshard_after_forward`` either
way and tied embeddings in the root: no ``register_fsdp_forward_method`` is needed. Apply
``fully_shard`` *after* wrapping: a model already sharded is refused
(:func:`refuse_fully_sharded`), and a DTensor weight handed to the loss functions directly raises
a TypeError naming the fix (``megaloss/ops/validation.py``). FSDP2 averages gradients over its
ranks (the data-parallel mean), so with ``reduction="sum"`` the step's gradient is that of the
global sum divided by the world size.

Label convention: Hugging Face's. ``labels`` are *unshifted* (usually ``labels = input_ids``,
``-100`` where no loss) and shifted inside (:func:`causal_shift`), as ``*ForCausalLM(labels=...)``
does; already shifted targets go through ``shift_labels=`` (the name recent ``transformers``
uses), which is what a calibrated training step passes (its weights, from
:func:`megaloss.calibration.weights.compute_loss_weights`, are counted after the shift).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ...losses.cross_entropy import CrossEntropyOutput, linear_cross_entropy
from ...losses.position_z_loss import linear_position_z_loss
from ...losses.router import RouterPool
from ...losses.vocab_parallel_embedding import VocabParallelEmbedding
from ...losses.vocab_parallel_head import VocabParallelLMHead
from ...ops.cross_entropy_options import CrossEntropyOptions
from ...ops.labels import causal_shift
from ...parallel.groups import SINGLE_RANK, GroupLike, group_size
from ..head_config import (
    LogitTransform,
    model_logit_transform,
    resolve_softcapping,
    z_loss_refusal,
)
from ..lm_head import (
    GatheredLogits,
    LinearHead,
    head_loss_weights,
    linear_lm_head,
    shifted_targets,
    summing_options,
    wrapper_options,
)
from ..text_decoder import text_decoder
from .outputs import CausalLMLossOutput
from .router_loss import RouterLossHook

__all__ = ["CausalLMWithLoss", "LinearCrossEntropyHead", "HF_MODEL_API", "causal_shift"]


def _add_position_z_loss(head: nn.Module, out: CrossEntropyOutput, hidden_states: torch.Tensor,
                         add: bool) -> CrossEntropyOutput:
    """``out`` with the model's own z-loss term (:meth:`position_z_loss`) added to ``loss``
    and ``z_loss`` (no grad there) when ``add`` (the wrapper's call under its token mean);
    ``out`` itself when the model has no such term.

    Raises:
        ValueError: the model has a term and ``add`` is false: a caller other than the
            wrapper's mean (a sum, or the calibrated step's token weights) cannot place it
            (:func:`z_loss_refusal`).
    """
    if head.logit_transform.z_loss_coefficient == 0.0:
        return out
    if not add:
        raise ValueError(z_loss_refusal(head.logit_transform, "sum"))
    z = head.position_z_loss(hidden_states)
    return out._replace(loss=out.loss + z.to(out.loss.dtype),
                        z_loss=out.z_loss + z.detach().to(out.z_loss.dtype))


def _position_z_loss(head: nn.Module, hidden_states: torch.Tensor, parallel=None) -> torch.Tensor:
    h, b = head.scaled_inputs(hidden_states)
    options = head.options
    return linear_position_z_loss(
        h, head.weight, bias=b, coefficient=head.logit_transform.z_loss_coefficient,
        logit_softcapping=options.logit_softcapping, chunk_size=options.chunk_size,
        accum_dtype=options.accum_dtype, vocab_parallel_options=parallel)


class LinearCrossEntropyHead(LinearHead):
    """The (unsharded) lm_head plus :func:`megaloss.linear_cross_entropy`, as one module.

    ``forward(hidden_states [..., H], labels [...], loss_weights=None [...],
    position_z_loss=False)`` takes *shifted* labels and returns
    :class:`megaloss.CrossEntropyOutput` under ``options`` (a
    :class:`~megaloss.CrossEntropyOptions`) on the model's logits ``softcap(scale * z)``
    (``logit_transform``'s scale, the options' soft-cap), plus, with ``position_z_loss=True``
    (its wrapper's token mean), the model's own z-loss term (:meth:`position_z_loss`); without
    labels, the raw logits (:meth:`LinearHead.logits`).

    Raises:
        TypeError: ``linear`` is not an ``nn.Linear``.
        ValueError (forward): the model has a z-loss term and ``position_z_loss`` is false
            (:func:`z_loss_refusal`).
    """

    def __init__(self, linear: nn.Linear, options: CrossEntropyOptions,
                 logit_transform: Optional[LogitTransform] = None) -> None:
        super().__init__(linear, options, logit_transform)

    def loss(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
             loss_weights: Optional[torch.Tensor] = None, position_z_loss: bool = False):
        h, b = self.scaled_inputs(hidden_states)
        out = linear_cross_entropy(h, self.weight, labels, bias=b, loss_weights=loss_weights,
                                   options=self.options, return_stats=True)
        return _add_position_z_loss(self, out, hidden_states, position_z_loss)

    def position_z_loss(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The model's own z-loss term, ``z_loss_coefficient * mean over every position of
        logsumexp(logits) ** 2`` (Bamba's, ``transformers/models/bamba/modeling_bamba.py``),
        on the logits this head's loss sees, chunked
        (:func:`megaloss.losses.position_z_loss.linear_position_z_loss`: no ``[tokens, V]``
        tensor).

        Args:
            hidden_states: ``[..., H]``, every position counted (padding included, as the
                model's own loss counts it).

        Returns:
            A differentiable scalar (fp32, fp64 for fp64 inputs); 0 when the coefficient is 0.
        """
        return _position_z_loss(self, hidden_states)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.options!r}"


def _is_tied(model: nn.Module, lm_head: nn.Linear) -> bool:
    inp = model.get_input_embeddings()
    return inp is not None and getattr(inp, "weight", None) is lm_head.weight


def _tied_embedding(inp: nn.Module, head: VocabParallelLMHead) -> VocabParallelEmbedding:
    """The vocab-parallel replacement of the tied input embedding ``inp``, on ``head``'s shard."""
    scale = getattr(inp, "embed_scale", None)
    if not isinstance(inp, nn.Embedding) or (type(inp) is not nn.Embedding and scale is None):
        raise TypeError(f"a tied input embedding under tensor parallelism must be an nn.Embedding "
                        f"(or one with an embed_scale), got {type(inp).__name__}")
    if isinstance(scale, torch.Tensor):
        scale = float(scale)
    return VocabParallelEmbedding.tied_to(head, padding_idx=inp.padding_idx, scale=scale)


class _VocabParallelHead(GatheredLogits, VocabParallelLMHead):
    """:class:`megaloss.VocabParallelLMHead` whose module call returns the stats too (the
    z-loss part is logged), so ZeRO-3's hooks around the call gather the shard; the model's
    logit transform and z-loss term as :class:`LinearCrossEntropyHead`; without labels the
    gathered raw logits (:class:`GatheredLogits`)."""

    def loss(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
             loss_weights: Optional[torch.Tensor] = None, position_z_loss: bool = False):
        h, b = self.scaled_inputs(hidden_states)
        out = linear_cross_entropy(h, self.weight, labels, bias=b, loss_weights=loss_weights,
                                   options=self.options, return_stats=True,
                                   vocab_parallel_options=self.parallel)
        return _add_position_z_loss(self, out, hidden_states, position_z_loss)

    def position_z_loss(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """:meth:`LinearCrossEntropyHead.position_z_loss` over this rank's vocab shard (the
        same value on every TP rank)."""
        return _position_z_loss(self, hidden_states, self.parallel)


# What CausalLMWithLoss forwards to the wrapped model (transformers' PreTrainedModel API).
HF_MODEL_API = frozenset({
    "config", "generation_config", "main_input_name", "name_or_path", "device", "dtype",
    "can_generate", "num_parameters", "get_input_embeddings", "set_input_embeddings",
    "enable_input_require_grads", "disable_input_require_grads", "tie_weights",
    "gradient_checkpointing_enable", "gradient_checkpointing_disable", "is_gradient_checkpointing",
    "supports_gradient_checkpointing", "activation_checkpointing_enable",
    "activation_checkpointing_disable", "is_activation_checkpointing", "generate",
})


class HeadWrapper(RouterLossHook, nn.Module):
    """What the Hugging Face loss wrappers share (:class:`CausalLMWithLoss`,
    :class:`~megaloss.integrations.hf.causal_lm_log_probs.CausalLMWithLogProbs`): the model's
    router term (:class:`~megaloss.integrations.hf.router_loss.RouterLossHook`), its own
    logit transform (``logit_transform``, from
    :func:`~megaloss.integrations.head_config.model_logit_transform`: its scale on the head, its
    soft-cap in the options), its ``nn.Linear`` lm_head replaced in place by a loss head
    (vocab-parallel at TP > 1, a tied input embedding moved onto the head's shard), the
    Hugging Face model API and :meth:`save_pretrained` forwarded to the wrapped model."""

    def _install_head(self, model: nn.Module, lm_head: nn.Linear, options, tp_group: GroupLike,
                      local_head, parallel_head) -> None:
        """Set ``logit_transform`` (the model's, found and verified by
        :func:`~megaloss.integrations.head_config.model_logit_transform` before its lm_head is
        replaced), ``options`` (its soft-cap resolved against the options'), ``ignore_index``,
        ``tp_size``, ``tied``, ``vocab_size`` and ``model``, whose output embedding becomes
        ``local_head(lm_head)`` (TP 1) or ``parallel_head(hidden_size, vocab_size, tp_group=,
        bias=, dtype=, device=)`` loaded with the full weight's rows (TP > 1), with the
        transform; both may read ``self.options``.

        Raises:
            ValueError: see :func:`~megaloss.integrations.head_config.model_logit_transform`
                and :func:`~megaloss.integrations.head_config.resolve_softcapping`; a model
                z-loss term with CE options whose reduction is not ``"mean"``
                (:func:`z_loss_refusal`); the config outputs router logits and the model's
                router term cannot be reproduced
                (:func:`~megaloss.integrations.router_config.model_router_loss`).
        """
        self._install_router(model)
        self.logit_transform = transform = model_logit_transform(model)
        self.options = options.replace(logit_softcapping=resolve_softcapping(
            options.logit_softcapping, transform.softcapping, "logit_softcapping"))
        if isinstance(self.options, CrossEntropyOptions):
            why = z_loss_refusal(transform, self.options.reduction)
            if why is not None:
                raise ValueError(why)
        self.ignore_index = self.options.ignore_index
        self.tp_size = group_size(tp_group)
        vocab_size, hidden_size = lm_head.weight.shape
        self.tied = _is_tied(model, lm_head)
        if self.tp_size > 1:
            head: nn.Module = parallel_head(
                hidden_size, vocab_size, tp_group=tp_group, bias=lm_head.bias is not None,
                dtype=lm_head.weight.dtype, device=lm_head.weight.device)
            head.load_full_weight(lm_head.weight.detach(),
                                  None if lm_head.bias is None else lm_head.bias.detach())
            if self.tied:
                model.set_input_embeddings(_tied_embedding(model.get_input_embeddings(), head))
        else:
            head = local_head(lm_head)
        head.logit_transform = transform
        model.set_output_embeddings(head)
        self.model = model
        self.vocab_size = vocab_size

    def __getattr__(self, name: str):
        # The Hugging Face model API the Trainer, PEFT and user code call on "the model"
        # (checkpointing, config, embeddings, saving) reaches the wrapped *ForCausalLM.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in HF_MODEL_API:
                return getattr(super().__getattr__("model"), name)
            raise

    def save_pretrained(self, save_directory, *args, **kwargs):
        """The wrapped model's ``save_pretrained`` (the head keeps the ``lm_head`` parameter
        names, so the folder loads back as the original ``*ForCausalLM``).

        Raises:
            ValueError: under tensor parallelism, where this rank holds only a vocab shard of
                the lm_head (gather it with :meth:`VocabParallelLMHead.load_full_weight`'s
                inverse first, or save through DeepSpeed's checkpoint).
        """
        if self.tp_size > 1:
            raise ValueError(f"save_pretrained would save this rank's vocab shard of the lm_head "
                             f"(tp={self.tp_size}); save a DeepSpeed checkpoint, or gather the "
                             "head's rows on one rank first")
        return self.model.save_pretrained(save_directory, *args, **kwargs)

    @property
    def decoder(self) -> nn.Module:
        return text_decoder(self.model)

    @property
    def head(self) -> nn.Module:
        return self.model.get_output_embeddings()


class CausalLMWithLoss(HeadWrapper):
    """Wrap a ``transformers`` ``*ForCausalLM``: forward = decoder + fused CE, no logits; the
    wrapper behaves as the model it wraps otherwise (forward without labels, ``generate``,
    keyword arguments, a dict-style output).

    The decoder is ``model.base_model`` (``model.model`` for Llama, Qwen, Mistral...); the lm_head
    is ``model.get_output_embeddings()``, replaced in place by the loss head (so
    ``model.lm_head`` is the head afterwards; the wrapper owns ``model``). Called without
    labels the head is the plain lm_head again, so ``wrapper(input_ids)`` is the wrapped model's
    own forward (its logits, transforms and output type) and ``wrapper.generate(...)`` its own
    ``generate``, on the very weights being trained. To patch the model itself instead (its own
    ``model(**batch)`` computing megaloss's loss), see :func:`megaloss.integrations.hf.apply`.

    Args:
        model: a ``PreTrainedModel`` with a base model and an ``nn.Linear`` output embedding.
        options: the CE options (:class:`~megaloss.CrossEntropyOptions`); default options when
            ``None``, whose ``reduction="mean"`` is Hugging Face's token mean
            (``num_items_in_batch`` honoured, :meth:`forward`), so the wrapper trains as the
            model would under the Hugging Face Trainer, TRL or a plain loop (a
            mixture-of-experts model's router term, ``router_aux_loss_coef * aux_loss`` when
            router logits are output, added as the model adds it:
            :mod:`megaloss.integrations.router_config`). A calibrated
            training step (:func:`megaloss.integrations.deepspeed.initialize`, the FSDP step,
            :class:`~megaloss.integrations.hf.trainer.MegalossTrainer`) weights the tokens itself
            and needs ``reduction="sum"``: pass ``MegalossConfig.ce.options()`` (those steps
            refuse another reduction). Their ``logit_softcapping``, when ``None``, becomes the
            model's own final soft-cap (Gemma 2's ``config.final_logit_softcapping``), and the
            model's logit scale (Cohere's ``logit_scale``, Granite's ``logits_scaling``,
            Falcon-H1's ``lm_head_multiplier``, ...) scales the head's inputs
            (:mod:`megaloss.integrations.head_config`), so the loss is the one
            ``model(input_ids, labels=...)`` computes; a model z-loss term (Bamba's
            ``z_loss_coefficient``) is added under ``reduction="mean"`` and refused under any
            other or with ``loss_weights``.
        tp_group: tensor-parallel group (``Topology.tp_group``); default
            :data:`~megaloss.parallel.SINGLE_RANK` (no tensor parallelism); ``None`` is torch's
            default group. With size > 1 the lm_head is split over the vocabulary
            (:class:`megaloss.VocabParallelLMHead`, rows of the original weight copied, parameters
            tagged ``tensor_model_parallel``); the decoder stays replicated and gets the full
            hidden-state gradient on every TP rank.

    The Hugging Face model API the Trainer and PEFT call (:data:`HF_MODEL_API`: ``config``,
    ``generation_config``, ``generate``, gradient / activation checkpointing,
    ``get_input_embeddings``, ``enable_input_require_grads``, ...) and :meth:`save_pretrained`
    reach the wrapped model, so ``TrainingArguments(gradient_checkpointing=True)`` checkpoints
    its decoder layers.

    Raises:
        TypeError: ``model`` has no base model or no ``nn.Linear`` output embedding.
        ValueError: the model's forward transforms its logits in a way megaloss does not
            reproduce (found by a probe forward,
            :func:`~megaloss.integrations.head_config.model_logit_transform`), or cuts them;
            ``options.logit_softcapping`` set and different from the model's own soft-cap; a
            model z-loss term with a reduction other than ``"mean"``; the config outputs router
            logits and the model's router term cannot be reproduced (the reason).
        TypeError: TP > 1 with a tied input embedding that is neither an ``nn.Embedding`` nor
            one with an ``embed_scale`` (Gemma 3's scaled embedding): its forward is unknown.

    Tied embeddings (``tie_word_embeddings=True``: Llama 3.2, Qwen2.5 up to 7B, Gemma). At TP 1
    the head keeps the embedding's Parameter. At TP > 1 the input embedding is replaced by a
    :class:`megaloss.VocabParallelEmbedding` on the head's own shard (Megatron's vocab-parallel
    lookup: zeros outside the shard, one all-reduce), so the shard's gradient is the sum of both
    uses, as for the unsharded tied weight; ``padding_idx`` and ``embed_scale`` are kept.
    """

    def __init__(self, model: nn.Module, *, options: Optional[CrossEntropyOptions] = None,
                 tp_group: GroupLike = SINGLE_RANK) -> None:
        super().__init__()
        lm_head = linear_lm_head(model)
        self._install_head(
            model, lm_head, wrapper_options(options, CrossEntropyOptions, "mean"), tp_group,
            lambda linear: LinearCrossEntropyHead(linear, summing_options(self.options)),
            lambda *size, **kw: _VocabParallelHead(*size, **kw,
                                                   options=summing_options(self.options)))

    def forward(self, input_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, *,
                shift_labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                loss_weights: Optional[torch.Tensor] = None,
                num_items_in_batch: Any = None, output_router_logits: Optional[bool] = None,
                router_loss: Optional[RouterPool] = None, **kwargs: Any) -> Any:
        """With labels: decoder, then the fused CE of its last hidden states (plus the model's
        router term). Without: the wrapped model's own forward.

        Args:
            input_ids: ``[B, T]`` int64 (or ``inputs_embeds=[B, T, H]`` among ``kwargs``).
            labels: ``[B, T]`` Hugging Face labels, *unshifted* (``labels = input_ids`` with
                ``ignore_index`` where no loss); shifted here by :func:`causal_shift`, so the
                last position of each row has no target. Global vocab ids also under TP.
            shift_labels: ``[B, T]`` already shifted targets (``shift_labels[b, t]`` is the
                target of position ``t``), instead of ``labels``.
            attention_mask, position_ids: passed to the decoder (``[B, T]``).
            loss_weights: ``[B, T]`` per-token weights aligned with the *shifted* targets (a
                calibration's, under ``reduction="sum"``); ``None``: 1.
            num_items_in_batch: Hugging Face's divisor of the token sum (the Trainer's count of
                target tokens over the whole gradient-accumulation step and, with
                ``average_tokens_across_devices``, over the ranks): with ``reduction="mean"``
                the loss is ``sum_t w_t l_t / num_items_in_batch``, as ``transformers``'
                ``ForCausalLMLoss`` computes it; ``None``: the micro-batch's token mean.
            output_router_logits: a mixture-of-experts model's router logits for this call;
                ``None``: the config's ``output_router_logits``. When output, the loss adds
                ``router_aux_loss_coef * aux_loss`` as the model's own forward does (its
                ``load_balancing_loss_func`` on the router logits and ``attention_mask``,
                :meth:`router_loss`; added to ``sum / num_items_in_batch`` unscaled, as the
                model does), and the output carries ``aux_loss`` and ``router_logits``.
            router_loss: the calibrated step's router pool
                (:class:`megaloss.losses.router.RouterPool`, from
                :mod:`megaloss.integrations.step.router`): megaloss's calibrated router losses
                on the decoder's router logits *replace* the model's own term; the output's
                ``router`` holds them (:class:`megaloss.losses.router.RouterLossOutput`). A
                statistics-only pool (the ``"step"`` scope's pre-pass) returns this rank's
                :class:`~megaloss.losses.router.RouterStatistics` and needs no labels.
            **kwargs: passed to the decoder (``inputs_embeds``, ``pixel_values`` of a
                vision-language model, ...), or to the wrapped model without labels
                (``use_cache`` defaults to ``False`` with labels).

        Returns:
            With labels, a :class:`~megaloss.integrations.hf.outputs.CausalLMLossOutput`
            (``out.loss`` / ``out["loss"]`` / ``out[0]``; ``logits`` ``None``) under the
            wrapper's options: by default Hugging Face's token mean (fp32, fp64 for a fp64
            model, differentiable, z-loss included), ``z_loss`` its z-loss part (no grad),
            ``num_valid_tokens`` and ``num_correct_tokens`` after the shift, ``aux_loss`` and
            ``router_logits`` when router logits are output. Without labels,
            what the wrapped model returns (its ``CausalLMOutputWithPast`` with logits).

        Raises:
            ValueError: both ``labels`` and ``shift_labels``; labels of another shape than the
                tokens; ``loss_weights`` / ``num_items_in_batch`` without labels;
                ``num_items_in_batch`` with a reduction other than ``"mean"``; router logits
                output with a router coefficient > 0 under a reduction other than ``"mean"``
                or with ``loss_weights`` (the model's per-micro-batch term has no exact place
                there: megaloss's calibrated router loss, ``router_loss=`` of the calibrated
                step, or ``output_router_logits=False``), or a router term megaloss cannot
                reproduce.
        """
        labeled = labels is not None or shift_labels is not None
        pool = self.pool_router_kwargs(router_loss, labeled, kwargs)
        if pool is not None and router_loss.statistics_only:  # the "step" scope's pre-pass
            return self.pool_statistics(router_loss, input_ids, attention_mask, position_ids,
                                        pool)
        if not labeled:
            if output_router_logits is not None:
                kwargs["output_router_logits"] = output_router_logits
            return own_forward(self.model, input_ids, attention_mask, position_ids, kwargs,
                               loss_weights=loss_weights, num_items_in_batch=num_items_in_batch)
        targets = shifted_targets(token_grid(input_ids, kwargs), labels, shift_labels,
                                  self.ignore_index, self.logit_transform.shifts_labels)
        if pool is not None:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, **pool)
            result = self.head_loss(out.last_hidden_state, targets, loss_weights=loss_weights,
                                    num_items_in_batch=num_items_in_batch)
            loss, router = self.add_pool_loss(result.loss, router_loss, out.router_logits,
                                              attention_mask, position_ids)
            return CausalLMLossOutput(
                loss=loss, z_loss=result.z_loss,
                num_valid_tokens=result.num_valid_tokens,
                num_correct_tokens=result.num_correct_tokens, router_logits=out.router_logits,
                router=router)
        routed = self.router_logits_requested(output_router_logits)
        self.check_router_loss(routed, self.options.reduction, loss_weights)
        kwargs.setdefault("use_cache", False)
        self.decoder_router_kwargs(routed, output_router_logits, kwargs)
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids, **kwargs)
        result = self.head_loss(out.last_hidden_state, targets, loss_weights=loss_weights,
                                num_items_in_batch=num_items_in_batch)
        if routed:
            router_logits = getattr(out, "router_logits", None)
            loss, term = self.add_router_loss(result.loss, router_logits, attention_mask)
            result = CausalLMLossOutput(
                loss=loss, z_loss=result.z_loss, num_valid_tokens=result.num_valid_tokens,
                num_correct_tokens=result.num_correct_tokens, aux_loss=term.aux_loss,
                router_logits=router_logits)
        return result

    def head_loss(self, hidden_states: torch.Tensor, shift_labels: torch.Tensor, *,
                  loss_weights: Optional[torch.Tensor] = None,
                  num_items_in_batch: Any = None) -> CausalLMLossOutput:
        """The loss head on the decoder's last hidden states ``[B, T, H]`` and *shifted*
        targets ``[B, T]``, under the wrapper's reduction (see :meth:`forward`)."""
        dtype = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
        why = z_loss_refusal(self.logit_transform, self.options.reduction, loss_weights)
        if why is not None:
            raise ValueError(why)
        weights = head_loss_weights(shift_labels, self.ignore_index, self.options.reduction,
                                    loss_weights, num_items_in_batch, dtype)
        # the model's own z-loss is a mean over the micro-batch's positions, next to its token
        # mean (or its sum / num_items_in_batch): added here, where that mean is taken
        stats = self.head(hidden_states, shift_labels, loss_weights=weights,
                          position_z_loss=self.logit_transform.z_loss_coefficient != 0.0)
        return CausalLMLossOutput(loss=stats.loss, z_loss=stats.z_loss,
                                  num_valid_tokens=stats.num_valid_tokens,
                                  num_correct_tokens=stats.num_correct_tokens)

    def extra_repr(self) -> str:
        return (f"tp_size={self.tp_size}, vocab_size={self.vocab_size}, tied={self.tied}, "
                f"reduction={self.options.reduction!r}")


def token_grid(input_ids: Optional[torch.Tensor], kwargs: dict) -> torch.Tensor:
    """A ``[B, T]`` tensor of the tokens' layout for the labels' shape check: ``input_ids``, or
    ``inputs_embeds[..., 0]`` when only embeddings are given.

    Raises:
        ValueError: neither ``input_ids`` nor ``inputs_embeds``.
    """
    if input_ids is not None:
        return input_ids
    embeds = kwargs.get("inputs_embeds")
    if embeds is None:
        raise ValueError("pass input_ids (or inputs_embeds) with the labels")
    return embeds[..., 0]


def own_forward(model: nn.Module, input_ids: Optional[torch.Tensor],
                attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                kwargs: dict, **loss_arguments: Any) -> Any:
    """A wrapper called without labels: the wrapped ``model``'s own forward (its logits and
    output type; its lm_head, a loss head, returns the raw logits then).

    Raises:
        ValueError: one of the wrapper's ``loss_arguments`` (``loss_weights``,
            ``num_items_in_batch``) given: they need labels.
    """
    given = [name for name, value in loss_arguments.items() if value is not None]
    if given:
        raise ValueError(f"{' and '.join(given)} need labels or shift_labels")
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 **kwargs)
