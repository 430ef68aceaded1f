"""What the two Triton epilogues (:mod:`megaloss.ops.triton_epilogue` for the cross-entropy,
:mod:`megaloss.ops.triton_log_probs` for the log-probabilities) share: the fp32 ``tanh`` of
soft-capping, how a program finds its row, its label's column and its block of (soft-capped)
logits, the block size of a launch, the CUDA device guard, and whether Triton's interpreter
runs them.

Imports ``triton``; only those two modules import this one.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["MAX_BLOCK", "tanh_f32", "row_label", "grad_block", "load_logits", "block_size",
           "device_guard", "interpreted", "row_major"]

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


@triton.jit
def row_label(labels_ptr, ignore_index, vocab_start):
    """This program's row (``program_id(0)``, int64) and its label's column in this vocabulary
    slice: -1 (which never matches a column) for an ignored label or one outside the slice."""
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    return row, tl.where(label != ignore_index, label - vocab_start, -1)


@triton.jit
def grad_block(logits_ptr, stride_row, row, n_cols, BLOCK: tl.constexpr):
    """The columns of this program's block (``program_id(1)``) of ``row``, their mask and their
    pointers: the launch grid of the gradient kernels is (rows, column blocks)."""
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    return cols, mask, logits_ptr + row * stride_row + cols


@triton.jit
def load_logits(ptrs, mask, cap, HAS_CAP: tl.constexpr):
    """A block of logits in fp32 (0 where masked) and, with ``HAS_CAP``, soft-capped:
    ``(cap * t, t)`` with ``t = tanh(z / cap)`` (the gradient's chain factor is ``1 - t^2``;
    ``t`` is unused without soft-capping)."""
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    t = y
    if HAS_CAP:
        t = tanh_f32(y / cap)
        y = cap * t
    return y, t


def row_major(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` with unit column stride (the kernels step along a row's columns)."""
    return logits if logits.stride(1) == 1 else logits.contiguous()


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
