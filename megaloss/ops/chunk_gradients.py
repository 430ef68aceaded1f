"""The parameter and input gradients of a chunked ``hidden @ weight.T (+ bias)`` head, built chunk
by chunk from each chunk's logit gradient: what the chunk driver
(:mod:`megaloss.ops.chunk_driver`) accumulates for every vocabulary-level loss.

The GEMMs run in the compute dtype (``promote_types(hidden, weight)``); the weight and bias
gradients accumulate across chunks in ``promote_types(accum_dtype, compute dtype)`` (fp32 for
bf16 inputs by default: half-precision accumulation made training diverge in Liger-Kernel).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["compute_operands", "HeadGradients"]


def compute_operands(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
                     ) -> Tuple[torch.dtype, torch.Tensor, Optional[torch.Tensor]]:
    """``(compute dtype, weight, bias)``, the weight and bias cast to the compute dtype."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    w = weight if weight.dtype == dtype else weight.to(dtype)
    return dtype, w, None if bias is None else bias.to(dtype)


class HeadGradients:
    """``d_hidden`` (``None`` unless needed), ``d_weight`` and ``d_bias`` (accumulation dtype,
    ``None`` unless needed) of one chunk loop; :meth:`add` takes one chunk's logit gradient.

    Args:
        hidden, weight, bias: the loop's inputs (``[N, H]``, ``[V, H]``, ``[V]`` or ``None``).
        accum_dtype: the options' ``accum_dtype``.
        need: ``(hidden, weight, bias)`` gradients wanted.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor], accum_dtype: torch.dtype,
                 need: Tuple[bool, bool, bool]) -> None:
        self.dtype, self.weight, self.bias = compute_operands(hidden, weight, bias)
        need_h, need_w, need_b = need
        accum = torch.promote_types(accum_dtype, self.dtype)
        self.d_hidden = (torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
                         if need_h else None)
        # Uninitialised: the first chunk writes it (no zero-fill pass over [V, H]); zeros
        # when no chunk will come.
        alloc = torch.zeros if hidden.shape[0] == 0 else torch.empty
        self.d_weight = alloc(weight.shape, dtype=accum, device=weight.device) if need_w else None
        self._first = True
        self.d_bias = (torch.zeros(bias.shape, dtype=accum, device=bias.device)
                       if need_b else None)

    def add(self, start: int, stop: int, h: torch.Tensor, grad_logits: torch.Tensor) -> None:
        """Add the chunk ``[start, stop)``'s contribution: ``h`` its hidden states in the
        compute dtype, ``grad_logits`` ``[C, V]`` the loss's gradient w.r.t. its logits (any
        floating dtype; the bias gradient is summed from it in the accumulation dtype, before
        any cast)."""
        g = grad_logits.to(self.dtype)
        if self.d_hidden is not None:
            if self.d_hidden.dtype == self.dtype:
                torch.mm(g, self.weight, out=self.d_hidden[start:stop])
            else:  # mixed-dtype inputs: the gradient is cast to the hidden states' dtype
                self.d_hidden[start:stop] = torch.mm(g, self.weight)
        first, self._first = self._first, False
        if self.d_weight is not None:
            if self.d_weight.dtype == self.dtype:
                if first:
                    torch.mm(g.t(), h, out=self.d_weight)
                else:
                    self.d_weight.addmm_(g.t(), h)
            elif first:
                self.d_weight.copy_(torch.mm(g.t(), h))
            else:  # bf16 GEMM, fp32 accumulation across chunks
                self.d_weight.add_(torch.mm(g.t(), h))
        if self.d_bias is not None:
            self.d_bias.add_(grad_logits.sum(dim=0, dtype=self.d_bias.dtype))
