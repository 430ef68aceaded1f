"""megaloss.linear_distillation_loss against the float64 full-logits reference
(tests/helpers/distillation_reference.py), on one process.

Tolerances: fp64 inputs 1e-10 (same math, other summation order); fp32 inputs vs the fp64
reference 2e-5 (values of order 1, V <= 40); bf16: error vs fp64 at most 2x the error of eager
torch on the same bf16 inputs, plus 1e-3.
"""
import itertools

import pytest
import torch

import megaloss
from tests.helpers.distillation_reference import reference_distillation, teacher_topk

N, H, HT, V, K = 23, 12, 9, 37, 5


def make_inputs(dtype=torch.float64, seed=0, bias=False, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dtype)  # noqa
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::4] = -100
    t_h, t_w = r(N, HT), r(V, HT)
    return dict(hidden=r(N, H), weight=r(V, H), labels=labels, teacher_hidden_states=t_h,
                teacher_weight=t_w, bias=r(V) if bias else None)


def run(fn, inp, grad_out=None, **kw):
    """(loss, grads of hidden, weight[, bias]) of ``fn``."""
    leaves = [inp["hidden"].detach().clone().requires_grad_(),
              inp["weight"].detach().clone().requires_grad_()]
    b = inp.get("bias")
    if b is not None:
        b = b.detach().clone().requires_grad_()
        leaves.append(b)
    loss = fn(leaves[0], leaves[1], inp["labels"], bias=b, **kw)
    if grad_out is None:
        grad_out = torch.ones_like(loss)
    grads = torch.autograd.grad(loss, leaves, grad_out.to(loss.dtype))
    return loss.detach(), grads


def teacher_kwargs(inp, topk, temperature):
    if not topk:
        return dict(teacher_hidden_states=inp["teacher_hidden_states"],
                    teacher_weight=inp["teacher_weight"])
    ids, lp = teacher_topk(inp["teacher_hidden_states"], inp["teacher_weight"], K, temperature)
    return dict(teacher_topk_ids=ids, teacher_topk_log_probs=lp)


def to64(inp):
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in inp.items()}


CASES = ([(kind, 0.5, t, topk) for kind in ("forward_kl", "reverse_kl") for t in (1.0, 2.0)
          for topk in (False, True)]
         + [("jsd", beta, t, topk) for beta in (0.0, 0.5, 1.0) for t in (1.0, 2.0)
            for topk in (False, True)])


def test_matrix_float64():
    """Every kind x temperature {1, 2} x beta {0, 0.5, 1} x full / top-k; alpha, soft-capping,
    bias, T**2 on or off alternating over the cases; chunk_size 7 (4 chunks, a ragged last)."""
    for i, (kind, beta, t, topk) in enumerate(CASES):
        inp = make_inputs(bias=i % 2 == 0, seed=i)
        opts = dict(kind=kind, beta=beta, temperature=t, alpha=(0.0, 0.25)[i % 2],
                    temperature_squared=i % 3 != 0,
                    logit_softcapping=(None, 4.0)[(i // 2) % 2],
                    teacher_logit_softcapping=None if topk else (None, 3.0)[(i // 2) % 2])
        tk = teacher_kwargs(inp, topk, t)
        loss, grads = run(megaloss.linear_distillation_loss, inp, chunk_size=7, **tk, **opts)
        ref, ref_grads = run(reference_distillation, inp, **tk, **opts)
        torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10, msg=f"{kind} {beta} {t}")
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10,
                                       msg=f"grad {kind} {beta} {t} {topk}")


def test_jsd_beta_ends_are_the_kls():
    inp = make_inputs()
    tk = teacher_kwargs(inp, False, 1.0)
    f = lambda **o: megaloss.linear_distillation_loss(  # noqa: E731
        inp["hidden"], inp["weight"], inp["labels"], **tk, **o)
    assert torch.equal(f(kind="jsd", beta=0.0), f(kind="forward_kl"))
    assert torch.equal(f(kind="jsd", beta=1.0), f(kind="reverse_kl"))
    fkl, rkl, mid = f(kind="forward_kl"), f(kind="reverse_kl"), f(kind="jsd", beta=0.5)
    assert float(mid) > 0 and not torch.isclose(fkl, rkl)
    assert float(mid) < min(float(fkl), float(rkl))  # JSD(0.5) <= KL/4-ish bound: much smaller


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_reductions_and_loss_weights(reduction):
    inp = make_inputs(bias=True)
    w = torch.rand(N, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grad_out = torch.rand(N if reduction == "none" else (), dtype=torch.float64) + 0.5
    for topk in (False, True):
        tk = teacher_kwargs(inp, topk, 2.0)
        opts = dict(kind="jsd", beta=0.3, temperature=2.0, alpha=0.5, reduction=reduction,
                    loss_weights=w)
        loss, grads = run(megaloss.linear_distillation_loss, inp, grad_out, chunk_size=5,
                          **tk, **opts)
        ref, ref_grads = run(reference_distillation, inp, grad_out, **tk, **opts)
        torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_stats_parts_and_top1():
    inp = make_inputs()
    for topk in (False, True):
        tk = teacher_kwargs(inp, topk, 1.0)
        out = megaloss.linear_distillation_loss_with_stats(
            inp["hidden"], inp["weight"], inp["labels"], kind="reverse_kl", alpha=0.4,
            chunk_size=6, **tk)
        loss, d, ce, matches = reference_distillation(
            inp["hidden"], inp["weight"], inp["labels"], kind="reverse_kl", alpha=0.4,
            parts=True, **tk)
        torch.testing.assert_close(out.loss, loss, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out.divergence, d, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out.ce_loss, ce, rtol=1e-10, atol=1e-10)
        assert int(out.num_top1_matches) == int(matches)
        assert int(out.num_valid_tokens) == int((inp["labels"] != -100).sum())
    # a student equal to the teacher: divergence 0 and every valid token agrees
    same = megaloss.linear_distillation_loss_with_stats(
        inp["teacher_hidden_states"], inp["teacher_weight"], inp["labels"],
        teacher_hidden_states=inp["teacher_hidden_states"], teacher_weight=inp["teacher_weight"])
    assert abs(float(same.divergence)) < 1e-12
    assert int(same.num_top1_matches) == int(same.num_valid_tokens)


def test_teacher_gets_no_gradient_and_module_form():
    inp = make_inputs()
    t_h = inp["teacher_hidden_states"].clone().requires_grad_()
    t_w = inp["teacher_weight"].clone().requires_grad_()
    h = inp["hidden"].clone().requires_grad_()
    mod = megaloss.LinearDistillationLoss(kind="jsd", temperature=2.0)
    loss = mod(h, inp["weight"], inp["labels"], teacher_hidden_states=t_h, teacher_weight=t_w)
    loss.backward()
    assert t_h.grad is None and t_w.grad is None and h.grad is not None
    assert "kind=jsd" in repr(mod)
    opts = megaloss.DistillationOptions(kind="jsd", temperature=2.0)
    same = megaloss.linear_distillation_loss(h, inp["weight"], inp["labels"], options=opts,
                                             teacher_hidden_states=t_h, teacher_weight=t_w)
    assert torch.equal(same, loss.detach()) or torch.allclose(same, loss, rtol=0, atol=0)


def test_fp32_and_bf16():
    inp64 = make_inputs(scale=0.5)
    for kind, topk in itertools.product(("forward_kl", "jsd"), (False, True)):
        tk64 = teacher_kwargs(inp64, topk, 2.0)
        opts = dict(kind=kind, temperature=2.0, alpha=0.2)
        ref, ref_grads = run(reference_distillation, inp64, **tk64, **opts)
        for dtype in (torch.float32, torch.bfloat16):
            inp = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                       else v) for k, v in inp64.items()}
            tk = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tk64.items()}
            loss, grads = run(megaloss.linear_distillation_loss, inp, chunk_size=8, **tk, **opts)
            if dtype == torch.float32:
                torch.testing.assert_close(loss.double(), ref, rtol=2e-5, atol=2e-5)
                for got, want in zip(grads, ref_grads):
                    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)
                continue
            # eager bf16: the same reference formula run on the bf16 tensors
            eager, eager_grads = run(reference_distillation, inp, **tk, **opts)
            assert abs(float(loss) - float(ref)) <= 2 * abs(float(eager) - float(ref)) + 1e-3
            for got, want, e in zip(grads, ref_grads, eager_grads):
                err = (got.double() - want).abs().max()
                assert err <= 2 * (e.double() - want).abs().max() + 1e-3


def test_all_ignored_is_zero():
    inp = make_inputs()
    inp["labels"] = torch.full((N,), -100)
    loss, grads = run(megaloss.linear_distillation_loss, inp,
                      **teacher_kwargs(inp, False, 1.0))
    assert float(loss) == 0.0 and all(float(g.abs().max()) == 0.0 for g in grads)


@pytest.mark.parametrize("change, match", [
    (dict(teacher_weight=None), "go together"),
    (dict(teacher_topk_ids=torch.zeros(N, 2, dtype=torch.long)), "exactly one"),
    (dict(teacher_weight=torch.zeros(V + 1, HT, dtype=torch.float64)), "teacher_weight"),
    (dict(teacher_hidden_states=torch.zeros(N - 1, HT, dtype=torch.float64)),
     "teacher_hidden_states"),
    (dict(kind="kl"), "kind"), (dict(beta=1.5), "beta"), (dict(temperature=0.0), "temperature"),
    (dict(alpha=-0.1), "alpha"), (dict(temperature_squared=1), "temperature_squared"),
])
def test_bad_full_teacher(change, match):
    inp = make_inputs()
    kw = dict(teacher_hidden_states=inp["teacher_hidden_states"],
              teacher_weight=inp["teacher_weight"])
    kw.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        megaloss.linear_distillation_loss(inp["hidden"], inp["weight"], inp["labels"], **kw)


def test_bad_topk_teacher():
    inp = make_inputs()
    ids, lp = teacher_topk(inp["teacher_hidden_states"], inp["teacher_weight"], K)
    f = lambda i, p, **o: megaloss.linear_distillation_loss(  # noqa: E731
        inp["hidden"], inp["weight"], inp["labels"], teacher_topk_ids=i,
        teacher_topk_log_probs=p, **o)
    dup = ids.clone()
    dup[0, 1] = dup[0, 0]
    for args, match in [((ids + V, lp), r"in \[0, 37\)"), ((dup, lp), "distinct"),
                        ((ids, lp.abs()), "<= 0"), ((ids, lp[:, :2]), "shape"),
                        ((ids.float(), lp), "integer"),
                        ((ids, torch.full_like(lp, -0.1)), "at most 1")]:
        with pytest.raises((ValueError, TypeError), match=match):
            f(*args)
    with pytest.raises(ValueError, match="teacher_logit_softcapping"):
        f(ids, lp, teacher_logit_softcapping=2.0)
    with pytest.raises(TypeError, match="not both"):
        f(ids, lp, options=megaloss.DistillationOptions(), kind="jsd")


def test_topk_unused_slots_and_a_full_top_k():
    """A slot of log-prob -inf is no outcome (its id, whatever it is, stays in the tail); a top-k
    holding all the mass (k = V) gives the full-teacher loss, reverse KL included."""
    inp = make_inputs(seed=4)
    ids, lp = teacher_topk(inp["teacher_hidden_states"], inp["teacher_weight"], K)
    ids, lp = ids.clone(), lp.clone()
    lp[:, -1] = float("-inf")
    ids[:, -1] = ids[:, 0]  # a repeated id in an unused slot is allowed
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        tk = dict(teacher_topk_ids=ids, teacher_topk_log_probs=lp)
        loss, grads = run(megaloss.linear_distillation_loss, inp, chunk_size=6, kind=kind, **tk)
        ref, ref_grads = run(reference_distillation, inp, kind=kind, **tk)
        torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-10)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    all_k = teacher_kwargs(inp, False, 1.0)
    ids_v, lp_v = teacher_topk(inp["teacher_hidden_states"], inp["teacher_weight"], V)
    for kind in ("forward_kl", "reverse_kl"):
        full = megaloss.linear_distillation_loss(inp["hidden"], inp["weight"], inp["labels"],
                                                 kind=kind, **all_k)
        topk = megaloss.linear_distillation_loss(inp["hidden"], inp["weight"], inp["labels"],
                                                 kind=kind, teacher_topk_ids=ids_v,
                                                 teacher_topk_log_probs=lp_v)
        torch.testing.assert_close(topk, full, rtol=1e-9, atol=1e-9)
