"""Single-process checks of the DeepSpeed / HF wiring: the causal-LM wrapper against Hugging
Face's own loss and gradients (float64), the mpu object and TP tags as DeepSpeed reads them, and
ds_config loading. Multi-process behaviour is in test_deepspeed_equivalence.py."""
import pytest
import torch

from megaloss.distributed.mpu import DeepSpeedMPU, init_dp_tp_mesh, is_tensor_parallel, \
    mark_tensor_parallel
from megaloss.distributed.topology import Topology
from megaloss.integrations.config import CEConfig
from megaloss.integrations.hf import CausalLMWithLoss, causal_shift


def _tiny_llama(vocab=29, tie=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                      tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).double()


def test_causal_shift():
    y = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert causal_shift(y).tolist() == [[2, 3, -100], [5, 6, -100]]
    assert causal_shift(y, ignore_index=-1)[:, -1].tolist() == [-1, -1]
    with pytest.raises(TypeError, match="labels"):
        causal_shift(y.float())
    with pytest.raises(ValueError, match="sequence"):
        causal_shift(torch.tensor(3))


@pytest.mark.parametrize("tie", [False, True])
def test_wrapper_matches_hf_loss_and_gradients(tie):
    """sum-reduced fused CE / valid tokens == the float64 mean CE of HF's own logits (HF's
    ``loss`` upcasts to fp32, so it is recomputed here in fp64 with HF's shift); same gradients
    (chunked: 7 tokens per chunk over 2 x 11 tokens); tied embeddings stay tied."""
    ids = torch.randint(0, 29, (2, 11), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :4] = -100
    ref_model = _tiny_llama(tie=tie)
    logits = ref_model(input_ids=ids).logits
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 29),
                                            labels[:, 1:].reshape(-1), ignore_index=-100)
    assert logits.dtype == torch.float64
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}

    model = _tiny_llama(tie=tie)
    wrapper = CausalLMWithLoss(model, ce=CEConfig(chunk_size=7))
    if tie:
        assert wrapper.head.weight is model.get_input_embeddings().weight
    out = wrapper(ids, causal_shift(labels))
    assert int(out.num_valid_tokens) == int((causal_shift(labels) != -100).sum())
    loss = out.loss / out.num_valid_tokens
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    loss.backward()
    grads = {n.removeprefix("model."): p.grad for n, p in wrapper.named_parameters()}
    grads = {("lm_head.weight" if n == "lm_head.weight" else n): g for n, g in grads.items()}
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-10, atol=1e-12, msg=name)


def test_wrapper_loss_weights_and_z_loss():
    ids = torch.randint(0, 29, (2, 9), generator=torch.Generator().manual_seed(4))
    labels = causal_shift(ids)
    w = torch.rand(labels.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    wrapper = CausalLMWithLoss(_tiny_llama(), ce=CEConfig(z_loss=1e-2, chunk_size=5))
    out = wrapper(ids, labels, loss_weights=w)
    with torch.no_grad():
        h = wrapper.decoder(input_ids=ids).last_hidden_state
        logits = h @ wrapper.head.weight.T
        lse = torch.logsumexp(logits, -1)
        valid = labels != -100
        tgt = logits.gather(-1, labels.clamp_min(0)[..., None])[..., 0]
        per_token = (lse - tgt + 1e-2 * lse ** 2) * valid
        z = (1e-2 * lse ** 2 * valid * w).sum()
    torch.testing.assert_close(out.loss.detach(), (per_token * w).sum(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.z_loss, z, rtol=1e-12, atol=1e-12)


def test_wrapper_rejects_bad_inputs():
    with pytest.raises(TypeError, match="ForCausalLM"):
        CausalLMWithLoss(torch.nn.Linear(2, 2))
    wrapper = CausalLMWithLoss(_tiny_llama())
    with pytest.raises(ValueError, match="labels"):
        wrapper(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))


def test_mpu_single_process_and_tags_deepspeed_reads():
    from deepspeed.runtime.utils import is_model_parallel_parameter
    mpu = DeepSpeedMPU(Topology())
    assert (mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()) == (1, 0)
    assert (mpu.get_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()) == (1, 0)
    assert mpu.get_pipeline_model_parallel_world_size() == 1
    assert mpu.get_data_parallel_group_ranks() == [0]
    with pytest.raises(TypeError, match="topology"):
        DeepSpeedMPU(object())
    with pytest.raises(RuntimeError, match="initialised"):
        init_dp_tp_mesh(1)
    p = torch.nn.Parameter(torch.zeros(3))
    assert not is_model_parallel_parameter(p) and not is_tensor_parallel(p)
    assert mark_tensor_parallel(p) is p
    assert is_model_parallel_parameter(p) and is_tensor_parallel(p) and p.partition_dim == 0
    with pytest.raises(TypeError, match="Parameter"):
        mark_tensor_parallel(torch.zeros(3))


def test_vocab_parallel_head_is_tagged_for_deepspeed():
    """The TP head the wrapper installs is what DeepSpeed counts once per TP group."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    from megaloss.vocab_parallel import VocabParallelLMHead
    head = VocabParallelLMHead(4, 10)
    assert all(is_model_parallel_parameter(p) for p in head.parameters())


def test_load_ds_config_points_monitors_at_output_dir(tmp_path):
    from megaloss.integrations.deepspeed import build_parallel, load_ds_config
    src = {"csv_monitor": {"enabled": True, "output_path": "", "job_name": "j"},
           "tensorboard": {"enabled": False, "output_path": ""},
           "wandb": {"enabled": True}, "megaloss": {"ce": {"z_loss": 1e-3}}}
    cfg, ml = load_ds_config(src, output_dir=str(tmp_path))
    assert cfg["csv_monitor"]["output_path"] == str(tmp_path / "monitor")
    assert cfg["tensorboard"]["output_path"] == ""  # disabled: untouched
    assert "output_path" not in cfg["wandb"]
    assert src["csv_monitor"]["output_path"] == ""  # the caller's dict is not modified
    assert ml.ce.z_loss == 1e-3
    with pytest.raises(ValueError, match="megaloss.ce.zloss"):
        load_ds_config({"megaloss": {"ce": {"zloss": 1}}})
    state = build_parallel(1)
    assert state.mpu is None and state.dp_size == state.tp_size == 1
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        build_parallel(2)
