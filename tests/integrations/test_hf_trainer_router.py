"""MegalossTrainer with router losses on 2 ranks under DeepSpeed ZeRO-2 (the shared Trainer launch,
``shared_launch_hf``): a tiny Qwen3-MoE, one sample per micro-batch, gradient accumulation 2, the
ds_config's ``"megaloss": {"router": {...}}``. This is the configuration where a Hugging Face
model's per-micro-batch router term goes wrong under the Trainer: data-parallel ranks and
gradient accumulation scale it by the world size or the accumulation steps. One SGD step (lr 1)
equals the float64 reference of the scope's definition, computed from the model's own router
logits with the papers' formulas (tests/helpers/toy_moe.py): ``micro_batch``, the mean over the
4 micro-batches of their router losses; ``step``, one router loss over the step's 4 samples
(both independent of which rank holds which sample). fp32 training: every tensor's update within
``2e-4 ||grad|| + 1e-7`` of ``-grad`` (the tolerance of tests/integrations/test_hf_trainer.py).
"""
import argparse
import os
import sys
import traceback

import pytest
import torch

from tests.helpers.toy_moe import padded_samples, reference_hf_step, tiny_qwen3_moe

pytest.importorskip("accelerate")

VOCAB, SEQ, AUX, Z = 41, 6, 0.3, 0.01
CASES = ("micro_batch", "step")


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _train(out_dir, scope):
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from megaloss.integrations.hf.trainer import MegalossTrainer

    unset_hf_deepspeed_config()
    model = tiny_qwen3_moe(VOCAB)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                 "train_batch_size": "auto", "gradient_clipping": 0.0,
                 "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
                 "steps_per_print": 1000,
                 "megaloss": {"router": {"aux_loss": AUX, "z_loss": Z, "scope": scope}}}
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=1,
                             gradient_accumulation_steps=2, max_steps=1, learning_rate=1.0,
                             optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
                             max_grad_norm=0.0, save_strategy="no", report_to=[], use_cpu=True,
                             deepspeed=ds_config, remove_unused_columns=False,
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    trainer = MegalossTrainer(model=model, args=args, train_dataset=padded_samples(VOCAB, SEQ),
                              data_collator=_collate)
    trainer.train()
    after = {n: p.detach().clone() for n, p in trainer.model.model.named_parameters()}
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return {"before": before, "after": after}


def _reference(scope):
    model = tiny_qwen3_moe(VOCAB).double()
    one_rank = [[{k: v[None] for k, v in sample.items()} for sample in padded_samples(VOCAB, SEQ)]]
    reference_hf_step(model, one_rank, scope=scope, aux=AUX, z=Z).backward()
    return {n: p.grad for n, p in model.named_parameters()}


# the shared two-rank Trainer launch ---------------------------------------------------------
def shared_launch_hf_jobs(tmp_path):
    return [{"worker": __file__, "argv": ["--worker", str(tmp_path)]}]


@pytest.mark.deepspeed
@pytest.mark.timeout(900)  # the first test using the shared launch waits for it
@pytest.mark.parametrize("scope", CASES)
def test_trainer_router_losses_on_two_ranks_equal_float64(shared_launch_hf, scope):
    run = shared_launch_hf["test_hf_trainer_router"]
    path = run.tmp_path / f"{scope}.pt"
    assert path.exists(), f"case {scope} left no result: {run.outputs[0][-3000:]}"
    result = torch.load(path, weights_only=False)
    assert "crash" not in result, result["crash"]
    grads = _reference(scope)
    for name, g in grads.items():
        update = result["after"][name].double() - result["before"][name].double()
        assert (update + g).norm() <= 2e-4 * g.norm() + 1e-7, name


def _worker_main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    a = parser.parse_args(argv)
    from megaloss.integrations.deepspeed.compat import skip_cpu_shm_comm_build
    skip_cpu_shm_comm_build()
    rank = int(os.environ.get("RANK", "0"))
    for scope in CASES:
        try:
            result = _train(os.path.join(a.worker, scope), scope)
        except Exception:  # noqa: BLE001 - reported to the parent, which fails that case
            result = {"crash": f"rank {rank}: {traceback.format_exc()}"}
        if result is not None:
            torch.save(result, os.path.join(a.worker, f"{scope}.pt"))
        if result is not None and "crash" in result:
            raise SystemExit(1)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
