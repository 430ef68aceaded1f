"""A causal LM with DeepSeek-V3's multi-token prediction depths for the calibrated step (the MoE
job's ``--mtp D``): :class:`CausalLMWithMTP` wraps a :class:`megaloss.CausalLMWithLoss` and
:class:`launch.jobs.mtp_module.MultiTokenPrediction`; in training its forward is
:func:`megaloss.losses.multi_token.multi_token_prediction_loss` (main CE plus
``scaling_factor / D`` x each depth's CE, every depth through the shared lm_head, chunked) plus
the calibrated step's router pool; otherwise it is the wrapper's (the held-out CE is the main
model's; the ``"step"`` scope's routing pre-pass).

Calibration. The step hands the main loss's per-token ``loss_weights`` (its global token mean,
with the engine's loss multiplier). Depth ``k`` has its own global count: the rolled targets of
every block lose their last ``k`` positions. The job's blocks are full (no ignored target, no
packing: :func:`launch.jobs.text_data.lm_blocks`), so each depth's count is the main count x
``(T - k) / T`` on every rank and micro-batch, and depth ``k``'s weights are the main ones x
``T / (T - k)``: exactly what :func:`megaloss.losses.multi_token.mtp_loss_weights` computes,
without its all-reduce. A micro-batch with an ignored target is refused.
"""
from __future__ import annotations

from typing import Any, List, NamedTuple, Optional

import torch
from torch import nn

from .mtp_module import MultiTokenPrediction

__all__ = ["MTPTrainOutput", "CausalLMWithMTP"]


class MTPTrainOutput(NamedTuple):
    """A training forward's output, what the calibrated step reads (``loss``, ``z_loss``,
    ``num_valid_tokens``, ``router``) and the depths' CE parts (``depth_losses [D]``,
    detached: this micro-batch's part of each depth's global mean, with the step's loss
    multiplier)."""

    loss: torch.Tensor
    z_loss: torch.Tensor
    num_valid_tokens: torch.Tensor
    router: Any
    depth_losses: torch.Tensor


class CausalLMWithMTP(nn.Module):
    """``lm`` (a :class:`megaloss.CausalLMWithLoss` with ``reduction="sum"``, the calibrated
    step's) with ``depth`` MTP depths (module docstring), ``scaling_factor`` (Megatron-core's
    ``mtp_loss_scaling_factor``, divided by ``depth``).

    The depths' CE parts of the training forwards since :meth:`take_depth_sums` add up in
    ``depth_sums`` (float64 ``[D]``). The depths' own decoder layers are MoE layers of the
    model's class, their routers outside the decoder's router logits (not balanced).

    Raises:
        ValueError: ``depth < 1`` (:class:`MultiTokenPrediction`).
    """

    def __init__(self, lm: nn.Module, depth: int, scaling_factor: float) -> None:
        super().__init__()
        self.lm = lm
        self.mtp = MultiTokenPrediction(lm.model, depth)
        # the model's own initialisation for the depths' fresh layers (transformers' MoE
        # experts are torch.empty until the model's post_init initialises them)
        self.mtp.apply(lm.model._init_weights)
        self.depth, self.scaling_factor = depth, float(scaling_factor)
        self.register_buffer("depth_sums", torch.zeros(depth, dtype=torch.float64),
                             persistent=False)

    @property
    def decoder(self) -> nn.Module:
        """The wrapped model's decoder (the wrapper's)."""
        return self.lm.decoder

    def forward(self, input_ids: torch.Tensor, shift_labels: Optional[torch.Tensor] = None, *,
                loss_weights: Optional[torch.Tensor] = None, router_loss: Any = None,
                **kwargs: Any) -> Any:
        """Training with ``loss_weights`` and ``router_loss`` (the calibrated step): an
        :class:`MTPTrainOutput`; else the wrapper's forward.

        Raises:
            ValueError: an ignored target in a training micro-batch (module docstring).
        """
        from megaloss.losses.multi_token import multi_token_prediction_loss

        if (not self.training or loss_weights is None or shift_labels is None
                or router_loss is None or router_loss.statistics_only):
            return self.lm(input_ids, shift_labels=shift_labels, loss_weights=loss_weights,
                           router_loss=router_loss, **kwargs)
        ignore = self.lm.ignore_index
        if bool((shift_labels == ignore).any()):
            raise ValueError("CausalLMWithMTP calibrates the depths for full blocks: a training "
                             f"micro-batch holds targets equal to ignore_index={ignore}")
        kwargs["output_router_logits"] = True
        kwargs.setdefault("use_cache", False)
        out = self.lm.decoder(input_ids=input_ids, **kwargs)
        hidden = out.last_hidden_state
        depth_hidden = self.mtp(hidden, input_ids)
        t = shift_labels.shape[-1]
        weights: List[torch.Tensor] = [loss_weights] + [
            loss_weights * (t / (t - k)) if t > k else torch.zeros_like(loss_weights)
            for k in range(1, self.depth + 1)]
        head = self.lm.head
        mtp = multi_token_prediction_loss(hidden, head.weight, shift_labels, depth_hidden,
                                          bias=head.bias, scaling_factor=self.scaling_factor,
                                          loss_weights=weights, options=head.options)
        router = self.lm.pool_router_loss(router_loss, out.router_logits, None, None)
        depth_losses = mtp.depth_losses.detach().to(torch.float64)
        self.depth_sums += depth_losses
        return MTPTrainOutput(loss=mtp.loss + router.loss.to(mtp.loss.dtype),
                              z_loss=torch.zeros((), dtype=mtp.loss.dtype),
                              num_valid_tokens=(shift_labels != ignore).sum(), router=router,
                              depth_losses=depth_losses)

    def take_depth_sums(self) -> torch.Tensor:
        """``depth_sums`` (a copy), then zeroed."""
        sums = self.depth_sums.clone()
        self.depth_sums.zero_()
        return sums
