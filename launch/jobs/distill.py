"""The distillation step of ``launch/distill_lm.py``: a student :class:`megaloss.CausalLMWithLoss`
whose training forward is megaloss's linear distillation loss against a frozen teacher, and whose
eval forward is the student's own cross-entropy (so
:func:`megaloss.integrations.deepspeed.evaluate` reports the student's held-out perplexity).

Training forward, per micro-batch: the teacher's decoder (no grad) and the student's decoder on
the same tokens, then :func:`megaloss.linear_distillation_loss` of both last hidden states with
both lm_heads. Under tensor parallelism each TP rank holds the same vocab rows of both heads
(:func:`megaloss.vocab_shard_range`; :class:`megaloss.CausalLMWithLoss` splits both the same
way), so the loss is vocab-parallel over the TP group and no ``[tokens, vocab]`` logits are
built for either model.

The module's forward takes what :func:`megaloss.integrations.deepspeed.train_step` passes
(``shift_labels``, the calibration's ``loss_weights``) with ``reduction="sum"``, so every
optimizer step is calibrated globally as the CE job's is.

The teacher is held outside the module's parameters (not trained, not in the optimizer, not
in the student's checkpoint, not partitioned by ZeRO).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import nn

__all__ = ["DistilledCausalLM", "DistillationStepOutput"]


class DistillationStepOutput(NamedTuple):
    """The training forward's output, shaped as :class:`megaloss.CrossEntropyOutput` for
    :func:`megaloss.integrations.deepspeed.train_step` (``loss``, ``z_loss`` (0: no z-loss in
    the distillation loss), ``num_valid_tokens``), plus the student's hard-label CE part
    ``ce_loss`` and ``num_top1_matches`` (tokens where student and teacher agree on the most
    likely token), both summed with the calibration's weights / counted, for logging."""

    loss: torch.Tensor
    z_loss: torch.Tensor
    num_valid_tokens: torch.Tensor
    ce_loss: torch.Tensor
    num_top1_matches: torch.Tensor


class DistilledCausalLM(nn.Module):
    """A student trained against a teacher; see the module docstring.

    Args:
        student: the student :class:`megaloss.CausalLMWithLoss` (trained).
        teacher: the teacher :class:`megaloss.CausalLMWithLoss` of the same vocabulary and TP
            group (frozen; moved to the student's device and dtype at the first forward).
        options: :class:`megaloss.DistillationOptions` with ``reduction="sum"``.
        tp_group: the TP group both heads are split over.

    Raises:
        ValueError: vocabularies or TP sizes differ; ``options.reduction`` is not ``"sum"``.
    """

    def __init__(self, student: nn.Module, teacher: nn.Module, options: Any, *,
                 tp_group: Any) -> None:
        super().__init__()
        if student.vocab_size != teacher.vocab_size:
            raise ValueError(f"teacher vocab_size {teacher.vocab_size} differs from the student's "
                             f"{student.vocab_size}")
        if student.tp_size != teacher.tp_size:
            raise ValueError(f"teacher tp_size {teacher.tp_size} differs from the student's "
                             f"{student.tp_size}")
        if options.reduction != "sum":
            raise ValueError(f"options.reduction must be 'sum' (the calibrated step weights "
                             f"tokens itself), got {options.reduction!r}")
        self.student = student
        # Not a submodule: DeepSpeed must neither train, save nor partition the teacher.
        self.__dict__["teacher"] = teacher.requires_grad_(False).eval()
        self.options = options
        self.tp_group = tp_group
        self.vocab_size = student.vocab_size

    def _teacher_on(self, like: torch.Tensor) -> nn.Module:
        teacher = self.__dict__["teacher"]
        w = teacher.head.weight
        if w.device != like.device or w.dtype != like.dtype:
            teacher.to(device=like.device, dtype=like.dtype)
        return teacher

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                shift_labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                loss_weights: Optional[torch.Tensor] = None):
        """Training: the distillation loss (:class:`DistillationStepOutput`); eval: the
        student's :class:`megaloss.CrossEntropyOutput`. Arguments as
        :meth:`megaloss.CausalLMWithLoss.forward` (``input_ids [B, T]`` int64, ``labels`` /
        ``shift_labels [B, T]``, ``loss_weights [B, T]`` aligned with the shifted targets)."""
        student = self.student
        if not self.training:
            return student(input_ids, labels, shift_labels=shift_labels,
                           attention_mask=attention_mask, position_ids=position_ids,
                           loss_weights=loss_weights)
        from megaloss import VocabParallelOptions, causal_shift, linear_distillation_loss_with_stats

        if (labels is None) == (shift_labels is None):
            raise ValueError("pass exactly one of labels (unshifted) and shift_labels")
        if shift_labels is None:
            shift_labels = causal_shift(labels, self.options.ignore_index)
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, use_cache=False)
        hidden = student.decoder(**inputs).last_hidden_state
        teacher = self._teacher_on(student.head.weight)
        with torch.no_grad():
            teacher_hidden = teacher.decoder(**inputs).last_hidden_state
        parallel = (VocabParallelOptions(self.tp_group, self.vocab_size)
                    if student.tp_size > 1 else None)
        out = linear_distillation_loss_with_stats(
            hidden, student.head.weight, shift_labels, teacher_hidden_states=teacher_hidden,
            teacher_weight=teacher.head.weight, loss_weights=loss_weights, options=self.options,
            vocab_parallel_options=parallel)
        return DistillationStepOutput(out.loss, torch.zeros_like(out.loss.detach()),
                                      out.num_valid_tokens, out.ce_loss, out.num_top1_matches)

    def extra_repr(self) -> str:
        return f"teacher={type(self.__dict__['teacher'].model).__name__}, {self.options!r}"
