"""What the ``torch.compile`` tests share: a compiled function that counts Dynamo's graphs, the
graph-break budget each entry point is held to, and label patterns whose ignored rows sit where
a compiled chunk loop could go wrong (chunk boundaries, a chunk with no valid row, no valid row
at all)."""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

# Graph breaks per call under torch.compile, what the design achieves: the input checks' host
# syncs are in-graph asserts, the chunk loop's autograd Function is traced on the
# gradient-in-forward schedule (reduction "mean" / "sum" outside fp16: 0 breaks) and runs
# eagerly on the recompute schedule (reduction "none", the log-probs, fp16: 1 break, so that
# the compiled graph does not save every chunk's logits; megaloss/ops/chunk_driver.py).
# A regression (a new .item(), bool(tensor), an untraceable call) raises the count and fails.
GRAPH_BREAKS = {"gradient_in_forward": 0, "recompute": 1}


def counted_compile(fn: Callable, backend: str = "aot_eager"):
    """``(compiled fn, counter)``: ``counter.frame_count`` is the number of graphs Dynamo
    compiled (graph breaks + 1, plus one per recompilation)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, dynamic=False), counter


def assert_graph_breaks(counter, max_breaks: int, fn: Callable, *args, what: str = "") -> None:
    """The calls so far compiled into at most ``max_breaks + 1`` graphs (a graph break or a
    recompilation adds one); else fail with ``torch._dynamo.explain``'s reasons for
    ``fn(*args)``."""
    if counter.frame_count <= max_breaks + 1:
        return
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    reasons = "\n".join(f"- {b.reason.splitlines()[0]} at {b.user_stack[-1:]}"
                        for b in explained.break_reasons)
    raise AssertionError(f"{what}: {counter.frame_count} graphs compiled (graph breaks "
                         f"{explained.graph_break_count} > {max_breaks}, or a "
                         f"recompilation):\n{reasons}")


def ignore_patterns(n: int, chunk: int, vocab: int, seed: int,
                    ignore_index: int = -100) -> Dict[str, torch.Tensor]:
    """Labels ``[n]`` (``n`` a multiple of ``chunk``, at least 3 chunks) with ``ignore_index``:
    at the first and last row of every chunk; over the whole second chunk (plus scattered rows
    elsewhere); a quarter of the rows at random (Liger-Kernel's reproduction of its compiled
    loss going wrong); everywhere; nowhere."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randint(0, vocab, (n,), generator=gen)
    out = {}
    y = base.clone()
    y[0::chunk] = ignore_index
    y[chunk - 1::chunk] = ignore_index
    out["chunk_boundaries"] = y
    y = base.clone()
    y[chunk:2 * chunk] = ignore_index
    y[2 * chunk + 1::3] = ignore_index
    out["ignored_chunk"] = y
    y = base.clone()
    y[torch.randperm(n, generator=gen)[:n // 4]] = ignore_index
    out["random_quarter"] = y
    out["all_ignored"] = torch.full_like(base, ignore_index)
    out["none_ignored"] = base
    return out


def leaves(*tensors: torch.Tensor, copies: int) -> Tuple[Tuple[torch.Tensor, ...], ...]:
    """``copies`` tuples of fresh leaf copies of ``tensors`` requiring grad: each variant of a
    test gets its own, so one backward gives every variant's gradients apart."""
    return tuple(tuple(t.detach().clone().requires_grad_() for t in tensors)
                 for _ in range(copies))
