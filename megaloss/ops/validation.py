"""Argument checks shared by the cross-entropy entry points: clear ValueError/TypeError naming the
argument, never a silent broadcast, a NaN or a device-side assert."""
from __future__ import annotations

from typing import Optional

import torch


def check_ce_tensors(hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                     bias: Optional[torch.Tensor], loss_weights: Optional[torch.Tensor],
                     *, weight_name: str = "weight") -> None:
    """Shapes, dtypes and devices of the CE inputs (the vocab range of labels is checked
    separately, since it needs the global V)."""
    for name, t in (("hidden_states", hidden_states), (weight_name, weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not hidden_states.is_floating_point():
        raise TypeError(f"hidden_states must be a floating tensor, got {hidden_states.dtype}")
    if not weight.is_floating_point():
        raise TypeError(f"{weight_name} must be a floating tensor, got {weight.dtype}")
    if hidden_states.dim() < 1:
        raise ValueError("hidden_states must have shape [..., H], got a 0-dim tensor")
    if weight.dim() != 2:
        raise ValueError(f"{weight_name} must have shape [V, H], got {tuple(weight.shape)}")
    if weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(f"{weight_name} has hidden size {weight.shape[1]} but hidden_states has "
                         f"{hidden_states.shape[-1]} (shapes {tuple(weight.shape)} and "
                         f"{tuple(hidden_states.shape)})")
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if tuple(labels.shape) != tuple(hidden_states.shape[:-1]):
        raise ValueError(f"labels must have shape {tuple(hidden_states.shape[:-1])} "
                         f"(hidden_states.shape[:-1]), got {tuple(labels.shape)}")
    devices = {("hidden_states", hidden_states.device), (weight_name, weight.device),
               ("labels", labels.device)}
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError("bias must be a floating torch.Tensor or None")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape [{weight.shape[0]}], got {tuple(bias.shape)}")
        devices.add(("bias", bias.device))
    if loss_weights is not None:
        if not isinstance(loss_weights, torch.Tensor) or not loss_weights.is_floating_point():
            raise TypeError("loss_weights must be a floating torch.Tensor or None")
        if tuple(loss_weights.shape) != tuple(labels.shape):
            raise ValueError(f"loss_weights must have the shape of labels {tuple(labels.shape)}, "
                             f"got {tuple(loss_weights.shape)}")
        devices.add(("loss_weights", loss_weights.device))
    if len({d for _, d in devices}) > 1:
        raise ValueError("all inputs must be on one device, got "
                         + ", ".join(f"{n} on {d}" for n, d in sorted(devices, key=str)))


def first_bad_label(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> Optional[int]:
    """The first label outside [0, vocab_size) that is not ignore_index, or None (one host sync:
    the alternative is a device-side assert or silent garbage)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    return int(labels[bad][0]) if bool(bad.any()) else None


def label_range_error(value: int, vocab_size: int, ignore_index: int) -> ValueError:
    return ValueError(f"labels must be in [0, {vocab_size}) or ignore_index={ignore_index}, "
                      f"found {value}")


def check_label_range(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise :func:`label_range_error` for the first out-of-range label, if any."""
    value = first_bad_label(labels, vocab_size, ignore_index)
    if value is not None:
        raise label_range_error(value, vocab_size, ignore_index)
