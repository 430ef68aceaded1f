"""The options of the per-token log-probabilities (:func:`megaloss.linear_log_probs` and its
module), read down to their chunk kernel (:mod:`.log_probs_kernel`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .cross_entropy_options import CE_IMPLS
from .options import (
    OptionsBase,
    check_bool,
    check_choice,
    check_chunk_fields,
    check_finite_positive,
    check_softcapping,
)

__all__ = ["LogProbsOptions"]


@dataclass(frozen=True)
class LogProbsOptions(OptionsBase):
    """Options of :func:`megaloss.linear_log_probs` and :class:`megaloss.LinearLogProbs`.

    The scaled logits are ``y = softcap(z) / temperature``: soft-capping acts on the raw lm_head
    logits (as Gemma 2's ``final_logit_softcapping`` does inside the model,
    ``transformers``' ``Gemma2ForCausalLM.forward``), and the temperature divides what the model
    returns (as TRL's trainers do, ``logits / temperature`` before ``selective_log_softmax``).

    Attributes:
        ignore_index: label value whose token gets ``log_probs = 0``, ``entropy = 0``,
            ``greedy_match = False`` and no gradient (int).
        temperature: ``T > 0`` (finite), the divisor of the (soft-capped) logits.
        logit_softcapping: ``c`` in Gemma 2's ``c * tanh(logits / c)`` (arXiv:2408.00118);
            ``None`` disables it, else ``> 0``.
        return_entropy: also compute the per-token entropy of ``softmax(y)`` (one more
            ``[tokens]`` statistic in the vocab-parallel all-reduce, one more pass per chunk).
        chunk_size: tokens per chunk (``>= 1``), or ``None`` (default):
            :func:`~megaloss.ops.chunk_driver.auto_chunk_size`. The working set is a few
            ``chunk_size x V`` fp32 buffers (``x V/tp`` under tensor parallelism).
        accum_dtype: floating dtype of the weight/bias gradient accumulation across chunks.
        impl: the chunk epilogue, as :class:`CrossEntropyOptions`'s: ``"torch"``, ``"triton"``
            or ``"auto"``.

    Raises:
        ValueError / TypeError: an option out of range or of the wrong type, naming it.
    """

    ignore_index: int = -100
    temperature: float = 1.0
    logit_softcapping: Optional[float] = None
    return_entropy: bool = False
    chunk_size: Optional[int] = None
    accum_dtype: torch.dtype = torch.float32
    impl: str = "auto"

    def __post_init__(self) -> None:
        check_finite_positive("temperature", self.temperature)
        check_softcapping(self, "logit_softcapping")
        check_bool("return_entropy", self.return_entropy)
        check_choice("impl", self.impl, CE_IMPLS)
        check_chunk_fields(self)
        object.__setattr__(self, "temperature", float(self.temperature))

