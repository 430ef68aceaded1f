"""MegalossTrainer (megaloss.integrations.hf.trainer): a tiny random-init Llama trained one SGD
step (lr 1, no clipping, no weight decay) by transformers.Trainer, compared with float64 plain
torch (full logits, ``F.cross_entropy`` + z-loss) on the global batch of that step.

Compared quantity: the parameter update ``after - before`` against ``-grad`` of the float64
reference, per tensor, ``||update + grad|| <= 2e-4 ||grad|| + 1e-7`` (fp32 training: the update
is a difference of fp32 parameters ~1e-2 holding ~1e-3 steps, so ~1e-5 relative is the floor).

This file is also the worker of the DeepSpeed test: ``deepspeed --num_gpus 2
tests/integrations/test_hf_trainer.py --worker OUT --zero 2 --reduction token``.
"""
import argparse
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")

VOCAB, SEQ, N_SAMPLES = 97, 12, 8
Z_LOSS = 1e-3


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def samples(n=N_SAMPLES):
    """Uneven lengths (3..SEQ tokens), so ranks and micro-batches hold different token counts."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, SEQ + 1, (1,), generator=g))
        out.append({"input_ids": torch.randint(1, VOCAB, (length,), generator=g).tolist()})
    return out


def collate(batch):
    ids = torch.zeros(len(batch), SEQ, dtype=torch.long)
    mask = torch.zeros(len(batch), SEQ, dtype=torch.long)
    for i, s in enumerate(batch):
        x = torch.tensor(s["input_ids"])
        ids[i, :len(x)], mask[i, :len(x)] = x, 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def reference_grads(state, reduction, data):
    """float64 plain torch on the whole global batch: loss and gradients by parameter name."""
    model = tiny_llama().double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    batch = collate(data)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits, target = logits[:, :-1], batch["labels"][:, 1:]
    valid = target != -100
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="none",
                         ignore_index=-100).view(target.shape)
    per_token = (ce + Z_LOSS * torch.logsumexp(logits, -1) ** 2) * valid
    if reduction == "token":
        loss = per_token.sum() / valid.sum()
    else:  # sample: mean over samples of each sample's token mean
        loss = (per_token.sum(1) / valid.sum(1)).mean()
    loss.backward()
    return loss.item(), {k: p.grad for k, p in model.named_parameters()}


def assert_update_is_minus_grad(before, after, grads):
    for name, g in grads.items():
        update = after[name].double() - before[name].double()
        err = (update + g).norm()
        assert err <= 2e-4 * g.norm() + 1e-7, (name, float(err), float(g.norm()))


def ds_config(zero):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "train_batch_size": "auto", "gradient_clipping": 0.0,
            "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 1000,
            "megaloss": {"ce": {"chunk_size": 5, "z_loss": Z_LOSS, "loss_reduction": "token"}}}


def train_one_step(out_dir, reduction, deepspeed_zero=None, per_device=2, gas=2):
    """Build, train one step with MegalossTrainer; returns (before, after, log_history) on rank 0
    (``None`` elsewhere)."""
    from transformers import TrainingArguments

    from megaloss.integrations.hf.trainer import MegalossTrainer
    cfg = None
    if deepspeed_zero is not None:
        cfg = ds_config(deepspeed_zero)
        cfg["megaloss"]["ce"]["loss_reduction"] = reduction
    model = tiny_llama()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=gas, max_steps=1, learning_rate=1.0,
                             optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
                             max_grad_norm=0.0, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, deepspeed=cfg,
                             remove_unused_columns=False, dataloader_num_workers=0,
                             disable_tqdm=True, seed=0)
    megaloss_cfg = None if cfg is not None else {"ce": {"chunk_size": 5, "z_loss": Z_LOSS,
                                                        "loss_reduction": reduction}}
    seen = []

    def recording_collate(batch):  # what this rank trained on (uneven tokens per rank)
        seen.extend(batch)
        return collate(batch)

    trainer = MegalossTrainer(model=model, args=args, train_dataset=samples(),
                              data_collator=recording_collate, megaloss_config=megaloss_cfg)
    trainer._seen = seen
    trainer.train()
    hf_model = trainer.model.model
    params = list(hf_model.parameters())
    if deepspeed_zero == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(params):
            after = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    else:
        after = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_initialized() else 1
    local_tokens = sum(len(s["input_ids"]) - 1 for s in trainer._seen)
    tokens = [None] * world
    if world > 1:
        dist.all_gather_object(tokens, local_tokens)
    else:
        tokens = [local_tokens]
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return before, after, trainer.state.log_history + [{"tokens_per_rank": tokens}]


# single process (fast tier) ------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_single_process_gas2_equals_float64(tmp_path, reduction):
    before, after, logs = train_one_step(str(tmp_path), reduction, per_device=2, gas=4)
    ref_loss, grads = reference_grads(before, reduction, samples())
    assert_update_is_minus_grad(before, after, grads)
    step = [entry for entry in logs if "loss" in entry][0]
    assert step["loss"] == pytest.approx(ref_loss, rel=1e-3)
    assert step["ce_loss"] + step["z_loss"] == pytest.approx(ref_loss, rel=1e-4)
    assert step["z_loss"] > 0 and step["num_valid_tokens"] == sum(
        len(s["input_ids"]) - 1 for s in samples())


def test_options_come_from_the_ds_config_section(tmp_path):
    from transformers import TrainingArguments

    from megaloss.integrations.hf.trainer import MegalossTrainer
    cfg = {"megaloss": {"ce": {"z_loss": 1e-4, "label_smoothing": 0.1, "logit_softcapping": 30.0,
                               "loss_reduction": "square", "chunk_size": 64}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.deepspeed = str(path)  # read as a path, without starting DeepSpeed here
    from megaloss.integrations.hf.trainer import megaloss_config_from_args
    section = megaloss_config_from_args(args)
    opts = section.ce.options()
    assert (opts.z_loss, opts.label_smoothing, opts.logit_softcapping, opts.chunk_size) == (
        1e-4, 0.1, 30.0, 64)
    assert section.ce.loss_reduction == "square"
    with pytest.raises(ValueError, match="data parallelism only"):
        MegalossTrainer(model=tiny_llama(), args=TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[]),
            megaloss_config={"tensor_parallel_size": 2})


# two processes under DeepSpeed (slow tier) -----------------------------------------------------
@pytest.mark.deepspeed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("zero,reduction", [(2, "token"), (2, "sample"), (3, "token")])
def test_deepspeed_two_ranks_equals_float64(tmp_path, zero, reduction):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
    from launch_helpers import run_deepspeed_launcher
    run_deepspeed_launcher(os.path.abspath(__file__),
                           ["--worker", str(tmp_path), "--zero", str(zero),
                            "--reduction", reduction], timeout=220)
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    ref_loss, grads = reference_grads(result["before"], reduction, samples())
    assert_update_is_minus_grad(result["before"], result["after"], grads)
    step = [entry for entry in result["logs"] if "loss" in entry][0]
    tokens = result["logs"][-1]["tokens_per_rank"]
    assert len(tokens) == 2 and tokens[0] != tokens[1]  # two ranks, uneven tokens
    assert step["loss"] == pytest.approx(ref_loss, rel=1e-3)
    assert step["ce_loss"] + step["z_loss"] == pytest.approx(ref_loss, rel=1e-4)
    grad_norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values())).item()
    if step.get("grad_norm") is not None:
        assert step["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    json.dump({"ref_loss": ref_loss, "ref_grad_norm": grad_norm, "step": step,
               "tokens_per_rank": tokens},
              open(tmp_path / "figures.json", "w"))


def _worker_main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--reduction", default="token")
    parser.add_argument("--local_rank", type=int, default=0)
    a = parser.parse_args(argv)
    from megaloss.integrations.deepspeed import skip_cpu_shm_comm_build
    skip_cpu_shm_comm_build()
    result = train_one_step(os.path.join(a.worker, "trainer"), a.reduction, deepspeed_zero=a.zero)
    if result is not None:
        before, after, logs = result
        torch.save({"before": before, "after": after, "logs": logs},
                   os.path.join(a.worker, "result.pt"))


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
