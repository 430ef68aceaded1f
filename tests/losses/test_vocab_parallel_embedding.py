"""VocabParallelEmbedding: one process against ``nn.Embedding``; and on 2 spawned gloo TP ranks
(vocab 37, padded to 38), tied to / untied from a ``VocabParallelLMHead``, every CE reduction,
against a float64 single-process model on the full ``[V, H]`` table(s). Tolerance 1e-10
(float64 on both sides; only the order of the sums differs)."""
import math

import pytest
import torch
from torch import nn

from megaloss import VocabParallelEmbedding, VocabParallelLMHead
from megaloss.testing import run_distributed
from tests.helpers.ce_reference import reference_linear_ce
from tests.helpers.vocab_shards import shard_rows

N_TOK, H, V, PAD = 13, 6, 37, 3
REDUCTIONS = ("mean", "sum", "none")


def test_single_process_matches_nn_embedding_with_padding_idx():
    ref = nn.Embedding(V, H, padding_idx=PAD).double()
    emb = VocabParallelEmbedding(V, H, tp_group=None, padding_idx=PAD, dtype=torch.float64)
    emb.load_full_weight(ref.weight.detach())
    ids = torch.tensor([[0, PAD, 5, 36], [PAD, 7, 7, 1]])
    cot = torch.randn(2, 4, H, dtype=torch.float64)
    out, want = emb(ids), ref(ids)
    assert torch.equal(out, want)
    (out * cot).sum().backward()
    (want * cot).sum().backward()
    assert torch.equal(emb.weight.grad, ref.weight.grad)
    assert not emb.weight.grad[PAD].any()


def test_tied_to_shares_the_heads_parameter_and_bad_inputs_raise():
    head = VocabParallelLMHead(H, V, tp_group=None)
    emb = VocabParallelEmbedding.tied_to(head, padding_idx=-1)
    assert emb.weight is head.weight and emb.padding_idx == V - 1
    assert torch.equal(VocabParallelEmbedding(V, H).weight, head.weight)  # the same init draw
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 37\), got 37"):
        emb(torch.tensor([1, 37]))
    with pytest.raises(ValueError, match="got -2"):
        emb(torch.tensor([-2]))
    with pytest.raises(TypeError, match="integer"):
        emb(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="weight must have shape"):
        VocabParallelEmbedding(V, H, weight=nn.Parameter(torch.zeros(V, H + 1)))
    with pytest.raises(TypeError, match="nn.Parameter"):
        VocabParallelEmbedding(V, H, weight=torch.zeros(V, H))
    with pytest.raises(ValueError, match="padding_idx"):
        VocabParallelEmbedding(V, H, padding_idx=V)
    with pytest.raises(ValueError, match="num_embeddings"):
        VocabParallelEmbedding(0, H)
    with pytest.raises(TypeError, match="VocabParallelLMHead"):
        VocabParallelEmbedding.tied_to(nn.Linear(H, V))


def _inputs():
    g = torch.Generator().manual_seed(5)
    table = torch.randn(V, H, generator=g, dtype=torch.float64)
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    mix = torch.randn(H, H, generator=g, dtype=torch.float64) / math.sqrt(H)
    ids = torch.randint(0, V, (2, N_TOK), generator=g)
    ids[0, :3] = PAD
    ids[1, -2:] = V - 1  # the last real row, next to the padded one
    labels = torch.randint(0, V, (2, N_TOK), generator=g)
    labels[0, ::2] = -100  # uneven valid tokens ...
    labels[1] = -100  # ... and a micro-batch (row) with none
    return table, head, mix, ids, labels


def _model_loss(emb_out, mix, head_loss, labels):
    hidden = torch.tanh(emb_out @ mix)
    return [head_loss(hidden[i], labels[i]) for i in range(labels.shape[0])]


def _worker(rank, world):
    table, head_w, mix, ids, labels = _inputs()
    out = {}
    for tied in (True, False):
        for reduction in REDUCTIONS:
            head = VocabParallelLMHead(H, V, tp_group=None, dtype=torch.float64,
                                       reduction=reduction, z_loss=1e-3, chunk_size=4)
            head.load_full_weight(table if tied else head_w)
            emb = (VocabParallelEmbedding.tied_to(head, padding_idx=PAD) if tied else
                   VocabParallelEmbedding(V, H, padding_idx=PAD, dtype=torch.float64))
            if not tied:
                emb.load_full_weight(table)
            m = mix.clone().requires_grad_(True)
            losses = _model_loss(emb(ids), m, head, labels)
            total = sum(loss.sum() for loss in losses)
            params = [emb.weight, m] + ([] if tied else [head.weight])
            grads = torch.autograd.grad(total, params)
            out[tied, reduction] = ([loss.detach() for loss in losses],
                                    [g.detach() for g in grads])
    return out


def _reference(tied, reduction):
    table, head_w, mix, ids, labels = _inputs()
    leaves = [t.clone().requires_grad_(True) for t in (table, mix, head_w)]
    t, m, w = leaves
    emb_out = nn.functional.embedding(ids, t, padding_idx=PAD)
    losses = _model_loss(emb_out, m, lambda h, y: reference_linear_ce(
        h, t if tied else w, y, reduction=reduction, z_loss=1e-3), labels)
    used = leaves[:2] if tied else leaves
    grads = torch.autograd.grad(sum(loss.sum() for loss in losses), used)
    return [loss.detach() for loss in losses], list(grads)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_tied_and_untied_under_tp2_match_the_float64_reference():
    results = run_distributed(_worker, 2, timeout=240)
    tol = dict(rtol=1e-10, atol=1e-10)
    for tied in (True, False):
        for reduction in REDUCTIONS:
            ref_losses, ref_grads = _reference(tied, reduction)
            for rank, per_rank in enumerate(results):
                losses, grads = per_rank[tied, reduction]
                for got, want in zip(losses, ref_losses):
                    torch.testing.assert_close(got, want, **tol)
                # the embedding shard (tied: the sum of the lookup's and the head's gradients)
                torch.testing.assert_close(grads[0], shard_rows(ref_grads[0], 2, rank), **tol)
                torch.testing.assert_close(grads[1], ref_grads[1], **tol)  # replicated layer
                if not tied:
                    torch.testing.assert_close(grads[2], shard_rows(ref_grads[2], 2, rank), **tol)
            if tied:  # the lookup's padding row still trains through the head, as unsharded
                assert ref_grads[0][PAD].abs().sum() > 0
