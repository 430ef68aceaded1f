"""The embedding wrapper under a real DeepSpeed engine gives single-process gradients.

2 gloo ranks, GAS = 2, micro-batch sizes that differ per rank and per micro-batch (global sizes
5 and 3), ZeRO 2 and 3, SGD with lr = 1 so the parameter change after one step IS the gradient.
Reference: a hand-written symmetric cosine InfoNCE in float64 on one process over the global
micro-batches, weighted ``n_m / N`` (the step's query mean). Tolerance: fp32 engine vs float64,
rtol 2e-4 / atol 2e-6 on the gradient. The same step without ``step_loss_weights`` (mean of
micro-batch means) must NOT match: that is the compensation this test pins down. The same step
through megaloss's one calibrated step (``run_step``, the MNR family; plain and GradCache) on
``initialize``'s engine matches too.
"""
import pytest
import torch

from megaloss.testing import run_distributed
from tests.helpers.tiny_encoder import TokenEncoder

pytestmark = pytest.mark.deepspeed_pool  # its DeepSpeed test runs on shared ranks: conftest.py

V, H, T, TEMP = 13, 8, 5, 0.1
# per rank: local sizes of the 2 micro-batches -> global sizes 5 and 3
SIZES = {0: [3, 1], 1: [2, 2]}


def _Encoder():
    return TokenEncoder(V, H)


def _data():
    """Global micro-batches (rank order): token ids and masks of queries and documents."""
    g = torch.Generator().manual_seed(7)
    out = []
    for m in range(2):
        n = sum(SIZES[r][m] for r in SIZES)
        q = torch.randint(0, V, (n, T), generator=g)
        d = torch.randint(0, V, (n, T), generator=g)
        qm = (torch.rand(n, T, generator=g) > 0.3).long()
        qm[:, 0] = 1
        dm = torch.ones(n, T, dtype=torch.long)
        dm[:, -2:] = (torch.rand(n, 2, generator=g) > 0.5).long()
        out.append((q, qm, d, dm))
    return out


def _initial_state():
    torch.manual_seed(0)
    return {k: v.clone() for k, v in _Encoder().state_dict().items()}


def _reference_grads(weighted: bool):
    """float64 single-process gradient of sum_m c_m * L_m (c_m = n_m/N or 1/G)."""
    enc = _Encoder().double()
    enc.load_state_dict({k: v.double() for k, v in _initial_state().items()})
    batches = _data()
    total_n = sum(b[0].shape[0] for b in batches)
    total = 0.0
    for q, qm, d, dm in batches:
        def embed(ids, mask):
            h = enc(ids, mask)
            mk = mask.double().unsqueeze(-1)
            return torch.nn.functional.normalize((h * mk).sum(1) / mk.sum(1), dim=-1)
        s = embed(q, qm) @ embed(d, dm).T / TEMP
        target = torch.arange(s.shape[0])
        loss = (torch.nn.functional.cross_entropy(s, target)
                + torch.nn.functional.cross_entropy(s.T, target)) / 2
        c = q.shape[0] / total_n if weighted else 1.0 / len(batches)
        total = total + c * loss
    total.backward()
    return {n: p.grad.clone() for n, p in enc.named_parameters()}, float(total.detach())


def _ds_worker(rank, world, stages):
    import deepspeed
    import torch.distributed as dist

    from megaloss.integrations.deepspeed.compat import skip_cpu_shm_comm_build
    from megaloss.integrations.hf.embedding import EmbeddingModelWithMNR, step_loss_weights

    skip_cpu_shm_comm_build()  # no JIT build of DeepSpeed's optional CPU shm all-reduce
    group = dist.group.WORLD
    batches = _data()
    results = {}
    runs = [(stage, True) for stage in stages] + [(stages[0], False)]
    for stage, weighted in runs:
        enc = _Encoder()
        enc.load_state_dict(_initial_state())
        model = EmbeddingModelWithMNR(enc, temperature=TEMP, symmetric=True, group=group)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                  "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9,
                  "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
        engine, *_ = deepspeed.initialize(model=model, config=config,
                                          optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        before = {n: deepspeed.utils.safe_get_full_fp32_param(p).clone()
                  for n, p in engine.module.encoder.named_parameters()}
        weights = step_loss_weights(SIZES[rank], group) if weighted else torch.ones(2)
        logged = 0.0
        for m, (q, qm, d, dm) in enumerate(batches):
            lo = sum(SIZES[r][m] for r in range(rank))
            sl = slice(lo, lo + SIZES[rank][m])
            out = engine(q[sl], qm[sl], d[sl], dm[sl], loss_weight=weights[m])
            engine.backward(out.loss)
            engine.step()
            logged += float(weights[m] * out.value) / 2
        grads = {n: (before[n] - deepspeed.utils.safe_get_full_fp32_param(p)).double()
                 for n, p in engine.module.encoder.named_parameters()}
        results[(stage, weighted)] = (grads, logged, weights.tolist())
        if hasattr(engine, "destroy"):
            engine.destroy()
    for cached in (False, True):
        results[("run_step", cached)] = _run_step_case(rank, batches, group, cached)
    return results


def _run_step_case(rank, batches, group, cached):
    """The same step through megaloss's one calibrated step (``run_step`` with the MNR family)
    on ``initialize``'s engine (ZeRO-2), plainly or with GradCache (mini-batches of 1 row)."""
    import deepspeed

    from megaloss import Topology
    from megaloss.integrations.deepspeed import initialize
    from megaloss.integrations.grad_cache import inner_replay_backward
    from megaloss.integrations.hf.embedding import EmbeddingModelWithMNR, cached_mnr_forward
    from megaloss.integrations.step import run_step
    from megaloss.integrations.step.mnr import MNRStepLoss

    enc = _Encoder()
    enc.load_state_dict(_initial_state())
    model = EmbeddingModelWithMNR(enc, temperature=TEMP, symmetric=True, group=group)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 9,
              "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
    me = initialize(model, config, topology=Topology.build(1),
                    optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    before = {n: deepspeed.utils.safe_get_full_fp32_param(p).clone()
              for n, p in me.engine.module.encoder.named_parameters()}
    micro_batches = []
    for m, (q, qm, d, dm) in enumerate(batches):
        lo = sum(SIZES[r][m] for r in range(rank))
        sl = slice(lo, lo + SIZES[rank][m])
        micro_batches.append({"query_input_ids": q[sl], "query_attention_mask": qm[sl],
                              "document_input_ids": d[sl], "document_attention_mask": dm[sl]})
    def grad_cache(mb, w):
        return cached_mnr_forward(me.engine, mb, mini_batch_size=1,
                                  backward=inner_replay_backward(me.engine), loss_weight=w)

    loss = MNRStepLoss(cached=grad_cache if cached else None)
    out = run_step(me, loss, micro_batches, log=False)
    grads = {n: (before[n] - deepspeed.utils.safe_get_full_fp32_param(p)).double()
             for n, p in me.engine.module.encoder.named_parameters()}
    me.engine.destroy()
    return grads, out.loss, out.metrics, out.num_tokens


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(300)
def test_deepspeed_gas_uneven_matches_single_process():
    results = run_distributed(_ds_worker, 2, (2, 3), timeout=280)
    ref, ref_loss = _reference_grads(weighted=True)
    ref_unweighted, _ = _reference_grads(weighted=False)
    for rank, res in enumerate(results):
        for stage in (2, 3):
            grads, logged, weights = res[(stage, True)]
            assert weights == pytest.approx([2 * 5 / 8, 2 * 3 / 8])
            assert logged == pytest.approx(ref_loss, rel=1e-5)  # the step's global query mean
            for name, g in ref.items():
                torch.testing.assert_close(grads[name], g, rtol=2e-4, atol=2e-6,
                                           msg=f"rank {rank} ZeRO-{stage} {name}")
        # Without the compensation DeepSpeed gives the mean of micro-batch means: it equals the
        # unweighted reference and differs clearly from the query-weighted one.
        plain, _, _ = res[(2, False)]
        for name, g in ref_unweighted.items():
            torch.testing.assert_close(plain[name], g, rtol=2e-4, atol=2e-6)
        diff = max(float((plain[n] - ref[n]).abs().max() / ref[n].abs().max()) for n in ref)
        assert diff > 1e-2
        # the one calibrated step with the MNR family, plain and with GradCache: the same
        for cached in (False, True):
            grads, loss, metrics, queries = res[("run_step", cached)]
            assert queries == 8
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert metrics["mnr_loss"] == pytest.approx(ref_loss, rel=1e-5)
            for name, g in ref.items():
                torch.testing.assert_close(grads[name], g, rtol=2e-4, atol=2e-6,
                                           msg=f"rank {rank} run_step cached={cached} {name}")


# single-process checks of the wrapper's pieces (no engine, no processes) ---------------------
def test_mean_pool_and_errors():
    from megaloss.integrations.hf.embedding import mean_pool

    h = torch.arange(24, dtype=torch.float64).reshape(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    out = mean_pool(h, mask)
    torch.testing.assert_close(out[0], h[0, :2].mean(0))
    assert torch.equal(out[1], torch.zeros(4, dtype=torch.float64))  # all padding: zeros, no NaN
    with pytest.raises(ValueError, match="attention_mask"):
        mean_pool(h, mask[:, :2])


def test_wrapper_single_process_matches_reference_and_validates():
    from megaloss.integrations.hf.embedding import EmbeddingModelWithMNR

    enc = _Encoder().double()
    enc.load_state_dict({k: v.double() for k, v in _initial_state().items()})
    model = EmbeddingModelWithMNR(enc, temperature=TEMP, symmetric=True, group=None)
    total_n = sum(b[0].shape[0] for b in _data())
    for q, qm, d, dm in _data():
        out = model(q, qm, d, dm, loss_weight=torch.tensor(q.shape[0] / total_n))
        out.loss.backward()
        assert out.value.requires_grad is False and 0 <= float(out.accuracy) <= 1
    ref, _ = _reference_grads(weighted=True)
    for name, p in model.encoder.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-10, atol=1e-12)
    assert "temperature=0.1" in repr(model)
    with pytest.raises(TypeError, match="encoder"):
        EmbeddingModelWithMNR(lambda x: x)
    with pytest.raises(ValueError, match="temperature"):
        EmbeddingModelWithMNR(enc, temperature=0.0)
    with pytest.raises(ValueError, match="similarity"):
        EmbeddingModelWithMNR(enc, similarity="l2")


def test_step_loss_weights_single_process():
    from megaloss.integrations.hf.embedding import step_loss_weights

    torch.testing.assert_close(step_loss_weights([3, 1], None), torch.tensor([1.5, 0.5]))
    torch.testing.assert_close(step_loss_weights([2, 2, 2], None), torch.ones(3))
    torch.testing.assert_close(step_loss_weights([3, 1], None, loss_multiplier=1.0),
                               torch.tensor([0.75, 0.25]))
    assert torch.equal(step_loss_weights([0, 0], None), torch.zeros(2))
    with pytest.raises(ValueError, match="local_sizes"):
        step_loss_weights([], None)
    with pytest.raises(ValueError, match="loss_multiplier"):
        step_loss_weights([1], None, loss_multiplier=0.0)
