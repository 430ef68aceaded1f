"""``VocabParallelOptions(shard_range=...)``: an lm_head split that is not megaloss's
``ceil(V / tp)`` rows per rank (DeepSpeed AutoTP's, or any other), on 2 gloo ranks: loss and
gradients equal to full-logits ``F.cross_entropy`` in float64, for AutoTP's 19 + 18 split of 37
rows and a lopsided 30 + 7 one; ranges that do not tile the vocabulary, or given on one rank only,
raise the same error on every rank."""
import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(200)]

VOCAB, HIDDEN, TOKENS = 37, 16, 11
SPLITS = ((19, 18), (30, 7))


def _worker(rank, world):
    import torch.distributed as dist
    import torch.nn.functional as F

    from megaloss import VocabParallelOptions, linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    w = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    y = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    y[2] = -100
    href, wref = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy(href @ wref.T, y, ignore_index=-100)
    ref.backward()
    errors = []
    for sizes in SPLITS:
        start = sum(sizes[:rank])
        stop = start + sizes[rank]
        hs = h.clone().requires_grad_()
        ws = w[start:stop].clone().requires_grad_()
        opts = VocabParallelOptions(None, VOCAB, shard_range=(start, stop))
        loss = linear_cross_entropy(hs, ws, y, vocab_parallel_options=opts, chunk_size=4)
        loss.backward()
        errors.append((float((loss - ref).abs() / ref.abs()),
                       float((hs.grad - href.grad).norm() / href.grad.norm()),
                       float((ws.grad - wref.grad[start:stop]).norm()
                             / wref.grad[start:stop].norm())))
    msgs = []
    for ranges in (((0, 19), (20, 37)), ((0, 19), None)):
        r = ranges[rank]
        rows = 19 if r is None else r[1] - r[0]
        opts = VocabParallelOptions(None, VOCAB, shard_range=r)
        try:
            linear_cross_entropy(h, w[:rows].clone(), y, vocab_parallel_options=opts)
        except ValueError as err:
            msgs.append(str(err))
        else:
            msgs.append(None)
    dist.barrier()
    return errors, msgs


def test_shard_range_matches_full_logits_and_bad_ranges_fail_on_every_rank():
    results = run_distributed(_worker, 2, timeout=180)
    for rank, (errors, msgs) in enumerate(results):
        for loss_err, h_err, w_err in errors:
            assert loss_err < 1e-12 and h_err < 1e-12 and w_err < 1e-12, (rank, errors)
        assert msgs[0] is not None and "must tile [0, 37)" in msgs[0], msgs
        assert msgs[1] is not None and "given on tensor-parallel rank(s) [0] only" in msgs[1]
    assert results[0][1] == results[1][1]  # the same error on both ranks


def test_shard_range_needs_vocab_size_and_an_ordered_range():
    from megaloss import VocabParallelOptions

    assert VocabParallelOptions(None, 37, shard_range=[19, 37]).shard_range == (19, 37)
    for bad in ((5, 3), (0, 38), (0,), (0.0, 3)):
        with pytest.raises(ValueError, match="shard_range must be"):
            VocabParallelOptions(None, 37, shard_range=bad)
    with pytest.raises(ValueError, match="shard_range must be"):
        VocabParallelOptions(None, shard_range=(0, 3))
