"""``linear_log_probs(..., vocab_parallel_options=...)`` on 2 spawned gloo ranks (ONE spawn
looping over every case) vs the float64 single-process full-logits reference on the unsharded
lm_head: values, and gradients of hidden_states / weight shard / bias shard for random per-token
upstream gradients of log_probs and entropy together. Cases: an uneven vocab (37, padded to 38),
a vocab of 1 (rank 1 holds no real row), Megatron sequence-parallel input, fp32, and a bad label
on one rank raising on both."""

import pytest
import torch

from megaloss.testing import run_distributed
from tests.helpers.log_probs_reference import reference
from tests.helpers.vocab_shards import shard_rows

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

H = 6
CASES = {
    "uneven_vocab_bias_T_cap": dict(n=13, v=37, bias=True, temperature=0.8,
                                    logit_softcapping=4.0, chunk_size=4),
    "vocab_of_one": dict(n=5, v=1, bias=False, temperature=1.0, logit_softcapping=None,
                         chunk_size=8),
    "sequence_parallel": dict(n=7, v=37, bias=True, temperature=1.5, logit_softcapping=None,
                              chunk_size=3, sequence_parallel=True),
    "fp32": dict(n=9, v=40, bias=False, temperature=0.6, logit_softcapping=3.0, chunk_size=4,
                 dtype=torch.float32),
}
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def _inputs(case, seed, n_total):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_total, H, generator=g, dtype=torch.float64)
    weight = torch.randn(case["v"], H, generator=g, dtype=torch.float64)
    bias = torch.randn(case["v"], generator=g, dtype=torch.float64) if case["bias"] else None
    labels = torch.randint(0, case["v"], (n_total,), generator=g)
    labels[::4] = -100
    a = torch.randn(n_total, generator=g, dtype=torch.float64)
    c = torch.randn(n_total, generator=g, dtype=torch.float64)
    return hidden, weight, bias, labels, a, c


def _n_total(case, world):
    return case["n"] * (world if case.get("sequence_parallel") else 1)


def _worker(rank, world):
    import megaloss
    results = {}
    for seed, (name, case) in enumerate(CASES.items()):
        dtype = case.get("dtype", torch.float64)
        sp = case.get("sequence_parallel", False)
        hidden, weight, bias, labels, a, c = _inputs(case, seed, _n_total(case, world))
        if sp:
            rows = slice(rank * case["n"], (rank + 1) * case["n"])
            hidden, labels_in = hidden[rows], labels[rows]
        else:
            labels_in = labels
        h = hidden.to(dtype).requires_grad_(True)
        leaves = [h, shard_rows(weight, world, rank).to(dtype).requires_grad_(True)]
        if bias is not None:
            leaves.append(shard_rows(bias, world, rank).to(dtype).requires_grad_(True))
        parallel = megaloss.VocabParallelOptions(vocab_size=case["v"], sequence_parallel=sp)
        out = megaloss.linear_log_probs(
            h, leaves[1], labels_in, bias=leaves[2] if bias is not None else None,
            temperature=case["temperature"], logit_softcapping=case["logit_softcapping"],
            chunk_size=case["chunk_size"], return_entropy=True, vocab_parallel_options=parallel)
        loss = (out.log_probs.double() * a).sum() + (out.entropy.double() * c).sum()
        grads = torch.autograd.grad(loss, leaves)
        results[name] = ([t.detach() for t in out], [g.detach() for g in grads])
    # a bad label on rank 1 only: both ranks raise (none waits in a collective)
    try:
        labels = torch.zeros(4, dtype=torch.long)
        labels[0] = 99 if rank == 1 else 0
        megaloss.linear_log_probs(torch.randn(4, H), torch.randn(3, H), labels,
                                  vocab_parallel_options=megaloss.VocabParallelOptions(
                                      vocab_size=5))
        results["bad_label"] = None
    except ValueError as e:
        results["bad_label"] = str(e)
    return results


def test_log_probs_under_tp2_match_the_float64_reference():
    world = 2
    results = run_distributed(_worker, world, timeout=240)
    for seed, (name, case) in enumerate(CASES.items()):
        hidden, weight, bias, labels, a, c = _inputs(case, seed, _n_total(case, world))
        dtype = case.get("dtype", torch.float64)
        # the reference sees the inputs the ranks saw (rounded to dtype), in float64
        leaves = [t.to(dtype).double().requires_grad_(True)
                  for t in (hidden, weight) + ((bias,) if bias is not None else ())]
        ref = reference(leaves[0], leaves[1], labels, leaves[2] if bias is not None else None,
                        temperature=case["temperature"], cap=case["logit_softcapping"])
        ref_grads = torch.autograd.grad((ref[0] * a).sum() + (ref[1] * c).sum(), leaves)
        tol = TOL[dtype]
        for rank in range(world):
            (lp, ent, lse, greedy), grads = results[rank][name]
            msg = f"{name} rank {rank}"
            torch.testing.assert_close(lp.double(), ref[0], **tol, msg=msg)
            torch.testing.assert_close(ent.double(), ref[1], **tol, msg=msg)
            torch.testing.assert_close(lse.double(), ref[2], **tol, msg=msg)
            assert torch.equal(greedy, ref[3]), msg
            d_hidden = ref_grads[0]
            if case.get("sequence_parallel"):
                d_hidden = d_hidden[rank * case["n"]:(rank + 1) * case["n"]]
            torch.testing.assert_close(grads[0].double(), d_hidden, **tol, msg=msg)
            for got, full in zip(grads[1:], ref_grads[1:]):
                torch.testing.assert_close(got.double(), shard_rows(full, world, rank), **tol,
                                           msg=msg)
    for rank in range(world):
        assert results[rank]["bad_label"] is not None
        assert "found 99" in results[rank]["bad_label"]
