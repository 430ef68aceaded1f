"""Single-device math: one chunk driver and the chunk kernels of the vocabulary-level losses. No
process groups: cross-rank combination comes in as a kernel's ``reduce_max`` / ``reduce_sum``
callables (:class:`~.chunk_kernel.VocabSlice`).

- :mod:`.chunk_driver`: :func:`~.chunk_driver.chunked_head`, the one loop and autograd Function
  of every vocabulary-level loss (``hidden @ weight.T`` a chunk at a time; gradient formed in
  forward for a scalar loss, recomputed in backward for per-token upstream gradients and fp16).
- :mod:`.chunk_kernel`: the :class:`~.chunk_kernel.ChunkKernel` contract and the logit math the
  kernels share (soft-capping, the label's column in a vocabulary slice, the stats dtype).
- :mod:`.chunk_gradients`: the head's input / weight / bias gradients accumulated chunk by chunk.
- :mod:`.cross_entropy_chunk`: the cross-entropy kernel (label smoothing, z-loss, soft-capping,
  class weights, token accuracy); :mod:`.chunk_stats` the statistics and loss both of its
  epilogues share; :mod:`.triton_epilogue` its fused Triton epilogue.
- :mod:`.log_probs_chunk`: the per-token log-probabilities / entropy math, its kernel in
  :mod:`.log_probs_kernel`;
  :mod:`.triton_log_probs` its Triton epilogue.
- :mod:`.distillation_chunk`: the distillation kernel (forward / reverse KL, generalised JSD,
  hard-label CE; full or top-k teacher).
- :mod:`.epilogue_choice`: torch or Triton epilogue (``impl``).
- :mod:`.infonce_rows`: InfoNCE rows against a set of columns, chunked, gradients in forward.
- :mod:`.options`: what every options class shares (:class:`~.options.OptionsBase`, the field
  checks, :func:`~.options.resolve_options`); the options the kernels read beside them:
  :mod:`.cross_entropy_options`, :mod:`.log_probs_options`, :mod:`.distillation_options` (the
  other losses' options live beside those losses in :mod:`megaloss.losses`).
- :mod:`.labels`: :func:`~.labels.causal_shift`, Hugging Face's unshifted labels to targets.
- :mod:`.validation`: tensor checks that raise ValueError/TypeError naming the argument.

Adding a vocabulary-level loss (the pattern of Liger-Kernel's ``src/liger_kernel/chunked_loss/``
and torchtitan's ``ChunkedLossWrapper``):

1. a kernel: subclass :class:`~.chunk_kernel.ChunkKernel` in ``ops/<loss>_chunk.py``; set
   ``n_outputs`` / ``n_differentiable`` / ``saved`` and write ``forward(logits, rows, coef)``
   (row statistics of the slice, combined with the slice's ``reduce_max`` / ``reduce_sum``,
   then the per-token terms, and ``coef``-weighted logit gradient when ``coef`` is given) and
   ``backward(logits, rows, saved, upstream)`` (often ``forward`` again with
   ``coef=upstream[0]``);
2. the options: a frozen dataclass on :class:`~.options.OptionsBase` in
   ``ops/<loss>_options.py``, each field an entry-point keyword of the same name and default;
3. the public function in ``megaloss/losses/``: check the inputs inside
   :func:`megaloss.losses.vocab_parallel.vocab_layout` (every TP rank agrees before any
   collective), build the kernel with ``layout.vocab_slice()``, call
   :func:`~.chunk_driver.chunked_head`, return the loss (``return_stats=True``: its
   ``*Output``); a module form and a ds_config field built from the options.

``__all__`` is that contract (:func:`chunked_head`, :class:`ChunkKernel`, :class:`VocabSlice`);
the kernels, options and helpers are imported from their modules.

The cross-entropy's class weights and token accuracy were added that way: a few lines in its
kernel and its function.
"""
from .chunk_driver import chunked_head
from .chunk_kernel import ChunkKernel, VocabSlice

__all__ = ["chunked_head", "ChunkKernel", "VocabSlice"]
