"""Each token's coefficient in a loss reduced over tokens: what the chunk driver multiplies a
token's loss (and its logit gradient) by, so that ``reduction="mean"`` / ``"sum"`` / ``"none"``
mean what they mean in ``torch.nn.functional.cross_entropy``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["TokenCoefficients", "token_coefficients"]


class TokenCoefficients(NamedTuple):
    """``valid [N]`` bool (label not ignored); ``coef [N]`` each token's coefficient."""

    valid: torch.Tensor
    coef: torch.Tensor


def token_coefficients(labels: torch.Tensor, ignore_index: int, reduction: str,
                       loss_weights: Optional[torch.Tensor], dtype: torch.dtype,
                       class_of_label: Optional[torch.Tensor] = None) -> TokenCoefficients:
    """The coefficients of a token-reduced loss.

    Args:
        labels: ``[N]`` int64 (``ignore_index`` where ignored).
        ignore_index: the ignored label.
        reduction: ``"mean"``: ``w_t / sum_t(w_t c_t)``; ``"sum"`` / ``"none"``: ``w_t``, with
            ``w_t`` the token's loss weight (1 without ``loss_weights``; 0 where ignored) and
            ``c_t`` its label's class weight (1 without ``class_of_label``) — torch's weighted
            mean divides by the sum of the labels' class weights.
        loss_weights: ``[N]`` per-token weights, or ``None``.
        dtype: the statistics dtype of the coefficients (fp32, fp64 for fp64 inputs).
        class_of_label: ``[N]`` the class weight of each token's label (0 where ignored).

    The mean's denominator is clamped to the dtype's smallest normal so that "every label
    ignored" gives 0, not 0/0, without a host sync.
    """
    valid = labels != ignore_index
    w_tok = valid.to(dtype)
    if loss_weights is not None:
        w_tok = w_tok * loss_weights.to(dtype)
    if reduction != "mean":
        return TokenCoefficients(valid, w_tok)
    total = w_tok if class_of_label is None else w_tok * class_of_label
    return TokenCoefficients(valid, w_tok / total.sum().clamp_min(torch.finfo(dtype).tiny))
