"""The last stage of a megaloss pipeline: :class:`CrossEntropyHeadStage` (the lm_head as a
pipeline layer) and :class:`PipelineCrossEntropyLoss` (the ``loss_fn`` that applies the step's
calibrated weights and the measured multipliers), with :func:`last_stage_sums` (the step's
loss sums, shared by every stage).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...losses.cross_entropy import CrossEntropyOutput, linear_cross_entropy
from ...losses.vocab_parallel_head import VocabParallelLMHead
from ...ops.cross_entropy_options import CrossEntropyOptions
from ...parallel.comm import all_reduce_sum_
from ...parallel.groups import SINGLE_RANK, GroupLike, group_ranks, group_size
from .pipeline_layout import PipelineLayout
from .pipeline_probe import PipelineScale

__all__ = ["CrossEntropyHeadStage", "PipelineCrossEntropyLoss", "last_stage_sums"]


class CrossEntropyHeadStage(nn.Module):
    """The last pipeline stage's layer: the final norm in ``forward`` and the lm_head with the
    fused (TP > 1: vocab-parallel) cross-entropy in :meth:`loss`, which the pipeline's
    ``loss_fn`` (:class:`PipelineCrossEntropyLoss`) calls. No ``[tokens, vocab]`` logits.

    Args:
        lm_head: the full ``nn.Linear`` ``[V, H]`` lm_head; with ``tp_group`` of size > 1 this
            rank keeps its vocab rows (:class:`megaloss.VocabParallelLMHead`, parameters tagged
            ``tensor_model_parallel``).
        options: CE options (``reduction="sum"``, the default, is required: the calibration
            weights the tokens).
        tp_group: the tensor-parallel group (``PipelineLayout.topology.tp_group``).
        norm: the decoder's final norm (``forward`` applies it), or None.

    Raises:
        TypeError: ``lm_head`` not an ``nn.Linear``; ``options`` not CrossEntropyOptions.
        ValueError: ``options.reduction`` is not ``"sum"``.
    """

    def __init__(self, lm_head: nn.Linear, *, options: Optional[CrossEntropyOptions] = None,
                 tp_group: GroupLike = SINGLE_RANK, norm: Optional[nn.Module] = None) -> None:
        super().__init__()
        if not isinstance(lm_head, nn.Linear):
            raise TypeError(f"lm_head must be an nn.Linear, got {type(lm_head).__name__}")
        options = CrossEntropyOptions(reduction="sum") if options is None else options
        if not isinstance(options, CrossEntropyOptions):
            raise TypeError(f"options must be a CrossEntropyOptions, got "
                            f"{type(options).__name__}")
        if options.reduction != "sum":
            raise ValueError(f"options.reduction must be 'sum' (the calibration weights the "
                             f"tokens), got {options.reduction!r}")
        self.options = options
        self.norm = norm
        if group_size(tp_group) > 1:
            vocab, hidden = lm_head.weight.shape
            head = VocabParallelLMHead(hidden, vocab, tp_group=tp_group,
                                       bias=lm_head.bias is not None, dtype=lm_head.weight.dtype,
                                       device=lm_head.weight.device, options=options)
            head.load_full_weight(lm_head.weight.detach(),
                                  None if lm_head.bias is None else lm_head.bias.detach())
            self.lm_head: nn.Module = head
        else:
            self.lm_head = lm_head

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states if self.norm is None else self.norm(hidden_states)

    def loss(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
             loss_weights: Optional[torch.Tensor] = None) -> CrossEntropyOutput:
        """Fused CE of ``hidden_states [..., H]`` against *shifted* ``labels [...]`` with
        per-token ``loss_weights`` (same shape), as :class:`megaloss.CrossEntropyOutput`."""
        if isinstance(self.lm_head, VocabParallelLMHead):
            return self.lm_head(hidden_states, labels, loss_weights=loss_weights,
                                return_stats=True)
        return linear_cross_entropy(hidden_states, self.lm_head.weight, labels,
                                    bias=self.lm_head.bias, loss_weights=loss_weights,
                                    options=self.options, return_stats=True)


class PipelineCrossEntropyLoss:
    """The pipeline's ``loss_fn(outputs, labels)`` on the last stage, ``labels`` =
    ``(shift_labels, loss_weights)`` as :func:`pipeline_train_step` feeds them.

    Training: returns a scalar whose value is ``local x loss_log_multiplier`` and whose gradient
    is that of ``local x gradient multiplier`` (``local = sum_t w_t * l_t``), so the engine's
    gradients and its returned loss are both the global ones (:class:`PipelineScale`). Eval
    (the stage in ``eval()`` mode): the plain CE sum (z-loss left out). The detached sums and
    valid-token counts are kept for :meth:`global_sums`.
    """

    def __init__(self, stage: CrossEntropyHeadStage, scale: PipelineScale) -> None:
        self.stage = stage
        self.gradient_multiplier = float(scale.gradient.loss_multiplier)
        self.log_multiplier = float(scale.loss_log_multiplier)
        self.reset()

    def reset(self) -> None:
        self._sums = torch.zeros(3, dtype=torch.float64)  # loss, z-loss, valid tokens

    def __call__(self, outputs: torch.Tensor, labels: Sequence[torch.Tensor]) -> torch.Tensor:
        shift_labels, weights = labels
        out = self.stage.loss(outputs, shift_labels, loss_weights=weights)
        local = out.loss if self.stage.training else out.loss - out.z_loss
        self._sums = self._sums.to(local.device)
        self._sums += torch.stack([local.detach().double(), out.z_loss.detach().double(),
                                   out.num_valid_tokens.detach().double()])
        if not self.stage.training:
            return local
        g, m = self.gradient_multiplier, self.log_multiplier
        return local * g + local.detach() * (m - g)

    def global_sums(self, layout: PipelineLayout, device: torch.device) -> torch.Tensor:
        """``[loss, z-loss, valid tokens]`` summed over the last stage's data-parallel group
        since :meth:`reset`, float64, on every rank (broadcast over the pipeline from its last
        stage). Collective: every rank calls it."""
        return last_stage_sums(self._sums, layout, device)


def last_stage_sums(sums: Optional[torch.Tensor], layout: PipelineLayout,
                     device: torch.device) -> torch.Tensor:
    topo = layout.topology
    out = torch.zeros(3, dtype=torch.float64, device=device)
    if layout.is_last_stage and sums is not None:
        out += sums.to(device)
        all_reduce_sum_(out, topo.dp_group)
    if topo.pp_size > 1:
        src = group_ranks(topo.pp_group)[-1]
        dist.broadcast(out, src=src, group=topo.pp_group)
    return out
