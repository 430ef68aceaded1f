"""Argument checks shared by the cross-entropy entry points: clear ValueError/TypeError naming the
argument, never a silent broadcast, a NaN or a device-side assert.

Under ``torch.compile`` (while Dynamo traces a call: :func:`compiling`) the checks of tensor
*values*, each a host sync that Dynamo cannot trace (``bool(tensor)`` is a graph break), change:

- the values that would otherwise give a silently wrong loss (a label out of range, which the
  chunk kernels would clamp into the vocabulary; negative or non-finite class weights; a
  malformed top-k teacher) are checked in the graph by :func:`flagged`, with
  ``torch._assert_async``: no graph break, no host sync; a bad value raises a ``RuntimeError``
  carrying the same message when the compiled call runs (CPU), or fires a device-side assert
  (CUDA, as ``F.cross_entropy``'s own for a label out of range), instead of the ValueError
  naming the first bad value;
- the NaN / inf scan of the hidden states (:func:`check_finite`) is skipped: such a row makes
  the loss NaN, which is not silent.

Shapes, dtypes, devices and options are Python-level facts Dynamo guards on: checked alike in
both modes. In eager mode every check is as before.
"""
from __future__ import annotations

from typing import Optional

import torch


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (False without torch.distributed)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without torch.distributed
        return False
    return isinstance(t, DTensor)


def check_not_dtensor(name: str, t) -> None:
    """Refuse a ``torch.distributed.tensor.DTensor`` input (a sharded FSDP2 ``fully_shard``
    parameter read outside the forward of the module that owns it), naming the fix.

    Under FSDP2 (``torch/distributed/fsdp/_fully_shard/_fully_shard.py``) a parameter is a
    ``Shard(0)`` DTensor except inside the forward (and backward) of its FSDP unit, where the
    unit's pre-forward hook swaps in the unsharded tensor in the MixedPrecisionPolicy's
    ``param_dtype``. A loss given ``model.lm_head.weight`` directly therefore receives the shard.
    A tensor-parallel lm_head (``ColwiseParallel``, a ``Shard(0)`` DTensor over the TP mesh
    dimension) goes in as its local rows with
    :meth:`megaloss.VocabParallelOptions.from_dtensor`, which the message names.

    Raises:
        TypeError: ``t`` is a DTensor.
    """
    if is_dtensor(t):
        placements = getattr(t, "placements", None)
        raise TypeError(
            f"{name} is a DTensor (placements {placements}, global shape {tuple(t.shape)}); "
            "megaloss takes this rank's plain tensors. If it is\n"
            "- a parameter sharded by FSDP2's fully_shard, read outside the forward of its "
            "unit: compute the loss in an FSDP-managed forward (megaloss.integrations.hf's "
            "heads, built before fully_shard, or a method of the lm_head's module registered "
            "with torch.distributed.fsdp.register_fsdp_forward_method);\n"
            "- a tensor-parallel lm_head (ColwiseParallel, Shard(0) over the TP mesh "
            "dimension): w, opts = megaloss.VocabParallelOptions.from_dtensor(weight), then "
            "the loss of (..., w, ..., vocab_parallel_options=opts)")


def compiling() -> bool:
    """Whether ``torch.compile`` (Dynamo) is tracing the current call
    (``torch.compiler.is_compiling()``): the value checks then go in the graph (module doc)."""
    return torch.compiler.is_compiling()


def flagged(bad: torch.Tensor, message: str) -> bool:
    """Whether any element of the bool tensor ``bad`` is True.

    Eager: ``bool(bad.any())``, one host sync; the caller raises its own error naming the bad
    value. Under ``torch.compile`` (:func:`compiling`): ``torch._assert_async(~bad.any(),
    message)`` in the graph and ``False`` returned, so no graph break and no host sync; the
    compiled call raises ``RuntimeError(message)`` where a value is bad (a device-side assert
    on CUDA).
    """
    if compiling():
        torch._assert_async(~bad.any(), message)
        return False
    return bool(bad.any())


def check_ce_tensors(hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                     bias: Optional[torch.Tensor], loss_weights: Optional[torch.Tensor],
                     *, weight_name: str = "weight") -> None:
    """Shapes, dtypes and devices of the CE inputs (the vocab range of labels is checked
    separately, since it needs the global V), and finite hidden states (:func:`check_finite`;
    the weight is not scanned: ``V x H`` per call). A DTensor input is refused
    (:func:`check_not_dtensor`)."""
    for name, t in (("hidden_states", hidden_states), (weight_name, weight), ("labels", labels),
                    ("bias", bias), ("loss_weights", loss_weights)):
        check_not_dtensor(name, t)
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
        why = (": an empty placeholder, as a ZeRO-3 parameter is outside its module's forward; "
               "compute the loss inside that forward (the HF wrappers do), or gather it "
               "(deepspeed.zero.GatheredParameters)") if weight.numel() == 0 else ""
        raise ValueError(f"{weight_name} must have shape [V, H], got {tuple(weight.shape)}{why}")
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
    check_finite("hidden_states", hidden_states)


def check_finite(name: str, x: torch.Tensor) -> None:
    """Raise a ValueError naming ``name`` and the first token whose row of ``x [..., H]`` holds
    a NaN or an infinity. One pass over ``x`` and one host sync (as the label-range check); the
    loss of such a row would be NaN, and so would every gradient of the step. Skipped under
    ``torch.compile`` (:func:`compiling`): the NaN loss shows it there."""
    if x.device.type == "meta" or x.numel() == 0 or compiling():
        return
    bad = ~torch.isfinite(x.reshape(-1, x.shape[-1])).all(dim=-1)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise ValueError(f"{name} holds NaN or inf (first at token {first} of "
                         f"{bad.numel()}): the computation before the loss overflowed or "
                         "diverged")


def first_bad_label(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> Optional[int]:
    """The first label outside [0, vocab_size) that is not ignore_index, or None (one host sync:
    the alternative is a device-side assert or silent garbage). Under ``torch.compile``: None,
    the check asserted in the graph (:func:`flagged`)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if not flagged(bad, label_range_message(vocab_size, ignore_index)):
        return None
    return int(labels[bad][0])


def label_range_message(vocab_size: int, ignore_index: int) -> str:
    return f"labels must be in [0, {vocab_size}) or ignore_index={ignore_index}"


def label_range_error(value: int, vocab_size: int, ignore_index: int) -> ValueError:
    return ValueError(f"{label_range_message(vocab_size, ignore_index)}, found {value}")


def check_label_range(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise :func:`label_range_error` for the first out-of-range label, if any."""
    value = first_bad_label(labels, vocab_size, ignore_index)
    if value is not None:
        raise label_range_error(value, vocab_size, ignore_index)
