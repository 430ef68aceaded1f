"""MNR loss, single process: against an independent float64 reference (loss, input gradients,
metrics), the module's learnable temperature, and every input error.

The reference below is written from the formula (``F.cross_entropy`` on the full score matrix with
``-inf`` for masked false negatives), not from megaloss's code; the distributed tests reuse it.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megaloss._deprecated import mnr_loss_with_metrics
from megaloss.losses.mnr import MNROutput, MultipleNegativesRankingLoss, mnr_loss

TOL = dict(rtol=1e-9, atol=1e-11)  # float64 end to end; only summation order differs


# reference -------------------------------------------------------------------------------------
def reference_scores(q, p, neg, *, temperature, similarity, ids=None):
    """Full ``[N, N(1+K)]`` and ``[N, N]`` score matrices of the global batch, masked with -inf."""
    if similarity == "cosine":
        q, p = F.normalize(q, dim=-1), F.normalize(p, dim=-1)
        neg = None if neg is None else F.normalize(neg, dim=-1)
    docs = p if neg is None else torch.cat([p, neg.reshape(-1, q.shape[1])])
    fwd, back = q @ docs.T / temperature, p @ q.T / temperature
    if ids is not None:
        n = q.shape[0]
        same = (ids[:, None] == ids[None, :]) & ~torch.eye(n, dtype=torch.bool)
        fwd = torch.cat([fwd[:, :n].masked_fill(same, -math.inf), fwd[:, n:]], dim=1)
        back = back.masked_fill(same, -math.inf)
    return fwd, back


def reference_mnr(q, p, neg=None, *, temperature=0.05, similarity="cosine", symmetric=False,
                  ids=None):
    fwd, back = reference_scores(q, p, neg, temperature=temperature, similarity=similarity, ids=ids)
    target = torch.arange(q.shape[0])
    loss = F.cross_entropy(fwd, target)
    if symmetric:
        loss = (loss + F.cross_entropy(back, target)) / 2
    return loss


def reference_metrics(q, p, neg=None, *, temperature=0.05, similarity="cosine", ids=None):
    fwd, _ = reference_scores(q, p, neg, temperature=temperature, similarity=similarity, ids=ids)
    ranks = []
    for i, row in enumerate(fwd.tolist()):
        ranks.append(1 + sum(1 for j, s in enumerate(row) if s > row[i]))
    return sum(r == 1 for r in ranks) / len(ranks), sum(ranks) / len(ranks)


def make_batch(n, k, d=6, seed=0, dtype=torch.float64, dup=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d, generator=g, dtype=dtype)
    p = q + 1.5 * torch.randn(n, d, generator=g, dtype=dtype)  # related, so metrics are non-trivial
    neg = torch.randn(n, k, d, generator=g, dtype=dtype) if k else None
    ids = torch.randint(0, max(n // 2, 1), (n,), generator=g) if dup else None
    return q, p, neg, ids


# loss and gradients ----------------------------------------------------------------------------
@pytest.mark.parametrize("similarity", ["cosine", "dot"])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("dup", [False, True])
@pytest.mark.parametrize("local_loss", [False, True])
def test_matches_reference_loss_grads_and_metrics(similarity, symmetric, k, dup, local_loss):
    q, p, neg, ids = make_batch(7, k, dup=dup, seed=k + 2 * dup)
    temperature = 0.05 if similarity == "cosine" else 1.5
    inputs = [t.clone().requires_grad_() for t in (q, p) + ((neg,) if k else ())]
    ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = mnr_loss_with_metrics(*inputs, temperature=temperature, similarity=similarity,
                                symmetric=symmetric, local_loss=local_loss, duplicate_ids=ids,
                                chunk_size=3)  # 7 rows: blocks of 3, 3, 1
    ref = reference_mnr(*ref_inputs, temperature=temperature, similarity=similarity,
                        symmetric=symmetric, ids=ids)
    torch.testing.assert_close(out.loss, ref, **TOL)
    assert out.num_queries == 7
    out.loss.backward()
    ref.backward()
    for a, b in zip(inputs, ref_inputs):
        torch.testing.assert_close(a.grad, b.grad, **TOL)
    acc, mean_rank = reference_metrics(q, p, neg, temperature=temperature, similarity=similarity,
                                       ids=ids)
    assert out.accuracy.item() == pytest.approx(acc)
    assert out.mean_rank.item() == pytest.approx(mean_rank)
    assert 0 < acc < 1 and mean_rank > 1  # the case discriminates


def test_plain_function_equals_metrics_variant_and_duplicates_matter():
    q, p, neg, ids = make_batch(6, 2, dup=True, seed=3)
    plain = mnr_loss(q, p, neg, duplicate_ids=ids)
    assert isinstance(plain, torch.Tensor) and plain.dim() == 0
    assert isinstance(mnr_loss_with_metrics(q, p, neg, duplicate_ids=ids), MNROutput)
    torch.testing.assert_close(plain, mnr_loss_with_metrics(q, p, neg, duplicate_ids=ids).loss)
    assert len(set(ids.tolist())) < len(ids)  # duplicates present ...
    assert not torch.allclose(plain, mnr_loss(q, p, neg))  # ... and masking them changes the loss


def test_chunk_size_invariance_grad_output_and_no_grad():
    """Blocks of 1, 2, 5 or all rows give the same loss and gradients (temperature included); the
    saved gradients are multiplied by grad_output; under no_grad nothing is prepared."""
    q, p, neg, ids = make_batch(5, 2, dup=True, seed=9)
    results = []
    for chunk in (1, 2, 5, 1024):
        leaves = [t.clone().requires_grad_() for t in (q, p, neg)]
        scale = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
        out = mnr_loss_with_metrics(*leaves, temperature=torch.exp(-scale), symmetric=True,
                                    duplicate_ids=ids, chunk_size=chunk)
        (3.0 * out.loss).backward()
        results.append([out.loss, out.mean_rank, scale.grad] + [t.grad for t in leaves])
    leaves = [t.clone().requires_grad_() for t in (q, p, neg)]
    scale = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    ref = reference_mnr(*leaves, temperature=torch.exp(-scale), symmetric=True, ids=ids)
    (3.0 * ref).backward()
    _, mean_rank = reference_metrics(q, p, neg, temperature=math.exp(-2.5), ids=ids)
    assert mean_rank > 1  # the metric discriminates
    want = [ref, torch.tensor(mean_rank, dtype=torch.float64), scale.grad]
    want += [t.grad for t in leaves]
    for got in results:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(mnr_loss(q, p, neg, duplicate_ids=ids, chunk_size=2),
                                   reference_mnr(q, p, neg, ids=ids), **TOL)


def test_perfect_retrieval_metrics():
    q = torch.eye(4, dtype=torch.float64)
    out = mnr_loss_with_metrics(q, q.clone(), similarity="dot", temperature=0.1)
    assert out.accuracy.item() == 1.0 and out.mean_rank.item() == 1.0


def test_low_precision_inputs_accumulate_in_float32():
    """bf16 inputs: the loss equals the float64 loss of the same (bf16-rounded) inputs to fp32
    accuracy (cosine normalises after upcasting; 2e-2 was needed when it normalised in bf16)."""
    q, p, neg, _ = (t.bfloat16() if t is not None else None for t in make_batch(8, 2, seed=5))
    loss = mnr_loss(q, p, neg)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), reference_mnr(q.double(), p.double(), neg.double()),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("symmetric", [False, True])
def test_under_autocast_the_loss_and_gradients_are_the_float32_ones(symmetric):
    """Inside ``torch.autocast("cpu", bfloat16)`` (AMP around an encoder's forward and its loss):
    the fp32 embeddings' loss and gradients, as outside it (1e-6; it raised "Expected out tensor
    to have dtype BFloat16" when the block products took the autocast dtype)."""
    q, p, neg = (t.float() for t in make_batch(8, 2, seed=7)[:3])
    results = []
    for enabled in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, p, neg)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            loss = mnr_loss(*leaves, symmetric=symmetric)
        loss.backward()
        results.append((loss.detach(), [t.grad for t in leaves]))
    (plain, plain_grads), (amp, amp_grads) = results
    assert amp.dtype == torch.float32
    torch.testing.assert_close(amp, plain, rtol=1e-6, atol=1e-7)
    for a, b in zip(amp_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_empty_global_batch_gives_zero_loss_and_gradients():
    q = torch.zeros(0, 4, requires_grad=True)
    out = mnr_loss_with_metrics(q, torch.zeros(0, 4), torch.zeros(0, 2, 4))
    assert out.loss.item() == 0.0 and math.isnan(out.accuracy.item()) and out.num_queries == 0
    out.loss.backward()
    assert q.grad.shape == (0, 4)


# module ----------------------------------------------------------------------------------------
def test_module_fixed_and_learnable_temperature():
    q, p, neg, ids = make_batch(5, 2, seed=7)
    fixed = MultipleNegativesRankingLoss(0.1, symmetric=True)
    assert "temperature=0.1" in repr(fixed) and not list(fixed.parameters())
    torch.testing.assert_close(fixed(q, p, neg), reference_mnr(q, p, neg, temperature=0.1,
                                                               symmetric=True), **TOL)

    learn = MultipleNegativesRankingLoss(0.1, learnable_temperature=True).double()
    learn(q, p, neg).backward()
    scale = learn.logit_scale.detach().clone().requires_grad_()  # ln 10, rounded to float32 at init
    reference_mnr(q, p, neg, temperature=torch.exp(-scale)).backward()
    torch.testing.assert_close(learn.logit_scale.grad, scale.grad, **TOL)

    with torch.no_grad():  # above the CLIP clamp: T = 1/100 and no gradient through the clamp
        learn.logit_scale.fill_(6.0)
    learn.logit_scale.grad = None
    loss = learn(q, p, neg)
    torch.testing.assert_close(loss, reference_mnr(q, p, neg, temperature=0.01), **TOL)
    loss.backward()
    assert learn.logit_scale.grad.item() == 0.0
    assert isinstance(learn.forward_with_metrics(q, p, neg), MNROutput)


def test_module_rejects_bad_options():
    with pytest.raises(ValueError, match="temperature"):
        MultipleNegativesRankingLoss(0.0)
    with pytest.raises(ValueError, match="similarity"):
        MultipleNegativesRankingLoss(similarity="l2")
    with pytest.raises(ValueError, match="max_logit_scale"):
        MultipleNegativesRankingLoss(0.001, learnable_temperature=True)


# errors ----------------------------------------------------------------------------------------
def _errors():
    q, p, neg, _ = make_batch(3, 2)
    nan_q = q.clone()
    nan_q[1, 2] = float("nan")
    inf_n = neg.clone()
    inf_n[0, 1, 0] = float("inf")
    return [
        (ValueError, "query must be", dict(query=q[0], positive=p[0])),
        (ValueError, "positive must", dict(query=q, positive=p[:2])),
        (ValueError, "negatives must", dict(query=q, positive=p, negatives=neg[:, :, :3])),
        (ValueError, "negatives must", dict(query=q, positive=p, negatives=neg[:2])),
        (TypeError, "floating", dict(query=q.long(), positive=p.long())),
        (TypeError, "dtype", dict(query=q, positive=p.float())),
        (ValueError, "temperature", dict(query=q, positive=p, temperature=0.0)),
        (ValueError, "temperature", dict(query=q, positive=p, temperature=-1.0)),
        (ValueError, "temperature", dict(query=q, positive=p, temperature=torch.tensor(-0.5))),
        (ValueError, "temperature", dict(query=q, positive=p,
                                         temperature=torch.tensor(float("nan")))),
        (ValueError, "similarity", dict(query=q, positive=p, similarity="l2")),
        (ValueError, "chunk_size", dict(query=q, positive=p, chunk_size=0)),
        (ValueError, "query contains NaN", dict(query=nan_q, positive=p)),
        (ValueError, "negatives contains NaN or inf", dict(query=q, positive=p, negatives=inf_n)),
        (TypeError, "duplicate_ids must be an integer",
         dict(query=q, positive=p, duplicate_ids=torch.zeros(3))),
        (ValueError, "duplicate_ids must be", dict(query=q, positive=p,
                                                   duplicate_ids=torch.zeros(2, dtype=torch.long))),
    ]


@pytest.mark.parametrize("error,match,kwargs", _errors())
def test_clear_errors(error, match, kwargs):
    with pytest.raises(error, match=match):
        mnr_loss(**kwargs)
