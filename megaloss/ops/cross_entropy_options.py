"""The options of the linear cross-entropy (:func:`megaloss.linear_cross_entropy`, its module and
vocab-parallel forms), read down to its chunk kernel (:mod:`.cross_entropy_chunk`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .options import OptionsBase, check_choice, check_chunk_fields, check_float, check_softcapping

__all__ = ["CrossEntropyOptions", "CE_REDUCTIONS", "CE_IMPLS"]

# torch's reductions, which the distillation loss takes too; the chunk epilogues (``impl``),
# which the log-probabilities take too
CE_REDUCTIONS = ("mean", "sum", "none")
CE_IMPLS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class CrossEntropyOptions(OptionsBase):
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
        chunk_size: tokens per chunk (``>= 1``), or ``None`` (default): the chunk whose fp32
            logits are about the size of the hidden states,
            :func:`~megaloss.ops.chunk_driver.auto_chunk_size`. The working set is
            ``chunk_size x V`` logits in fp32 (``x V/tp`` under tensor parallelism).
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
    chunk_size: Optional[int] = None
    accum_dtype: torch.dtype = torch.float32
    impl: str = "auto"

    def __post_init__(self) -> None:
        check_choice("reduction", self.reduction, CE_REDUCTIONS)
        check_choice("impl", self.impl, CE_IMPLS)
        check_float("label_smoothing", self.label_smoothing, 0.0, 1.0)
        check_float("z_loss", self.z_loss, 0.0, float("inf"))
        check_softcapping(self, "logit_softcapping")
        check_chunk_fields(self)
        # Python floats whatever numeric type came in (ints, numpy scalars).
        object.__setattr__(self, "label_smoothing", float(self.label_smoothing))
        object.__setattr__(self, "z_loss", float(self.z_loss))

