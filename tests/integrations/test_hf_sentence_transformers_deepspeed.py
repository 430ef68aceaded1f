"""GatheredMultipleNegativesRankingLoss inside SentenceTransformerTrainer under ``deepspeed
--num_gpus 2`` (CPU, gloo, ZeRO-2): one SGD step (lr 1, no clipping) equals the float64
single-process gradient of the loss on the step's global batch (8 triplets, 4 per rank).

Tolerance: ``||update + grad|| <= 2e-4 ||grad|| + 1e-7`` per parameter (fp32 training against
float64; see test_hf_trainer.py). This file is also the worker:
``deepspeed --num_gpus 2 tests/integrations/test_hf_sentence_transformers_deepspeed.py --worker
OUT --model_dir DIR``.
"""
import argparse
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_hf_sentence_transformers import batch, load_model, make_model_dir  # noqa: E402

N_PAIRS = 8


def columns():
    return batch(N_PAIRS, 1, seed=11)  # anchor, positive, negative


def _worker_main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--local_rank", type=int, default=0)
    a = parser.parse_args(argv)
    from megaloss.integrations.deepspeed import skip_cpu_shm_comm_build
    skip_cpu_shm_comm_build()
    from datasets import Dataset
    from sentence_transformers import (SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)

    from megaloss.integrations.hf.sentence_transformers import \
        GatheredMultipleNegativesRankingLoss
    model = load_model(a.model_dir).float()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    anchor, positive, negative = columns()
    data = Dataset.from_dict({"anchor": anchor, "positive": positive, "negative": negative})
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "train_batch_size": "auto", "gradient_clipping": 0.0,
           "zero_optimization": {"stage": a.zero}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 1000}
    args = SentenceTransformerTrainingArguments(
        output_dir=os.path.join(a.worker, "trainer"), per_device_train_batch_size=4,
        max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, deepspeed=cfg, disable_tqdm=True, seed=0)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                         loss=GatheredMultipleNegativesRankingLoss(model))
    trainer.train()
    after = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"before": before, "after": after, "logs": trainer.state.log_history},
                   os.path.join(a.worker, "result.pt"))


@pytest.mark.deepspeed
@pytest.mark.timeout(240)
def test_sentence_transformer_trainer_zero2_equals_float64(tmp_path):
    pytest.importorskip("datasets")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
    from launch_helpers import run_deepspeed_launcher

    from megaloss.integrations.hf.sentence_transformers import \
        GatheredMultipleNegativesRankingLoss
    model_dir = make_model_dir(str(tmp_path / "model"))
    run_deepspeed_launcher(os.path.abspath(__file__),
                           ["--worker", str(tmp_path), "--model_dir", model_dir], timeout=220)
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    model = load_model(model_dir)  # float64
    model.load_state_dict({k: v.double() for k, v in result["before"].items()})
    loss = GatheredMultipleNegativesRankingLoss(model)([model.tokenize(c) for c in columns()],
                                                       None)
    loss.backward()
    grads = dict(model.named_parameters())
    for name, p in grads.items():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        update = result["after"][name].double() - result["before"][name].double()
        assert (update + g).norm() <= 2e-4 * g.norm() + 1e-7, name
    step = [e for e in result["logs"] if "loss" in e][0]
    assert step["loss"] == pytest.approx(loss.item(), rel=1e-3)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
