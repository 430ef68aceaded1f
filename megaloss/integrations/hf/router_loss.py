"""The mixture-of-experts router term of the Hugging Face loss wrappers
(:class:`~megaloss.integrations.hf.CausalLMWithLoss`,
:class:`~megaloss.integrations.hf.CausalLMWithDistillation`,
:class:`~megaloss.integrations.hf.CausalLMWithLogProbs` and
:func:`~megaloss.integrations.hf.apply`):
what :class:`RouterLossHook` adds to a wrapper so that it asks its decoder for router logits
when the model would output them and adds the model's own
``router_aux_loss_coef * load_balancing_loss_func(router_logits, ...)``
(:mod:`megaloss.integrations.router_config`) as the model's forward does, through one method,
:meth:`RouterLossHook.router_loss`.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from ...calibration.weights import sample_ids_from_boundaries
from ...losses.router import RouterPool
from ..router_config import RouterLoss, model_router_loss, router_loss_refusal

__all__ = ["RouterLossHook", "RouterLossTerm"]


class RouterLossTerm(NamedTuple):
    """What :meth:`RouterLossHook.router_loss` returns.

    Attributes:
        loss: the term the wrapper adds to its loss (``coefficient * aux_loss``, a
            differentiable scalar; ``None`` when the model adds no router term).
        aux_loss: the model's own ``aux_loss`` (what ``MoeCausalLMOutputWithPast.aux_loss``
            holds: unscaled, float32 as the model's function computes it), or ``None``.
    """

    loss: Optional[torch.Tensor]
    aux_loss: Optional[torch.Tensor]


class RouterLossHook:
    """The router-loss part of a loss wrapper (module docstring). ``router`` is the model's
    :class:`~megaloss.integrations.router_config.RouterLoss` (``None`` for a model without
    router logits), read by :meth:`_install_router` before the lm_head is replaced."""

    router: Optional[RouterLoss]

    def _install_router(self, model: nn.Module) -> None:
        """Read ``model``'s router term (:func:`~megaloss.integrations.router_config.
        model_router_loss`: a probe forward of the model itself for an MoE model).

        Raises:
            ValueError: the config outputs router logits (``output_router_logits=True``) and
                the model's router term cannot be reproduced (the reason and the fix).
        """
        router = model_router_loss(model)
        if router is not None and router.refusal is not None and router.output_router_logits:
            raise ValueError(router.refusal)
        self.router = router

    @property
    def router_aux_loss_coef(self) -> float:
        """The model's router coefficient (0 without a router term): what a caller of the
        log-probs wrapper multiplies ``out.aux_loss`` by to add the model's term itself."""
        router = self.router
        return 0.0 if router is None or router.aux_function is None else router.coefficient

    def router_logits_requested(self, output_router_logits: Optional[bool]) -> bool:
        """Whether this call outputs router logits: the call's ``output_router_logits``, else
        the model's config (``False`` for a model without router logits)."""
        return self.router is not None and self.router.requested(output_router_logits)

    def check_router_loss(self, requested: bool, reduction: str,
                          loss_weights: Optional[torch.Tensor] = None) -> None:
        """Refuse what cannot carry the model's router term (before the decoder runs).

        Raises:
            ValueError: router logits ``requested`` with a coefficient > 0 and a
                ``reduction`` other than ``"mean"`` or ``loss_weights`` (the calibrated
                step's), or a router term that cannot be reproduced
                (:func:`~megaloss.integrations.router_config.router_loss_refusal`).
        """
        why = router_loss_refusal(self.router, requested, reduction, loss_weights)
        if why is not None:
            raise ValueError(why)

    def decoder_router_kwargs(self, requested: bool, output_router_logits: Optional[bool],
                              kwargs: dict) -> dict:
        """``kwargs`` for the decoder with ``output_router_logits`` set as this call decides
        (for a model without router logits, the call's value passed on when given)."""
        if self.router is not None:
            kwargs["output_router_logits"] = requested
        elif output_router_logits is not None:
            kwargs["output_router_logits"] = output_router_logits
        return kwargs

    def router_loss(self, router_logits: Any,
                    attention_mask: Optional[torch.Tensor]) -> RouterLossTerm:
        """The router term of one forward: the model's own ``coefficient * aux_loss`` on the
        decoder's ``router_logits`` (a tuple of one ``[B * T, E]`` tensor per MoE layer) and
        the call's 2-D ``attention_mask`` (``[B, T]``; ``None``: every token counts), as the
        model's forward computes it. The one place the wrappers compute the router term: a
        calibrated form (global counts, a step's token weights) replaces this method.

        Raises:
            ValueError: the model's router term cannot be reproduced (its reason).
        """
        aux = self.router.aux_loss(router_logits, attention_mask)
        if aux is None:
            return RouterLossTerm(None, None)
        return RouterLossTerm(self.router.coefficient * aux, aux)

    def add_router_loss(self, loss: torch.Tensor, router_logits: Any,
                        attention_mask: Optional[torch.Tensor]):
        """``(loss + term, term)`` with ``term`` the :meth:`router_loss` of this forward, in
        ``loss``'s dtype (the model adds it to its token mean, or to its ``sum /
        num_items_in_batch`` unscaled)."""
        term = self.router_loss(router_logits, attention_mask)
        if term.loss is None:
            return loss, term
        return loss + term.loss.to(loss.dtype), term

    # megaloss's calibrated router losses (the calibrated step's ``router_loss=``) -------------
    def pool_router_kwargs(self, router_loss: Optional[RouterPool], has_labels: bool,
                           kwargs: dict) -> Optional[dict]:
        """The decoder's keyword arguments for a call with the calibrated step's
        ``router_loss=`` pool: ``kwargs`` with router logits requested (the pool's losses then
        *replace* the model's own term, whose per-micro-batch mean has no exact place in a
        calibrated step) and ``use_cache`` off by default; ``None`` without a pool.

        Raises:
            TypeError: ``router_loss`` is not a :class:`megaloss.losses.router.RouterPool`.
            ValueError: the model outputs no router logits (no router to balance), or its
                ``top_k`` is unknown; a pool that is not statistics-only without labels.
        """
        if router_loss is None:
            return None
        if not isinstance(router_loss, RouterPool):
            raise TypeError(f"router_loss must be a megaloss.losses.router.RouterPool (the "
                            f"calibrated step's), got {type(router_loss).__name__}")
        if self.router is None or not self.router.top_k:
            raise ValueError("router losses were asked for (a megaloss.router section or "
                             "LanguageModelLoss(router=...)) but the model has no router "
                             "logits to compute them on (or no known top_k): remove the router "
                             "options")
        if not has_labels and not router_loss.statistics_only:
            raise ValueError("router_loss= (the calibrated step's router pool) needs labels or "
                             "shift_labels")
        return {"use_cache": False, **kwargs, "output_router_logits": True}

    def pool_statistics(self, router_loss: RouterPool, input_ids: Optional[torch.Tensor],
                        attention_mask: Optional[torch.Tensor],
                        position_ids: Optional[torch.Tensor], decoder_kwargs: dict) -> Any:
        """The ``"step"`` scope's routing pre-pass of a statistics-only pool: the decoder's
        forward (``decoder_kwargs`` from :meth:`pool_router_kwargs`), then this rank's
        :class:`~megaloss.losses.router.RouterStatistics` of its router logits."""
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids, **decoder_kwargs)
        return self.pool_router_loss(router_loss, out.router_logits, attention_mask,
                                     position_ids)

    def add_pool_loss(self, loss: torch.Tensor, router_loss: RouterPool, router_logits: Any,
                      attention_mask: Optional[torch.Tensor],
                      position_ids: Optional[torch.Tensor]):
        """``(loss + the pool's share, the share)``: :meth:`pool_router_loss`'s
        :class:`~megaloss.losses.router.RouterLossOutput`, its ``loss`` in ``loss``'s dtype."""
        router = self.pool_router_loss(router_loss, router_logits, attention_mask, position_ids)
        return loss + router.loss.to(loss.dtype), router

    def pool_router_loss(self, router_loss: RouterPool, router_logits: Any,
                         attention_mask: Optional[torch.Tensor],
                         position_ids: Optional[torch.Tensor]) -> Any:
        """The pool's share (:func:`megaloss.losses.router.router_loss`, a
        :class:`~megaloss.losses.router.RouterLossOutput`; or this rank's
        :class:`~megaloss.losses.router.RouterStatistics` for a statistics-only pool) on the
        decoder's ``router_logits`` (one ``[B * T, E]`` tensor per MoE layer), padding masked by
        the 2-D ``attention_mask``, sequences by rows or by ``position_ids`` restarting at 0
        (packed samples)."""
        if not router_logits:
            raise ValueError(f"{type(self.model).__name__}'s decoder returned no router_logits "
                             f"with output_router_logits=True: the router losses cannot be "
                             f"computed")
        layers = tuple(router_logits)
        sequences = None
        if router_loss.options.seq_aux_loss:
            sequences = _sequence_ids(layers[0].shape[0], attention_mask, position_ids)
        return router_loss(layers, int(self.router.top_k), mask=attention_mask,
                           sequence_ids=sequences)


def _sequence_ids(tokens: int, attention_mask: Optional[torch.Tensor],
                  position_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Each routed token's sequence: packed samples from ``position_ids`` (a restart at 0), else
    the rows of the ``[B, T]`` grid (from whichever of the two is given)."""
    grid = position_ids if position_ids is not None else attention_mask
    if grid is None or grid.dim() != 2 or grid.numel() != tokens:
        return None  # one sequence: a single row
    if position_ids is not None:
        return sample_ids_from_boundaries(position_ids, position_ids=position_ids)
    rows, length = grid.shape
    return torch.arange(rows, device=grid.device).repeat_interleave(length)
