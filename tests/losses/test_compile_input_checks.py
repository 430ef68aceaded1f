"""The input checks under ``torch.compile`` (``megaloss/ops/validation.py``): the value checks
that cost a host sync in eager mode become in-graph asserts, so a compiled call still refuses a
label out of range, a negative class weight or a malformed top-k teacher (a RuntimeError when it
runs, CPU) without a graph break, while the NaN / inf scan of the hidden states is skipped (the
loss is NaN); eager calls raise the ValueError naming the bad value, as before."""
import math

import pytest
import torch

import megaloss
from megaloss.ops.validation import flagged
from tests.helpers.compile_checks import GRAPH_BREAKS, assert_graph_breaks, counted_compile

BREAKS_EARLY = GRAPH_BREAKS["gradient_in_forward"]
N, H, V, CHUNK, K = 12, 4, 11, 4, 3


def _inputs():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[::3] = -100
    ce_weight = torch.rand(V, generator=gen, dtype=torch.float64) + 0.1
    ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(N)])
    log_probs = torch.log_softmax(torch.randn(N, K, generator=gen, dtype=torch.float64), -1)
    return h, w, labels, ce_weight, ids, log_probs - 0.5  # 0.5 nats in the tail


def _losses(h, w, labels, ce_weight, ids, log_probs):
    ce = megaloss.linear_cross_entropy(h, w, labels, ce_weight=ce_weight, chunk_size=CHUNK)
    kd = megaloss.linear_distillation_loss(h, w, labels, teacher_topk_ids=ids,
                                           teacher_topk_log_probs=log_probs, chunk_size=CHUNK)
    return ce + kd


def _bad(name, args):
    h, w, labels, ce_weight, ids, log_probs = (t.clone() for t in args)
    if name == "label":
        labels[4] = V
    elif name == "ce_weight":
        ce_weight[2] = -1.0
    elif name == "topk_ids":
        ids[5, 0] = V + 3
    elif name == "topk_log_probs":
        log_probs[1, 1] = 0.5
    return h, w, labels, ce_weight, ids, log_probs


BAD = {"label": f"labels must be in \\[0, {V}\\) or ignore_index=-100",
       "ce_weight": "ce_weight must hold finite weights >= 0",
       "topk_ids": f"teacher_topk_ids must be in \\[0, {V}\\)",
       "topk_log_probs": "teacher_topk_log_probs must be log-probabilities"}


def test_flagged_is_a_plain_check_in_eager_mode():
    assert flagged(torch.tensor([False, True]), "unused") is True
    assert flagged(torch.tensor([False, False]), "unused") is False


@pytest.mark.parametrize("name", sorted(BAD))
def test_eager_calls_raise_the_value_error(name):
    with pytest.raises(ValueError, match=BAD[name]):
        _losses(*_bad(name, _inputs()))


@pytest.mark.slow  # one compilation, ~3 s on CPU
def test_compiled_calls_refuse_bad_values_without_a_graph_break():
    compiled, counter = counted_compile(_losses)
    good = _inputs()
    torch.testing.assert_close(compiled(*good), _losses(*good), rtol=1e-12, atol=1e-12)
    for name, message in BAD.items():
        with pytest.raises(RuntimeError, match=message):
            compiled(*_bad(name, good))
    h, *rest = good
    h = h.clone()
    h[4, 1] = float("nan")  # a row with a label (an ignored one gives NaN gradients only)
    with pytest.raises(ValueError, match="hidden_states holds NaN or inf"):
        _losses(h, *rest)
    assert math.isnan(float(compiled(h, *rest)))  # skipped under compile: NaN, not silent
    assert_graph_breaks(counter, BREAKS_EARLY, _losses, *good, what="input checks")
