"""Label conventions: Hugging Face causal LMs take *unshifted* labels (``labels = input_ids``) and
shift inside (``transformers``' ``ForCausalLMLoss`` in ``loss/loss_utils.py``); megaloss's losses
and calibration take the shifted targets."""
from __future__ import annotations

import torch

__all__ = ["causal_shift"]


def causal_shift(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Hugging Face labels (``labels[b, t]`` = token at ``t``) -> shifted targets.

    ``out[b, t] = labels[b, t + 1]`` and ``out[b, T - 1] = ignore_index``, so ``out`` keeps the
    shape ``[B, T]`` of the hidden states (counting valid tokens *after* the shift, one fewer per
    row, as the calibration requires).

    Raises:
        TypeError: ``labels`` is not an integer tensor.
        ValueError: ``labels`` has no sequence dim.
    """
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point():
        raise TypeError(f"labels must be an integer tensor, got {getattr(labels, 'dtype', labels)}")
    if labels.dim() < 1:
        raise ValueError("labels must have a sequence dimension [..., T]")
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=ignore_index)
