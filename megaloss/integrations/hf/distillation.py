"""A Hugging Face ``*ForCausalLM`` student whose forward returns the distillation loss towards a
frozen teacher (:func:`megaloss.linear_distillation_loss`): no ``[tokens, vocab]`` logits of
either model.

As in :mod:`.causal_lm` (and for the same reasons: ZeRO-3 gathers a parameter only inside the
forward of the module that owns it), the student's lm_head is replaced by a head module whose
forward computes the loss. The teacher is *not* a submodule: DeepSpeed neither partitions,
casts, trains nor checkpoints it (move it to the device and dtype you want; it is put in eval
mode with ``requires_grad=False``). Its decoder runs under ``torch.no_grad()`` in this forward,
and its lm_head rows (this TP rank's shard under tensor parallelism) go into the loss. Without a
teacher module the micro-batches carry the teacher as stored top-k ids and log-probs
(``teacher_topk_ids`` / ``teacher_topk_log_probs``).

Under PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) the student is sharded like
:class:`~megaloss.integrations.hf.CausalLMWithLoss` (wrap first, then ``fully_shard`` the decoder
layers, optionally the head, and the wrapper as root); a teacher already sharded by
``fully_shard`` is refused with a ValueError (its weights are used outside its own forward).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ...losses.distillation import linear_distillation_loss
from ...losses.router import RouterPool
from ...losses.vocab_parallel import vocab_shard_range
from ...losses.vocab_parallel_head import VocabParallelLMHead
from ...ops.cross_entropy_options import CrossEntropyOptions
from ...ops.distillation_options import DistillationOptions
from ...parallel.groups import SINGLE_RANK, GroupLike, group_rank, group_size
from ..head_config import LogitTransform, model_logit_transform, resolve_softcapping
from ..lm_head import (
    GatheredLogits,
    LinearHead,
    head_loss_weights,
    linear_lm_head,
    refuse_fully_sharded,
    shifted_targets,
    summing_options,
    wrapper_options,
)
from ..text_decoder import text_decoder
from .causal_lm import own_forward, token_grid
from .outputs import MoeDistillationOutput
from .router_loss import RouterLossHook

__all__ = ["CausalLMWithDistillation", "LinearDistillationHead"]


class LinearDistillationHead(LinearHead):
    """The student's (unsharded) lm_head plus :func:`megaloss.linear_distillation_loss`, as one
    module (:class:`~megaloss.integrations.lm_head.LinearHead`: the original
    ``nn.Linear``'s Parameter objects, tied embeddings stay tied).
    ``forward(hidden_states, labels, *, loss_weights=None, **teacher)`` returns a
    :class:`megaloss.DistillationOutput`; ``teacher`` are the teacher keywords of
    :func:`megaloss.linear_distillation_loss` (a teacher module's already scaled by its own
    transform). The student's logits are its model's (``logit_transform``'s scale, the options'
    ``logit_softcapping``). Without labels, the student's raw logits.

    Raises:
        TypeError: ``linear`` is not an ``nn.Linear``.
    """

    def __init__(self, linear: nn.Linear, options: DistillationOptions,
                 logit_transform: Optional[LogitTransform] = None) -> None:
        super().__init__(linear, options, logit_transform)

    def loss(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
             loss_weights: Optional[torch.Tensor] = None, **teacher):
        h, b = self.scaled_inputs(hidden_states)  # the student's logit scale
        return linear_distillation_loss(h, self.weight, labels, bias=b,
                                        loss_weights=loss_weights, options=self.options,
                                        return_stats=True, **teacher)


class _VocabParallelDistillationHead(GatheredLogits, VocabParallelLMHead):
    """This TP rank's student lm_head shard plus the vocab-parallel distillation loss; without
    labels the student's gathered logits (:class:`GatheredLogits`)."""

    def __init__(self, *args, distillation_options: DistillationOptions, **kwargs) -> None:
        super().__init__(*args, options=CrossEntropyOptions(), **kwargs)
        self.distillation_options = distillation_options

    def loss(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
             loss_weights: Optional[torch.Tensor] = None, **teacher):
        h, b = self.scaled_inputs(hidden_states)  # the student's logit scale
        return linear_distillation_loss(
            h, self.weight, labels, bias=b, loss_weights=loss_weights,
            options=self.distillation_options, vocab_parallel_options=self.parallel,
            return_stats=True, **teacher)


def _teacher_rows(weight: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's ``[ceil(V / tp), Ht]`` rows of the teacher's lm_head (zero padding rows,
    a copy on the last rank only)."""
    start, stop, rows = vocab_shard_range(weight.shape[0], tp, rank)
    shard = weight[start:stop]
    if stop - start == rows:
        return shard
    return torch.cat([shard, shard.new_zeros(rows - (stop - start), weight.shape[1])])


def _refuse_sharded_teacher(teacher: nn.Module) -> None:
    """The teacher is not a submodule, and its decoder and lm_head weight are used outside its
    own forward: under FSDP2's ``fully_shard`` they would be shards.

    Raises:
        ValueError: a parameter of ``teacher`` is a DTensor.
    """
    refuse_fully_sharded(
        teacher, "teacher", "the wrapper runs teacher.base_model and reads the teacher's lm_head "
        "weight outside the teacher's forward, so FSDP2 never unshards them. Keep the frozen "
        "teacher unsharded (a replica per rank, not a submodule of the fully_shard root), or "
        "pass its top-k per batch (teacher_topk_ids / teacher_topk_log_probs)")


class CausalLMWithDistillation(RouterLossHook, nn.Module):
    """Wrap a ``transformers`` ``*ForCausalLM`` student: forward = student decoder + (teacher
    decoder, no grad) + the chunked distillation loss of both lm_heads.

    Args:
        model: the student ``PreTrainedModel`` (a base model and an ``nn.Linear`` output
            embedding); its lm_head is replaced by the loss head, the wrapper owns it.
        teacher: a frozen ``*ForCausalLM`` over the same vocabulary, or ``None`` when the
            micro-batches carry the teacher's top-k (``teacher_topk_ids`` and
            ``teacher_topk_log_probs`` in :meth:`forward`). Not registered as a submodule.
        options: :class:`~megaloss.DistillationOptions` (e.g.
            ``MegalossConfig.distillation.options()``, ``reduction="sum"``, for a calibrated
            step, which weights the tokens itself and refuses another reduction); default
            options when ``None``: ``reduction="mean"``, Hugging Face's token mean with
            ``num_items_in_batch`` honoured (:meth:`forward`).
            ``logit_softcapping``, when ``None``, becomes the student's own final soft-cap and
            ``teacher_logit_softcapping`` the teacher module's own (each from its config, e.g.
            Gemma 2's ``final_logit_softcapping``), and each model's logit scale (Cohere,
            Granite, Falcon-H1, ...) scales its own hidden states and bias
            (:mod:`megaloss.integrations.head_config`: ``logit_transform`` and
            ``teacher_logit_transform``), so both distributions are those the models' forwards
            give. A z-loss term of either model's own loss (Bamba's) is not part of its
            distribution and is not added. A mixture-of-experts student's router term
            (``router_aux_loss_coef * aux_loss`` when its router logits are output,
            :mod:`megaloss.integrations.router_config`) is added under ``reduction="mean"``
            as the student's own loss adds it (:meth:`forward`).
        tp_group: tensor-parallel group; with size > 1 both lm_heads are split over the
            vocabulary (the student's as a :class:`megaloss.VocabParallelLMHead`, tagged
            ``tensor_model_parallel``; the teacher's rows sliced per call).

    Raises:
        TypeError: a model without base model or ``nn.Linear`` output embedding; ``options``
            not a :class:`~megaloss.DistillationOptions`.
        ValueError: teacher and student vocabularies differ; TP > 1 with a tied student lm_head;
            a model whose forward transforms its logits in a way megaloss does not reproduce
            (:func:`~megaloss.integrations.head_config.model_logit_transform`); a soft-cap of
            the options set and different from that model's own; a teacher already sharded by
            FSDP2; the student's config outputs router logits and its router term cannot be
            reproduced.
    """

    def __init__(self, model: nn.Module, teacher: Optional[nn.Module] = None, *,
                 options: Optional[DistillationOptions] = None,
                 tp_group: GroupLike = SINGLE_RANK) -> None:
        super().__init__()
        lm_head = linear_lm_head(model)
        options = wrapper_options(options, DistillationOptions, "mean")
        self._install_router(model)
        self.logit_transform = model_logit_transform(model, "student")
        caps = {"logit_softcapping": resolve_softcapping(
            options.logit_softcapping, self.logit_transform.softcapping, "logit_softcapping",
            "student")}
        vocab_size, hidden_size = lm_head.weight.shape
        self.teacher_logit_transform = None
        if teacher is not None:
            t_head = teacher.get_output_embeddings()
            if not isinstance(t_head, nn.Linear) or t_head.weight.shape[0] != vocab_size:
                raise ValueError(f"teacher must be a *ForCausalLM with an nn.Linear lm_head of "
                                 f"{vocab_size} rows (the student's vocabulary)")
            _refuse_sharded_teacher(teacher)
            # the teacher's own transform, not the student's: they may be different models
            self.teacher_logit_transform = model_logit_transform(teacher, "teacher")
            caps["teacher_logit_softcapping"] = resolve_softcapping(
                options.teacher_logit_softcapping, self.teacher_logit_transform.softcapping,
                "teacher_logit_softcapping", "teacher")
        self.options = options.replace(**caps)
        head_options = summing_options(self.options)
        if teacher is not None:
            teacher.eval()
            teacher.requires_grad_(False)
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        if self.tp_size > 1:
            inp = model.get_input_embeddings()
            if inp is not None and inp.weight is lm_head.weight:
                raise ValueError("tensor parallelism needs an untied lm_head "
                                 "(tie_word_embeddings=False)")
            head: nn.Module = _VocabParallelDistillationHead(
                hidden_size, vocab_size, tp_group=tp_group, bias=lm_head.bias is not None,
                dtype=lm_head.weight.dtype, device=lm_head.weight.device,
                distillation_options=head_options)
            head.load_full_weight(lm_head.weight.detach(),
                                  None if lm_head.bias is None else lm_head.bias.detach())
        else:
            head = LinearDistillationHead(lm_head, head_options)
        head.logit_transform = self.logit_transform
        model.set_output_embeddings(head)
        self.model = model
        self.vocab_size = vocab_size
        self.ignore_index = self.options.ignore_index
        self.__dict__["teacher"] = teacher  # not a submodule: DeepSpeed must not own it

    @property
    def decoder(self) -> nn.Module:
        return text_decoder(self.model)

    @property
    def head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The student's own ``generate`` (its lm_head returns logits without labels)."""
        return self.model.generate(*args, **kwargs)

    def _teacher_inputs(self, input_ids, attention_mask, position_ids, kwargs):
        teacher = self.teacher
        _refuse_sharded_teacher(teacher)
        with torch.no_grad():
            out = text_decoder(teacher)(input_ids=input_ids, attention_mask=attention_mask,
                                        position_ids=position_ids, **kwargs)
        head = teacher.get_output_embeddings()
        weight, bias = head.weight.detach(), head.bias
        hidden, bias = self.teacher_logit_transform.scale_inputs(
            out.last_hidden_state, None if bias is None else bias.detach())
        if self.tp_size > 1:
            weight = _teacher_rows(weight, self.tp_size, self.tp_rank)
            bias = None if bias is None else _teacher_rows(bias.detach()[:, None], self.tp_size,
                                                           self.tp_rank)[:, 0]
        return dict(teacher_hidden_states=hidden, teacher_weight=weight,
                    teacher_bias=bias)

    def forward(self, input_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, *,
                shift_labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                loss_weights: Optional[torch.Tensor] = None,
                teacher_topk_ids: Optional[torch.Tensor] = None,
                teacher_topk_log_probs: Optional[torch.Tensor] = None,
                num_items_in_batch: Any = None, output_router_logits: Optional[bool] = None,
                router_loss: Optional[RouterPool] = None,
                **kwargs: Any) -> Any:
        """Student decoder, teacher (module or top-k), then the chunked distillation loss (plus
        the student's router term); without labels, the student's own forward (its logits).

        Args:
            input_ids: ``[B, T]`` int64 (or ``inputs_embeds`` among ``kwargs``).
            labels / shift_labels: at most one, as in
                :meth:`megaloss.integrations.hf.CausalLMWithLoss.forward`; neither: the
                student model's own forward with the other arguments.
            attention_mask, position_ids: passed to both decoders.
            loss_weights: ``[B, T]`` per-token weights of the shifted targets.
            teacher_topk_ids, teacher_topk_log_probs: ``[B, T, k]``, the teacher's top-k at
                each position (aligned with the shifted targets: position ``t``'s distribution
                over the token at ``t + 1``), only without a teacher module.
            num_items_in_batch: with ``reduction="mean"``, the divisor of the token sums
                (Hugging Face's, as in :meth:`megaloss.integrations.hf.CausalLMWithLoss.forward`).
            output_router_logits: a mixture-of-experts student's router logits for this call
                (``None``: its config's). When output, ``loss`` adds the student's
                ``router_aux_loss_coef * aux_loss`` as its own forward adds it to its loss
                (:meth:`router_loss`); the teacher runs with its own config.
            router_loss: the calibrated step's router pool
                (:class:`megaloss.losses.router.RouterPool`): megaloss's calibrated router
                losses on the student's router logits replace its own term (in ``loss``; the
                output's ``router``), as in :meth:`CausalLMWithLoss.forward
                <megaloss.integrations.hf.CausalLMWithLoss.forward>`.
            **kwargs: passed to both decoders (``use_cache`` defaults to ``False``).

        Returns:
            :class:`megaloss.DistillationOutput` under the wrapper's options (``loss``,
            ``divergence`` and ``ce_loss`` reduced alike); with the student's router logits
            output, a :class:`~megaloss.integrations.hf.outputs.MoeDistillationOutput` (the
            same fields, ``loss`` with the router term, then ``aux_loss`` and
            ``router_logits``); without labels, the student's output.

        Raises:
            ValueError: both ``labels`` / ``shift_labels``; a top-k teacher together with a
                teacher module, or neither; ``loss_weights`` / ``num_items_in_batch`` without
                labels; ``num_items_in_batch`` with a reduction other than ``"mean"``; shapes
                (from the loss); router logits output with a router coefficient > 0 under a
                reduction other than ``"mean"`` or with ``loss_weights`` (megaloss's
                calibrated router loss, ``router_loss=`` of the calibrated step, or
                ``output_router_logits=False``), or a router term megaloss cannot reproduce.
        """
        labeled = labels is not None or shift_labels is not None
        # the student decoder's arguments under a pool (the teacher's stay kwargs, as configured)
        pool = self.pool_router_kwargs(router_loss, labeled, kwargs)
        if pool is not None and router_loss.statistics_only:  # the "step" scope's pre-pass
            return self.pool_statistics(router_loss, input_ids, attention_mask, position_ids,
                                        pool)
        if not labeled:
            if output_router_logits is not None:
                kwargs["output_router_logits"] = output_router_logits
            return own_forward(self.model, input_ids, attention_mask, position_ids, kwargs,
                               loss_weights=loss_weights, num_items_in_batch=num_items_in_batch)
        target = shifted_targets(token_grid(input_ids, kwargs), labels, shift_labels,
                                 self.ignore_index, self.logit_transform.shifts_labels)
        kwargs.setdefault("use_cache", False)
        topk = teacher_topk_ids is not None or teacher_topk_log_probs is not None
        if (self.teacher is not None) == topk:
            raise ValueError("give the teacher either as the wrapper's teacher module or as "
                             "teacher_topk_ids / teacher_topk_log_probs per batch (one of them)")
        routed = pool is not None or self.router_logits_requested(output_router_logits)
        if pool is None:
            self.check_router_loss(routed, self.options.reduction, loss_weights)
        if topk:
            teacher = dict(teacher_topk_ids=teacher_topk_ids,
                           teacher_topk_log_probs=teacher_topk_log_probs)
        else:
            teacher = self._teacher_inputs(input_ids, attention_mask, position_ids, kwargs)
        if pool is None:
            self.decoder_router_kwargs(routed, output_router_logits, kwargs)
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids, **(kwargs if pool is None else pool))
        hidden = out.last_hidden_state
        weights = head_loss_weights(
            target, self.ignore_index, self.options.reduction, loss_weights, num_items_in_batch,
            torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        result = self.head(hidden, target, loss_weights=weights, **teacher)
        if not routed:
            return result
        router_logits = getattr(out, "router_logits", None)
        if pool is not None:
            loss, router = self.add_pool_loss(result.loss, router_loss, router_logits,
                                              attention_mask, position_ids)
            return MoeDistillationOutput(*result._replace(loss=loss), aux_loss=None,
                                         router_logits=router_logits, router=router)
        loss, term = self.add_router_loss(result.loss, router_logits, attention_mask)
        return MoeDistillationOutput(*result._replace(loss=loss), aux_loss=term.aux_loss,
                                     router_logits=router_logits)

    def extra_repr(self) -> str:
        return (f"tp_size={self.tp_size}, vocab_size={self.vocab_size}, "
                f"teacher={'module' if self.teacher is not None else 'top-k per batch'}")
