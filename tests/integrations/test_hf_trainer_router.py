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
import torch.nn.functional as F

pytest.importorskip("accelerate")

VOCAB, SEQ, AUX, Z = 41, 6, 0.3, 0.01
CASES = ("micro_batch", "step")


def _model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16,
                            moe_intermediate_size=8, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                            num_experts_per_tok=2, head_dim=8, output_router_logits=False,
                            router_aux_loss_coef=0.001)
    config._experts_implementation = "eager"
    return Qwen3MoeForCausalLM(config)


def _samples():
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(4):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        mask = torch.ones(SEQ, dtype=torch.long)
        mask[SEQ - 1 - i % 3:] = 0
        out.append({"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100),
                    "attention_mask": mask})
    return out


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _train(out_dir, scope):
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from megaloss.integrations.hf.trainer import MegalossTrainer

    unset_hf_deepspeed_config()
    model = _model()
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
    trainer = MegalossTrainer(model=model, args=args, train_dataset=_samples(),
                              data_collator=_collate)
    trainer.train()
    after = {n: p.detach().clone() for n, p in trainer.model.model.named_parameters()}
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return {"before": before, "after": after}


def _reference(scope):
    from tests.helpers.toy_moe import reference_router

    model = _model().double()
    ce, valid, pieces = 0.0, 0, []
    for s in _samples():
        o = model(input_ids=s["input_ids"][None], attention_mask=s["attention_mask"][None],
                  output_router_logits=True)
        labels = s["labels"][1:]
        ce = ce + F.cross_entropy(o.logits[0, :-1], labels, ignore_index=-100, reduction="sum")
        valid += int((labels != -100).sum())
        pieces.append((o.router_logits, s["attention_mask"]))

    def pool(ps):
        layers = [torch.cat([p[0][i] for p in ps]) for i in range(2)]
        return reference_router(layers, torch.cat([p[1] for p in ps]), aux=AUX, z=Z)

    router = pool(pieces) if scope == "step" else sum(pool([p]) for p in pieces) / len(pieces)
    (ce / valid + router).backward()
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
