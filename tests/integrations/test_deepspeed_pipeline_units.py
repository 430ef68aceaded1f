"""Single-process pieces of the pipeline integration: the last stage's loss (value and gradient
multipliers apart), its head's argument checks, the config key, the parameter names of the
Llama stages, the probe's coefficient ids. float64 references; no engine, no processes."""
import pytest
import torch
import torch.nn.functional as F

from megaloss import CrossEntropyOptions, Topology
from megaloss.calibration import EngineScale
from megaloss.calibration.engine_scale import measure_grad_scale
from megaloss.integrations.deepspeed import load_megaloss_config
from megaloss.integrations.deepspeed.pipeline import (
    CrossEntropyHeadStage,
    PipelineCrossEntropyLoss,
    PipelineScale,
    build_pipeline_layout,
)
from megaloss.integrations.deepspeed.pipeline_llama import hf_parameter_name
from megaloss.parallel import SINGLE_RANK


def _stage(vocab=11, hidden=6):
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False).double()
    return CrossEntropyHeadStage(head, options=CrossEntropyOptions(reduction="sum", chunk_size=3))


def _scale(gradient_multiplier, log_multiplier):
    g = EngineScale("test", 1.0 / gradient_multiplier, float(gradient_multiplier), 1, 1,
                    1.0 / gradient_multiplier)
    return PipelineScale(g, float(log_multiplier))


def test_last_stage_loss_has_the_logged_value_and_the_calibrated_gradient():
    stage = _stage()
    loss_fn = PipelineCrossEntropyLoss(stage, _scale(4, 2))
    h = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (2, 5))
    y[0, :3] = -100
    w = torch.rand(2, 5, dtype=torch.float64) * (y != -100)
    out = loss_fn(stage(h), (y, w))
    logits = stage.lm_head(h)
    ce = F.cross_entropy(logits.reshape(-1, 11), y.reshape(-1), ignore_index=-100,
                         reduction="none")
    ref = (ce * w.reshape(-1)).sum()
    torch.testing.assert_close(out.detach(), 2 * ref.detach(), rtol=1e-12, atol=0)
    (g_out,) = torch.autograd.grad(out, h)
    (g_ref,) = torch.autograd.grad(4 * ref, h)
    torch.testing.assert_close(g_out, g_ref, rtol=1e-10, atol=1e-12)
    assert float(loss_fn._sums[2]) == float((y != -100).sum())


def test_head_stage_refuses_a_mean_reduction_and_a_non_linear():
    with pytest.raises(ValueError, match="reduction must be 'sum'"):
        CrossEntropyHeadStage(torch.nn.Linear(4, 7), options=CrossEntropyOptions(reduction="mean"))
    with pytest.raises(TypeError, match="nn.Linear"):
        CrossEntropyHeadStage(torch.nn.Embedding(7, 4))


def test_pipeline_parallel_size_key():
    assert load_megaloss_config({"megaloss": {"pipeline_parallel_size": 2}}
                                ).pipeline_parallel_size == 2
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        load_megaloss_config({"megaloss": {"pipeline_parallel_size": 0}})


def test_layout_needs_torch_distributed_and_valid_sizes():
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an int >= 1"):
        build_pipeline_layout(0)
    with pytest.raises(RuntimeError, match="torch.distributed"):
        build_pipeline_layout(2)


def test_llama_stage_parameter_names():
    assert hf_parameter_name("0.embed_tokens.weight", 2) == "model.embed_tokens.weight"
    assert (hf_parameter_name("2.layer.self_attn.q_proj.weight", 2)
            == "model.layers.1.self_attn.q_proj.weight")
    assert hf_parameter_name("3.norm.weight", 2) == "model.norm.weight"
    assert hf_parameter_name("3.lm_head.weight", 2) == "lm_head.weight"
    # tied: the weight under PipelineModule.tied_modules, the norm a layer of its own
    assert (hf_parameter_name("tied_modules.embed_tokens.lm_head.weight", 2)
            == "model.embed_tokens.weight")


def test_tied_llama_layers_share_one_weight_between_lookup_and_head():
    from deepspeed.pipe import TiedLayerSpec
    from transformers import LlamaConfig, LlamaForCausalLM

    from megaloss.integrations.deepspeed.pipeline_llama import (
        LlamaNormStage,
        llama_pipeline_layers,
    )
    cfg = LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).double()
    state = model.state_dict()
    layers = llama_pipeline_layers(cfg, state_dict=state)
    first, last = layers[0], layers[-1]
    assert isinstance(first, TiedLayerSpec) and isinstance(last, TiedLayerSpec)
    assert first.key == last.key and first.tied_weight_attr == ["lm_head.weight"]
    assert first.forward_fn is not None and last.forward_fn is None
    assert layers[-2].typename is LlamaNormStage and len(layers) == 4
    tied = first.build().double()
    assert tied.embed_tokens.weight is tied.lm_head.weight
    ids = torch.tensor([[0, 3, 10, 7]])
    labels = torch.tensor([[3, 10, 7, -100]])
    hidden = first.forward_fn(tied, ids)
    torch.testing.assert_close(hidden, model.model.embed_tokens(ids), rtol=0, atol=0)
    h = torch.randn(1, 4, 8, dtype=torch.float64)
    assert tied(h) is h  # the last place: no norm, the loss does the head
    tied.loss(h, labels).loss.backward()
    hidden.sum().backward()  # both uses accumulate into the one weight
    ref_w = model.lm_head.weight.detach().clone().requires_grad_()
    (F.cross_entropy(h[0] @ ref_w.T, labels[0], reduction="sum")
     + F.embedding(ids, ref_w).sum()).backward()
    torch.testing.assert_close(tied.lm_head.weight.grad, ref_w.grad, rtol=1e-12, atol=1e-12)


def test_topology_has_no_pipeline_by_default():
    t = Topology()
    assert (t.pp_size, t.pp_rank) == (1, 0)
    assert "pp" not in repr(t)


def test_coefficient_ids_must_name_the_group():
    with pytest.raises(ValueError, match="coefficient_ids must name 1 members"):
        measure_grad_scale(lambda c: torch.ones(4), group=SINGLE_RANK, gas=1, engine="x",
                           coefficient_ids=(0, [0, 1]))
