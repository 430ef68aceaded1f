"""linear_distillation_loss under tensor parallelism: both lm_heads split over 2 spawned gloo
ranks (vocab 37, padded to 38), replicated or Megatron-sequence-parallel input, every kind and
both teacher forms in ONE spawn, vs the float64 single-process reference on the unsharded
heads; and a bad input on one rank raising on both."""

import pytest
import torch

from megaloss.testing import run_distributed
from tests.helpers.distillation_reference import reference_distillation, teacher_topk
from tests.helpers.vocab_shards import shard_rows

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

N, H, HT, V, K = 10, 5, 4, 37, 4
CASES = [(kind, beta, t, topk, sp) for (kind, beta) in
         (("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.0))
         for t, topk, sp in ((1.0, False, False), (2.0, True, True), (2.0, False, True),
                             (1.0, True, False))]


def _inputs():
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::3] = -100
    return dict(hidden=r(N, H), weight=r(V, H), bias=r(V), t_hidden=r(N, HT), t_weight=r(V, HT),
                labels=labels)


def _opts(case):
    kind, beta, t, topk, _ = case
    return dict(kind=kind, beta=beta, temperature=t, alpha=0.25, reduction="sum",
                logit_softcapping=5.0, teacher_logit_softcapping=None if topk else 4.0)


def _teacher(inp, case, tokens=slice(None), tp_rank=None, tp=1):
    topk, t = case[3], case[2]
    if topk:
        ids, lp = teacher_topk(inp["t_hidden"], inp["t_weight"], K, t)
        return dict(teacher_topk_ids=ids[tokens], teacher_topk_log_probs=lp[tokens])
    w = inp["t_weight"] if tp_rank is None else shard_rows(inp["t_weight"], tp, tp_rank)
    return dict(teacher_hidden_states=inp["t_hidden"][tokens], teacher_weight=w)


def _worker(rank, world):
    import megaloss
    inp = _inputs()
    out = []
    for case in CASES:
        sp = case[4]
        tokens = slice(rank * N // world, (rank + 1) * N // world) if sp else slice(None)
        h = inp["hidden"][tokens].clone().requires_grad_(True)
        w = shard_rows(inp["weight"], world, rank).requires_grad_(True)
        b = shard_rows(inp["bias"], world, rank).requires_grad_(True)
        parallel = megaloss.VocabParallelOptions(vocab_size=V, sequence_parallel=sp)
        res = megaloss.linear_distillation_loss_with_stats(
            h, w, inp["labels"][tokens], bias=b, vocab_parallel_options=parallel, chunk_size=3,
            **_teacher(inp, case, tokens, rank, world), **_opts(case))
        grads = torch.autograd.grad(res.loss, [h, w, b])
        out.append((res.loss.detach(), res.divergence, res.ce_loss, int(res.num_top1_matches),
                    [g.detach() for g in grads]))
    # a bad top-k id on rank 1 only: both ranks raise, neither hangs
    ids, lp = teacher_topk(inp["t_hidden"], inp["t_weight"], K)
    if rank == 1:
        ids = ids.clone()
        ids[0, 0] = V + 3
    try:
        megaloss.linear_distillation_loss(
            inp["hidden"], shard_rows(inp["weight"], world, rank), inp["labels"],
            teacher_topk_ids=ids, teacher_topk_log_probs=lp,
            vocab_parallel_options=megaloss.VocabParallelOptions(vocab_size=V))
        raised = None
    except ValueError as err:
        raised = str(err)
    return out, raised


def test_tp2_matches_the_reference_for_every_case():
    results = run_distributed(_worker, 2, timeout=240)
    inp = _inputs()
    for i, case in enumerate(CASES):
        leaves = [inp[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
        ref, d, ce, matches = reference_distillation(
            leaves[0], leaves[1], inp["labels"], bias=leaves[2], parts=True,
            **_teacher(inp, case), **_opts(case))
        ref_grads = torch.autograd.grad(ref, leaves)
        sp = case[4]
        for rank, (per_rank, _) in enumerate(results):
            loss, div, ce_got, m, grads = per_rank[i]
            msg = f"case {case} rank {rank}"
            torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-10, msg=msg)
            torch.testing.assert_close(div, d, rtol=1e-10, atol=1e-10, msg=msg)
            torch.testing.assert_close(ce_got, ce, rtol=1e-10, atol=1e-10, msg=msg)
            assert m == int(matches), msg
            tokens = slice(rank * N // 2, (rank + 1) * N // 2) if sp else slice(None)
            torch.testing.assert_close(grads[0], ref_grads[0][tokens], rtol=1e-10, atol=1e-10,
                                       msg=msg)
            for got, full in zip(grads[1:], ref_grads[1:]):
                torch.testing.assert_close(got, shard_rows(full, 2, rank), rtol=1e-10, atol=1e-10,
                                           msg=msg)
    raised = [r for _, r in results]
    assert raised[1] is not None and "teacher_topk_ids" in raised[1]
    assert raised[0] is not None and "rank(s) [1]" in raised[0]
