"""One entry point for the sequence-level preference losses, the loss chosen by the type of its
options: :class:`~megaloss.DPOOptions` -> :func:`~megaloss.losses.dpo.dpo_loss`
(DPO, IPO and TRL's other pairwise types; arXiv:2305.18290),
:class:`~megaloss.losses.simpo.CPOOptions` -> :func:`~megaloss.losses.simpo.cpo_loss` (CPO,
arXiv:2401.08417, and SimPO with ``loss_type="simpo"``, arXiv:2405.14734),
:class:`~megaloss.losses.orpo.ORPOOptions` -> :func:`~megaloss.losses.orpo.orpo_loss`
(arXiv:2403.07691), :class:`~megaloss.losses.kto.KTOOptions` ->
:func:`~megaloss.losses.kto.kto_loss` (arXiv:2402.01306).

A training step and a held-out evaluation that take the options from a config both need the
same mapping from options to loss and from the rows of a micro-batch to the loss's arguments;
written once here, they cannot drift apart
(:func:`megaloss.integrations.deepspeed.preference_train_step` and ``launch/train_dpo.py``'s
evaluation call it).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from .dpo import DPOOptions, DPOOutput, dpo_loss
from .kto import KTOOptions, KTOOutput, kto_loss
from .orpo import ORPOOptions, ORPOOutput, orpo_loss
from .simpo import CPOOptions, CPOOutput, cpo_loss

__all__ = ["PreferenceOptions", "PREFERENCE_OPTIONS", "PREFERENCE_LOSSES",
           "preference_loss_kind", "sequence_preference_loss"]

PreferenceOptions = Union[DPOOptions, CPOOptions, ORPOOptions, KTOOptions]

# (options class, loss name); the names key what a caller needs per loss (its micro-batch keys,
# checks and metrics), so they are read from here rather than spelled again
PREFERENCE_OPTIONS: Tuple[Tuple[type, str], ...] = (
    (DPOOptions, "dpo"), (CPOOptions, "cpo"), (ORPOOptions, "orpo"), (KTOOptions, "kto"))
PREFERENCE_LOSSES: Tuple[str, ...] = tuple(name for _, name in PREFERENCE_OPTIONS)


def preference_loss_kind(options: Any) -> str:
    """The name in :data:`PREFERENCE_LOSSES` of the loss ``options`` selects: ``"dpo"``,
    ``"cpo"`` (CPO and SimPO), ``"orpo"`` or ``"kto"``.

    Raises:
        TypeError: ``options`` is an instance of none of the four options classes.
    """
    kind = next((name for cls, name in PREFERENCE_OPTIONS if isinstance(options, cls)), None)
    if kind is None:
        raise TypeError("options must be a DPOOptions, CPOOptions, ORPOOptions or KTOOptions, "
                        f"got {type(options).__name__}")
    return kind


def sequence_preference_loss(
    log_probs: torch.Tensor,
    options: PreferenceOptions,
    *,
    lengths: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    desirable: Optional[torch.Tensor] = None,
    kl: Union[None, float, torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    nll_weight: Union[None, float, torch.Tensor] = None,
    return_stats: bool = False,
) -> Union[torch.Tensor, DPOOutput, CPOOutput, ORPOOutput, KTOOutput]:
    """The preference loss ``options`` selects (:func:`preference_loss_kind`) on one
    micro-batch's sequence log-probs.

    The paired losses (DPO, CPO / SimPO, ORPO) read rows ``[:P]`` as the chosen completions
    and rows ``[P:]`` as the rejected ones of the same pairs (``2P`` rows); KTO reads each row
    as one example. An argument the selected loss does not read is ignored, so a caller passes
    what it has whatever the options (``lengths`` for KTO; ``ref_log_probs`` for CPO / ORPO;
    ``nll_weight`` for DPO and KTO; ``desirable`` and ``kl`` for the paired losses).

    Args:
        log_probs: ``[2P]`` (paired) or ``[B]`` (KTO) floating sequence log-probs under the
            policy (differentiable; :func:`~megaloss.losses.dpo.sequence_log_probs`).
        options: a ``DPOOptions``, ``CPOOptions``, ``ORPOOptions`` or ``KTOOptions``; its
            fields are the loss's.
        lengths: ``[2P]`` (or ``[B]``) completion token counts, integer or floating, in the
            rows' order; required by the length-normalised types (SimPO, ORPO, DPO's ``"ipo"``
            and ``"sigmoid_norm"``), as the loss says.
        ref_log_probs: floating sequence log-probs under the reference (detached), in the rows'
            order: ``[2P]`` for DPO, ``[B]`` for KTO; required by both.
        desirable: KTO's ``[B]`` bool or 0 / 1 labels (required).
        kl: KTO's baseline ``z0`` (:func:`~megaloss.losses.kto.kto_kl_baseline`); ``None``: 0.
        weights: ``[P]`` pair weights (paired losses) or ``[B]`` example weights (KTO), in the
            loss's dtype or castable to it (:func:`~megaloss.losses.orpo.preference_weights`);
            ``None``: the mean over this call's pairs / examples.
        nll_weight: CPO's and ORPO's weight of each NLL token (float or scalar tensor;
            ``None``: the loss's default).
        return_stats: return the loss's ``*Output`` (``DPOOutput``, ``CPOOutput``,
            ``ORPOOutput`` or ``KTOOutput``, what its ``*_metrics`` reads) instead of the loss.

    Returns:
        The loss (a differentiable scalar in ``log_probs``' dtype), or its ``*Output`` with
        ``return_stats=True``: exactly what the selected loss function returns.

    Raises:
        TypeError: ``options`` of none of the four classes; ``log_probs`` not a tensor; the
            loss's own type errors (non-floating inputs).
        ValueError: ``log_probs`` not 1-D; an odd number of rows for a paired loss;
            ``ref_log_probs`` missing for DPO / KTO, ``desirable`` missing for KTO; the loss's
            own shape and option errors.
    """
    kind = preference_loss_kind(options)
    if not isinstance(log_probs, torch.Tensor):
        raise TypeError(f"log_probs must be a torch.Tensor, got {type(log_probs).__name__}")
    if log_probs.dim() != 1:
        raise ValueError(f"log_probs must be 1-D sequence log-probs, got shape "
                         f"{tuple(log_probs.shape)}")
    if kind in ("dpo", "kto") and ref_log_probs is None:
        raise ValueError(f"ref_log_probs is required for {type(options).__name__}")
    if kind == "kto":
        if desirable is None:
            raise ValueError("desirable is required for KTOOptions")
        return kto_loss(log_probs, ref_log_probs, desirable, kl=kl, sample_weights=weights,
                        options=options, return_stats=return_stats)
    rows = log_probs.shape[0]
    if rows % 2:
        raise ValueError(f"log_probs must hold 2P rows (chosen, then rejected) for "
                         f"{type(options).__name__}, got {rows}")
    p = rows // 2
    pair = dict(chosen_lengths=None if lengths is None else lengths[:p],
                rejected_lengths=None if lengths is None else lengths[p:],
                pair_weights=weights, options=options, return_stats=return_stats)
    chosen, rejected = log_probs[:p], log_probs[p:]
    if kind == "dpo":
        return dpo_loss(chosen, rejected, ref_log_probs[:p], ref_log_probs[p:], **pair)
    loss = cpo_loss if kind == "cpo" else orpo_loss
    return loss(chosen, rejected, nll_weight=nll_weight, **pair)
