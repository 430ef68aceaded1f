"""Sequence parallelism (DeepSpeed-Ulysses attention over the Topology's ``sp`` group) with global
calibration, against single-process float64: SP=2 (2 processes) and DP=2 x SP=2 (4 processes),
ZeRO 1-3, GAS 1-2, all three ``loss_reduction`` s, a sequence length that is no multiple of SP
(padded to it), and one micro-batch of packed samples that cross the SP split; plus SP=2 x TP=2
(4 processes, vocab-parallel lm_head, ZeRO-2, GAS 2).

Every rank gets the *full* labels of its DP rank's micro-batches (the calibration counts each
sample whole) and feeds its SP slice of the tokens through a tiny Llama whose attention is
DeepSpeed's ``UlyssesSPAttentionHF``; the loss is megaloss's chunked CE on the slice. The
reference runs the same Llama on one process in float64 over the whole global batch with the
same per-token weights (XTuner's definitions over whole samples). fp32 model: every parameter's
gradient within 1e-4 relative (Frobenius) of the reference, the logged loss within 1e-5.
"""
import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.deepspeed_pool]  # shared ranks: see conftest.py

VOCAB, HIDDEN, SEQ, MICRO = 29, 16, 7, 2      # SEQ odd: SP=2 pads every row by one token
REDUCTIONS = ("token", "sample", "square")
# (world, sp, tp) -> (ZeRO stage, GAS) covering set
LAYOUTS = {(2, 2, 1): [(1, 1), (2, 2), (3, 2)], (4, 2, 1): [(1, 2), (2, 1), (3, 2)],
           (4, 2, 2): [(2, 2)]}


def _config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=16, tie_word_embeddings=False,
                       attn_implementation="sdpa")


def _model(dtype):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).to(dtype)


def _batches(dp, gas):
    """[dp][gas] micro-batches of full-length input_ids, shift_labels, position_ids and the
    packed-sample boundaries (cu_seqlens: the calibration's view; attention stays causal over
    the whole row, as in the reference)."""
    from megaloss import causal_shift
    g = torch.Generator().manual_seed(100 * dp + gas)
    out = []
    for d in range(dp):
        row = []
        for i in range(gas):
            ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
            labels = causal_shift(ids).masked_fill(torch.rand(MICRO, SEQ, generator=g) < 0.25,
                                                   -100)
            pos = torch.arange(SEQ).repeat(MICRO, 1)
            # packed: in row 0 a second sample starts at token 3, across the SP split (4 | 3)
            cu = torch.tensor([0, 3, SEQ, 2 * SEQ]) if d == 0 and i == 0 else None
            row.append({"input_ids": ids, "shift_labels": labels, "position_ids": pos,
                        "cu_seqlens": cu})
        out.append(row)
    return out


def _reference(dp, gas, reduction):
    """float64, one process: sum over the global batch of w_t * l_t, and its gradients."""
    import torch.nn.functional as F

    from megaloss import LossCalibrator
    model = _model(torch.float64)
    mbs = [mb for row in _batches(dp, gas) for mb in row]
    step = LossCalibrator(loss_reduction=reduction, weight_dtype=torch.float64).begin_step(
        [mb["shift_labels"] for mb in mbs], cu_seqlens=[mb["cu_seqlens"] for mb in mbs])
    total = 0.0
    for i, mb in enumerate(mbs):
        # plain causal attention over the row (as Ulysses + sdpa does); position_ids only
        # mark the packed samples for the weights
        logits = model(input_ids=mb["input_ids"]).logits
        per = F.cross_entropy(logits.reshape(-1, VOCAB), mb["shift_labels"].reshape(-1),
                              reduction="none", ignore_index=-100)
        total = total + (per * step.weights(i).reshape(-1)).sum()
    total.backward()
    return float(total.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _run(rank, world, sp, tp, layouts):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from megaloss import CausalLMWithLoss, CrossEntropyOptions, LossCalibrator, Topology
    from megaloss.calibration.weights import split_for_sequence_parallel
    from megaloss.integrations.deepspeed import probe_deepspeed
    from megaloss.integrations.deepspeed.compat import skip_cpu_shm_comm_build
    from megaloss.integrations.deepspeed.mpu import DeepSpeedMPU
    from megaloss.integrations.hf.ulysses import enable_ulysses_attention

    skip_cpu_shm_comm_build()
    deepspeed.init_distributed()
    topo = Topology.build(tp, sequence_parallel_size=sp)
    assert (topo.sp_size, topo.tp_size, topo.dp_sp_size) == (sp, tp, world // tp)
    mpu = DeepSpeedMPU(topo)
    out = {}
    for stage, gas in layouts:
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
               "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
               "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
        scale = probe_deepspeed(cfg, mpu=mpu)
        model = CausalLMWithLoss(_model(torch.float32), tp_group=topo.tp_group,
                                 options=CrossEntropyOptions(reduction="sum", chunk_size=5))
        restore = enable_ulysses_attention(model.model, topo, micro_batch_size=MICRO)
        engine, *_ = deepspeed.initialize(model=model, config=cfg, mpu=mpu,
                                          optimizer=torch.optim.SGD(model.parameters(), lr=0.0))
        mbs = _batches(topo.dp_size, gas)[topo.dp_rank]
        for reduction in REDUCTIONS:
            calib = LossCalibrator(topo, loss_reduction=reduction, engine_scale=scale)
            step = calib.begin_step([mb["shift_labels"] for mb in mbs],
                                    cu_seqlens=[mb["cu_seqlens"] for mb in mbs])
            grads = {}
            for i, mb in enumerate(mbs):
                ids, pos = (split_for_sequence_parallel(mb[k], topo.sp_rank, sp, 0)
                            for k in ("input_ids", "position_ids"))
                res = engine(ids, shift_labels=step.local_labels(i), position_ids=pos,
                             loss_weights=step.weights(i))
                engine.backward(step.loss_for_backward(res.loss))
                if i == gas - 1:
                    grads = {n.removeprefix("model."): _full(safe_get_full_grad(p), p, topo)
                             for n, p in engine.module.named_parameters()}
                engine.step()
            out[(stage, gas, reduction)] = (float(step.global_loss()), grads,
                                            scale.loss_multiplier)
        engine.destroy()
        restore()
    return out


def _full(grad, param, topo):
    """The whole parameter's gradient: vocab shards gathered over TP, padding rows dropped."""
    import torch.distributed as dist
    grad = grad.double().clone()
    if getattr(param, "tensor_model_parallel", False) and topo.tp_size > 1:
        parts = [torch.empty_like(grad) for _ in range(topo.tp_size)]
        dist.all_gather(parts, grad, group=topo.tp_group)
        grad = torch.cat(parts)[:VOCAB]
    return grad


def _check(results, world, sp, tp):
    dp = world // (sp * tp)
    failures = []
    for stage, gas in LAYOUTS[(world, sp, tp)]:
        for reduction in REDUCTIONS:
            ref_loss, ref_grads = _reference(dp, gas, reduction)
            for rank, res in enumerate(results):
                loss, grads, mult = res[(stage, gas, reduction)]
                where = f"rank {rank} dp={dp} sp={sp} tp={tp} zero{stage} gas={gas} {reduction}"
                if abs(loss - ref_loss) > 1e-5 * abs(ref_loss):
                    failures.append(f"{where}: loss {loss} != {ref_loss} (multiplier {mult})")
                for name, ref in ref_grads.items():
                    rel = float((grads[name] - ref).norm() / ref.norm().clamp_min(1e-30))
                    if rel > 1e-4:
                        failures.append(f"{where}: {name} relative error {rel:.2e}")
    assert not failures, "\n".join(failures[:20])


def _run_each(rank, world, meshes):
    """Every ``(sp, tp)`` of ``meshes`` on the same ranks, one after the other (one spawn and
    one set of imports for all the layouts of a world size)."""
    return {(sp, tp): _run(rank, world, sp, tp, LAYOUTS[(world, sp, tp)]) for sp, tp in meshes}


@pytest.fixture(scope="module")
def world4_results():
    """DP=2 x SP=2 and SP=2 x TP=2 in one 4-process spawn: ``{(sp, tp): per-rank results}``."""
    meshes = [(sp, tp) for world, sp, tp in LAYOUTS if world == 4]
    per_rank = run_distributed(_run_each, 4, meshes, timeout=600)
    return {mesh: [r[mesh] for r in per_rank] for mesh in meshes}


@pytest.mark.timeout(420)
def test_ulysses_sp2_matches_single_device():
    results = run_distributed(_run, 2, 2, 1, LAYOUTS[(2, 2, 1)], timeout=400)
    _check(results, 2, 2, 1)


@pytest.mark.timeout(660)
@pytest.mark.parametrize("sp, tp", [(2, 1), (2, 2)], ids=["dp2xsp2", "sp2xtp2"])
def test_ulysses_world4_matches_single_device(world4_results, sp, tp):
    _check(world4_results[(sp, tp)], 4, sp, tp)
