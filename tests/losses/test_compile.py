"""The chunked losses under ``torch.compile``: loss and gradients equal to eager megaloss and to
the float64 full-logits references, with ``ignore_index`` rows at chunk boundaries, a chunk with
no valid row and no valid row at all (a compiled fused CE returning a wrong loss once any row is
ignored is the failure Liger-Kernel fixed in its PR 1338); every reduction, label smoothing,
z-loss, soft-cap, loss weights, class weights; the log-probabilities (with entropy) and the
distillation loss (full and top-k teacher). Each entry point compiles to one graph (no graph
break, no recompilation across the label patterns: ``tests/helpers/compile_checks.py``).

Backend ``aot_eager`` (Dynamo + AOTAutograd, what every backend sees; no code generation, so
the suite stays fast) for all, and one Inductor case. CPU, float32 and float64.

Tolerances: compiled against eager megaloss, float64 ``1e-12`` (relative and absolute), float32
``1e-6``; both against the float64 references, float64 ``1e-10``, float32 ``1e-4`` relative and
``1e-5`` absolute (fp32 rounding of sums over up to 24 tokens and 97 classes).
"""
import pytest
import torch
import torch.nn.functional as F

import megaloss
from tests.helpers.compile_checks import (
    GRAPH_BREAKS,
    assert_graph_breaks,
    counted_compile,
    ignore_patterns,
    leaves,
)
from tests.helpers.distillation_reference import reference_distillation, teacher_topk
from tests.helpers.log_probs_reference import reference as reference_log_probs

BREAKS_EARLY = GRAPH_BREAKS["gradient_in_forward"]  # reduction "mean" / "sum"
BREAKS_RECOMPUTE = GRAPH_BREAKS["recompute"]  # reduction "none", log-probs
pytestmark = pytest.mark.slow  # each compilation takes seconds on CPU

N, H, V, CHUNK = 24, 8, 97, 8  # 3 chunks
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-6, atol=1e-6)}
REF_TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-5)}

# (name, keywords of linear_cross_entropy, uses loss_weights, uses ce_weight)
CE_VARIANTS = [
    ("mean_smooth_z_cap", dict(label_smoothing=0.1, z_loss=1e-3, logit_softcapping=3.0), False,
     False),
    ("sum_loss_weights", dict(reduction="sum", z_loss=1e-2), True, False),
    ("mean_ce_weight", dict(label_smoothing=0.05), False, True),
]


def _inputs(dtype, seed=0):
    """``hidden [N, H], weight [V, H], upstream [N], loss_weights [N], ce_weight [V]``, drawn in
    float64 (the same values for every dtype, up to its rounding)."""
    gen = torch.Generator().manual_seed(seed)
    drawn = (torch.randn(N, H, generator=gen, dtype=torch.float64),
             torch.randn(V, H, generator=gen, dtype=torch.float64),
             torch.randn(N, generator=gen, dtype=torch.float64),
             torch.rand(N, generator=gen, dtype=torch.float64),
             torch.rand(V, generator=gen, dtype=torch.float64) + 0.5)
    return tuple(t.to(dtype) for t in drawn)


def _ce_variants(pairs, labels, upstream, loss_weights, ce_weight):
    """Every CE variant on its own ``(hidden, weight)`` leaves; a scalar to back-propagate and
    the outputs (the losses, then the stats of one return_stats call)."""
    outs, total = [], 0
    for (h, w), (_, kw, use_lw, use_cw) in zip(pairs, CE_VARIANTS):
        loss = megaloss.linear_cross_entropy(
            h, w, labels, chunk_size=CHUNK, loss_weights=loss_weights if use_lw else None,
            ce_weight=ce_weight if use_cw else None, **kw)
        outs.append(loss)
        total = total + (loss * upstream if loss.dim() else loss).sum()
    stats = megaloss.linear_cross_entropy(pairs[0][0].detach(), pairs[0][1].detach(), labels,
                                          chunk_size=CHUNK, z_loss=1e-2, return_stats=True)
    return total, outs, (stats.z_loss, stats.num_valid_tokens, stats.num_correct_tokens)


def _ce_reference(h, w, labels, kw, loss_weights, ce_weight):
    """float64 full-logits reference of one variant."""
    h, w = h.double(), w.double()
    if ce_weight is None:
        return megaloss_reference(h, w, labels, kw, loss_weights)
    eps = kw.get("label_smoothing", 0.0)
    per = F.cross_entropy(h @ w.T, labels, weight=ce_weight.double(), ignore_index=-100,
                          label_smoothing=eps, reduction="none")
    denom = (ce_weight.double()[labels.clamp_min(0)] * (labels != -100)).sum()
    return per.sum() / denom.clamp_min(torch.finfo(torch.float64).tiny)


def megaloss_reference(h, w, labels, kw, loss_weights):
    from tests.helpers.ce_reference import reference_linear_ce
    return reference_linear_ce(h, w, labels, loss_weights=None if loss_weights is None
                               else loss_weights.double(), **kw)


def _run(fn, dtype, labels, seed=0):
    h, w, upstream, lw, cw = _inputs(dtype, seed)
    pairs = leaves(h, w, copies=len(CE_VARIANTS))
    total, outs, stats = fn(pairs, labels, upstream, lw, cw)
    total.backward()
    return [o.detach() for o in outs], [(a.grad, b.grad) for a, b in pairs], stats


# fp64 only: fp32 under a real code generator is test_inductor_cross_entropy_equals_eager_...
@pytest.mark.parametrize("dtype", [torch.float64], ids=["fp64"])
def test_compiled_cross_entropy_equals_eager_with_ignored_rows(dtype):
    compiled, counter = counted_compile(_ce_variants)
    for name, labels in ignore_patterns(N, CHUNK, V, seed=1).items():
        got, got_grads, got_stats = _run(compiled, dtype, labels)
        want, want_grads, want_stats = _run(_ce_variants, dtype, labels)
        for (variant, kw, use_lw, use_cw), g, e, (gh, gw), (eh, ew) in zip(
                CE_VARIANTS, got, want, got_grads, want_grads):
            msg = f"{name}/{variant}"
            torch.testing.assert_close(g, e, **TOL[dtype], msg=msg)
            torch.testing.assert_close(gh, eh, **TOL[dtype], msg=msg + " d hidden")
            torch.testing.assert_close(gw, ew, **TOL[dtype], msg=msg + " d weight")
            # and against float64 full logits, gradients through the same upstream
            h, w, upstream, lw, cw = _inputs(torch.float64)
            h.requires_grad_()
            w.requires_grad_()
            ref = _ce_reference(h, w, labels, kw, lw if use_lw else None, cw if use_cw else None)
            (ref * upstream if ref.dim() else ref).sum().backward()
            torch.testing.assert_close(g.double(), ref.detach(), **REF_TOL[dtype], msg=msg)
            torch.testing.assert_close(gh.double(), h.grad, **REF_TOL[dtype], msg=msg + " dh")
            torch.testing.assert_close(gw.double(), w.grad, **REF_TOL[dtype], msg=msg + " dw")
        for g, e in zip(got_stats, want_stats):
            torch.testing.assert_close(g, e, **TOL[dtype], msg=f"{name} stats")
        assert int(got_stats[1]) == int((labels != -100).sum())
        if name == "all_ignored":
            assert all(float(g.abs().max()) == 0.0 for g in got)
    h, w, upstream, lw, cw = _inputs(dtype)
    assert_graph_breaks(counter, BREAKS_EARLY, _ce_variants,
                        leaves(h, w, copies=len(CE_VARIANTS)), labels, upstream, lw, cw,
                        what="linear_cross_entropy, mean / sum")


def _ce_none(h, w, labels):
    return megaloss.linear_cross_entropy(h, w, labels, chunk_size=CHUNK, reduction="none",
                                         logit_softcapping=3.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_compiled_cross_entropy_none_equals_eager_with_ignored_rows(dtype):
    """``reduction="none"``: the recompute schedule, whose chunk loop runs eagerly under
    compile (one graph break) so that the compiled graph does not keep every chunk's logits."""
    compiled, counter = counted_compile(_ce_none)
    h0, w0, upstream, *_ = _inputs(dtype, seed=11)
    for name, labels in ignore_patterns(N, CHUNK, V, seed=12).items():
        results = []
        for f in (compiled, _ce_none):
            (h, w), = leaves(h0, w0, copies=1)
            loss = f(h, w, labels)
            (loss * upstream).sum().backward()
            results.append((loss.detach(), h.grad, w.grad))
        for g, e in zip(*results):
            torch.testing.assert_close(g, e, **TOL[dtype], msg=name)
        (h, w), = leaves(h0.double(), w0.double(), copies=1)
        ref = _ce_reference(h, w, labels, dict(reduction="none", logit_softcapping=3.0), None,
                            None)
        (ref * upstream.double()).sum().backward()
        for g, e in zip(results[0], (ref, h.grad, w.grad)):
            torch.testing.assert_close(g.double(), e.detach(), **REF_TOL[dtype], msg=name)
    assert_graph_breaks(counter, BREAKS_RECOMPUTE, _ce_none, h0, w0, labels,
                        what="linear_cross_entropy, none")


def test_inductor_cross_entropy_equals_eager_with_ignored_rows():
    """The same with code generated by Inductor (its own kernels for the chunk epilogue, the
    in-place logits buffer and the gradient accumulation), float32, mean and sum."""
    def fn(pairs, labels):
        (h1, w1), (h2, w2) = pairs
        mean = megaloss.linear_cross_entropy(h1, w1, labels, chunk_size=CHUNK, z_loss=1e-3)
        total = megaloss.linear_cross_entropy(h2, w2, labels, chunk_size=CHUNK, reduction="sum")
        return mean, total

    compiled = torch.compile(fn, backend="inductor", dynamic=False)
    h, w, *_ = _inputs(torch.float32, seed=2)
    for name, labels in ignore_patterns(N, CHUNK, V, seed=3).items():
        results = []
        for f in (compiled, fn):
            pairs = leaves(h, w, copies=2)
            mean, total = f(pairs, labels)
            (mean + total).backward()
            results.append((mean.detach(), total.detach(), *(t.grad for p in pairs for t in p)))
        for g, e in zip(*results):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=name)


def _log_probs(h, w, labels):
    out = megaloss.linear_log_probs(h, w, labels, chunk_size=CHUNK, return_entropy=True,
                                    temperature=0.7, logit_softcapping=4.0)
    return out.log_probs, out.entropy, out.lse, out.greedy_match


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_compiled_log_probs_equal_eager_with_ignored_rows(dtype):
    compiled, counter = counted_compile(_log_probs)
    h0, w0, a, *_ = _inputs(dtype, seed=4)
    b = torch.randn(N, generator=torch.Generator().manual_seed(5), dtype=dtype)
    for name, labels in ignore_patterns(N, CHUNK, V, seed=6).items():
        results = []
        for f in (compiled, _log_probs):
            (h, w), = leaves(h0, w0, copies=1)
            lp, ent, lse, greedy = f(h, w, labels)
            ((lp * a).sum() + (ent * b).sum()).backward()
            results.append((lp.detach(), ent.detach(), lse, greedy, h.grad, w.grad))
        for g, e in zip(*results):
            torch.testing.assert_close(g, e, **TOL[dtype], msg=name)
        (h, w), = leaves(h0.double(), w0.double(), copies=1)
        lp, ent, lse, greedy = reference_log_probs(h, w, labels, temperature=0.7, cap=4.0)
        ((lp * a.double()).sum() + (ent * b.double()).sum()).backward()
        for g, e in zip(results[0][:3] + results[0][4:], (lp, ent, lse, h.grad, w.grad)):
            torch.testing.assert_close(g.double(), e.detach(), **REF_TOL[dtype], msg=name)
    assert_graph_breaks(counter, BREAKS_RECOMPUTE, _log_probs, h0, w0, labels,
                        what="linear_log_probs")


def _distillation(pairs, labels, teacher_h, teacher_w, topk_ids, topk_lp):
    (h1, w1), (h2, w2) = pairs
    full = megaloss.linear_distillation_loss(
        h1, w1, labels, teacher_hidden_states=teacher_h, teacher_weight=teacher_w,
        chunk_size=CHUNK, kind="jsd", beta=0.3, alpha=0.2, temperature=2.0)
    topk = megaloss.linear_distillation_loss(
        h2, w2, labels, teacher_topk_ids=topk_ids, teacher_topk_log_probs=topk_lp,
        chunk_size=CHUNK, kind="forward_kl", reduction="sum")
    return full, topk


@pytest.mark.parametrize("dtype", [torch.float64], ids=["fp64"])
def test_compiled_distillation_equals_eager_with_ignored_rows(dtype):
    compiled, counter = counted_compile(_distillation)
    h0, w0, *_ = _inputs(dtype, seed=7)
    gen = torch.Generator().manual_seed(8)
    teacher_h = torch.randn(N, 6, generator=gen, dtype=dtype)
    teacher_w = torch.randn(V, 6, generator=gen, dtype=dtype)
    ids, lp = teacher_topk(teacher_h, teacher_w, k=5)
    lp = lp.to(dtype)
    for name, labels in ignore_patterns(N, CHUNK, V, seed=9).items():
        results = []
        for f in (compiled, _distillation):
            pairs = leaves(h0, w0, copies=2)
            full, topk = f(pairs, labels, teacher_h, teacher_w, ids, lp)
            (full + topk).backward()
            results.append((full.detach(), topk.detach(), *(t.grad for p in pairs for t in p)))
        for g, e in zip(*results):
            torch.testing.assert_close(g, e, **TOL[dtype], msg=name)
        (h1, w1), (h2, w2) = leaves(h0.double(), w0.double(), copies=2)
        full = reference_distillation(h1, w1, labels, teacher_hidden_states=teacher_h.double(),
                                      teacher_weight=teacher_w.double(), kind="jsd", beta=0.3,
                                      alpha=0.2, temperature=2.0)
        topk = reference_distillation(h2, w2, labels, teacher_topk_ids=ids,
                                      teacher_topk_log_probs=lp.double(), reduction="sum")
        (full + topk).backward()
        for g, e in zip(results[0], (full, topk, h1.grad, w1.grad, h2.grad, w2.grad)):
            torch.testing.assert_close(g.double(), e.detach(), **REF_TOL[dtype], msg=name)
    assert_graph_breaks(counter, BREAKS_EARLY, _distillation, leaves(h0, w0, copies=2), labels,
                        teacher_h, teacher_w, ids, lp, what="linear_distillation_loss")
