"""CachedGatheredMultipleNegativesRankingLoss in SentenceTransformerTrainer without DeepSpeed:
every GradCache replay takes the scale the Trainer applies to the returned loss.

One process, float64, the tiny SentenceTransformer of test_hf_sentence_transformers.py, SGD
(lr 1, no clipping, same seed: same data order), 12 triplets, 4 per micro-batch, gradient
accumulation 2: the
epoch is a full window of 2 micro-batches and a last window of 1 (the Trainer divides that one's
loss by 1, not 2). Mini-batch 3: replays of 3 and 1 rows per micro-batch. The parameters after
the epoch (both updates) equal those of the non-cached loss: ``||u_cached - u|| <= 1e-6 ||u||``
per parameter (float64; summation order only). Also: a caller outside a Trainer that divides
the returned loss by its window gets the non-cached gradient of ``loss / GAS`` (rtol 1e-8).
"""
import os
import sys

import pytest
import torch

pytest.importorskip("datasets")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_hf_sentence_transformers import batch, features, load_model, make_model_dir  # noqa: E402

# Importing sentence-transformers costs ~10 CPU-s (sklearn, transformers' model code): this
# module is in the slow tier and imports it only when a test runs, so collecting the fast tier
# does not.
pytestmark = pytest.mark.slow


def adapter():
    """``megaloss.integrations.hf.sentence_transformers``, imported on first use."""
    pytest.importorskip("sentence_transformers")
    from megaloss.integrations.hf import sentence_transformers
    return sentence_transformers

PER_DEVICE, GAS, MINI, ROWS = 4, 2, 3, 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_st_windows")))


def _train(model_dir, out_dir, cached):
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )

    anchor, positive, negative = batch(ROWS, 1, seed=21)
    data = Dataset.from_dict({"anchor": anchor, "positive": positive, "negative": negative})
    model = load_model(model_dir)
    st = adapter()
    loss = (st.CachedGatheredMultipleNegativesRankingLoss(model, mini_batch_size=MINI) if cached
            else st.GatheredMultipleNegativesRankingLoss(model))
    args = SentenceTransformerTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=GAS, num_train_epochs=1, learning_rate=1.0, optim="sgd",
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_drop_last=False)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss)
    trainer.train()
    assert trainer.state.global_step == 2  # windows of 2 and 1 micro-batches
    return {k: p.detach().clone() for k, p in trainer.model.named_parameters()}


def test_trainer_cached_update_equals_non_cached_short_last_window(model_dir, tmp_path):
    before = {k: p.detach().clone() for k, p in load_model(model_dir).named_parameters()}
    plain = _train(model_dir, str(tmp_path / "plain"), cached=False)
    cached = _train(model_dir, str(tmp_path / "cached"), cached=True)
    ratios = []
    for name, after in plain.items():
        u, c = after - before[name], cached[name] - before[name]
        if u.norm() > 0:
            ratios.append(float(c.norm() / u.norm()))
        assert (c - u).norm() <= 1e-6 * u.norm() + 1e-12, \
            f"{name}: |u_cached| / |u| = {float(c.norm() / max(u.norm(), 1e-30)):.4f}"
    assert len(ratios) > len(plain) // 2  # the steps did train the model


def test_caller_dividing_by_its_window_outside_a_trainer(model_dir):
    """A caller of its own (no Trainer on the stack) that divides the returned loss by its
    window: the replays run in its backward and take that scale, the non-cached gradient of
    ``loss / GAS`` (rtol 1e-8, float64)."""
    model = load_model(model_dir)
    feats = features(model, batch(7, 1, seed=5))  # 3 replays
    st = adapter()
    out = {}
    for name, loss_fn in (("plain", st.GatheredMultipleNegativesRankingLoss(model)),
                          ("cached", st.CachedGatheredMultipleNegativesRankingLoss(
                              model, mini_batch_size=MINI))):
        model.zero_grad(set_to_none=True)
        (loss_fn(feats, None) / GAS).backward()
        # parameters the loss never reaches (the unused pooler) keep no gradient in either run
        out[name] = {n: p.grad.clone() for n, p in model.named_parameters()
                     if p.grad is not None}
    assert out["cached"].keys() == out["plain"].keys() and out["plain"]
    for name, g in out["plain"].items():
        torch.testing.assert_close(out["cached"][name], g, rtol=1e-8, atol=1e-12, msg=name)
