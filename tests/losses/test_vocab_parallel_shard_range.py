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


def _default_chunk_worker(rank, world):
    """The default chunk (``chunk_size=None``) where the ranks' real rows differ (19 + 18 of 37,
    the padded split and the same ``shard_range``): at H 18 and 3000 tokens a rank's own rows
    gave it 2048-token chunks and its peer 4096, so their per-chunk all-reduces mismatched
    (gloo: "Connection reset by peer")."""
    import torch.nn.functional as F

    import megaloss
    from megaloss import VocabParallelOptions

    n, hidden = 3000, 18
    g = torch.Generator().manual_seed(1)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(VOCAB, hidden, generator=g, dtype=torch.float64)
    tw = torch.randn(VOCAB, hidden, generator=g, dtype=torch.float64)
    y = torch.randint(0, VOCAB, (n,), generator=g)
    logits, teacher = h @ w.T, h @ tw.T
    ref = {"ce": F.cross_entropy(logits, y),
           "lp": torch.log_softmax(logits, -1).gather(-1, y[:, None])[:, 0],
           "kd": F.kl_div(torch.log_softmax(logits, -1), torch.log_softmax(teacher, -1),
                          log_target=True, reduction="none").sum(-1).mean()}
    start, stop = (0, 19) if rank == 0 else (19, 37)
    padded = torch.zeros(19, hidden, dtype=torch.float64)
    padded[:stop - start] = w[start:stop]
    tpadded = torch.zeros(19, hidden, dtype=torch.float64)
    tpadded[:stop - start] = tw[start:stop]
    errors = {}
    for name, weights, opts in (
            ("padded", (padded, tpadded), VocabParallelOptions(None, VOCAB)),
            ("shard_range", (w[start:stop], tw[start:stop]),
             VocabParallelOptions(None, VOCAB, shard_range=(start, stop)))):
        ce = megaloss.linear_cross_entropy(h, weights[0], y, vocab_parallel_options=opts)
        lp = megaloss.linear_log_probs(h, weights[0], y, vocab_parallel_options=opts).log_probs
        kd = megaloss.linear_distillation_loss(
            h, weights[0], y, teacher_hidden_states=h, teacher_weight=weights[1],
            kind="forward_kl", alpha=0.0, vocab_parallel_options=opts)
        errors[name] = [float((a - ref[k]).abs().max() / ref[k].abs().max())
                        for k, a in (("ce", ce), ("lp", lp), ("kd", kd))]
    return errors


def test_the_default_chunk_is_the_same_on_ranks_with_different_rows():
    for rank, errors in enumerate(run_distributed(_default_chunk_worker, 2, timeout=180)):
        for name, errs in errors.items():
            assert max(errs) < 1e-12, (rank, name, errs)
