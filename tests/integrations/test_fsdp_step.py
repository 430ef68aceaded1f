"""The one calibrated step (``megaloss.integrations.step.run_step``) on the FSDP2 / DDP adapter
(``megaloss.integrations.fsdp.FSDPStepEngine``), 2 gloo ranks, a tiny Llama in float64:
``CausalLMWithLoss`` under ``fully_shard`` (layers + the wrapper as root) and under DDP, 2
micro-batches per rank with uneven valid tokens (rank 1 ignores half of its labels), one SGD
step (lr 1, no clipping): the parameters after the step, the step's loss and its token count
equal one process training on the whole global batch in float64 (HF's next-token CE, the token
mean). Tolerance: 1e-10 relative (float64 sums in another order).

Also single-process: the adapter's optimizer step (learning-rate schedule, clipping, step
count) and the count check of ``gradient_accumulation_steps``.
"""
import pytest
import torch
import torch.nn.functional as F

from megaloss.testing import run_distributed

VOCAB, SEQ, ROWS, GAS = 61, 12, 2, 2


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
    return LlamaForCausalLM(config).double()


def _micro_batches(rank):
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for _ in range(GAS):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        labels = ids.clone()
        if rank == 1:
            labels[:, : SEQ // 2] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _reference(world):
    """One process, the whole global batch: parameters after one SGD step (lr 1), and the
    loss."""
    model = _llama()
    batches = [b for r in range(world) for b in _micro_batches(r)]
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                           ignore_index=-100)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad
    return {n: p.detach() for n, p in model.named_parameters()}, float(loss.detach())


def _step_rank(rank, world, engine_kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import megaloss
    from megaloss.calibration import probe_ddp, probe_fsdp
    from megaloss.integrations.fsdp import FSDPStepEngine
    from megaloss.integrations.step import run_step
    from megaloss.integrations.step.lm import LanguageModelLoss

    llama = _llama()
    model = megaloss.CausalLMWithLoss(llama, options=megaloss.CrossEntropyOptions(reduction="sum"))
    if engine_kind == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        for layer in llama.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        scale = probe_fsdp(model, gas=GAS)
        module = model
    else:
        module = DDP(model)
        scale = probe_ddp(gas=GAS)
    calibrator = megaloss.LossCalibrator(megaloss.Topology.default(), engine_scale=scale,
                                         weight_dtype=torch.float64)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    engine = FSDPStepEngine(module, optimizer, calibrator, gradient_accumulation_steps=GAS)
    metrics = run_step(engine, LanguageModelLoss(), _micro_batches(rank), log=False)
    params = {}
    for name, p in llama.named_parameters():
        params[name] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
    return metrics, params


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine_kind", ["fsdp2", "ddp"])
def test_run_step_equals_one_process(engine_kind):
    world = 2
    ref_params, ref_loss = _reference(world)
    valid = sum(int((b["labels"][:, 1:] != -100).sum())
                for r in range(world) for b in _micro_batches(r))
    for metrics, params in run_distributed(_step_rank, world, engine_kind, timeout=240):
        assert metrics.num_tokens == valid
        assert metrics.step == 1 and metrics.grad_norm > 0
        assert abs(metrics.loss - ref_loss) <= 1e-10 * abs(ref_loss)
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-10, atol=1e-12, msg=name)


def _one_process_engine(**kwargs):
    import megaloss
    from megaloss.integrations.fsdp import FSDPStepEngine

    model = megaloss.CausalLMWithLoss(_llama(),
                                      options=megaloss.CrossEntropyOptions(reduction="sum"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    calibrator = megaloss.LossCalibrator(weight_dtype=torch.float64)
    return model, FSDPStepEngine(model, optimizer, calibrator, **kwargs)


def test_optimizer_step_schedule_clip_and_count():
    """One process: the learning rate of step k from the schedule, the norm before clipping
    reported and the update clipped to ``max_grad_norm``, the step count continued from
    ``steps_done``."""
    from megaloss.integrations.step import run_step
    from megaloss.integrations.step.lm import LanguageModelLoss

    model, engine = _one_process_engine(max_grad_norm=1e-3, lr_schedule=lambda k: 0.1 * k,
                                        steps_done=4)
    before = [p.detach().clone() for p in model.parameters()]
    m = run_step(engine, LanguageModelLoss(), _micro_batches(0), log=False)
    assert m.step == 5 and engine.steps_done == 5
    assert m.lr == pytest.approx(0.5)
    assert m.grad_norm > 1e-3  # the norm before clipping
    moved = torch.sqrt(sum(((p.detach() - b) ** 2).sum()
                           for p, b in zip(model.parameters(), before)))
    assert float(moved) == pytest.approx(0.5 * 1e-3, rel=1e-4)  # lr x the clipped norm


def test_count_checked():
    from megaloss.integrations.step import run_step
    from megaloss.integrations.step.lm import LanguageModelLoss

    _, engine = _one_process_engine(gradient_accumulation_steps=3)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3"):
        run_step(engine, LanguageModelLoss(), _micro_batches(0), log=False)


def test_what_is_not_a_step_is_refused_naming_it():
    """A tensor or a dict instead of the list of micro-batches, an empty list, a loss or an
    engine of the wrong type: a TypeError / ValueError naming the argument, before any
    forward."""
    from megaloss.integrations.step import LanguageModelLoss, run_step

    _, engine = _one_process_engine()
    mb = _micro_batches(0)[0]
    with pytest.raises(TypeError, match="micro_batches must be a list of dicts"):
        run_step(engine, LanguageModelLoss(), mb, log=False)
    with pytest.raises(TypeError, match=r"micro_batches\[0\] must be a dict of tensors"):
        run_step(engine, LanguageModelLoss(), [mb["input_ids"]], log=False)
    with pytest.raises(ValueError, match="micro_batches is empty"):
        run_step(engine, LanguageModelLoss(), [], log=False)
    with pytest.raises(TypeError, match="loss must be a megaloss.integrations.step.StepLoss"):
        run_step(engine, engine, [mb], log=False)
    with pytest.raises(TypeError, match="engine must be a megaloss.integrations.step.StepEngine"):
        run_step(LanguageModelLoss(), engine, [mb], log=False)
