"""A Hugging Face mixture-of-experts model (Qwen3-MoE, tiny, float64) in the calibrated step with
megaloss's router losses: ``CausalLMWithLoss(model)`` under DDP on 2 gloo ranks, 2 micro-batches
per rank of uneven rows and padding, ``LanguageModelLoss(router=RouterLossOptions(scope=...))``:
the parameters after one SGD step (lr 1) equal one process's on the whole global batch, whose
loss is the token-mean CE of the model's own logits plus the router losses of the scope's
definition computed from the model's own ``router_logits`` with the papers' formulas
(tests/helpers/toy_moe.py). Tolerance 1e-9 relative (float64; the model's routers run their
softmax in float32, which picks the experts, the same in both).
"""
import pytest
import torch

from megaloss.testing import run_distributed
from tests.helpers.toy_moe import padded_samples, reference_hf_step, tiny_qwen3_moe

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

VOCAB, SEQ, GAS, AUX, Z = 41, 6, 2, 0.3, 0.01
SCOPES = ("micro_batch", "global", "step")


def _model():
    return tiny_qwen3_moe(VOCAB).double()


def _batches(rank):
    g = torch.Generator().manual_seed(20 + rank)
    out = []
    for m in range(GAS):
        rows = 1 + (rank + m) % 2
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        mask = torch.ones(rows, SEQ, dtype=torch.long)
        mask[0, SEQ - 1 - m:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return out


def _rank(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import megaloss
    from megaloss.calibration import probe_ddp
    from megaloss.integrations.fsdp import FSDPStepEngine
    from megaloss.integrations.step import run_step
    from megaloss.integrations.step.lm import LanguageModelLoss
    from megaloss.losses.router_options import RouterLossOptions

    out = {}
    for scope in SCOPES:
        model = megaloss.CausalLMWithLoss(_model(),
                                          options=megaloss.CrossEntropyOptions(reduction="sum"))
        calibrator = megaloss.LossCalibrator(megaloss.Topology.default(),
                                             engine_scale=probe_ddp(gas=GAS),
                                             weight_dtype=torch.float64)
        module = DDP(model)
        engine = FSDPStepEngine(module, torch.optim.SGD(module.parameters(), lr=1.0),
                                calibrator, gradient_accumulation_steps=GAS)
        options = RouterLossOptions(aux_loss=AUX, z_loss=Z, scope=scope)
        metrics = run_step(engine, LanguageModelLoss(router=options), _batches(rank), log=False)
        out[scope] = (metrics, {n: p.detach().clone() for n, p in model.model.named_parameters()})
    return out


def _reference(scope):
    model = _model()
    loss = reference_hf_step(model, [_batches(r) for r in range(2)], scope=scope, aux=AUX, z=Z)
    loss.backward()
    with torch.no_grad():
        params = {n: p - p.grad for n, p in model.named_parameters()}
    return float(loss.detach()), params


@pytest.mark.timeout(300)
def test_qwen3_moe_router_losses_in_the_calibrated_step_equal_one_process():
    results = run_distributed(_rank, 2, timeout=280)
    for scope in SCOPES:
        ref_loss, ref_params = _reference(scope)
        for metrics, params in (r[scope] for r in results):
            assert abs(metrics.loss - ref_loss) <= 1e-9 * abs(ref_loss), (scope, metrics.loss,
                                                                           ref_loss)
            assert metrics.router_aux_loss > 0 and metrics.expert_load_max >= 1.0
            for name, p in params.items():
                torch.testing.assert_close(p, ref_params[name], rtol=1e-9, atol=1e-12,
                                           msg=f"{scope} {name}")


def _one_batch():
    return _batches(1)[0]


@pytest.mark.parametrize("kind", ["distillation", "log_probs"])
def test_distillation_and_log_probs_wrappers_take_the_step_pool(kind):
    """The distillation (a MoE student) and log-probs wrappers under the step's pool: the output's
    ``router`` is megaloss's router loss of the model's own router logits (the distillation
    loss carries it), and a statistics-only pool (the ``step`` scope's pre-pass) returns the
    counts of those logits."""
    import megaloss
    from megaloss.losses.router import RouterPool, router_loss, router_statistics
    from megaloss.losses.router_options import RouterLossOptions

    model = _model()
    mb = _one_batch()
    if kind == "distillation":
        wrapper = megaloss.CausalLMWithDistillation(
            model, _model(), options=megaloss.DistillationOptions(reduction="sum"))
    else:
        wrapper = megaloss.CausalLMWithLogProbs(model)
    options = RouterLossOptions(aux_loss=AUX, z_loss=Z, scope="step")
    own = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                output_router_logits=True).router_logits
    expected = router_loss(own, 2, options=options, mask=mb["attention_mask"])
    weights = (mb["labels"][:, 1:] != -100).to(torch.float64)
    weights = torch.cat([weights, torch.zeros(weights.shape[0], 1, dtype=torch.float64)], 1)
    kwargs = dict(labels=mb["labels"], attention_mask=mb["attention_mask"])
    if kind == "distillation":
        kwargs["loss_weights"] = weights
    out = wrapper(mb["input_ids"], router_loss=RouterPool(options), **kwargs)
    torch.testing.assert_close(out.router.loss, expected.loss, rtol=1e-12, atol=0)
    if kind == "distillation":
        plain = wrapper(mb["input_ids"], output_router_logits=False, **kwargs)
        torch.testing.assert_close(out.loss, plain.loss + expected.loss, rtol=1e-12, atol=0)
    stats = wrapper(mb["input_ids"], attention_mask=mb["attention_mask"],
                    router_loss=RouterPool(options, statistics_only=True))
    torch.testing.assert_close(stats.counts, router_statistics(
        own, 2, mask=mb["attention_mask"]).counts)


def test_a_model_without_router_refuses_the_pool():
    from transformers import LlamaConfig, LlamaForCausalLM

    import megaloss
    from megaloss.losses.router import RouterPool
    from megaloss.losses.router_options import RouterLossOptions

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16,
                                         num_hidden_layers=1, num_attention_heads=2))
    wrapper = megaloss.CausalLMWithLoss(llama)
    ids = torch.randint(0, VOCAB, (1, SEQ))
    with pytest.raises(ValueError, match="no router"):
        wrapper(ids, labels=ids, router_loss=RouterPool(RouterLossOptions(aux_loss=0.1)))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("scope", ["micro_batch", "step"])
def test_megaloss_trainer_router_losses_under_gradient_accumulation(tmp_path, scope):
    """MegalossTrainer with the ds_config-style ``router`` section, 4 micro-batches of one padded
    sample each (gradient accumulation 4, the configuration where a router term added per
    micro-batch is over-weighted by the accumulation steps): one SGD step equals the float64
    reference of the scope's definition (``micro_batch``: the mean of the micro-batches'
    router losses; ``step``: one loss over the step's tokens)."""
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    from megaloss.integrations.hf.trainer import MegalossTrainer

    samples = padded_samples(VOCAB, SEQ)

    def collate(rows):
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}

    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1,
                             gradient_accumulation_steps=4, max_steps=1, learning_rate=1.0,
                             optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
                             max_grad_norm=0.0, save_strategy="no", report_to=[], use_cpu=True,
                             remove_unused_columns=False, disable_tqdm=True, seed=0)
    trainer = MegalossTrainer(model=model, args=args, train_dataset=samples,
                              data_collator=collate,
                              megaloss_config={"router": {"aux_loss": AUX, "z_loss": Z,
                                                          "scope": scope}})
    trainer.train()
    after = dict(trainer.model.model.named_parameters())

    ref = _model()
    one_rank = [[{k: v[None] for k, v in sample.items()} for sample in samples]]
    reference_hf_step(ref, one_rank, scope=scope, aux=AUX, z=Z).backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(before[name] - after[name].detach(), p.grad, rtol=1e-9,
                                   atol=1e-12, msg=name)
