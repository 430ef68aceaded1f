"""CachedGatheredMultipleNegativesRankingLoss (GradCache) equals the non-cached gathered loss.

Single process, float64, the tiny random-init SentenceTransformer of
test_hf_sentence_transformers.py: loss and every parameter gradient against
GatheredMultipleNegativesRankingLoss on the same batch (rtol 1e-10 / 1e-8: summation order only),
for mini-batch sizes that split the batch unevenly, with hard negatives and both directions; and
the loss value against sentence-transformers' own CachedMultipleNegativesRankingLoss. The
caller's loss scale outside a Trainer (the replays run in the caller's backward): ``loss * s``
back-propagated gives ``s`` times the non-cached gradients (sentence-transformers'
test_cmnrl.py scaler case, ported; same tolerances), a ``torch.amp.GradScaler`` (2**16) the
non-cached gradients after ``unscale_``; 2 gloo ranks, gathered, uneven, loss * 0.5: the mean
gradient over 0.5 is the single-process global batch's (rtol 1e-8).

Under ``deepspeed --num_gpus 2`` (CPU, gloo; the launch this folder's Trainer modules share,
``shared_launch_hf`` of tests/helpers/shared_launches.py), SentenceTransformerTrainer, ZeRO-2
and ZeRO-3,
gradient accumulation 2, 4 triplets per rank per micro-batch, mini-batch 3 (replays of 3 and 1
rows): the SGD update (lr 1) of the cached loss equals that of the non-cached loss from the same
seed (same data order): ``||u_cached - u|| <= 1e-5 ||u|| + 1e-8`` per parameter (fp32, summation
order); the same over an epoch of 3 micro-batches per rank under ZeRO-2, whose last window
holds 1 micro-batch (the Trainer divides it by 1, not by GAS). sentence-transformers' own
cached loss stops on the first step there ("Gradient computed
twice for this partition"). This file is also the worker.
"""
import argparse
import itertools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_hf_sentence_transformers import (  # noqa: E402
    assert_grads_close,
    batch,
    features,
    grads,
    load_model,
    loss_and_grads,
    make_model_dir,
)

from megaloss.testing import run_distributed  # noqa: E402

# Importing sentence-transformers costs ~10 CPU-s (sklearn, transformers' model code): this
# module is in the slow tier and imports it only when a test runs, so collecting the fast tier
# does not.
pytestmark = pytest.mark.slow


def adapter():
    """``megaloss.integrations.hf.sentence_transformers``, imported on first use."""
    pytest.importorskip("sentence_transformers")
    from megaloss.integrations.hf import sentence_transformers
    return sentence_transformers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_st_cached")))


@pytest.mark.parametrize("mini_batch_size,negatives,symmetric", [
    (1, 1, False), (3, 2, True), (7, 0, False), (32, 1, True)])
def test_cached_equals_non_cached(model_dir, mini_batch_size, negatives, symmetric):
    model = load_model(model_dir)
    columns = batch(7, negatives, seed=3)
    st = adapter()
    ref_loss, ref_grads = loss_and_grads(
        model, st.GatheredMultipleNegativesRankingLoss(model, symmetric=symmetric), columns)
    cached = st.CachedGatheredMultipleNegativesRankingLoss(model, symmetric=symmetric,
                                                           mini_batch_size=mini_batch_size)
    loss, g = loss_and_grads(model, cached, columns)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=0)
    assert_grads_close(g, ref_grads)
    with torch.no_grad():  # evaluation: the plain loss, same value
        torch.testing.assert_close(cached(features(model, columns), None), ref_loss,
                                   rtol=1e-10, atol=0)


def test_value_matches_sentence_transformers_cached_mnrl(model_dir):
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
    model = load_model(model_dir)
    columns = batch(6, 1, seed=4)
    ref_loss, ref_grads = loss_and_grads(
        model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=4), columns)
    ours = adapter().CachedGatheredMultipleNegativesRankingLoss(model, mini_batch_size=4)
    loss, g = loss_and_grads(model, ours, columns)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=0)
    assert_grads_close(g, ref_grads)


def _scaled_loss_and_grads(model, loss_fn, columns, scale):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(features(model, columns), None) * scale
    loss.backward()
    return loss.detach(), grads(model)


@pytest.mark.parametrize("scale", [0.5, 1000.0])
def test_caller_scale_reaches_every_replay(model_dir, scale):
    """sentence-transformers' tests/sentence_transformer/losses/test_cmnrl.py scaler case, ported:
    5 triplets, mini-batch 2 (3 replays), the returned loss times ``scale`` back-propagated
    outside any Trainer: loss and gradients equal sentence-transformers' non-cached
    MultipleNegativesRankingLoss times ``scale`` (and its own cached loss's), float64, rtol 1e-10
    on the loss, 1e-8 on the gradients."""
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        MultipleNegativesRankingLoss,
    )
    model = load_model(model_dir)
    columns = batch(5, 1, seed=8)
    ref_loss, ref_grads = _scaled_loss_and_grads(model, MultipleNegativesRankingLoss(model),
                                                 columns, scale)
    st_loss, st_grads = _scaled_loss_and_grads(
        model, CachedMultipleNegativesRankingLoss(model, mini_batch_size=2), columns, scale)
    ours = adapter().CachedGatheredMultipleNegativesRankingLoss(model, mini_batch_size=2)
    loss, g = _scaled_loss_and_grads(model, ours, columns, scale)
    for other_loss, other_grads in ((ref_loss, ref_grads), (st_loss, st_grads)):
        torch.testing.assert_close(loss, other_loss, rtol=1e-10, atol=0)
        assert_grads_close(g, other_grads)


def test_grad_scaler_unscaled_gradients_equal_non_cached(model_dir):
    """torch.amp.GradScaler (init scale 2**16, CPU): ``scaler.scale(loss).backward()`` then
    ``unscale_``: the non-cached gathered loss's gradients (float64, rtol 1e-8)."""
    model = load_model(model_dir)
    columns = batch(7, 2, seed=9)
    st = adapter()
    out = {}
    for name, loss_fn in (("plain", st.GatheredMultipleNegativesRankingLoss(model)),
                          ("cached", st.CachedGatheredMultipleNegativesRankingLoss(
                              model, mini_batch_size=3))):
        model.zero_grad(set_to_none=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler.scale(loss_fn(features(model, columns), None)).backward()
        scaler.unscale_(optimizer)
        out[name] = grads(model)
    assert_grads_close(out["cached"], out["plain"])


def _scaled_rank_grads(rank, world, model_dir, columns, sizes, scale):
    model = load_model(model_dir)
    start = sum(sizes[:rank])
    mine = [c[start:start + sizes[rank]] for c in columns]
    loss_fn = adapter().CachedGatheredMultipleNegativesRankingLoss(model, mini_batch_size=2)
    loss = loss_fn(features(model, mine), None)
    (loss * scale).backward()
    return {"loss": loss.detach(), "grads": grads(model)}


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_two_ranks_gathered_caller_scale(model_dir):
    """2 gloo ranks, 5 and 2 triplets (3 replays each, rank 1's padded), the returned loss
    times 0.5: the ranks' mean gradient over 0.5 is the single-process non-cached gradient of
    the global batch (float64, rtol 1e-8)."""
    sizes = [5, 2]
    columns = batch(sum(sizes), 1, seed=10)
    model = load_model(model_dir)
    ref_loss, ref_grads = loss_and_grads(
        model, adapter().GatheredMultipleNegativesRankingLoss(model), columns)
    results = run_distributed(_scaled_rank_grads, 2, model_dir, columns, sizes, 0.5,
                              timeout=140)
    for r in results:
        torch.testing.assert_close(r["loss"], ref_loss, rtol=1e-10, atol=0)
    mean = {n: sum(r["grads"][n] for r in results) / 2 / 0.5 for n in ref_grads}
    assert_grads_close(mean, ref_grads)


def test_conventions_and_errors(model_dir):
    model = load_model(model_dir)
    loss_fn = adapter().CachedGatheredMultipleNegativesRankingLoss(model, mini_batch_size=8,
                                                                   scale=10)
    assert loss_fn.get_config_dict()["mini_batch_size"] == 8
    assert loss_fn.get_config_dict()["scale"] == 10.0
    assert "2101.06983" in loss_fn.citation and "1807.03748" in loss_fn.citation
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="mini_batch_size"):
            adapter().CachedGatheredMultipleNegativesRankingLoss(model, mini_batch_size=bad)
    with pytest.raises(ValueError, match="at least 2"):
        loss_fn(features(model, batch(3, 0)[:1]), None)


# under DeepSpeed ----------------------------------------------------------------------------
PER_RANK, GAS, MINI = 4, 2, 3
CASES = ((2, "full"), (3, "full"), (2, "short"))  # (ZeRO stage, accumulation windows)


def _worker_main(argv):  # ZeRO-3's zero.Init follows the latest TrainingArguments
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    a = parser.parse_args(argv)
    from megaloss.integrations.deepspeed.compat import skip_cpu_shm_comm_build
    skip_cpu_shm_comm_build()
    import deepspeed
    deepspeed.init_distributed()  # ZeRO-3 builds the model under zero.Init: comm first
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    updates = {}
    for (zero, window), name in itertools.product(CASES, ("plain", "cached")):
        # "short": one epoch of 3 micro-batches per rank, windows of 2 and 1
        micro_batches = GAS if window == "full" else GAS + 1
        anchor, positive, negative = batch(2 * PER_RANK * micro_batches, 1, seed=12)
        data = Dataset.from_dict({"anchor": anchor, "positive": positive, "negative": negative})
        cfg = {"train_micro_batch_size_per_gpu": PER_RANK, "gradient_accumulation_steps": GAS,
               "train_batch_size": "auto", "gradient_clipping": 0.0,
               "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True,
               "steps_per_print": 1000}
        args = SentenceTransformerTrainingArguments(
            output_dir=os.path.join(a.worker, f"{name}{zero}{window}"),
            per_device_train_batch_size=PER_RANK, gradient_accumulation_steps=GAS,
            **({"max_steps": 1} if window == "full" else {"num_train_epochs": 1}),
            learning_rate=1.0, optim="sgd",
            lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, deepspeed=cfg, disable_tqdm=True,
            seed=0)
        model = load_model(a.model_dir).float()
        st = adapter()
        loss = (st.CachedGatheredMultipleNegativesRankingLoss(model, mini_batch_size=MINI)
                if name == "cached" else st.GatheredMultipleNegativesRankingLoss(model))
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                             loss=loss)
        trainer.train()
        # the trained fp32 weights (ZeRO-3: gathered from the partitions)
        key = zero if window == "full" else "short"
        updates[key, name] = {k: deepspeed.utils.safe_get_full_fp32_param(p).clone()
                              for k, p in trainer.model.named_parameters()}
        updates[key, name + "_loss"] = [e["loss"] for e in trainer.state.log_history
                                        if "loss" in e]
        updates[key, name + "_steps"] = trainer.state.global_step
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(updates, os.path.join(a.worker, "result.pt"))


def shared_launch_hf_jobs(tmp_path):
    """This module's worker job in the shared Trainer launch (``shared_launch_hf``): ZeRO-2
    then ZeRO-3, each
    plain then cached (4 one-step trainings), then ZeRO-2 over an epoch whose last window is
    short (plain, cached); the tiny model written under ``tmp_path / "model"``."""
    model = make_model_dir(str(tmp_path / "model"))
    return [{"worker": __file__, "argv": ["--worker", str(tmp_path), "--model_dir", model]}]


@pytest.fixture(scope="module")
def trainer_runs(shared_launch_hf):
    """The results of this module's trainings in the shared launch, and the initial weights."""
    pytest.importorskip("datasets")
    run = shared_launch_hf["test_hf_sentence_transformers_cached"]
    result = torch.load(run.tmp_path / "result.pt", weights_only=False)
    before = dict(load_model(str(run.tmp_path / "model")).float().named_parameters())
    return result, before


@pytest.mark.deepspeed
@pytest.mark.timeout(900)  # the first test using the shared launch waits for it
@pytest.mark.parametrize("zero", [2, 3])
def test_trainer_cached_equals_non_cached(trainer_runs, zero):
    result, before = trainer_runs
    assert result[zero, "cached_loss"] == pytest.approx(result[zero, "plain_loss"], rel=1e-5)
    moved = 0
    for name, after in result[zero, "plain"].items():
        u = after - before[name].detach()
        c = result[zero, "cached"][name] - before[name].detach()
        assert (c - u).norm() <= 1e-5 * u.norm() + 1e-8, f"ZeRO-{zero} {name}"
        moved += int(u.norm() > 0)
    assert moved > len(result[zero, "plain"]) // 2  # the step did train the model


@pytest.mark.deepspeed
@pytest.mark.timeout(900)
def test_trainer_cached_equals_non_cached_short_last_window(trainer_runs):
    """ZeRO-2, one epoch of windows of 2 and 1 micro-batches: the Trainer divides the last
    window's loss by 1; every replay of that window must be divided by 1 too."""
    result, before = trainer_runs
    assert result["short", "cached_steps"] == result["short", "plain_steps"] == 2
    assert result["short", "cached_loss"] == pytest.approx(result["short", "plain_loss"],
                                                           rel=1e-5)
    for name, after in result["short", "plain"].items():
        u = after - before[name].detach()
        c = result["short", "cached"][name] - before[name].detach()
        assert (c - u).norm() <= 1e-5 * u.norm() + 1e-8, \
            f"{name}: |u_cached - u| / |u| = {float((c - u).norm() / max(u.norm(), 1e-30)):.3g}"


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
