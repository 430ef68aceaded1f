"""The options of the linear distillation loss (:func:`megaloss.linear_distillation_loss`, its
module and vocab-parallel forms), read down to its chunk kernel (:mod:`.distillation_chunk`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .cross_entropy_options import CE_REDUCTIONS
from .options import (
    OptionsBase,
    check_bool,
    check_choice,
    check_chunk_fields,
    check_finite_positive,
    check_float,
    check_softcapping,
)

__all__ = ["DistillationOptions", "DISTILLATION_KINDS"]


DISTILLATION_KINDS = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class DistillationOptions(OptionsBase):
    """Options of :func:`megaloss.linear_distillation_loss` and its vocab-parallel form.

    With ``P`` the teacher's and ``Q`` the student's distribution at ``temperature`` (softmax of
    the soft-capped logits divided by ``T``), per valid token (label != ``ignore_index``)::

        loss = (1 - alpha) * T2 * D(P, Q) + alpha * CE(student logits at T=1, label)

    with ``T2 = T**2`` when ``temperature_squared`` (Hinton et al. 2015, arXiv:1503.02531: it
    keeps the soft term's gradient scale independent of ``T``), else 1.

    Attributes:
        kind: ``D``: ``"forward_kl"`` ``KL(P || Q)``, ``"reverse_kl"`` ``KL(Q || P)``, or
            ``"jsd"``, the generalised Jensen-Shannon divergence of Liger-Kernel
            (linkedin/Liger-Kernel, ``src/liger_kernel/ops/jsd.py``):
            ``beta * KL(P || M) + (1 - beta) * KL(Q || M)``, ``M = beta * P + (1 - beta) * Q``,
            where, as there, ``beta = 0`` is forward KL and ``beta = 1`` reverse KL (the
            formula itself is 0 at both ends; Liger switches to the KLs there, and so does this).
        beta: the JSD's ``beta`` in ``[0, 1]`` (read only for ``kind="jsd"``).
        temperature: ``T > 0`` (finite), applied to both models' (soft-capped) logits; with a
            top-k teacher the stored log-probs are taken as the teacher's distribution at ``T``.
        temperature_squared: multiply the divergence by ``T**2`` (bool).
        alpha: weight of the hard-label cross-entropy in ``[0, 1]``; 0 (default) is pure
            distillation.
        ignore_index: label of positions with neither loss nor gradient (int).
        reduction: ``"mean"`` over valid tokens (with ``loss_weights``: ``sum(w*l)/sum(w)``),
            ``"sum"`` (of ``w*l``) or ``"none"`` (per token, 0 at ignored positions).
        logit_softcapping: Gemma 2's ``c * tanh(z / c)`` on the student's logits
            (arXiv:2408.00118), ``None`` or ``> 0``.
        teacher_logit_softcapping: the same for the teacher's logits.
        chunk_size: tokens per chunk (``>= 1``), or ``None`` (default):
            :func:`~megaloss.ops.chunk_driver.auto_chunk_size`. The working set is a few
            ``chunk_size x V`` fp32 buffers (``x V/tp`` under tensor parallelism).
        accum_dtype: floating dtype of the student weight/bias gradient accumulation.

    Raises:
        ValueError / TypeError: an option out of range or of the wrong type, naming it.
    """

    kind: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    temperature_squared: bool = True
    alpha: float = 0.0
    ignore_index: int = -100
    reduction: str = "mean"
    logit_softcapping: Optional[float] = None
    teacher_logit_softcapping: Optional[float] = None
    chunk_size: Optional[int] = None
    accum_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, DISTILLATION_KINDS)
        check_choice("reduction", self.reduction, CE_REDUCTIONS)
        check_float("beta", self.beta, 0.0, 1.0)
        check_float("alpha", self.alpha, 0.0, 1.0)
        check_finite_positive("temperature", self.temperature)
        check_bool("temperature_squared", self.temperature_squared)
        check_softcapping(self, "logit_softcapping")
        check_softcapping(self, "teacher_logit_softcapping")
        check_chunk_fields(self)
        for name in ("beta", "alpha", "temperature"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def divergence(self) -> str:
        """The divergence computed: ``kind``, with ``"jsd"`` at ``beta`` 0 / 1 resolved to
        ``"forward_kl"`` / ``"reverse_kl"`` (Liger-Kernel's convention)."""
        if self.kind == "jsd" and self.beta in (0.0, 1.0):
            return "forward_kl" if self.beta == 0.0 else "reverse_kl"
        return self.kind

    @property
    def soft_scale(self) -> float:
        """``(1 - alpha) * T2``: the divergence's factor in the loss."""
        t2 = self.temperature ** 2 if self.temperature_squared else 1.0
        return (1.0 - self.alpha) * t2

