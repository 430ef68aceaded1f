"""MegalossTrainer (megaloss.integrations.hf.trainer) under DeepSpeed AutoTP: a ds_config with
``"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": true}``. transformers'
``deepspeed_init`` records the TP size (``deepspeed.tp_model_init``), accelerate gives the ranks
of a TP group the same batches, ``deepspeed.initialize`` shards the model; the Trainer wraps it
in ``AutoTPCausalLMWithLoss`` (megaloss's CE on AutoTP's lm_head shard), calibrates over the
engine's data-parallel group and measures the engine scale. Before, the Trainer wrapped the model
in ``CausalLMWithLoss`` and ``deepspeed.initialize`` failed inside ``trainer.train()`` (AutoTP
found no ``nn.Linear`` lm_head to make vocab-parallel).

The same comparison as tests/integrations/test_hf_trainer.py: one SGD step (lr 1) against
``-grad`` of the float64 reference on the whole global batch (8 samples, uneven lengths), the
logged loss, its parts and the gradient norm, then ``evaluate()`` on 7 held-out samples against
the reference's loss of the set. AutoTP's shards are gathered for the comparison. Cases: DP 1 x
TP 2 under ZeRO-2 (token) in the 2-process Trainer launch (``shared_launch_hf``), DP 2 x TP 2
under ZeRO-1 (square, label smoothing, soft-cap; uneven tokens per DP rank, an evened-out last
evaluation batch) in the 4-process launch (``shared_launch_4procs``). Fast tier: what is refused
before training.
"""
import argparse
import math
import os
import sys
import traceback
import types

import pytest
import torch

pytest.importorskip("accelerate")

from tests.integrations.test_hf_trainer import (  # noqa: E402
    assert_matches_reference,
    ce_section,
    collate,
    eval_samples,
    samples,
    tiny_llama,
)

AUTOTP = {"autotp_size": 2, "vocab_parallel_lm_head": True}
# name -> (case, per-device batch); GAS 2: 8 samples = one optimizer step on DP 1 and DP 2
CASES_2PROCS = {"autotp2-dp1-zero2-token": ({"zero": 2, "reduction": "token"}, 4)}
CASES_4PROCS = {"autotp2-dp2-zero1-square-smoothing-softcap": (
    {"zero": 1, "reduction": "square", "label_smoothing": 0.1, "logit_softcapping": 0.1}, 2)}


def ds_config(case, per_device):
    return {"train_micro_batch_size_per_gpu": per_device, "gradient_accumulation_steps": 2,
            "train_batch_size": "auto", "gradient_clipping": 0.0,
            "zero_optimization": {"stage": case["zero"]}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 1000, "tensor_parallel": dict(AUTOTP),
            "megaloss": {"ce": ce_section(case)}}


def full_state(module):
    """The parameters of the trained ``AutoTPCausalLMWithLoss`` as one device holds them, by the
    ``LlamaForCausalLM``'s names: each AutoTP layer's shards gathered by its own
    ``gather_params`` (deepspeed/module_inject/layers.py) on copies. Collective."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    out = {}
    for prefix, mod in module.named_modules():
        copies = {n: torch.nn.Parameter(p.detach().clone(), requires_grad=False)
                  for n, p in mod.named_parameters(recurse=False)}
        if copies and isinstance(mod, TensorParallel_Layer):
            mod.gather_params([copies.get("weight"), copies.get("bias")])
        out.update({f"{prefix}.{n}" if prefix else n: t.data for n, t in copies.items()})
    return out


def train_case(out_dir, case, per_device):
    """One step, then ``evaluate()``; ``{before, after, logs, eval, tokens_per_rank, lm_head,
    multiplier}`` on rank 0 (``None`` elsewhere)."""
    import torch.distributed as dist
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from megaloss.integrations.autotp import autotp_lm_head
    from megaloss.integrations.hf.trainer import MegalossTrainer
    unset_hf_deepspeed_config()
    model = tiny_llama()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=per_device,
                             per_device_eval_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=1, learning_rate=1.0, optim="sgd",
                             lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             deepspeed=ds_config(case, per_device), remove_unused_columns=False,
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    seen = []

    def recording_collate(batch):
        seen.extend(batch)
        return collate(batch)

    trainer = MegalossTrainer(model=model, args=args, train_dataset=samples(),
                              eval_dataset=eval_samples(), data_collator=recording_collate)
    trainer.train()
    local_tokens = sum(len(s["input_ids"]) - 1 for s in seen)
    head = autotp_lm_head(trainer.model)
    head_rows = (head.vocab_start_index, head.vocab_end_index, tuple(head.weight.shape))
    after = full_state(trainer.model)
    metrics = trainer.evaluate()
    world = dist.get_world_size()
    gathered = [None] * world
    dist.all_gather_object(gathered, (local_tokens, head_rows))
    if dist.get_rank() != 0:
        return None
    return {"before": before, "after": after, "logs": trainer.state.log_history,
            "eval": metrics, "tokens_per_rank": [g[0] for g in gathered],
            "lm_head": [g[1] for g in gathered], "multiplier": trainer._engine_scale[1]}


def _check(result, case, dp):
    tokens = result["tokens_per_rank"]
    assert len(tokens) == 2 * dp
    assert all(tokens[2 * d] == tokens[2 * d + 1] for d in range(dp)), tokens  # one TP group
    if dp > 1:
        assert tokens[0] != tokens[2], tokens  # uneven tokens across the DP ranks
    # AutoTP's vocab-parallel head: rows [0, 49) and [49, 97) of the 97 on each TP group
    assert result["lm_head"][:2] == [(0, 49, (49, 32)), (49, 97, (48, 32))], result["lm_head"]
    assert result["multiplier"] == dp  # measured: DeepSpeed averages over the DP group only
    figures = assert_matches_reference(case, result)
    step = [entry for entry in result["logs"] if "loss" in entry][0]
    grad_norm = math.sqrt(sum(float((g ** 2).sum()) for g in figures["grads"].values()))
    assert step["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    print(f"tokens per rank {tokens}, update rel err {figures['update_rel_err']:.2e} "
          f"(tolerance used {figures['tolerance_used']:.0%}), loss {figures['loss']} vs "
          f"{figures['ref_loss']:.7f}, grad norm {step['grad_norm']} vs {grad_norm:.7f}, eval "
          f"{figures['eval_loss']:.7f} vs {figures['ref_eval_loss']:.7f} "
          f"(rel {figures['eval_rel_err']:.1e})")


def _load(run, name):
    path = run.tmp_path / f"{name}.pt"
    assert path.exists(), f"case {name} left no result: {run.outputs[0][-3000:]}"
    result = torch.load(path, weights_only=False)
    assert "crash" not in result, result["crash"]
    return result


def shared_launch_hf_jobs(tmp_path):
    return [{"worker": __file__, "argv": ["--worker", str(tmp_path), "--procs", "2"]}]


def shared_launch_4procs_jobs(tmp_path):
    return [{"worker": __file__, "argv": ["--worker", str(tmp_path), "--procs", "4"]}]


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CASES_2PROCS))
def test_autotp_dp1_tp2_equals_float64(shared_launch_hf, name):
    _check(_load(shared_launch_hf["test_hf_trainer_autotp"], name), CASES_2PROCS[name][0], dp=1)


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.xdist_group("shared_launch_4procs")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CASES_4PROCS))
def test_autotp_dp2_tp2_equals_float64(shared_launch_4procs, name):
    _check(_load(shared_launch_4procs["test_hf_trainer_autotp"], name), CASES_4PROCS[name][0],
           dp=2)


# fast: refused before training ----------------------------------------------------------------
def _args(**changes):
    cfg = ds_config({"zero": 2, "reduction": "token"}, 2)
    for key, value in changes.items():
        cfg[key] = {**cfg[key], **value}
    return types.SimpleNamespace(deepspeed=cfg)


def test_autotp_refusals_before_training():
    from megaloss import CausalLMWithLoss
    from megaloss.integrations.hf.trainer import MegalossTrainer
    with pytest.raises(TypeError, match="pass the \\*ForCausalLM itself"):
        MegalossTrainer(model=CausalLMWithLoss(tiny_llama()), args=_args())
    with pytest.raises(ValueError, match="with ZeRO-3"):
        MegalossTrainer(model=tiny_llama(), args=_args(zero_optimization={"stage": 3}))
    with pytest.raises(ValueError, match="vocab_parallel_lm_head=true"):
        MegalossTrainer(model=tiny_llama(), args=_args(
            tensor_parallel={"vocab_parallel_lm_head": False}))


def _worker_main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--procs", type=int, required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    a = parser.parse_args(argv)
    from megaloss.integrations.deepspeed.compat import skip_cpu_shm_comm_build
    skip_cpu_shm_comm_build()
    rank = int(os.environ.get("RANK", "0"))
    for name, (case, per_device) in (CASES_2PROCS if a.procs == 2 else CASES_4PROCS).items():
        try:
            result = train_case(os.path.join(a.worker, name), case, per_device)
        except Exception:  # noqa: BLE001 - reported to the parent, which fails that case
            result = {"crash": f"rank {rank}: {traceback.format_exc()}"}
        if result is not None:
            torch.save(result, os.path.join(a.worker, f"{name}.pt"))
        if result is not None and "crash" in result:
            raise SystemExit(1)


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
