"""MegalossTrainer's data-parallel group and engine scale come from the engine accelerate built,
not from ``torch.distributed``'s world; tensor / sequence parallelism are refused with reasons.

Case where the world is not the engine's group: 2 gloo processes with ``torch.distributed``
initialized, each running its own single-process Trainer (the launcher's rank variables unset,
so accelerate trains without DDP: ``ParallelMode.NOT_PARALLEL``) on different data. Each rank's
SGD step (lr 1, GAS 2, ``token`` reduction) must equal the float64 gradient of *its own* batch
(tolerance of test_hf_trainer.py: ``||update + grad|| <= 2e-4 ||grad|| + 1e-7`` per tensor) and
log its own valid tokens. Assuming the world (every rank's tokens in the calibration, the loss
times 2) gives each rank another gradient.
"""
import os
import sys

import pytest

pytest.importorskip("accelerate")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_hf_trainer import (  # noqa: E402
    assert_update_is_minus_grad,
    case_reference,
    ce_section,
    collate,
    samples,
    tiny_llama,
)

from megaloss.testing import run_distributed  # noqa: E402

CASE = {"zero": None, "reduction": "token"}


def _train(out_dir, data, megaloss_config=None, **arguments):
    from transformers import TrainingArguments

    from megaloss.integrations.hf.trainer import MegalossTrainer
    model = tiny_llama()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=1, learning_rate=1.0,
                             optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
                             max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, remove_unused_columns=False,
                             disable_tqdm=True, seed=0, **arguments)
    trainer = MegalossTrainer(model=model, args=args, train_dataset=data, data_collator=collate,
                              megaloss_config=megaloss_config or {"ce": ce_section(CASE)})
    trainer.train()
    after = {k: v.detach().clone() for k, v in trainer.model.model.state_dict().items()}
    return before, after, trainer.state.log_history


def _worker(rank, world, out_dir):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)  # torch.distributed stays initialized; accelerate sees 1 rank
    data = samples(4, seed=10 + rank)  # one step: 2 micro-batches of 2
    before, after, logs = _train(os.path.join(out_dir, str(rank)), data)
    return before, after, logs, data


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_world_of_two_with_single_process_trainers(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path), timeout=280)
    for rank, (before, after, logs, data) in enumerate(results):
        _, grads = case_reference(CASE, before, data)
        err, _ = assert_update_is_minus_grad(before, after, grads)
        step = [e for e in logs if "loss" in e][0]
        assert step["num_valid_tokens"] == sum(len(s["input_ids"]) - 1 for s in data), rank
        print(f"rank {rank}: update rel err {err:.2e}")


@pytest.mark.parametrize("section,match", [
    ({"tensor_parallel_size": 2}, "tensor parallelism.*vocab-parallel"),
    ({"sequence_parallel_size": 2}, "sequence parallelism.*whole sequences"),
])
def test_tensor_and_sequence_parallelism_are_refused_with_the_reason(tmp_path, section, match):
    from transformers import TrainingArguments

    from megaloss.integrations.hf.trainer import MegalossTrainer
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=match):
        MegalossTrainer(model=tiny_llama(), args=args, train_dataset=samples(4),
                        data_collator=collate, megaloss_config=section)


def test_accelerate_parallelism_config_is_refused_with_the_reason(tmp_path):
    from transformers import TrainingArguments

    from megaloss.integrations.config import MegalossConfig
    from megaloss.integrations.hf.trainer import _refuse_model_parallelism

    class Parallelism:  # the fields of accelerate's ParallelismConfig that matter here
        tp_size, cp_size, sp_size = 1, 2, 1

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.parallelism_config = Parallelism()
    with pytest.raises(ValueError, match="parallelism_config.cp_size=2"):
        _refuse_model_parallelism(MegalossConfig(), args)
