"""Single-device math: chunk kernels and the autograd Functions built on them. No process
groups: cross-rank combination comes in as ``reduce_max`` / ``reduce_sum`` callables.

- :mod:`.options`: :class:`CrossEntropyOptions`, :class:`MNROptions`, :class:`LogProbsOptions`,
  :class:`DistillationOptions` (and the policy / DPO options), the validated options of the
  losses, and :func:`~.options.resolve_options` (``options=`` or keywords).
- :mod:`.chunk_gradients`: the head's input / weight / bias gradients accumulated chunk by chunk
  (shared by the CE, log-probs and distillation chunk loops).
- :mod:`.chunk_stats`: the per-token statistics of a CE chunk and the loss from them (the leaf
  both epilogues import): :class:`ChunkResult`, :func:`~.chunk_stats.loss_from_stats`.
- :mod:`.cross_entropy_chunk`: loss, log-sum-exp and logit gradient of one chunk of tokens: the
  torch epilogue and the choice of epilogue (:func:`~.cross_entropy_chunk.epilogue_impl`).
- :mod:`.triton_epilogue`: the same epilogue as two fused Triton kernels (CUDA, or CPU under
  ``TRITON_INTERPRET=1``); imports ``triton``, so it is imported only when selected.
- :mod:`.chunked_linear_ce`: the chunk loop and its autograd Function (gradients in forward).
- :mod:`.log_probs_chunk`: per-token log-probabilities, entropy, log-sum-exp and greedy match of
  one chunk, and its logit gradient for arbitrary per-token upstream gradients.
- :mod:`.triton_log_probs`: that epilogue as two fused Triton kernels (imports ``triton``; imported
  only when selected).
- :mod:`.chunked_log_probs`: their chunk loop and autograd Function (recompute in backward).
- :mod:`.distillation_chunk`: distillation loss (forward / reverse KL, generalised JSD, hard-label
  CE) of one chunk against one vocab slice, full or top-k teacher, with the student's gradient.
- :mod:`.chunked_linear_distillation`: its chunk loop and autograd Function.
- :mod:`.infonce_rows`: InfoNCE rows against a set of columns, chunked, gradients in forward.
- :mod:`.labels`: :func:`~.labels.causal_shift`, Hugging Face's unshifted labels to targets.
- :mod:`.validation`: tensor checks that raise ValueError/TypeError naming the argument.
"""
from .chunk_stats import ChunkResult
from .chunked_linear_ce import chunked_linear_cross_entropy
from .cross_entropy_chunk import chunk_cross_entropy
from .options import (
    CE_IMPLS,
    CE_REDUCTIONS,
    DISTILLATION_KINDS,
    SIMILARITIES,
    CrossEntropyOptions,
    DistillationOptions,
    LogProbsOptions,
    MNROptions,
)

__all__ = ["CrossEntropyOptions", "MNROptions", "LogProbsOptions", "CE_REDUCTIONS", "CE_IMPLS",
           "SIMILARITIES", "ChunkResult", "chunk_cross_entropy", "chunked_linear_cross_entropy",
           "DistillationOptions", "DISTILLATION_KINDS"]
