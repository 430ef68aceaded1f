"""DeepSpeed's own MoE layer (``deepspeed.moe.layer.MoE``, 4 experts split over 2 expert-parallel
gloo ranks, top-2) with megaloss's router losses through the recorded gate logits
(``megaloss.integrations.deepspeed.moe.RouterLogitsRecorder``) and the calibrated step (ZeRO-0,
ds_config ``megaloss.router``), 2 micro-batches per rank: the gate weight's gradient after one
step equals one device's router-loss gradient on the whole global batch under each scope,
computed in float64 from the formulas (tests/helpers/toy_moe.py's reference; the CE has no
valid label here, so the gate's gradient is the router term's alone). fp32 engine: tolerance
1e-5 relative."""
import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.deepspeed_pool]

VOCAB, HIDDEN, EXPERTS, SEQ, GAS = 23, 8, 4, 6, 2
AUX, Z = 0.5, 0.1
SCOPES = ("micro_batch", "global", "step")


def _batches(rank):
    g = torch.Generator().manual_seed(7 + rank)
    return [{"input_ids": torch.randint(0, VOCAB, (1 + m, SEQ), generator=g),
             "shift_labels": torch.full((1 + m, SEQ), -100)} for m in range(GAS)]


def _initial(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, HIDDEN, generator=g), torch.randn(EXPERTS, HIDDEN, generator=g)


def _model():
    import torch.nn.functional as F
    from deepspeed.moe.layer import MoE
    from torch import nn

    from megaloss.integrations.deepspeed.moe import RouterLogitsRecorder

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            embed, gate = _initial()
            self.embed = nn.Embedding(VOCAB, HIDDEN)
            self.embed.weight.data.copy_(embed)
            self.moe = MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS, ep_size=2,
                           k=2, min_capacity=64, drop_tokens=False, use_rts=False,
                           top2_2nd_expert_sampling=False)
            self.moe.deepspeed_moe.gate.wg.weight.data.copy_(gate)
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
            self.recorder = RouterLogitsRecorder(self)

        def forward(self, input_ids, shift_labels=None, loss_weights=None, router_loss=None,
                    **_):
            self.recorder.clear()
            h = self.embed(input_ids)
            h = h + self.moe(h)[0]
            if router_loss.statistics_only:  # the "step" scope's pre-pass: the counts only
                return router_loss(self.recorder.logits, self.recorder.top_k)
            ce = F.cross_entropy(self.head(h).reshape(-1, VOCAB), shift_labels.reshape(-1),
                                 ignore_index=-100, reduction="none")
            loss = (ce * loss_weights.reshape(-1)).sum()
            router = router_loss(self.recorder.logits, self.recorder.top_k)
            from tests.helpers.toy_moe import ToyOutput

            return ToyOutput(loss + router.loss, torch.zeros(()), torch.zeros(()), router)

    return Net()


def _worker(rank, world):
    from megaloss import Topology
    from megaloss.integrations.deepspeed import initialize, train_step

    out = {}
    for scope in SCOPES:
        model = _model()
        gate = model.moe.deepspeed_moe.gate.wg.weight
        before = gate.detach().clone()
        ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GAS,
                     "steps_per_print": 10**9, "gradient_clipping": 0.0,
                     "zero_optimization": {"stage": 0},
                     "megaloss": {"router": {"aux_loss": AUX, "z_loss": Z, "scope": scope}}}
        me = initialize(model, ds_config, topology=Topology.build(1),
                        optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        metrics = train_step(me, _batches(rank), log=False)
        out[scope] = (metrics.router_aux_loss, before - gate.detach())
        me.engine.destroy()
    return out


def _reference(scope):
    from tests.helpers.toy_moe import reference_scope

    embed, gate = (t.double() for t in _initial())
    gate.requires_grad_(True)
    pieces = {}
    for r in range(2):
        for m, mb in enumerate(_batches(r)):
            logits = embed[mb["input_ids"].reshape(-1)] @ gate.T
            pieces[r, m] = ([logits], torch.ones(logits.shape[0]))
    loss = reference_scope(pieces, scope=scope, aux=AUX, z=Z)
    (grad,) = torch.autograd.grad(loss, gate)
    return grad


@pytest.mark.timeout(300)
def test_deepspeed_moe_gate_gradient_equals_one_device():
    results = run_distributed(_worker, 2, timeout=280)
    failures = []
    for scope in SCOPES:
        ref = _reference(scope)
        for rank, per_scope in enumerate(results):
            aux, grad = per_scope[scope]
            rel = float((grad.double() - ref).norm() / ref.norm())
            if not aux > 0 or rel > 1e-5:
                failures.append(f"rank {rank}, scope {scope}: aux {aux}, relative error "
                                f"{rel:.2e} (norms {float(grad.norm()):.4g} vs "
                                f"{float(ref.norm()):.4g})")
    assert not failures, "\n".join(failures)
