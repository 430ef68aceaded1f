"""The one CE entry point under tensor parallelism: ``linear_cross_entropy(...,
vocab_parallel_options=VocabParallelOptions(...))`` on 2 spawned gloo ranks (vocab 37, padded to
38) vs the float64 single-process reference on the unsharded lm_head; and the deprecated
``vocab_parallel_linear_cross_entropy`` giving the same numbers on the same ranks."""

import pytest
import torch

from megaloss.testing import run_distributed
from tests.helpers.ce_reference import reference_linear_ce
from tests.helpers.vocab_shards import shard_rows

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

N, H, V = 11, 5, 37
OPTS = dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3, logit_softcapping=6.0,
            chunk_size=4)


def _inputs():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::3] = -100
    return hidden, weight, bias, labels


def _worker(rank, world):
    import warnings

    import megaloss
    hidden, weight, bias, labels = _inputs()
    out = []
    for old in (False, True):
        h = hidden.clone().requires_grad_(True)
        w = shard_rows(weight, world, rank).requires_grad_(True)
        b = shard_rows(bias, world, rank).requires_grad_(True)
        if old:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = megaloss.vocab_parallel_linear_cross_entropy(
                    h, w, labels, vocab_size=V, bias=b, **OPTS)
            assert any(issubclass(c.category, DeprecationWarning) for c in caught)
        else:
            parallel = megaloss.VocabParallelOptions(tp_group=None, vocab_size=V)
            loss = megaloss.linear_cross_entropy(h, w, labels, bias=b,
                                                 vocab_parallel_options=parallel, **OPTS)
        grads = torch.autograd.grad(loss, [h, w, b])
        out.append((loss.detach(), [g.detach() for g in grads]))
    return out


def test_unified_entry_point_under_tp2_matches_the_reference():
    results = run_distributed(_worker, 2, timeout=240)
    hidden, weight, bias, labels = _inputs()
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    ref = reference_linear_ce(leaves[0], leaves[1], labels, bias=leaves[2],
                              **{k: v for k, v in OPTS.items() if k != "chunk_size"})
    ref_grads = torch.autograd.grad(ref, leaves)
    for rank, per_rank in enumerate(results):
        (loss, grads), (old_loss, old_grads) = per_rank
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(grads[0], ref_grads[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(grads[1], shard_rows(ref_grads[1], 2, rank), rtol=1e-10,
                                   atol=1e-10)
        torch.testing.assert_close(grads[2], shard_rows(ref_grads[2], 2, rank), rtol=1e-10,
                                   atol=1e-10)
        assert torch.equal(old_loss, loss)  # the deprecated name: the same computation
        assert all(torch.equal(a, b) for a, b in zip(old_grads, grads))
    assert torch.equal(results[0][0][0], results[1][0][0])  # same loss on both TP ranks
