"""Single-device math: chunk kernels and the autograd Functions built on them. No process
groups: cross-rank combination comes in as ``reduce_max`` / ``reduce_sum`` callables.

- :mod:`.options`: :class:`CrossEntropyOptions`, the validated CE options.
- :mod:`.cross_entropy_chunk`: loss, log-sum-exp and logit gradient of one chunk of tokens, with
  the torch epilogue and the dispatch to :mod:`.triton_epilogue` (fused kernels for CUDA).
- :mod:`.chunked_linear_ce`: the chunk loop and its autograd Function (gradients in forward).
- :mod:`.infonce_rows`: InfoNCE rows against a set of columns, chunked, gradients in forward.
- :mod:`.validation`: tensor checks that raise ValueError/TypeError naming the argument.
"""
from .chunked_linear_ce import chunked_linear_cross_entropy
from .cross_entropy_chunk import ChunkResult, chunk_cross_entropy
from .options import CE_IMPLS, CE_REDUCTIONS, CrossEntropyOptions

__all__ = ["CrossEntropyOptions", "CE_REDUCTIONS", "CE_IMPLS", "ChunkResult", "chunk_cross_entropy",
           "chunked_linear_cross_entropy"]
