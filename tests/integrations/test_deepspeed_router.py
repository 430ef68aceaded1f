"""Router losses through DeepSpeed's engine (``megaloss.integrations.deepspeed.train_step`` with the
ds_config's ``"megaloss": {"router": {...}}``), ZeRO 0-3 on 2 gloo ranks, gradient accumulation
2 with uneven micro-batches and padding: the gradient of one step (SGD, lr 1) equals one device's
on the whole global batch under each scope's definition, computed in float64 from the formulas
(tests/helpers/toy_moe.py). The engine runs in fp32: tolerance 1e-5 relative (Frobenius norm of
the difference over the reference's), the logged loss within 1e-5 relative. A wrong engine
factor (gradient accumulation or data-parallel averaging applied to the router term, as in the
field's known scaling bugs) is off by a factor of 2 or 4.
"""
import pytest
import torch

from megaloss.testing import run_distributed
from tests.helpers.toy_moe import ToyMoE, micro_batches, reference_step

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.deepspeed_pool]

AUX, Z = 0.7, 0.05
CASES = [(0, "global"), (1, "micro_batch"), (2, "step"), (3, "global"), (3, "step")]


def _grads(stage, scope, rank):
    from deepspeed.utils import safe_get_full_fp32_param

    from megaloss import Topology
    from megaloss.integrations.deepspeed import initialize, train_step

    model = ToyMoE().float()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ds_config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "steps_per_print": 10**9, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "megaloss": {"router": {"aux_loss": AUX, "z_loss": Z, "scope": scope}},
    }
    me = initialize(model, ds_config, topology=Topology.build(1),
                    optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    metrics = train_step(me, micro_batches(rank), log=False)
    grads = {}
    for name, p in model.named_parameters():
        full = safe_get_full_fp32_param(p)
        full = (p.data if full is None else full).detach().clone()
        grads[name] = before[name] - full.reshape(before[name].shape)
    me.engine.destroy()
    return metrics.loss, grads


def _worker(rank, world):
    return {case: _grads(*case, rank) for case in CASES}


@pytest.mark.timeout(400)
def test_router_loss_under_zero_stages_equals_one_device():
    results = run_distributed(_worker, 2, timeout=380)
    failures = []
    for stage, scope in CASES:
        model = ToyMoE()
        loss = reference_step(model, [micro_batches(0), micro_batches(1)], scope=scope,
                              aux=AUX, z=Z)
        loss.backward()
        loss = loss.detach()
        for rank, per_case in enumerate(results):
            got_loss, grads = per_case[stage, scope]
            where = f"rank {rank}, ZeRO-{stage}, scope {scope}"
            if abs(got_loss - float(loss)) > 1e-5 * abs(float(loss)):
                failures.append(f"{where}: loss {got_loss} != {float(loss)}")
            for name, p in model.named_parameters():
                rel = float((grads[name].double() - p.grad).norm() / p.grad.norm())
                if rel > 1e-5:
                    ratio = float(grads[name].double().norm() / p.grad.norm())
                    failures.append(f"{where}: {name} relative error {rel:.2e} (norm ratio "
                                    f"{ratio:.4f})")
    assert not failures, "\n".join(failures)
