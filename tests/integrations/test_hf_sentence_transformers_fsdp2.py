"""GatheredMultipleNegativesRankingLoss under PyTorch FSDP2 (``fully_shard``) on 2 gloo ranks
(CPU): the tiny float64 SentenceTransformer of test_hf_sentence_transformers.py (1-layer BERT +
mean pooling), ``fully_shard`` on its BERT layer and then on the SentenceTransformer as the
root (the encoder runs inside FSDP-managed forwards: ``model(features)`` is the root's module
call), uneven per-rank batches, one rank empty. The same worker runs
CachedGatheredMultipleNegativesRankingLoss (GradCache: a no-grad pass, then per mini-batch a
forward with grad replayed inside the caller's backward, each one FSDP2-managed) with uneven
per-rank batches and mini-batch sizes that split them unevenly: the same number of mini-batches
on both ranks, different numbers (the rank with fewer re-runs one with a zero gradient), and an
empty rank. The re-run case hung until gloo's timeout while sentence-transformers' modules
wrote each pass's outputs into the mini-batch's features dict: the re-run then took the earlier
replay's graph outputs as inputs, ``fully_shard`` hooked them, and that rank's all-gathers no
longer matched its peer's. Each pass now gets new containers.

Compared: every rank's loss against the single-process loss of the concatenated batch (rtol
1e-10) and the full gradients after FSDP2's reduction (``grad.full_tensor()``: FSDP2 averages
over the ranks, the contract of :mod:`megaloss.losses.mnr`) against the single-process gradients
(rtol 1e-8: float64, different summation order only). An empty rank runs the placeholder
forward / backward (as under ZeRO-3): skipping its encoder would leave the other rank waiting in
FSDP2's all-gather and reduce-scatter.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_hf_sentence_transformers import (  # noqa: E402
    assert_grads_close,
    batch,
    features,
    gathered_mnrl,
    load_model,
    loss_and_grads,
    make_model_dir,
)

from megaloss.testing import run_distributed  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(300)]

# (per-rank rows, hard negatives, symmetric, mini_batch_size: None is the non-cached loss)
CASES = [((5, 2), 1, False, None), ((4, 0), 1, True, None), ((0, 3), 2, False, None),
         ((3, 3), 2, False, None),
         # CachedGatheredMultipleNegativesRankingLoss (GradCache): mini-batches of 4 split the
         # ranks' 5 / 6 rows as 4 + 1 / 4 + 2, of 2 the 3 / 4 rows as 2 + 1 / 2 + 2; then
         # different counts (5 rows as 2 + 2 + 1, 2 rows as 2: rank 1 re-runs its mini-batch
         # twice) and an empty rank (the placeholder forward in every replay)
         ((5, 6), 1, False, 4), ((3, 4), 2, True, 2), ((5, 2), 1, False, 2),
         ((0, 3), 2, True, 2)]


def loss_fn(model, symmetric, mini_batch_size):
    if mini_batch_size is None:
        return gathered_mnrl(model, symmetric=symmetric)
    from megaloss.integrations.hf.sentence_transformers import (
        CachedGatheredMultipleNegativesRankingLoss,
    )
    return CachedGatheredMultipleNegativesRankingLoss(model, symmetric=symmetric,
                                                      mini_batch_size=mini_batch_size)


def _worker(rank, world, model_dir, cases):
    from torch.distributed.fsdp import fully_shard

    from megaloss.ops.validation import is_dtensor
    out = []
    for columns, sizes, symmetric, mini_batch_size in cases:
        torch.manual_seed(0)
        model = load_model(model_dir)
        for layer in model[0].auto_model.encoder.layer:
            fully_shard(layer)
        fully_shard(model)
        start = sum(sizes[:rank])
        mine = [c[start:start + sizes[rank]] for c in columns]
        if sizes[rank] == 0:
            feats = [{k: (v[:0] if isinstance(v, torch.Tensor) else v)
                      for k, v in model.tokenize(["w1"]).items()} for _ in columns]
        else:
            feats = features(model, mine)
        loss = loss_fn(model, symmetric, mini_batch_size)(feats, None)
        loss.backward()
        # the unused BERT pooler has no gradient (zeros, as in the reference's grads())
        grads = {n: (p.grad.full_tensor() if p.grad is not None
                     else torch.zeros(p.shape, dtype=p.dtype))
                 for n, p in model.named_parameters()}
        out.append(dict(loss=loss.detach(), grads=grads,
                        sharded=all(is_dtensor(p) for p in model.parameters())))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("sentence_transformers")
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_st_fsdp2")))


def test_fsdp2_equals_single_process_global_batch(model_dir):
    cases, refs = [], []
    for sizes, negatives, symmetric, mini_batch_size in CASES:
        columns = batch(sum(sizes), negatives, seed=7)
        model = load_model(model_dir)
        refs.append(loss_and_grads(model, gathered_mnrl(model, symmetric=symmetric), columns))
        cases.append((columns, list(sizes), symmetric, mini_batch_size))
    results = run_distributed(_worker, 2, model_dir, cases, timeout=280)
    for i, (ref_loss, ref_grads) in enumerate(refs):
        for rank in range(2):
            r = results[rank][i]
            assert r["sharded"], (CASES[i], rank)
            torch.testing.assert_close(r["loss"], ref_loss, rtol=1e-10, atol=0)
            assert_grads_close(r["grads"], ref_grads)
        ref_norm = sum(float(g.norm()) ** 2 for g in ref_grads.values()) ** 0.5
        worst = max(sum(float((res[i]["grads"][n] - g).norm()) ** 2
                        for n, g in ref_grads.items()) ** 0.5 / ref_norm for res in results)
        print(f"{CASES[i]}: loss {float(ref_loss):.6f}, gradient error {worst:.1e} (norm)")
