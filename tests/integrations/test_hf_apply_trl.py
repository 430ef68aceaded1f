"""TRL 1.16's ``SFTTrainer`` on a model patched by ``megaloss.integrations.hf.apply`` against the
same run without: TRL routes its loss and its ``entropy`` / ``mean_token_accuracy`` metrics
through its own fused lm_head (``model(..., fused_lm_head=True)``, ``trl/trainer/utils.py``
``add_fused_lm_head``), which the patched model answers with megaloss's chunked log-probs,
whichever was patched first. Float64 tiny Llama, SGD, 4 steps of 2 accumulated micro-batches:
every micro-batch loss of the patched runs equals the float64 loss of the model's own logits
(``sum / num_items_in_batch``) to 1e-12, the two patch orders agree exactly, and the logged
curve and metrics equal TRL's own fused head's to 1e-4 relative (TRL's kernel runs in fp32 and is
5e-5 off the float64 loss inside the trainer; its metrics agree to 1e-5).
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
