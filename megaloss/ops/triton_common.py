"""What the two Triton epilogues (:mod:`megaloss.ops.triton_epilogue` for the cross-entropy,
:mod:`megaloss.ops.triton_log_probs` for the log-probabilities) share: the fp32 ``tanh`` of
soft-capping, the block size of a launch, the CUDA device guard, and whether Triton's
interpreter runs them.

Imports ``triton``; only those two modules import this one.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["MAX_BLOCK", "tanh_f32", "block_size", "device_guard", "interpreted"]

MAX_BLOCK = 4096
"""Largest block of columns a program handles at once (a power of two)."""


@triton.jit
def tanh_f32(a):
    """tanh in fp32 from ``exp`` (libdevice's tanh does not run in the interpreter), with a
    Taylor polynomial near 0 where ``(1 - e) / (1 + e)`` cancels."""
    e = tl.exp(-2.0 * tl.abs(a))
    a2 = a * a
    t = tl.where(tl.abs(a) < 0.125,
                 tl.abs(a) * (1.0 + a2 * (-0.333333333333 + a2 * (0.133333333333
                                                               - a2 * 0.0539682539683))),
                 (1.0 - e) / (1.0 + e))
    return tl.where(a < 0, -t, t)


def block_size(n_cols: int) -> int:
    """The power-of-two block of columns for rows of ``n_cols`` (16 to :data:`MAX_BLOCK`)."""
    return max(16, min(MAX_BLOCK, triton.next_power_of_2(max(n_cols, 1))))


def device_guard(t: torch.Tensor):
    """Launch on ``t``'s CUDA device (a no-op context on CPU)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def interpreted() -> bool:
    """Whether the kernels (and triton's own library functions they call) run in Triton's
    interpreter: ``TRITON_INTERPRET=1`` was set when triton was imported."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - every triton 3.x has it
        return False
    return isinstance(tanh_f32, InterpretedFunction) and isinstance(tl.sum, InterpretedFunction)
