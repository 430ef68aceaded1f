"""The options of the linear cross-entropy, validated once, carried as one frozen object from the
ds_config section (:class:`megaloss.integrations.deepspeed.CEConfig`) or the functional API's
keyword arguments down to the chunk kernel."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Dict, Optional

import torch

__all__ = ["CrossEntropyOptions", "CE_REDUCTIONS", "CE_IMPLS"]

CE_REDUCTIONS = ("mean", "sum", "none")
CE_IMPLS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class CrossEntropyOptions:
    """Options of :func:`megaloss.linear_cross_entropy` and its vocab-parallel form.

    Attributes:
        ignore_index: label value that contributes neither loss nor gradient (int).
        reduction: ``"mean"`` over valid tokens (with ``loss_weights``: ``sum(w*l)/sum(w)``; 0.0
            when no token is valid), ``"sum"`` (of ``w*l``) or ``"none"`` (per token, 0 at
            ignored positions). torch's ``F.cross_entropy`` meanings.
        label_smoothing: torch's definition (uniform over all ``V`` classes), in ``[0, 1]``.
        z_loss: coefficient of the PaLM z-loss ``logsumexp(logits)**2`` per valid token
            (Chowdhery et al. 2022, arXiv:2204.02311); ``>= 0``, 0 disables it.
        logit_softcapping: ``c`` in Gemma 2's ``c * tanh(logits / c)`` (arXiv:2408.00118);
            ``None`` disables it, else ``> 0``.
        chunk_size: tokens per chunk (``>= 1``); the working set is ``chunk_size x V`` logits in
            fp32 (``x V/tp`` under tensor parallelism).
        accum_dtype: floating dtype of the weight/bias gradient accumulation across chunks (fp32
            by default: half-precision accumulation made training diverge in Liger-Kernel).
        impl: the chunk epilogue (everything after the chunk's lm_head GEMM: row statistics,
            loss, and the logit gradient), see :mod:`megaloss.ops.cross_entropy_chunk`.
            ``"torch"``: eager torch ops on an fp32 copy of the logits (any device; the
            reference). ``"triton"``: the fused Triton kernels of
            :mod:`megaloss.ops.triton_epilogue` (two passes, the gradient written in place into
            the logits buffer in the compute dtype); needs the ``triton`` package and CUDA
            tensors, or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, slow,
            for tests); float64 inputs are refused. ``"auto"`` (default): ``"triton"`` for
            CUDA tensors of fp32/bf16/fp16 when ``triton`` imports, ``"torch"`` otherwise.
            Both give the same losses and gradients up to floating-point rounding.

    Raises:
        ValueError / TypeError: an option out of range or of the wrong type, naming it.
    """

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    logit_softcapping: Optional[float] = None
    chunk_size: int = 1024
    accum_dtype: torch.dtype = torch.float32
    impl: str = "auto"

    def __post_init__(self) -> None:
        if self.reduction not in CE_REDUCTIONS:
            raise ValueError(f"reduction must be one of {CE_REDUCTIONS}, got {self.reduction!r}")
        if not isinstance(self.impl, str) or self.impl not in CE_IMPLS:
            raise ValueError(f"impl must be one of {CE_IMPLS}, got {self.impl!r}")
        _check_float("label_smoothing", self.label_smoothing, 0.0, 1.0)
        _check_float("z_loss", self.z_loss, 0.0, float("inf"))
        if self.logit_softcapping is not None:
            _check_float("logit_softcapping", self.logit_softcapping, 0.0, float("inf"),
                         open_low=True, none_ok=True)
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) \
                or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {self.chunk_size!r}")
        if not isinstance(self.accum_dtype, torch.dtype) or not self.accum_dtype.is_floating_point:
            raise TypeError(f"accum_dtype must be a floating torch.dtype, got {self.accum_dtype!r}")
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {self.ignore_index!r}")
        # Python floats whatever numeric type came in (ints, numpy scalars).
        object.__setattr__(self, "label_smoothing", float(self.label_smoothing))
        object.__setattr__(self, "z_loss", float(self.z_loss))
        if self.logit_softcapping is not None:
            object.__setattr__(self, "logit_softcapping", float(self.logit_softcapping))

    def replace(self, **changes: Any) -> "CrossEntropyOptions":
        """A copy with ``changes`` applied (validated)."""
        return replace(self, **changes)

    def as_dict(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_float(name: str, value: Any, low: float, high: float, *, open_low: bool = False,
                 none_ok: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > low if open_low else value >= low) and value <= high
    if not ok:
        rng = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        extra = "None or " if none_ok else ""
        raise ValueError(f"{name} must be {extra}a float in {rng}, got {value!r}")
