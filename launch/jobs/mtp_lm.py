"""A causal LM with DeepSeek-V3's multi-token prediction depths, the module the calibrated step's
multi-token prediction family trains (the MoE job's ``--mtp D``,
:class:`megaloss.integrations.step.mtp.MultiTokenPredictionStepLoss` through
:func:`megaloss.integrations.step.run_step`): :class:`CausalLMWithMTP` wraps a
:class:`megaloss.CausalLMWithLoss` and :class:`launch.jobs.mtp_module.MultiTokenPrediction`.

Called by that family (``loss_weights`` one tensor per depth, the main loss's first, and
``mtp_labels``: every depth calibrated over the global batch by its own valid-token count, the
family's one all-reduce) its forward is
:func:`megaloss.losses.multi_token.multi_token_prediction_loss` (the main CE plus
``scaling_factor / D`` x each depth's CE, every depth through the shared lm_head, chunked) plus
the step's router pool's share. Otherwise it is the wrapper's forward: the held-out CE is the
main model's, and the ``"step"`` router scope's pre-pass routes the main model's tokens.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch import nn

from .mtp_module import MultiTokenPrediction

__all__ = ["MTPTrainOutput", "CausalLMWithMTP"]


class MTPTrainOutput(NamedTuple):
    """A training forward's output, what the multi-token prediction family reads: ``loss``
    (differentiable), ``z_loss`` (0: the CE options' z-loss is inside every term),
    ``num_valid_tokens``, ``router`` (the pool's router losses, or None) and ``depth_losses``
    ``[D]`` (detached: this micro-batch's part of each depth's global mean)."""

    loss: torch.Tensor
    z_loss: torch.Tensor
    num_valid_tokens: torch.Tensor
    router: Any
    depth_losses: torch.Tensor


class CausalLMWithMTP(nn.Module):
    """``lm`` (a :class:`megaloss.CausalLMWithLoss` with ``reduction="sum"``, the calibrated
    step's) with ``depth`` MTP depths (module docstring), ``scaling_factor`` (Megatron-core's
    ``mtp_loss_scaling_factor``, divided by ``depth``). The depths' own decoder layers are
    layers of the model's class (MoE layers for an MoE model, initialised as the model's own),
    whose routers are outside the decoder's router logits (not balanced).

    Raises:
        ValueError: ``depth < 1`` (:class:`MultiTokenPrediction`).
    """

    def __init__(self, lm: nn.Module, depth: int, scaling_factor: float) -> None:
        super().__init__()
        self.lm = lm
        self.mtp = MultiTokenPrediction(lm.model, depth)
        self.depth, self.scaling_factor = depth, float(scaling_factor)

    @property
    def decoder(self) -> nn.Module:
        """The wrapped model's decoder (the wrapper's)."""
        return self.lm.decoder

    def forward(self, input_ids: torch.Tensor, shift_labels: Optional[torch.Tensor] = None, *,
                loss_weights: Any = None, mtp_labels: Optional[Sequence[torch.Tensor]] = None,
                router_loss: Any = None, **kwargs: Any) -> Any:
        """With ``mtp_labels`` (the multi-token prediction family's call: ``loss_weights`` then
        holds ``D + 1`` tensors): an :class:`MTPTrainOutput`; else the wrapper's forward."""
        from megaloss.losses.multi_token import multi_token_prediction_loss

        if mtp_labels is None or (router_loss is not None and router_loss.statistics_only):
            return self.lm(input_ids, shift_labels=shift_labels, loss_weights=loss_weights,
                           router_loss=router_loss, **kwargs)
        pool = self.lm.pool_router_kwargs(router_loss, True, kwargs)  # the step's router pool
        out = self.lm.decoder(input_ids=input_ids,
                              **(pool if pool is not None else {"use_cache": False, **kwargs}))
        hidden = out.last_hidden_state
        head = self.lm.head
        mtp = multi_token_prediction_loss(
            hidden, head.weight, shift_labels, self.mtp(hidden, input_ids), bias=head.bias,
            scaling_factor=self.scaling_factor, loss_weights=loss_weights,
            depth_labels=mtp_labels, options=head.options)
        loss, router = mtp.loss, None
        if pool is not None:
            loss, router = self.lm.add_pool_loss(loss, router_loss, out.router_logits,
                                                 kwargs.get("attention_mask"),
                                                 kwargs.get("position_ids"))
        return MTPTrainOutput(loss=loss, z_loss=torch.zeros((), dtype=loss.dtype),
                              num_valid_tokens=(shift_labels != self.lm.ignore_index).sum(),
                              router=router, depth_losses=mtp.depth_losses)
