"""MegalossDPOMixin on TRL 1.16's DPOTrainer, trained for real: a tiny random-init float64
LlamaForCausalLM, a word-level tokenizer and a preference Dataset of prompt / chosen / rejected
strings, all built offline.

- One SGD step (lr 1, no clipping, GAS 2 of 2 pairs) of ``class T(MegalossDPOMixin,
  DPOTrainer)`` equals one of TRL's own ``DPOTrainer`` for one loss type of each kind the
  step treats differently (``LOSS_CASES``; every type's math against TRL's ``_compute_loss`` is
  in tests/losses/test_dpo_loss_types.py) and a weighted list of two: the logged loss, the
  parameter update of every tensor and the logged metrics within 1e-5 relative (TRL's chunked
  kernel computes the log-probs in float32, ``trl/kernels/chunked_logprob.py``; the mixin in the
  model's float64). Also with
  ``precompute_ref_log_probs`` (the reference log-probs computed before training).
- ``evaluate()``: the loss and metrics equal TRL's (each batch's pair mean, as TRL).
- Uneven micro-batches (3 pairs, GAS 2: micro-batches of 2 and 1): the mixin's step equals TRL's
  step on the 3 pairs as ONE micro-batch (the single-device mean); TRL's own GAS 2 step differs
  (mean of the two micro-batch means).
- 2 gloo processes (``megaloss.testing.run_distributed``, accelerate's MULTI_CPU DDP), 7 pairs,
  ``even_batches=False``: 4 pairs on one process, 3 on the other; the update equals minus the
  float64 gradient of the 7 pairs' mean loss computed from full logits in the test (1e-9
  relative; measured 5e-13). TRL's own DPOTrainer stops there in its metrics'
  ``accelerator.gather`` of the ``[P]`` rewards, of different sizes on the two processes.
- DPOConfig fields the mixin does not reproduce are refused at construction, naming the field.
"""
import copy
import os
import warnings

import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = pytest.mark.slow  # TRL's trainer import and a real training step take seconds

TOL = 1e-5
WORDS = ["<pad>", "<eos>", "a", "b", "c", "d", "e", "f"]
PROMPTS = ["a b", "c", "d e f", "b", "f e", "a", "c c d"]
# completions start with a space: TRL tokenizes prompt + completion as one string
CHOSEN = [" c d", " e", " a", " f f e", " b", " d d", " e"]
REJECTED = [" e", " a b c", " b b", " d", " a c", " f", " b a"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1)).double()


def pairs(n):
    from datasets import Dataset
    return Dataset.from_dict({"prompt": PROMPTS[:n], "chosen": CHOSEN[:n],
                              "rejected": REJECTED[:n]})


def config(out_dir, **kw):
    from trl import DPOConfig
    base = dict(output_dir=str(out_dir), use_cpu=True, bf16=False, report_to="none",
                per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
                learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
                max_grad_norm=0.0, logging_steps=1, save_strategy="no", disable_tqdm=True,
                seed=0, beta=0.5)
    base.update(kw)
    return DPOConfig(**base)


def mixin_class():
    from trl import DPOTrainer

    from megaloss.integrations.hf import MegalossDPOMixin

    class Trainer(MegalossDPOMixin, DPOTrainer):
        pass
    return Trainer


def train(cls, out_dir, n_pairs=4, with_ref=True, evaluate=False, **kw):
    """One step; returns ({name: update}, the step's log), or with ``evaluate`` the metrics of
    ``trainer.evaluate()`` on the pairs before training."""
    model = llama(0)
    ref = llama(1) if with_ref else None
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=model, ref_model=ref, args=config(out_dir, **kw),
                      train_dataset=pairs(n_pairs), processing_class=tokenizer(),
                      eval_dataset=pairs(n_pairs) if evaluate else None)
        if evaluate:
            return trainer.evaluate()
        trainer.train()
    after = trainer.accelerator.unwrap_model(trainer.model).state_dict()
    return {k: after[k] - before[k] for k in before}, trainer.state.log_history[0]


def assert_updates_close(ours, theirs, tol):
    for name, d in theirs.items():
        err = float((ours[name] - d).norm())
        assert err <= tol * float(d.norm()) + 1e-12, (name, err, float(d.norm()))


METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected", "entropy", "mean_token_accuracy", "num_tokens")


def assert_logs_close(ours, theirs, tol, names=("loss",) + METRICS):
    for name in names:
        a, b = ours[name], theirs[name]
        assert abs(a - b) <= tol * max(abs(b), 1e-2), (name, a, b)


# The trainer-level cases: one per way the mixin's step differs between loss types (the
# default; lengths: ipo, sigmoid_norm; label smoothing: exo_pair; margins sorted over the
# micro-batch: aot; a weighted list). Every loss type's value, gradients and metrics against
# TRL's own _compute_loss: tests/losses/test_dpo_loss_types.py.
LOSS_CASES = [
    ("sigmoid", {}), ("ipo", {}), ("exo_pair", {"label_smoothing": 0.1}), ("sigmoid_norm", {}),
    ("aot", {}), (["sigmoid", "sppo_hard"], {"loss_weights": [1.0, 0.5]})]


@pytest.mark.parametrize("loss_type,extra", LOSS_CASES, ids=lambda c: str(c))
def test_one_step_equals_trl(tmp_path, loss_type, extra):
    from trl import DPOTrainer
    kw = dict(loss_type=loss_type if isinstance(loss_type, list) else [loss_type], **extra)
    theirs, their_log = train(DPOTrainer, tmp_path / "trl", **kw)
    ours, our_log = train(mixin_class(), tmp_path / "ours", **kw)
    assert_updates_close(ours, theirs, TOL)
    assert_logs_close(our_log, their_log, TOL)
    assert "logits/chosen" in their_log and "logits/chosen" not in our_log  # needs the logits


def test_precomputed_reference_equals_trl(tmp_path):
    """``precompute_ref_log_probs``: the reference log-probs are computed by the mixin's
    ``compute_ref_log_probs`` before training (TRL's collator hands them back as float32)."""
    from trl import DPOTrainer
    kw = dict(loss_type=["sigmoid"], precompute_ref_log_probs=True)
    theirs, their_log = train(DPOTrainer, tmp_path / "trl", **kw)
    ours, our_log = train(mixin_class(), tmp_path / "ours", **kw)
    assert_updates_close(ours, theirs, TOL)
    assert_logs_close(our_log, their_log, TOL)
    assert abs(our_log["rewards/margins"]) > 1e-3


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_evaluate_equals_trl(tmp_path, loss_type):
    """evaluate(): the mean over each batch's pairs, as TRL (5 pairs in batches of 2, 2, 1)."""
    from trl import DPOTrainer
    kw = dict(loss_type=[loss_type], per_device_eval_batch_size=2, n_pairs=5, evaluate=True)
    theirs = train(DPOTrainer, tmp_path / "trl", **kw)
    ours = train(mixin_class(), tmp_path / "ours", **kw)
    names = ["eval_loss"] + [f"eval_{m}" for m in METRICS if m != "num_tokens"]
    assert_logs_close(ours, theirs, TOL, names)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_uneven_micro_batches_give_the_single_batch_step(tmp_path, loss_type):
    """3 pairs in GAS 2 micro-batches of 2 and 1: the mixin's step is that of the 3 pairs' mean
    (TRL's on one micro-batch of 3), which TRL's own GAS 2 step is not."""
    from trl import DPOTrainer
    kw = dict(loss_type=[loss_type])
    whole, whole_log = train(DPOTrainer, tmp_path / "whole", n_pairs=3,
                             per_device_train_batch_size=4, gradient_accumulation_steps=1, **kw)
    ours, our_log = train(mixin_class(), tmp_path / "ours", n_pairs=3, **kw)
    split, _ = train(DPOTrainer, tmp_path / "split", n_pairs=3, **kw)
    assert_updates_close(ours, whole, TOL)
    assert abs(our_log["loss"] - whole_log["loss"]) <= TOL * abs(whole_log["loss"])
    gap = max(float((split[k] - whole[k]).norm() / whole[k].norm()) for k in whole
              if whole[k].norm() > 0)
    assert gap > 1e-3, gap


@pytest.mark.parametrize("field,kw", [
    ("loss_type", dict(loss_type=["sft"])),
    ("f_divergence_type", dict(f_divergence_type="js_divergence")),
    ("ld_alpha", dict(ld_alpha=0.5)), ("use_weighting", dict(use_weighting=True))])
def test_unsupported_fields_are_refused(tmp_path, field, kw):
    with pytest.raises(ValueError, match=field):
        train(mixin_class(), tmp_path, **kw)


def test_model_by_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="model instance"):
        mixin_class()(model="some/model", args=config(tmp_path), train_dataset=pairs(2),
                      processing_class=tokenizer())


def test_forward_without_the_flag_is_the_model(tmp_path):
    """The replaced head keeps the model's own forward (logits) and the trained Parameter."""
    model = llama(0)
    ids = torch.tensor([[2, 3, 4, 5]])
    expected = model(ids).logits
    weight = model.lm_head.weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = mixin_class()(model=model, ref_model=llama(1), args=config(tmp_path),
                                train_dataset=pairs(2), processing_class=tokenizer())
    torch.testing.assert_close(trainer.model(ids).logits, expected, rtol=0, atol=0)
    assert trainer.model.get_output_embeddings().weight is weight


# 2 processes ---------------------------------------------------------------------------------
def _worker(rank, world, out_dir):
    cls = mixin_class()
    seen = []

    class Recording(cls):
        def get_batch_samples(self, *a, **k):
            batches, n = super().get_batch_samples(*a, **k)
            seen.extend({key: b[key].clone() for key in ("input_ids", "attention_mask",
                                                          "completion_mask")} for b in batches)
            return batches, n

    update, log = train(Recording, os.path.join(out_dir, str(rank)), n_pairs=7,
                        loss_type=["sigmoid"], accelerator_config={"even_batches": False})
    return update, log, seen


def _sequence_log_probs(model, b):
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b["input_ids"][:, 1:, None])[..., 0]
    return (lp * b["completion_mask"][:, 1:]).sum(-1)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_two_processes_uneven_pairs_give_the_global_gradient(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path), timeout=380)
    batches = [b for _, _, seen in results for b in seen]
    counts = [sum(b["input_ids"].shape[0] // 2 for b in seen) for _, _, seen in results]
    assert sorted(counts) == [3, 4], counts  # uneven pairs per process, 7 in all
    model, ref = llama(0), llama(1)
    chosen, rejected = [], []
    for b in batches:
        seq = _sequence_log_probs(model, b)
        with torch.no_grad():
            ref_seq = _sequence_log_probs(ref, b)
        p = seq.shape[0] // 2
        chosen.append(seq[:p] - ref_seq[:p])
        rejected.append(seq[p:] - ref_seq[p:])
    z = 0.5 * (torch.cat(chosen) - torch.cat(rejected))
    loss = -torch.nn.functional.logsigmoid(z).mean()
    loss.backward()
    expected = {k: -p.grad for k, p in model.named_parameters()}
    for update, _log, _ in results:
        assert_updates_close(update, expected, 1e-9)
    # the logged loss: the Trainer averages each process's calibrated share over the processes
    logged = sum(log["loss"] for _, log, _ in results) / 2
    ref = float(loss.detach())
    assert abs(logged - ref) <= 1e-6 * ref, (logged, ref)  # logged as float32


def test_copy_of_model_keeps_working():
    """A deep copy of an installed model (as TRL's sync / reference copies do) still runs."""
    from megaloss.integrations.hf.trl_dpo import _install
    model = llama(0)
    _install(model)
    clone = copy.deepcopy(model)
    ids = torch.tensor([[2, 3, 4]])
    torch.testing.assert_close(clone(ids).logits, model(ids).logits)
