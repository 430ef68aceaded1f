"""Which chunk epilogue runs: the eager torch one (any device, the reference) or the fused Triton
kernels (CUDA, or CPU under Triton's interpreter), for every loss that has both (the
cross-entropy, the log-probabilities). A leaf: it imports ``triton`` only when asked about a
forced ``impl="triton"`` on CPU tensors."""
from __future__ import annotations

import functools

import torch

__all__ = ["epilogue_impl"]

_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing driver libraries, ...)
        return False
    return True


def _interpreter_ready() -> bool:
    """Whether triton was imported under ``TRITON_INTERPRET=1`` (its interpreter runs kernels on
    CPU tensors). Imports triton: only asked when ``impl="triton"`` meets CPU tensors."""
    from .triton_common import interpreted  # imports triton
    return interpreted()


def epilogue_impl(impl: str, logits: torch.Tensor) -> str:
    """Which epilogue (``"torch"`` or ``"triton"``) ``impl`` selects for this chunk's logits.

    ``"auto"``: Triton for CUDA tensors of fp32 / bf16 / fp16 when ``triton`` imports, torch
    otherwise (CPU tensors always take torch, interpreter or not).

    Raises:
        ValueError: ``impl="triton"`` that cannot run here: float64 logits, ``triton`` not
            installed, CPU tensors without ``TRITON_INTERPRET=1``, or another device type.
    """
    if impl == "torch":
        return "torch"
    if impl == "auto":
        ok = logits.is_cuda and logits.dtype in _TRITON_DTYPES and _triton_importable()
        return "triton" if ok else "torch"
    if impl != "triton":
        raise ValueError(f"impl must be one of ('auto', 'torch', 'triton'), got {impl!r}")
    if logits.dtype not in _TRITON_DTYPES:
        raise ValueError(f"impl='triton' computes in fp32 and takes fp32/bf16/fp16 inputs, got "
                         f"{logits.dtype}; use impl='auto' or 'torch'")
    if not _triton_importable():
        raise ValueError("impl='triton' needs the triton package (pip install triton); use "
                         "impl='auto' or 'torch'")
    if logits.device.type == "cpu":
        if not _interpreter_ready():
            raise ValueError("impl='triton' on CPU tensors runs only under Triton's interpreter: "
                             "set TRITON_INTERPRET=1 before triton is first imported (slow, for "
                             "tests); use impl='auto' or 'torch' on CPU")
    elif not logits.is_cuda:
        raise ValueError(f"impl='triton' runs on CUDA tensors, got device {logits.device}; use "
                         f"impl='auto' or 'torch'")
    return "triton"
