"""TRL 1.16's ``SFTTrainer`` on a model patched by ``megaloss.integrations.hf.apply`` against the
same run without: TRL routes its loss and its ``entropy`` / ``mean_token_accuracy`` metrics
through its own fused lm_head (``model(..., fused_lm_head=True)``, ``trl/trainer/utils.py``
``add_fused_lm_head``), which the patched model answers with megaloss's chunked log-probs,
whichever was patched first. Float64 tiny Llama, SGD, 4 steps of 2 accumulated micro-batches:
every micro-batch loss of the patched runs equals the float64 loss of the model's own logits
(``sum / num_items_in_batch``) to 1e-12, the two patch orders agree exactly, and the logged
curve and metrics equal TRL's own fused head's to 1e-4 relative (TRL's head runs under its
config's default ``bf16=True``: CPU autocast, its GEMMs in bf16 and its statistics in fp32, 5e-5
off the float64 loss inside the trainer; its metrics agree to 1e-5).

TRL 1.16's ``DPOTrainer`` likewise (policy and reference patched, each by its own ``apply``):
its fused-head call asks for ``mean_logits`` too (the ``logits/chosen`` / ``logits/rejected``
metrics). Float64 tiny Llamas, ``bf16=False`` (TRL's configs default to ``bf16=True``, whose CPU
autocast would run TRL's head GEMMs in bf16), 3 SGD steps: every loss of the patched runs equals
the DPO sigmoid loss of the models' own float64 logits to 1e-12, the two patch orders agree
exactly, and the logged losses, rewards, log-probs and metrics equal the unpatched run's (TRL's
fused head: its softmax statistics in fp32 whatever the model's dtype,
``trl/kernels/chunked_logprob.py``, ``_forward_tile``) to fp32 rounding: log-probs summed over
about 20 tokens of about -4 each, to 1e-6 relative; rewards ``beta * (logp - ref_logp)``, near 0,
to 1e-7 absolute.
"""
import tempfile

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

V = 48
WORDS = ["<pad>", "<eos>"] + [f"w{i}" for i in range(V - 2)]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _run(patch):
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from megaloss.integrations.hf import apply
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1)).double()
    errors = []

    class Checked(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            with torch.no_grad():  # the model's own float64 logits (the class forward)
                kw = {k: v for k, v in inputs.items() if k != "labels"}
                logits = type(model).forward(model, **kw).logits
                ref = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, V), inputs["labels"][:, 1:].reshape(-1),
                    reduction="sum") / num_items_in_batch
            errors.append(abs(float(loss) - float(ref)))
            return loss

    if patch == "before":
        apply(model)
    g = torch.Generator().manual_seed(1)
    rows = [{"text": " ".join(WORDS[i] for i in torch.randint(2, V, (int(n),),
                                                              generator=g).tolist())}
            for n in torch.randint(4, 16, (16,), generator=g)]
    args = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, max_steps=4, learning_rate=0.5,
                     optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[],
                     use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Checked(model=model, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=_tokenizer())
    if patch == "after":
        apply(trainer.model)
    trainer.train()
    curve = [[h[k] for k in ("loss", "entropy", "mean_token_accuracy")]
             for h in trainer.state.log_history if "loss" in h]
    return torch.tensor(curve, dtype=torch.float64), max(errors)


def test_sft_trainer_with_apply_equals_without():
    without, trl_error = _run(None)
    assert without.shape == (4, 3)
    before, error = _run("before")
    after, error_after = _run("after")
    assert error < 1e-12 and error_after < 1e-12, (error, error_after, trl_error)
    assert torch.equal(before, after)
    torch.testing.assert_close(before[:, 0], without[:, 0], rtol=1e-4, atol=0)
    torch.testing.assert_close(before[:, 1:], without[:, 1:], rtol=1e-5, atol=1e-6)


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=1)).double()


DPO_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
            "logps/rejected", "logits/chosen", "logits/rejected", "entropy",
            "mean_token_accuracy", "rewards/accuracies")


def _run_dpo(patch):
    import torch.nn.functional as F
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from megaloss.integrations.hf import apply
    model, ref = _llama(0), _llama(0)
    errors = []

    class Checked(DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            with torch.no_grad():  # the DPO sigmoid loss of the models' own float64 logits
                kw = {k: inputs[k] for k in ("input_ids", "attention_mask")}
                labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
                labels = labels[:, 1:]

                def logps(m):
                    logits = type(m).forward(m, **kw).logits[:, :-1]
                    lp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])
                    return (lp[..., 0] * (labels != -100)).sum(1)

                chosen, rejected = (logps(model) - logps(self.ref_model)).chunk(2)
                ref_loss = -F.logsigmoid(self.beta * (chosen - rejected)).mean()
            errors.append(abs(float(loss) - float(ref_loss)))
            return loss

    if patch == "before":
        apply(model)
        apply(ref)
    g = torch.Generator().manual_seed(1)

    def text(lo, hi):
        n = int(torch.randint(lo, hi, (1,), generator=g))
        return " ".join(WORDS[i] for i in torch.randint(2, V, (n,), generator=g).tolist())

    rows = [{"prompt": text(2, 6), "chosen": text(2, 8), "rejected": text(2, 8)}
            for _ in range(12)]
    args = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=3,
                     learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
                     logging_steps=1, report_to=[], bf16=False, use_cpu=True,
                     save_strategy="no", disable_tqdm=True)
    trainer = Checked(model=model, ref_model=ref, args=args,
                      train_dataset=Dataset.from_list(rows), processing_class=_tokenizer())
    if patch == "after":
        apply(trainer.model)
        apply(trainer.ref_model)
    trainer.train()
    curve = [[h[k] for k in DPO_KEYS] for h in trainer.state.log_history if "loss" in h]
    return torch.tensor(curve, dtype=torch.float64), max(errors)


def test_dpo_trainer_with_apply_equals_without():
    without, trl_error = _run_dpo(None)
    assert without.shape == (3, len(DPO_KEYS))
    before, error = _run_dpo("before")
    after, error_after = _run_dpo("after")
    assert error < 1e-12 and error_after < 1e-12, (error, error_after, trl_error)
    assert torch.equal(before, after)
    col = {k: i for i, k in enumerate(DPO_KEYS)}
    rewards = [col[k] for k in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins")]
    torch.testing.assert_close(before[:, rewards], without[:, rewards], rtol=0, atol=1e-7)
    rest = [i for i in range(len(DPO_KEYS)) if i not in rewards]
    torch.testing.assert_close(before[:, rest], without[:, rest], rtol=1e-6, atol=1e-9)


def _tiny(kind):
    import transformers as tf
    common = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    if kind == "gemma2":  # a soft-cap inside the model's forward
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, head_dim=8,
                                                    final_logit_softcapping=2.0)).double()
    if kind == "granite":  # logits divided by logits_scaling
        return tf.GraniteForCausalLM(tf.GraniteConfig(**common, logits_scaling=0.25)).double()
    return _llama(0)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "granite"])
def test_fused_lm_head_call_equals_the_models_own_logits(kind):
    """TRL's ``fused_lm_head=True`` call on a patched model: every field DPOTrainer reads
    against the model's own float64 logits at TRL's temperature (the logit transforms of its
    forward included), to 1e-12."""
    from trl.trainer.utils import add_fused_lm_head

    from megaloss.integrations.hf import apply
    T = 0.7
    model = apply(_tiny(kind))
    add_fused_lm_head(model, temperature=T,
                      outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, V, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    with torch.no_grad():
        logits = type(model).forward(model, input_ids=ids, attention_mask=mask).logits
    y = labels[:, 1:]
    keep = y != -100
    logp = (logits[:, :-1] / T).log_softmax(-1)
    want = {"log_probs": logp.gather(-1, y.clamp(min=0)[..., None])[..., 0] * keep,
            "entropy": -(logp.exp() * logp).sum(-1) * keep,
            "mean_logits": (logits[:, :-1] / T).mean(-1) * keep}
    for name, value in want.items():
        torch.testing.assert_close(getattr(out, name).detach(), value, rtol=1e-12, atol=1e-12,
                                   msg=name)
    top1 = (logp.argmax(-1) == y) & keep
    assert torch.equal(out.is_top1, top1) and torch.equal(out.label_mask, keep)
