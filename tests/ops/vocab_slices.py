"""Vocab slices of one tensor-parallel group, emulated by threads of one process (for the chunk
epilogue's ``reduce_max`` / ``reduce_sum`` combine, on CPU under Triton's interpreter and on one
GPU)."""
import threading

import torch

from megaloss.ops.chunk_driver import chunked_head
from megaloss.ops.chunk_kernel import VocabSlice, no_reduce
from megaloss.ops.cross_entropy_chunk import CrossEntropyKernel

__all__ = ["Lockstep", "slices_and_one_device"]


class Lockstep:
    """Runs one function per vocab slice in threads, as the ranks of one tensor-parallel group:
    ``reducers(i)`` are slice ``i``'s ``reduce_max`` / ``reduce_sum``, combining the stacked
    values of all slices in a fixed order (every slice gets bitwise the same result). Outside a
    reduction one thread runs at a time: Triton's interpreter patches ``triton.language`` while
    a kernel runs, so two launches must not overlap."""

    def __init__(self, n):
        self.n, self.lock = n, threading.Lock()
        self.barrier = threading.Barrier(n, timeout=120)
        self.slots = [None] * n

    def _reduce(self, i, t, combine):
        self.slots[i] = t.clone()
        self.lock.release()
        try:
            self.barrier.wait()
            out = combine(torch.stack(self.slots))
            self.barrier.wait()  # all have read the slots before any writes the next round
        finally:
            self.lock.acquire()
        return t.copy_(out)

    def reducers(self, i):
        return (lambda t: self._reduce(i, t, lambda x: x.amax(0)),
                lambda t: self._reduce(i, t, lambda x: x.sum(0)))

    def run(self, fns):
        results, errors = [None] * self.n, []

        def body(i):
            with self.lock:
                try:
                    results[i] = fns[i]()
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    errors.append(e)
                    self.barrier.abort()

        threads = [threading.Thread(target=body, args=(i,)) for i in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def slices_and_one_device(h, w, labels, bounds, opts, upstream):
    """Runs the chunked cross-entropy (the chunk driver over :class:`CrossEntropyKernel`, as
    :func:`megaloss.linear_cross_entropy` calls it) on the vocab slices ``bounds``
    (``[(start, stop)]`` covering ``[0, V)``, in a :class:`Lockstep` group, with ``opts``) and
    on the whole vocabulary with the torch epilogue; returns ``(slices, whole)``: per slice
    ``(start, stop, loss, d_hidden, d_weight)``, and ``(loss, d_hidden, d_weight)``, the
    gradients of ``upstream`` times the loss. The sum of the slices' ``d_hidden`` and the
    concatenation of their ``d_weight`` should give the whole vocabulary's (as vocab-parallel
    ranks do)."""
    vocab = w.shape[0]

    def run(start, stop, o, reducers=(no_reduce, no_reduce)):
        hl = h.clone().requires_grad_()
        wl = w[start:stop].clone().requires_grad_()
        valid = (labels != o.ignore_index).to(torch.float32)
        coef = (valid / valid.sum().clamp_min(torch.finfo(valid.dtype).tiny)
                if o.reduction == "mean" else valid)
        kernel = CrossEntropyKernel(labels, o, VocabSlice(vocab, start, *reducers))
        loss, _, _ = chunked_head(kernel, hl, wl, None, coef=coef,
                                  reduction="none" if o.reduction == "none" else "sum",
                                  chunk_size=o.chunk_size, accum_dtype=o.accum_dtype)
        return loss, hl, wl

    group = Lockstep(len(bounds))
    outs = group.run([lambda i=i, b=b: run(*b, opts, group.reducers(i))
                      for i, b in enumerate(bounds)])
    slices = []
    for (start, stop), (loss, hl, wl) in zip(bounds, outs):
        # For reduction="none" this is the gradient pass (no collective in backward).
        dh, dw = torch.autograd.grad(loss, [hl, wl], upstream)
        slices.append((start, stop, loss.detach(), dh, dw))
    loss, hl, wl = run(0, vocab, opts.replace(impl="torch"))
    dh, dw = torch.autograd.grad(loss, [hl, wl], upstream)
    return slices, (loss.detach(), dh, dw)
