"""``nn.Module`` wrapper of :func:`megaloss.contrastive.mnr.mnr_loss` with an optional learnable
temperature (CLIP's ``logit_scale``)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .mnr import SIMILARITIES, MNROutput, mnr_loss, mnr_loss_with_metrics

__all__ = ["MultipleNegativesRankingLoss"]


class MultipleNegativesRankingLoss(nn.Module):
    """Gathered MNR / InfoNCE loss (see :mod:`megaloss.contrastive.mnr` for the math and the
    data-parallel gradient contract).

    Args:
        temperature: initial ``T > 0`` (``0.05`` = sentence-transformers' ``scale=20``).
        learnable_temperature: learn ``logit_scale = ln(1/T)`` as a parameter (CLIP, Radford et al.
            2021; open_clip). Its value is clamped to ``max_logit_scale`` in forward (no gradient
            past the clamp), i.e. ``T >= exp(-max_logit_scale)``.
        max_logit_scale: upper clamp of ``logit_scale``; CLIP's ``ln(100)``.
        similarity, symmetric, gather, group, local_loss, chunk_size: as in :func:`mnr_loss`
            (keyword-only).

    ``forward(query [B, D], positive [B, D], negatives [B, K, D] | None, duplicate_ids [B] | None)``
    returns the 0-dim global loss; :meth:`forward_with_metrics` returns an :class:`MNROutput`.
    Under ZeRO-3 call ``forward`` (the module's hooks gather ``logit_scale`` only there).

    Raises:
        ValueError: ``temperature <= 0``, unknown ``similarity``, or a learnable temperature whose
            initial ``logit_scale`` already exceeds ``max_logit_scale``.
    """

    def __init__(self, temperature: float = 0.05, *, learnable_temperature: bool = False,
                 max_logit_scale: float = math.log(100.0), similarity: str = "cosine",
                 symmetric: bool = False, gather: bool = True,
                 group: Optional[ProcessGroup] = None, local_loss: bool = True,
                 chunk_size: int = 1024) -> None:
        super().__init__()
        if not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        if similarity not in SIMILARITIES:
            raise ValueError(f"similarity must be one of {SIMILARITIES}, got {similarity!r}")
        init_scale = math.log(1.0 / temperature)
        if learnable_temperature and init_scale > max_logit_scale + 1e-12:
            raise ValueError(f"temperature={temperature} gives logit_scale {init_scale:.4f} above "
                             f"max_logit_scale={max_logit_scale:.4f}")
        self.learnable_temperature = learnable_temperature
        self.max_logit_scale = float(max_logit_scale)
        self.similarity, self.symmetric, self.gather = similarity, symmetric, gather
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        self.group, self.local_loss, self.chunk_size = group, local_loss, chunk_size
        if learnable_temperature:
            self.logit_scale = nn.Parameter(torch.tensor(init_scale, dtype=torch.float32))
        else:
            self.register_parameter("logit_scale", None)
            self._temperature = float(temperature)

    @property
    def temperature(self):
        """Current ``T``: a float, or a 0-dim tensor ``exp(-min(logit_scale, max))`` (with grad)."""
        if self.logit_scale is None:
            return self._temperature
        return torch.exp(-self.logit_scale.clamp(max=self.max_logit_scale))

    def _options(self):
        return dict(temperature=self.temperature, similarity=self.similarity,
                    symmetric=self.symmetric, gather=self.gather, group=self.group,
                    local_loss=self.local_loss, chunk_size=self.chunk_size)

    def forward(self, query: torch.Tensor, positive: torch.Tensor,
                negatives: Optional[torch.Tensor] = None,
                duplicate_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        return mnr_loss(query, positive, negatives, duplicate_ids=duplicate_ids, **self._options())

    def forward_with_metrics(self, query: torch.Tensor, positive: torch.Tensor,
                             negatives: Optional[torch.Tensor] = None,
                             duplicate_ids: Optional[torch.Tensor] = None) -> MNROutput:
        """Loss plus top-1 accuracy and mean rank of the positive (:class:`MNROutput`)."""
        return mnr_loss_with_metrics(query, positive, negatives, duplicate_ids=duplicate_ids,
                                     **self._options())

    def extra_repr(self) -> str:
        t = (f"logit_scale=learnable(max={self.max_logit_scale:.4f})" if self.learnable_temperature
             else f"temperature={self._temperature}")
        return (f"{t}, similarity={self.similarity!r}, symmetric={self.symmetric}, "
                f"gather={self.gather}, local_loss={self.local_loss}")
