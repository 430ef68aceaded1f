"""Multi-token prediction loss (``megaloss.losses.multi_token``) against a float64 reference that
forms every depth's logits with torch and rolls the labels by hand, sample by sample.

Tolerances: float64 losses and gradients (hidden states of every depth, lm_head weight) 1e-10
(rtol and atol); the rolled labels and the per-depth token counts exactly. The calibration case
(two micro-batches of uneven valid counts, each depth normalised by its own global count) must
equal one device on the concatenated batch to 1e-10, and the micro-batch-local normalisation
(Megatron-LM's ``process_mtp_loss``) is checked to be off by more than 1e-3 on the same case, so
the case can fail. The vocab-parallel path and the one all-reduce of the weights run on 2 gloo
ranks (slow tier).
"""
import pytest
import torch
import torch.nn.functional as F

from megaloss.calibration.weights import compute_loss_weights
from megaloss.losses.multi_token import (
    mtp_labels,
    mtp_loss_weights,
    multi_token_prediction_loss,
)
from megaloss.ops.cross_entropy_options import CrossEntropyOptions
from megaloss.parallel.groups import SINGLE_RANK
from megaloss.testing import run_distributed

IGNORE = -100
TOL = dict(rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- reference (written by hand)

def segments_of_rows(row_starts):
    """``[(start, end)]`` of the flattened positions, from each row's sample starts."""
    out = []
    for r, (length, starts) in enumerate(row_starts):
        bounds = list(starts) + [length]
        out += [(r * length + a, r * length + b) for a, b in zip(bounds[:-1], bounds[1:])]
    return out


def rolled_by_hand(labels, segments, k):
    flat = labels.reshape(-1).tolist()
    out = [IGNORE] * len(flat)
    for a, b in segments:
        for t in range(a, b):
            if t + k < b:
                out[t] = flat[t + k]
    return torch.tensor(out).view(labels.shape)


def reference_terms(hidden_list, weight, label_list, weight_list=None):
    """Per term: float64 logits, CE; token mean, or ``sum(w * l)`` with weights."""
    terms = []
    for i, (h, y) in enumerate(zip(hidden_list, label_list)):
        logits = h.reshape(-1, h.shape[-1]) @ weight.T
        per = F.cross_entropy(logits, y.reshape(-1), ignore_index=IGNORE, reduction="none")
        if weight_list is None:
            valid = (y.reshape(-1) != IGNORE).sum()
            terms.append(per.sum() / valid)
        else:
            terms.append((per * weight_list[i].reshape(-1)).sum())
    return terms


def reference_total(terms, scaling):
    d = len(terms) - 1
    return terms[0] + scaling / d * sum(terms[1:])


# ---------------------------------------------------------------- inputs

# two rows of 9 positions: row 0 packs samples starting at 0, 4, 6; row 1 is one sample
POSITION_IDS = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2],
                             [0, 1, 2, 3, 4, 5, 6, 7, 8]])
SEGMENTS = segments_of_rows([(9, [0, 4, 6]), (9, [0])])
CU_SEQLENS = torch.tensor([0, 4, 6, 9, 18])


def make_inputs(seed, depth, shape=(2, 9), h=5, v=11, pad_from=None):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, v, shape, generator=g)
    labels[..., -1] = IGNORE  # HF's shift: the last position has no target
    if pad_from is not None:
        labels[-1, pad_from:] = IGNORE  # right padding of the last row
    hidden = [torch.randn(*shape, h, generator=g, dtype=torch.float64) for _ in range(depth + 1)]
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    return labels, hidden, weight


def leaves(hidden, weight):
    return ([x.clone().requires_grad_(True) for x in hidden],
            weight.clone().requires_grad_(True))


# ---------------------------------------------------------------- labels

@pytest.mark.parametrize("depth", [1, 2, 3])
def test_labels_roll_inside_packed_samples(depth):
    labels, _, _ = make_inputs(0, 1, pad_from=6)
    expected = rolled_by_hand(labels, SEGMENTS, depth)
    by_pos = mtp_labels(labels, depth, position_ids=POSITION_IDS)
    by_cu = mtp_labels(labels.reshape(-1), depth, cu_seqlens=CU_SEQLENS)
    assert torch.equal(by_pos, expected)
    assert torch.equal(by_cu, expected.reshape(-1))
    # rows without boundaries: each row is one sample, nothing comes from the next row
    rows = rolled_by_hand(labels, segments_of_rows([(9, [0]), (9, [0])]), depth)
    assert torch.equal(mtp_labels(labels, depth), rows)
    assert torch.equal(mtp_labels(labels, 20), torch.full_like(labels, IGNORE))


def test_labels_never_cross_a_boundary():
    labels = torch.arange(18).view(2, 9)  # every label names its own source position
    for k in (1, 2, 3):
        rolled = mtp_labels(labels, k, position_ids=POSITION_IDS).reshape(-1)
        for t, src in enumerate(rolled.tolist()):
            if src == IGNORE:
                continue
            assert src == t + k
            assert any(a <= t and src < b for a, b in SEGMENTS), (k, t, src)


# ---------------------------------------------------------------- loss vs reference

@pytest.mark.parametrize("depth", [1, 2, 3])
def test_loss_and_gradients_match_float64_reference(depth):
    labels, hidden, weight = make_inputs(depth, depth, pad_from=7)
    scaling = 0.3
    hs, w = leaves(hidden, weight)
    out = multi_token_prediction_loss(hs[0], w, labels, hs[1:], scaling_factor=scaling,
                                      position_ids=POSITION_IDS,
                                      options=CrossEntropyOptions(chunk_size=4))
    hr, wr = leaves(hidden, weight)
    targets = [labels] + [rolled_by_hand(labels, SEGMENTS, k) for k in range(1, depth + 1)]
    terms = reference_terms(hr, wr, targets)
    ref = reference_total(terms, scaling)
    torch.testing.assert_close(out.loss, ref.detach(), **TOL)
    torch.testing.assert_close(out.main_loss, terms[0].detach(), **TOL)
    torch.testing.assert_close(out.depth_losses, torch.stack(terms[1:]).detach(), **TOL)
    assert out.depth_losses.shape == (depth,) and not out.depth_losses.requires_grad
    got = torch.autograd.grad(out.loss, hs + [w])
    want = torch.autograd.grad(ref, hr + [wr])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)


def test_cu_seqlens_equals_position_ids():
    labels, hidden, weight = make_inputs(5, 2)
    hs, w = leaves(hidden, weight)
    by_pos = multi_token_prediction_loss(hs[0], w, labels, hs[1:], position_ids=POSITION_IDS)
    flat = [x.reshape(-1, x.shape[-1]) for x in hs]
    by_cu = multi_token_prediction_loss(flat[0], w, labels.reshape(-1), flat[1:],
                                        cu_seqlens=CU_SEQLENS)
    torch.testing.assert_close(by_pos.loss, by_cu.loss, **TOL)
    hr, wr = leaves(hidden, weight)
    targets = [labels] + [rolled_by_hand(labels, SEGMENTS, k) for k in (1, 2)]
    ref = reference_total(reference_terms(hr, wr, targets), 0.1)  # the default factor
    torch.testing.assert_close(by_cu.loss, ref.detach(), **TOL)


# ---------------------------------------------------------------- calibration

def test_per_depth_calibration_over_uneven_micro_batches():
    """Two micro-batches (3 and 1 rows, padded unevenly): with :func:`mtp_loss_weights` and
    ``reduction="sum"`` the summed losses' gradients are one device's on the concatenated batch,
    each depth a token mean over its own rolled count."""
    depth, scaling = 2, 0.5
    g = torch.Generator().manual_seed(7)
    v, h = 13, 4
    l1 = torch.randint(0, v, (3, 8), generator=g)
    l1[:, -1] = IGNORE
    l2 = torch.randint(0, v, (1, 8), generator=g)
    l2[:, 3:] = IGNORE  # a short sample: 3 valid main targets, 1 at depth 2
    h1 = [torch.randn(3, 8, h, generator=g, dtype=torch.float64) for _ in range(depth + 1)]
    h2 = [torch.randn(1, 8, h, generator=g, dtype=torch.float64) for _ in range(depth + 1)]
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)

    calib = mtp_loss_weights([l1, l2], depth, dtype=torch.float64)
    for k in range(depth + 1):
        want = sum(int((rolled_by_hand(y, segments_of_rows([(8, [0])] * y.shape[0]), k)
                        != IGNORE).sum()) if k else int((y != IGNORE).sum()) for y in (l1, l2))
        assert float(calib.depths[k].num_tokens) == want
    w = weight.clone().requires_grad_(True)
    hs1 = [x.clone().requires_grad_(True) for x in h1]
    hs2 = [x.clone().requires_grad_(True) for x in h2]
    total = 0
    opts = CrossEntropyOptions(reduction="sum")
    for i, (hs, y) in enumerate([(hs1, l1), (hs2, l2)]):
        total = total + multi_token_prediction_loss(
            hs[0], w, y, hs[1:], scaling_factor=scaling, loss_weights=calib.weights(i),
            options=opts).loss
    got = torch.autograd.grad(total, hs1 + hs2 + [w])

    def one_device():
        hr = [torch.cat([a, b]).requires_grad_(True) for a, b in zip(h1, h2)]
        wr = weight.clone().requires_grad_(True)
        y = torch.cat([l1, l2])
        targets = [y] + [mtp_rows(y, k) for k in range(1, depth + 1)]
        ref = reference_total(reference_terms(hr, wr, targets), scaling)
        return ref, torch.autograd.grad(ref, hr + [wr])

    ref, ref_grads = one_device()
    torch.testing.assert_close(total, ref.detach(), **TOL)
    want = [g_[:3] for g_ in ref_grads[:-1]] + [g_[3:] for g_ in ref_grads[:-1]] + [ref_grads[-1]]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)

    # Megatron-LM's normalisation: each micro-batch's depth by its own count, averaged over GAS
    local = 0
    for hs, y in [(h1, l1), (h2, l2)]:
        hr = [x.clone() for x in hs]
        terms = reference_terms(hr, weight, [y] + [mtp_rows(y, k) for k in (1, 2)])
        local = local + reference_total(terms, scaling) / 2
    assert abs(float(local) - float(ref.detach())) > 1e-3


def mtp_rows(y, k):
    return rolled_by_hand(y, segments_of_rows([(y.shape[1], [0])] * y.shape[0]), k)


def test_weights_of_each_depth_are_compute_loss_weights_of_its_rolled_labels():
    labels, _, _ = make_inputs(3, 1, pad_from=5)
    calib = mtp_loss_weights([labels[:1], labels[1:]], 3, "sample",
                             position_ids=[POSITION_IDS[:1], POSITION_IDS[1:]],
                             dtype=torch.float64)
    for k in range(4):
        ys = [labels[:1], labels[1:]]
        if k:
            ys = [mtp_labels(y, k, position_ids=p) for y, p in zip(ys, POSITION_IDS.split(1))]
        want = compute_loss_weights(ys, "sample", group=SINGLE_RANK, dtype=torch.float64,
                                    position_ids=list(POSITION_IDS.split(1)))
        for i in range(2):
            torch.testing.assert_close(calib.weights(i)[k], want.weights[i], rtol=1e-15, atol=0)
        assert float(calib.depths[k].denominator) == float(want.denominator)
    assert torch.equal(calib.depth_labels(1)[1],
                       mtp_labels(labels[1:], 2, position_ids=POSITION_IDS[1:]))


# ---------------------------------------------------------------- bad input

def test_bad_inputs_are_named():
    labels, hidden, weight = make_inputs(1, 2)
    h, d = hidden[0], hidden[1:]
    with pytest.raises(ValueError, match="depth must be >= 1"):
        mtp_labels(labels, 0)
    with pytest.raises(TypeError, match="depth must be an int"):
        mtp_labels(labels, 1.0)
    with pytest.raises(TypeError, match="labels must be an integer"):
        mtp_labels(labels.double(), 1)
    with pytest.raises(ValueError, match="at least one depth"):
        multi_token_prediction_loss(h, weight, labels, [])
    with pytest.raises(TypeError, match="depth_hidden_states must be a list"):
        multi_token_prediction_loss(h, weight, labels, d[0])
    with pytest.raises(ValueError, match=r"depth_hidden_states\[1\] \(depth 2\)"):
        multi_token_prediction_loss(h, weight, labels, [d[0], d[1][:, :-1]])
    with pytest.raises(ValueError, match="scaling_factor must be a finite number >= 0"):
        multi_token_prediction_loss(h, weight, labels, d, scaling_factor=-0.1)
    with pytest.raises(TypeError, match="scaling_factor must be a number"):
        multi_token_prediction_loss(h, weight, labels, d, scaling_factor=True)
    with pytest.raises(ValueError, match="loss_weights.*3 tensors"):
        multi_token_prediction_loss(h, weight, labels, d, loss_weights=[labels.double()] * 2)
    with pytest.raises(ValueError, match=r"depth_labels\[0\] must have the shape"):
        multi_token_prediction_loss(h, weight, labels, d, depth_labels=[labels[0], labels])
    with pytest.raises(ValueError, match="reduction='none'"):
        multi_token_prediction_loss(h, weight, labels, d,
                                    options=CrossEntropyOptions(reduction="none"))
    with pytest.raises(ValueError, match="position_ids must have the shape"):
        multi_token_prediction_loss(h, weight, labels, d, position_ids=POSITION_IDS[:, :3])


# ---------------------------------------------------------------- 2 gloo ranks

def _tp_worker(rank, world):
    """Vocab-parallel MTP loss on a 2-rank lm_head split, and the step weights of a
    micro-batch per rank with one all-reduce over both."""
    from megaloss.losses.vocab_parallel import VocabParallelOptions
    from tests.helpers.vocab_shards import shard_rows
    depth = 2
    labels, hidden, weight = make_inputs(11, depth, v=13, pad_from=6)
    hs = [x.clone().requires_grad_(True) for x in hidden]
    ws = shard_rows(weight, world, rank).requires_grad_(True)
    out = multi_token_prediction_loss(
        hs[0], ws, labels, hs[1:], scaling_factor=0.2, position_ids=POSITION_IDS,
        options=CrossEntropyOptions(chunk_size=5),
        vocab_parallel_options=VocabParallelOptions(vocab_size=13))
    grads = torch.autograd.grad(out.loss, hs + [ws])
    calib = mtp_loss_weights([labels[rank:rank + 1]], depth, "square",
                             position_ids=[POSITION_IDS[rank:rank + 1]], dtype=torch.float64)
    return out.loss.detach(), [g.detach() for g in grads], calib.weights(0)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_vocab_parallel_and_one_all_reduce_on_two_ranks():
    results = run_distributed(_tp_worker, 2, timeout=180)
    labels, hidden, weight = make_inputs(11, 2, v=13, pad_from=6)
    hr, wr = leaves(hidden, weight)
    targets = [labels] + [rolled_by_hand(labels, SEGMENTS, k) for k in (1, 2)]
    ref = reference_total(reference_terms(hr, wr, targets), 0.2)
    ref_grads = torch.autograd.grad(ref, hr + [wr])
    from tests.helpers.vocab_shards import shard_rows
    one_rank = mtp_loss_weights([labels[:1], labels[1:]], 2, "square",
                                position_ids=list(POSITION_IDS.split(1)), group=SINGLE_RANK,
                                dtype=torch.float64)
    for rank, (loss, grads, weights) in enumerate(results):
        torch.testing.assert_close(loss, ref.detach(), **TOL)
        for a, b in zip(grads[:-1], ref_grads[:-1]):
            torch.testing.assert_close(a, b, **TOL)
        torch.testing.assert_close(grads[-1], shard_rows(ref_grads[-1], 2, rank), **TOL)
        for a, b in zip(weights, one_rank.weights(rank)):
            torch.testing.assert_close(a, b, rtol=1e-15, atol=0)
