"""GradCache under a real DeepSpeed engine, ZeRO 0-3: the cached gathered MNR gives the
single-process gradients of the global batch.

2 gloo ranks, GAS = 2, hard negatives, per-rank micro-batch sizes (3, 2) then (0, 3): uneven
replay counts (mini-batch 2: 2 vs 1, then 0 vs 2) and an empty rank that still joins every
collective. SGD with lr = 1, so the parameter change after the step IS the gradient. Reference:
float64 on one process, symmetric cosine InfoNCE with the hard negatives as extra columns over
each global micro-batch, weighted ``n_m / N``. Tolerance: fp32 engine vs float64, rtol 2e-4 /
atol 2e-6. sentence-transformers' own cached loss stops on the first step of ZeRO-2 and ZeRO-3
("Gradient computed twice for this partition"): its replays run inside one backward.
"""
import pytest
import torch

from megaloss.testing import run_distributed
from tests.helpers.tiny_encoder import TokenEncoder

pytestmark = pytest.mark.deepspeed_pool  # its DeepSpeed test runs on shared ranks: conftest.py

V, H, T, TEMP, MINI = 13, 8, 5, 0.1, 2
SIZES = {0: [3, 0], 1: [2, 3]}  # per rank, per micro-batch -> global sizes 5 and 3
STAGES = (0, 1, 2, 3)


def _Encoder():
    return TokenEncoder(V, H)


def _data():
    g = torch.Generator().manual_seed(7)
    out = []
    for m in range(2):
        n = sum(SIZES[r][m] for r in SIZES)
        q, d = (torch.randint(0, V, (n, T), generator=g) for _ in range(2))
        neg = torch.randint(0, V, (n, 1, T), generator=g)
        mask = (torch.rand(n, T, generator=g) > 0.3).long()
        mask[:, 0] = 1
        out.append({"query_input_ids": q, "query_attention_mask": mask,
                    "document_input_ids": d, "document_attention_mask": torch.ones_like(d),
                    "negative_input_ids": neg, "negative_attention_mask": torch.ones_like(neg)})
    return out


def _initial_state():
    torch.manual_seed(0)
    return {k: v.clone() for k, v in _Encoder().state_dict().items()}


def _reference_grads():
    enc = _Encoder().double()
    enc.load_state_dict({k: v.double() for k, v in _initial_state().items()})
    batches = _data()
    total_n = sum(b["query_input_ids"].shape[0] for b in batches)
    total = 0.0

    def embed(ids, mask):
        h = enc(ids, mask)
        mk = mask.double().unsqueeze(-1)
        return torch.nn.functional.normalize((h * mk).sum(1) / mk.sum(1), dim=-1)

    for b in batches:
        n = b["query_input_ids"].shape[0]
        q = embed(b["query_input_ids"], b["query_attention_mask"])
        d = embed(b["document_input_ids"], b["document_attention_mask"])
        neg = embed(b["negative_input_ids"][:, 0], b["negative_attention_mask"][:, 0])
        target = torch.arange(n)
        forward = torch.nn.functional.cross_entropy(torch.cat([q @ d.T, q @ neg.T], 1) / TEMP,
                                                    target)
        backward = torch.nn.functional.cross_entropy(d @ q.T / TEMP, target)
        total = total + n / total_n * (forward + backward) / 2
    total.backward()
    return {n: p.grad.clone() for n, p in enc.named_parameters()}, float(total.detach())


def _fp32(p):
    import deepspeed

    full = deepspeed.utils.safe_get_full_fp32_param(p)  # None without a ZeRO optimizer
    return (p.detach() if full is None else full).float().clone()


def _worker(rank, world):
    import deepspeed
    import torch.distributed as dist

    from megaloss.integrations.deepspeed.compat import skip_cpu_shm_comm_build
    from megaloss.integrations.grad_cache import inner_replay_backward
    from megaloss.integrations.hf.embedding import (
        EmbeddingModelWithMNR,
        cached_mnr_forward,
        step_loss_weights,
    )

    skip_cpu_shm_comm_build()
    group = dist.group.WORLD
    batches = _data()
    results = {}
    for stage in STAGES:
        enc = _Encoder()
        enc.load_state_dict(_initial_state())
        model = EmbeddingModelWithMNR(enc, temperature=TEMP, symmetric=True, group=group)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                  "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9,
                  "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
        engine, *_ = deepspeed.initialize(model=model, config=config,
                                          optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        before = {n: _fp32(p) for n, p in engine.module.encoder.named_parameters()}
        weights = step_loss_weights(SIZES[rank], group)
        logged, boundaries = 0.0, []
        for m, batch in enumerate(batches):
            lo = sum(SIZES[r][m] for r in range(rank))
            mine = {k: v[lo:lo + SIZES[rank][m]] for k, v in batch.items()}
            out = cached_mnr_forward(engine, mine, mini_batch_size=MINI,
                                     backward=inner_replay_backward(engine), loss_weight=weights[m])
            boundaries.append(engine.is_gradient_accumulation_boundary())
            engine.backward(out.loss)
            engine.step()
            logged += float(weights[m] * out.value) / 2
        grads = {n: (before[n] - _fp32(p)).double()
                 for n, p in engine.module.encoder.named_parameters()}
        results[stage] = (grads, logged, boundaries, int(engine.global_steps))
        if hasattr(engine, "destroy"):
            engine.destroy()
    return results


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(400)
def test_cached_mnr_zero_0_to_3_matches_single_process():
    results = run_distributed(_worker, 2, timeout=380)
    ref, ref_loss = _reference_grads()
    for rank, res in enumerate(results):
        for stage in STAGES:
            grads, logged, boundaries, steps = res[stage]
            # the engine's own accumulation state survives the replays: one optimizer step,
            # the second micro-batch is the boundary
            assert (boundaries, steps) == ([False, True], 1), f"rank {rank} ZeRO-{stage}"
            assert logged == pytest.approx(ref_loss, rel=1e-5)
            for name, g in ref.items():
                torch.testing.assert_close(grads[name], g, rtol=2e-4, atol=2e-6,
                                           msg=f"rank {rank} ZeRO-{stage} {name}")
