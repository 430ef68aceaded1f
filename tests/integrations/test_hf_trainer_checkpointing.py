"""``MegalossTrainer`` with ``gradient_checkpointing=True``: the Trainer enables checkpointing on
the model it is given, which is megaloss's ``CausalLMWithLoss`` wrapper; it died with
AttributeError before the first step. Now the wrapper forwards the Hugging Face model API, and a
checkpointed run is the unchecked run: the same SGD update (fp32, 1e-6 relative per tensor: the
same ops recomputed), while each decoder layer's forward runs under the checkpoint function and
twice per micro-batch (once recomputed in backward)."""
import pytest
import torch
from test_hf_trainer import collate, samples, tiny_llama

pytest.importorskip("accelerate")


def _train(tmp_path, checkpointing, monkeypatch):
    import transformers.modeling_utils as modeling_utils
    from transformers import TrainingArguments

    from megaloss.integrations.hf.trainer import MegalossTrainer
    model = tiny_llama()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=1, learning_rate=1.0,
                             optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
                             max_grad_norm=0.0, save_strategy="no", report_to=[], use_cpu=True,
                             gradient_checkpointing=checkpointing, remove_unused_columns=False,
                             disable_tqdm=True, seed=0)
    trainer = MegalossTrainer(model=model, args=args, train_dataset=samples(4),
                              data_collator=collate,
                              megaloss_config={"ce": {"chunk_size": 5, "loss_reduction": "sample"}})
    calls = []  # runs of checkpointed layer bodies: first forwards and backward recomputes
    checkpoint = modeling_utils.checkpoint

    def counting(fn, *args, **kwargs):
        return checkpoint(lambda *a, **k: calls.append(1) or fn(*a, **k), *args, **kwargs)
    monkeypatch.setattr(modeling_utils, "checkpoint", counting)
    trainer.train()
    assert model.model.layers[0].gradient_checkpointing == checkpointing
    after = trainer.model.model.state_dict()
    return before, after, len(calls), trainer.model


@pytest.mark.slow  # two Trainer runs
@pytest.mark.timeout(180)
def test_gradient_checkpointing_trains_like_without(tmp_path, monkeypatch):
    before, plain, plain_calls, _ = _train(tmp_path / "plain", False, monkeypatch)
    before2, ckpt, ckpt_calls, wrapper = _train(tmp_path / "ckpt", True, monkeypatch)
    assert wrapper.is_activation_checkpointing
    # 2 layers x 2 micro-batches, each run once forward and once recomputed in backward
    assert plain_calls == 0 and ckpt_calls == 2 * 2 * 2
    for name in plain:
        assert torch.equal(before[name], before2[name])
        update, want = ckpt[name] - before[name], plain[name] - before[name]
        assert (update - want).norm() <= 1e-6 * want.norm() + 1e-9, name


def test_wrapper_forwards_the_hf_model_api(tmp_path):
    from transformers import LlamaForCausalLM

    from megaloss import CausalLMWithLoss, CrossEntropyOptions
    llama = tiny_llama()
    model = CausalLMWithLoss(llama, options=CrossEntropyOptions(reduction="sum"))
    assert model.config is llama.config and model.generation_config is llama.generation_config
    assert model.get_input_embeddings() is llama.get_input_embeddings()
    assert model.supports_gradient_checkpointing and not model.is_activation_checkpointing
    model.activation_checkpointing_enable()
    assert llama.is_activation_checkpointing and model.is_activation_checkpointing
    model.activation_checkpointing_disable()
    assert not llama.is_activation_checkpointing
    assert model.num_parameters() == llama.num_parameters()
    with pytest.raises(AttributeError, match="no attribute 'not_an_hf_method'"):
        _ = model.not_an_hf_method
    # saved through the wrapper, the folder loads back as the original model, lm_head included
    model.save_pretrained(tmp_path / "saved")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    assert torch.equal(loaded.lm_head.weight, llama.lm_head.weight)
    assert torch.equal(loaded.model.embed_tokens.weight, llama.model.embed_tokens.weight)
