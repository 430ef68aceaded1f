"""MegalossTrainer (megaloss.integrations.hf.trainer): a tiny random-init Llama trained one SGD
step (lr 1, no clipping, no weight decay) by transformers.Trainer, compared with float64 plain
torch on the global batch of that step.

Reference (:func:`reference`): the float64 model's decoder, full ``[tokens, vocab]`` logits and
``F.cross_entropy`` (label smoothing, softcapping ``c * tanh(x / c)``, z-loss) through
``tests/helpers/ce_reference.py``'s ``reference_linear_ce``, with XTuner v1's per-sample weights
written out here: ``u_i`` = 1, ``1 / n_i`` or ``1 / sqrt(n_i)`` (``token`` / ``sample`` /
``square``, ``n_i`` the valid tokens of sample ``i`` after the causal shift), divided by
``sum_i u_i n_i`` over the whole global batch (``xtuner/v1/loss/ce_loss.py``; the same
definitions as ``tests/helpers/calibration_cases.py``'s ``reference``).

Compared quantity: the parameter update ``after - before`` against ``-grad`` of the reference, per
tensor, ``||update + grad|| <= 2e-4 ||grad|| + 1e-7`` (fp32 training: the update is a difference
of fp32 parameters ~1e-2 holding ~1e-3 steps, so ~1e-5 relative is the floor). After the step,
``trainer.evaluate()`` on 7 held-out samples (2 per batch: uneven batches; under 2 ranks the
last batch is evened out by accelerate with a repeated sample) must report the reference's loss
of the whole set with the same options, rel 1e-5.

The two-rank cases (:data:`DS_CASES`) all run in one ``deepspeed --num_gpus 2`` launch, the
one the Trainer tests share (``shared_launch_hf`` of tests/helpers/shared_launches.py; this
file's ``_worker_main`` is its part, also runnable alone: ``deepspeed --num_gpus 2
tests/integrations/test_hf_trainer.py --worker OUT``); the tests assert per case. One of them
reports to W&B offline; its run is read back with wandb's own reader (``wandb_history`` of
``tests/launch/test_monitors.py``).
"""
import argparse
import math
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

VOCAB, SEQ, N_SAMPLES, N_EVAL = 97, 12, 8, 7
Z_LOSS = 1e-3
SOFTCAP = 0.1  # logits of the random model are ~0.1: without the cap the gradient moves by 84%

# two-rank cases, one launch: per-device batch 2, GAS 2 (8 samples: one optimizer step)
DS_CASES = {
    "zero2-token": {"zero": 2, "reduction": "token"},
    "zero2-sample": {"zero": 2, "reduction": "sample"},
    "zero3-token": {"zero": 3, "reduction": "token"},
    "zero3-square": {"zero": 3, "reduction": "square"},
    "zero2-square-smoothing-softcap": {"zero": 2, "reduction": "square", "label_smoothing": 0.1,
                                       "logit_softcapping": SOFTCAP},
    # not compared with a reference: 3 steps logged to an offline W&B run, then evaluate()
    "zero2-wandb": {"zero": 2, "reduction": "square", "steps": 3, "wandb": True},
}


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(cfg)


def samples(n=N_SAMPLES, seed=1):
    """Uneven lengths (3..SEQ tokens), so ranks and micro-batches hold different token counts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(3, SEQ + 1, (1,), generator=g))
        out.append({"input_ids": torch.randint(1, VOCAB, (length,), generator=g).tolist()})
    return out


def eval_samples():
    return samples(N_EVAL, seed=2)


def collate(batch):
    ids = torch.zeros(len(batch), SEQ, dtype=torch.long)
    mask = torch.zeros(len(batch), SEQ, dtype=torch.long)
    for i, s in enumerate(batch):
        x = torch.tensor(s["input_ids"])
        ids[i, :len(x)], mask[i, :len(x)] = x, 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def reference(state, data, reduction, *, label_smoothing=0.0, logit_softcapping=None,
              grad=True):
    """float64 plain torch on the whole batch ``data`` (module docstring): the loss, and the
    gradients by parameter name (``None`` without ``grad``)."""
    from tests.helpers.ce_reference import reference_linear_ce
    model = tiny_llama().double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    batch = collate(data)
    with torch.set_grad_enabled(grad):
        hidden = model.model(input_ids=batch["input_ids"],
                             attention_mask=batch["attention_mask"]).last_hidden_state
        target = batch["labels"][:, 1:]  # the causal shift
        n = (target != -100).sum(1).double()  # valid tokens per sample (all samples have >= 2)
        u = {"token": torch.ones_like(n), "sample": 1 / n, "square": 1 / n.sqrt()}[reduction]
        weights = (u / (u * n).sum())[:, None].expand(target.shape)
        loss = reference_linear_ce(hidden[:, :-1], model.lm_head.weight, target,
                                   reduction="sum", loss_weights=weights, z_loss=Z_LOSS,
                                   label_smoothing=label_smoothing,
                                   logit_softcapping=logit_softcapping)
    if not grad:
        return loss.item(), None
    loss.backward()
    return loss.item(), {k: p.grad for k, p in model.named_parameters()}


def case_reference(case, state, data, grad=True):
    return reference(state, data, case["reduction"],
                     label_smoothing=case.get("label_smoothing", 0.0),
                     logit_softcapping=case.get("logit_softcapping"), grad=grad)


def assert_update_is_minus_grad(before, after, grads):
    """The tolerance of the module docstring. Returns ``||update + grad|| / ||grad||`` over all
    parameters together, and the largest share of its tolerance one tensor uses."""
    used, err2, norm2 = 0.0, 0.0, 0.0
    for name, g in grads.items():
        update = after[name].double() - before[name].double()
        err = (update + g).norm()
        assert err <= 2e-4 * g.norm() + 1e-7, (name, float(err), float(g.norm()))
        used = max(used, float(err / (2e-4 * g.norm() + 1e-7)))
        err2, norm2 = err2 + float(err) ** 2, norm2 + float(g.norm()) ** 2
    return math.sqrt(err2 / norm2), used


def ce_section(case):
    ce = {"chunk_size": 5, "z_loss": Z_LOSS, "loss_reduction": case["reduction"]}
    for key in ("label_smoothing", "logit_softcapping"):
        if key in case:
            ce[key] = case[key]
    return ce


def ds_config(case):
    zero = {"stage": case["zero"]}
    if case["zero"] == 3:  # every parameter partitioned and gathered per forward
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "train_batch_size": "auto", "gradient_clipping": 0.0, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "steps_per_print": 1000,
            "megaloss": {"ce": ce_section(case)}}


def train_case(out_dir, case, *, deepspeed, per_device=2, gas=2):
    """Build, train ``case.get("steps", 1)`` steps with MegalossTrainer, then ``evaluate()``;
    returns ``{before, after, logs, eval, tokens_per_rank}`` on rank 0 (``None`` elsewhere)."""
    import torch.distributed as dist
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from megaloss.integrations.hf.trainer import MegalossTrainer
    unset_hf_deepspeed_config()  # a previous case's ZeRO-3 config must not zero.Init the model
    model = tiny_llama()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if case.get("wandb"):
        os.environ.update(WANDB_MODE="offline", WANDB_DIR=out_dir, WANDB_SILENT="true",
                          WANDB_PROJECT="megaloss-test")
    args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=per_device,
                             per_device_eval_batch_size=2, gradient_accumulation_steps=gas,
                             max_steps=case.get("steps", 1), learning_rate=1.0, optim="sgd",
                             lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                             logging_steps=1, save_strategy="no",
                             report_to=["wandb"] if case.get("wandb") else [], use_cpu=True,
                             deepspeed=ds_config(case) if deepspeed else None,
                             remove_unused_columns=False, dataloader_num_workers=0,
                             disable_tqdm=True, seed=0)
    seen = []

    def recording_collate(batch):  # what this rank trained on (uneven tokens per rank)
        seen.extend(batch)
        return collate(batch)

    trainer = MegalossTrainer(model=model, args=args, train_dataset=samples(),
                              eval_dataset=eval_samples(), data_collator=recording_collate,
                              megaloss_config=None if deepspeed else {"ce": ce_section(case)})
    trainer.train()
    local_tokens = sum(len(s["input_ids"]) - 1 for s in seen)
    seen.clear()
    metrics = trainer.evaluate()
    if case.get("wandb") and trainer.is_world_process_zero():
        import wandb
        wandb.finish()
    hf_model = trainer.model.model
    if case["zero"] == 3 and deepspeed:
        import deepspeed as ds
        with ds.zero.GatheredParameters(list(hf_model.parameters())):
            after = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    else:
        after = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    world = dist.get_world_size() if dist.is_initialized() else 1
    tokens = [local_tokens]
    if world > 1:
        tokens = [None] * world
        dist.all_gather_object(tokens, local_tokens)
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return {"before": before, "after": after, "logs": trainer.state.log_history,
            "eval": metrics, "tokens_per_rank": tokens}


def assert_matches_reference(case, result):
    """One step and the evaluation against float64; returns the measured figures."""
    ref_loss, grads = case_reference(case, result["before"], samples())
    update_err, tol_used = assert_update_is_minus_grad(result["before"], result["after"], grads)
    step = [entry for entry in result["logs"] if "loss" in entry][0]
    assert step["loss"] == pytest.approx(ref_loss, rel=1e-3)
    assert step["ce_loss"] + step["z_loss"] == pytest.approx(ref_loss, rel=1e-4)
    assert step["z_loss"] > 0
    assert step["num_valid_tokens"] == sum(len(s["input_ids"]) - 1 for s in samples())
    ref_eval, _ = case_reference(case, result["after"], eval_samples(), grad=False)
    ev = result["eval"]
    assert ev["eval_loss"] == pytest.approx(ref_eval, rel=1e-5)
    assert ev["eval_ce_loss"] + ev["eval_z_loss"] == pytest.approx(ev["eval_loss"], rel=1e-9)
    assert ev["eval_num_valid_tokens"] == sum(len(s["input_ids"]) - 1 for s in eval_samples())
    return {"update_rel_err": update_err, "tolerance_used": tol_used, "loss": step["loss"],
            "ref_loss": ref_loss, "eval_loss": ev["eval_loss"], "ref_eval_loss": ref_eval,
            "eval_rel_err": abs(ev["eval_loss"] - ref_eval) / ref_eval, "grads": grads}


# single process (fast tier) ------------------------------------------------------------------
SINGLE_CASES = {
    "token": {"zero": None, "reduction": "token"},
    "sample": {"zero": None, "reduction": "sample"},
    "square-smoothing-softcap": {"zero": None, "reduction": "square", "label_smoothing": 0.1,
                                 "logit_softcapping": SOFTCAP},
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(SINGLE_CASES))
def test_single_process_gas4_equals_float64(tmp_path, name):
    case = SINGLE_CASES[name]
    result = train_case(str(tmp_path), case, deepspeed=False, per_device=2, gas=4)
    figures = assert_matches_reference(case, result)
    print(f"{name}: update rel err {figures['update_rel_err']:.2e} (tolerance used "
          f"{figures['tolerance_used']:.0%}), eval rel err {figures['eval_rel_err']:.1e}")


def test_options_come_from_the_ds_config_section(tmp_path):
    import json

    from transformers import TrainingArguments

    from megaloss.integrations.hf.trainer import MegalossTrainer, megaloss_config_from_args
    cfg = {"megaloss": {"ce": {"z_loss": 1e-4, "label_smoothing": 0.1, "logit_softcapping": 30.0,
                               "loss_reduction": "square", "chunk_size": 64}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.deepspeed = str(path)  # read as a path, without starting DeepSpeed here
    section = megaloss_config_from_args(args)
    opts = section.ce.options()
    assert (opts.z_loss, opts.label_smoothing, opts.logit_softcapping, opts.chunk_size) == (
        1e-4, 0.1, 30.0, 64)
    assert section.ce.loss_reduction == "square"
    with pytest.raises(ValueError, match="data parallelism only"):
        MegalossTrainer(model=tiny_llama(), args=TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[]),
            megaloss_config={"tensor_parallel_size": 2})


def test_evaluation_without_labels_is_refused(tmp_path):
    from transformers import TrainingArguments

    from megaloss.integrations.hf.trainer import MegalossTrainer
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             remove_unused_columns=False, disable_tqdm=True)
    trainer = MegalossTrainer(model=tiny_llama(), args=args, eval_dataset=eval_samples(),
                              data_collator=lambda b: {k: v for k, v in collate(b).items()
                                                       if k != "labels"})
    with pytest.raises(ValueError, match="needs 'labels'"):
        trainer.evaluate()


# two processes under DeepSpeed (slow tier): one launch, every case ----------------------------
def shared_launch_hf_jobs(tmp_path):
    """This module's worker job in the shared Trainer launch (``shared_launch_hf``): every
    :data:`DS_CASES` case, ``<case>.pt`` per case under ``tmp_path``, the W&B run under
    ``zero2-wandb/wandb``."""
    return [{"worker": __file__, "argv": ["--worker", str(tmp_path)]}]


@pytest.fixture(scope="module")
def ds_run(shared_launch_hf):
    """The output folder of this module's cases in the shared ``deepspeed --num_gpus 2``
    launch; nothing was written into the repository's ``wandb`` folder."""
    from tests.helpers.launch_helpers import REPO
    run = shared_launch_hf["test_hf_trainer"]
    written = [p for p in (REPO / "wandb").glob("*") if p.stat().st_mtime >= run.started]
    assert not written  # nothing written into the repository
    return run


def _load(run, name):
    path = run.tmp_path / f"{name}.pt"
    assert path.exists(), f"case {name} left no result: {run.outputs[0][-3000:]}"
    result = torch.load(path, weights_only=False)
    assert "crash" not in result, result["crash"]
    return result


@pytest.mark.deepspeed
@pytest.mark.timeout(900)  # the first test using the shared launch waits for it
@pytest.mark.parametrize("name", [c for c in DS_CASES if not DS_CASES[c].get("wandb")])
def test_deepspeed_two_ranks_equals_float64(ds_run, name):
    case = DS_CASES[name]
    result = _load(ds_run, name)
    tokens = result["tokens_per_rank"]
    assert len(tokens) == 2 and tokens[0] != tokens[1]  # two ranks, uneven tokens
    figures = assert_matches_reference(case, result)
    step = [entry for entry in result["logs"] if "loss" in entry][0]
    grad_norm = math.sqrt(sum(float((g ** 2).sum()) for g in figures["grads"].values()))
    if step.get("grad_norm") is not None:
        assert step["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    print(f"{name}: tokens per rank {tokens}, update rel err {figures['update_rel_err']:.2e} "
          f"(tolerance used {figures['tolerance_used']:.0%}), loss {figures['loss']} vs "
          f"{figures['ref_loss']:.6f}, eval {figures['eval_loss']:.7f} vs "
          f"{figures['ref_eval_loss']:.7f} (rel {figures['eval_rel_err']:.1e})")


@pytest.mark.deepspeed
@pytest.mark.timeout(900)
def test_wandb_offline_run_holds_the_trainer_logs(ds_run):
    """The W&B offline run of ``zero2-wandb`` (3 logged steps, then ``evaluate()``), read back
    with wandb's reader: every Trainer log entry is there at its global step with the same
    values, the megaloss series included; the files are under the test's folder."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
    from test_monitors import wandb_history
    result = _load(ds_run, "zero2-wandb")
    runs = list((ds_run.tmp_path / "zero2-wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), runs
    history, _ = wandb_history(runs[0])
    at_step = {}  # global step -> {tag: value}
    for tag, values in history.items():
        for wandb_step, value in values.items():
            at_step.setdefault(history["train/global_step"][wandb_step], {})[tag] = value
    train = [e for e in result["logs"] if "loss" in e]
    evals = [e for e in result["logs"] if "eval_loss" in e]
    assert [e["step"] for e in train] == [1, 2, 3] and [e["step"] for e in evals] == [3]
    for entry in train:
        logged = at_step[entry["step"]]
        for key in ("loss", "ce_loss", "z_loss", "num_valid_tokens", "learning_rate"):
            assert logged[f"train/{key}"] == pytest.approx(entry[key], rel=1e-12), key
        assert entry["num_valid_tokens"] == sum(len(s["input_ids"]) - 1 for s in samples())
        assert entry["z_loss"] > 0
    for key in ("loss", "ce_loss", "z_loss", "num_valid_tokens"):
        assert at_step[3][f"eval/{key}"] == pytest.approx(evals[0][f"eval_{key}"],
                                                          rel=1e-12), key
    assert evals[0]["eval_loss"] == result["eval"]["eval_loss"]


def _worker_main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--cases", default=",".join(DS_CASES))
    parser.add_argument("--local_rank", type=int, default=0)
    a = parser.parse_args(argv)
    from megaloss.integrations.deepspeed.compat import skip_cpu_shm_comm_build
    skip_cpu_shm_comm_build()
    rank = int(os.environ.get("RANK", "0"))
    for name in a.cases.split(","):
        try:
            result = train_case(os.path.join(a.worker, name), DS_CASES[name], deepspeed=True)
        except Exception:  # noqa: BLE001 - reported to the parent, which fails that case
            result = {"crash": f"rank {rank}: {traceback.format_exc()}"}
        if result is not None:
            torch.save(result, os.path.join(a.worker, f"{name}.pt"))
        if result is not None and "crash" in result:
            raise SystemExit(1)  # the ranks may be out of step: stop here


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
