"""Router losses in the one calibrated step (megaloss.integrations.step with
``LanguageModelLoss(router=RouterLossOptions(...))``): for every scope (``micro_batch``,
``global``, ``step``) and layout (DP, SP, TP replicas on 2 gloo ranks; DDP and FSDP2 engines),
2 micro-batches per rank of uneven rows, valid tokens and padding, the step's loss and gradient
equal one device's on the whole global batch under the scope's definition, computed in float64
from the formulas (tests/helpers/toy_moe.py: one-hot counts, autograd through the softmax).
Tolerance 1e-10 relative (float64 sums in another order).

The configurations of the field's calibration bugs are cases here: uneven micro-batches under
gradient accumulation (the micro-batch loss averaged with equal weight per micro-batch, not
scaled by accumulation steps or world size), and the ``step`` scope's gradient independent of
how the tokens are cut into micro-batches.
"""
import pytest
import torch

from megaloss.testing import run_distributed
from tests.helpers.toy_moe import ToyMoE, micro_batches, reference_step

AUX, Z = 0.7, 0.05
SCOPES = ("micro_batch", "global", "step")


def _options(scope, layers="per_layer"):
    from megaloss.losses.router_options import RouterLossOptions

    return RouterLossOptions(aux_loss=AUX, z_loss=Z, scope=scope, layers=layers)


def _engine(model, topology, engine, gas):
    import megaloss
    from megaloss.calibration import probe_ddp, probe_fsdp
    from megaloss.integrations.fsdp import FSDPStepEngine
    from megaloss.parallel.comm import all_reduce_sum_

    class SummingEngine(FSDPStepEngine):
        """Plain module, gradients summed over dp x sp at the boundary (engine factor 1)."""

        def after_backward(self, last):
            if last:
                for p in self.module.parameters():
                    all_reduce_sum_(p.grad, topology.dp_sp_group)
            super().after_backward(last)

    from megaloss.calibration.engine_scale import EngineScale
    from megaloss.parallel.groups import group_ranks

    ranks = tuple(group_ranks(topology.dp_sp_group))
    scale = EngineScale("sum", 1.0, 1.0, gas, len(ranks), 1.0, ranks)
    module = model
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        module, scale = DDP(model), probe_ddp(gas=gas)
    elif engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        module = fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        scale = probe_fsdp(module, gas=gas)
    calibrator = megaloss.LossCalibrator(topology, engine_scale=scale, weight_dtype=torch.float64)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    cls = SummingEngine if engine == "sum" else FSDPStepEngine
    return cls(module, optimizer, calibrator, gradient_accumulation_steps=gas)


def _rank(rank, world, tp, sp, engine, layers):
    import megaloss
    from megaloss.integrations.step import run_step
    from megaloss.integrations.step.lm import LanguageModelLoss

    topology = megaloss.Topology.build(tp, sequence_parallel_size=sp)
    batches = micro_batches(topology.dp_rank, padding=sp == 1)
    out = {}
    for scope in SCOPES:
        model = ToyMoE()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        step = _engine(model, topology, engine, len(batches))
        metrics = run_step(step, LanguageModelLoss(router=_options(scope, layers)), batches,
                           log=False)
        after = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                 for n, p in model.named_parameters()}
        out[scope] = (metrics, {n: before[n] - after[n] for n in before})  # lr 1: the gradient
    return out


def _reference(dp, scope, layers):
    model = ToyMoE()
    loss = reference_step(model, [micro_batches(r) for r in range(dp)],
                          scope=scope, aux=AUX, z=Z, layers=layers)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp, sp, engine, layers", [
    (1, 1, "sum", "per_layer"),
    (1, 1, "ddp", "concatenated"),
    (1, 1, "fsdp2", "per_layer"),
    (1, 2, "sum", "per_layer"),
    (2, 1, "sum", "per_layer"),
], ids=["dp2", "dp2-ddp-concatenated", "dp2-fsdp2", "sp2", "tp2"])
def test_step_router_loss_equals_one_device(tp, sp, engine, layers):
    dp = 2 // (tp * sp)
    results = run_distributed(_rank, 2, tp, sp, engine, layers, timeout=200)
    for scope in SCOPES:
        if sp > 1:  # the SP ranks cut unpadded sequences: the reference has no padding either
            model = ToyMoE()
            loss = reference_step(model, [micro_batches(0, padding=False)], scope=scope,
                                  aux=AUX, z=Z, layers=layers)
            loss.backward()
            ref_loss, ref_grads = float(loss.detach()), {n: p.grad for n, p in
                                                         model.named_parameters()}
        else:
            ref_loss, ref_grads = _reference(dp, scope, layers)
        for metrics, grads in (r[scope] for r in results):
            assert abs(metrics.loss - ref_loss) <= 1e-10 * abs(ref_loss), scope
            assert metrics.router_aux_loss > 0 and metrics.expert_load_max >= 1.0
            for name, g in grads.items():
                torch.testing.assert_close(g, ref_grads[name], rtol=1e-10, atol=1e-13,
                                           msg=f"{scope} {name}")


def _one_process(scope, batches):
    import megaloss
    from megaloss.integrations.fsdp import FSDPStepEngine
    from megaloss.integrations.step import run_step
    from megaloss.integrations.step.lm import LanguageModelLoss

    model = ToyMoE()
    calibrator = megaloss.LossCalibrator(weight_dtype=torch.float64)
    engine = FSDPStepEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), calibrator)
    before = [p.detach().clone() for p in model.parameters()]
    m = run_step(engine, LanguageModelLoss(router=_options(scope)), batches, log=False)
    return m, [b - p.detach() for b, p in zip(before, model.parameters())]


def test_step_scope_does_not_depend_on_the_micro_batch_cut():
    """The same 12 tokens cut into micro-batches of 4 + 4 + 4 and 6 + 2 + 4 tokens: the
    ``step`` scope's gradient is the same (one device's on the whole batch); the
    ``micro_batch`` scope's (a loss per micro-batch, averaged) is not."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 29, (1, 12), generator=g)
    labels = torch.randint(0, 29, (1, 12), generator=g)

    def cut(sizes):
        edges = torch.tensor([0, *sizes]).cumsum(0).tolist()
        return [{"input_ids": ids[:, a:b], "shift_labels": labels[:, a:b]}
                for a, b in zip(edges, edges[1:])]

    grads = {}
    for scope in ("step", "micro_batch"):
        for sizes in ((4, 4, 4), (6, 2, 4)):
            m, grads[scope, sizes] = _one_process(scope, cut(sizes))
    for a, b in zip(grads["step", (4, 4, 4)], grads["step", (6, 2, 4)]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    diff = max(float((a - b).abs().max()) for a, b in
               zip(grads["micro_batch", (4, 4, 4)], grads["micro_batch", (6, 2, 4)]))
    assert diff > 1e-4


def test_a_module_without_router_losses_is_refused():
    """A module whose forward ignores ``router_loss=`` would drop the router losses."""
    import megaloss
    from megaloss.integrations.fsdp import FSDPStepEngine
    from megaloss.integrations.step import run_step
    from megaloss.integrations.step.lm import LanguageModelLoss

    class NoRouter(ToyMoE):
        def forward(self, input_ids, router_loss=None, **kwargs):
            return super().forward(input_ids, **kwargs)

    model = NoRouter()
    engine = FSDPStepEngine(model, torch.optim.SGD(model.parameters(), lr=1.0),
                            megaloss.LossCalibrator(weight_dtype=torch.float64))
    with pytest.raises(TypeError, match="router"):
        run_step(engine, LanguageModelLoss(router=_options("global")), micro_batches(0),
                 log=False)


def _padded_under_sp(rank, world):
    import megaloss
    from megaloss.integrations.step import run_step
    from megaloss.integrations.step.lm import LanguageModelLoss

    topology = megaloss.Topology.build(1, sequence_parallel_size=2)
    model = ToyMoE()
    try:
        run_step(_engine(model, topology, "sum", 2),
                 LanguageModelLoss(router=_options("global")), micro_batches(0), log=False)
    except ValueError as err:
        return str(err)
    return None


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_padding_under_sequence_parallelism_is_refused_on_every_rank():
    """Each SP rank routes its slice without the attention mask: padded tokens would count."""
    for message in run_distributed(_padded_under_sp, 2, timeout=100):
        assert message is not None and "padding" in message


def _policy_batches(rank, family):
    g = torch.Generator().manual_seed(40 + rank)
    out = []
    for m in range(2):
        rows = 2 * (1 + (rank + m) % 2)
        ids = torch.randint(0, 29, (rows, 6), generator=g)
        completion = torch.zeros(rows, 6, dtype=torch.long)
        completion[:, 2:5] = 1
        mb = {"input_ids": ids, "completion_mask": completion}
        if family == "policy":
            mb["advantages"] = torch.randn(rows, generator=g, dtype=torch.float64)
        else:
            mb["ref_chosen_log_probs"] = torch.randn(rows // 2, generator=g, dtype=torch.float64)
            mb["ref_rejected_log_probs"] = torch.randn(rows // 2, generator=g,
                                                       dtype=torch.float64)
        out.append(mb)
    return out


def _policy_rank(rank, world, family):
    import megaloss
    from megaloss.integrations.step import run_step
    from megaloss.integrations.step.policy import PolicyStepLoss
    from megaloss.integrations.step.preference import PreferenceStepLoss
    from megaloss.losses.dpo import DPOOptions
    from megaloss.losses.policy_options import PolicyLossOptions
    from tests.helpers.toy_moe import ToyMoELogProbs

    topology = megaloss.Topology.build(1)
    out = {}
    for scope in ("global", "step"):
        deltas, metrics = [], []
        for router in (_options(scope), None):
            model = ToyMoELogProbs()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            loss = (PolicyStepLoss(PolicyLossOptions(), router=router) if family == "policy"
                    else PreferenceStepLoss(DPOOptions(), router=router))
            metrics.append(run_step(_engine(model, topology, "sum", 2), loss,
                                    _policy_batches(rank, family), log=False).metrics)
            deltas.append({n: before[n] - p.detach() for n, p in model.named_parameters()})
        out[scope] = (metrics[0], {n: deltas[0][n] - deltas[1][n] for n in deltas[0]})
    return out


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", ["policy", "dpo"])
def test_policy_and_preference_steps_add_the_router_losses(family):
    """The policy (GRPO) and preference (DPO) steps on a log-probs MoE module, 2 ranks x 2
    micro-batches: the update with router losses minus the update without is one device's
    router-loss gradient of the scope on the whole global batch (the losses are added, their
    gradients sum)."""
    from tests.helpers.toy_moe import ToyMoE, reference_router_step

    results = run_distributed(_policy_rank, 2, family, timeout=180)
    for scope in ("global", "step"):
        model = ToyMoE()
        ref = reference_router_step(model, [_policy_batches(r, family) for r in range(2)],
                                    scope=scope, aux=AUX, z=Z)
        grads = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
        for _, diff in (r[scope] for r in results):
            for (name, p), g in zip(model.named_parameters(), grads):
                g = torch.zeros_like(p) if g is None else g  # the lm_head: no router gradient
                torch.testing.assert_close(diff[name], g, rtol=1e-9, atol=1e-12,
                                           msg=f"{family} {scope} {name}")
        for metrics, _ in (r[scope] for r in results):
            assert metrics["router_aux_loss"] > 0
