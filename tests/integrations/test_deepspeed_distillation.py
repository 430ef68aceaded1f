"""The distillation loss through the whole DeepSpeed path against single-process float64
training: a tiny Llama student (vocab 37, padded under TP=2) distilled from a tiny Llama teacher
(other hidden size) for one optimizer step under four layouts that cover DP {1, 2}, TP {1, 2},
GAS {1, 2} and ZeRO {0, 2, 3} (not their full product: the suite's budget), each with another
kind / teacher form (module or stored top-k) / loss_reduction, all in ONE spawn of 4 processes
(a smaller layout runs as independent replicas). Multi-step training under these layouts is
test_deepspeed_equivalence's (the same engine path with the CE).

The reference: one process, no engine, float64, the calibrated loss written out (token: global
token mean; sample: mean of per-row means; square: weights 1/sqrt(n_s) over sum_s sqrt(n_s)),
clipping by the global gradient norm, SGD. Tolerance as test_deepspeed_equivalence: every
parameter within 1e-5 relative after fp32 training, logged loss and gradient norm within 1e-5
relative; the logged divergence / CE / top-1 agreement against the reference's.
"""
import math

import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.deepspeed_pool]  # shared ranks: see conftest.py

VOCAB, HIDDEN, T_HIDDEN, SEQ, K = 37, 16, 12, 10, 6
STEPS, GLOBAL_ROWS = 1, 8
LR, CLIP = 0.5, 0.03
REL_TOL = 1e-5
WORLD = 4
# (dp, tp, gas, ZeRO stage, distillation section, top-k teacher)
LAYOUTS = [
    (2, 1, 2, 2, dict(kind="forward_kl", temperature=2.0, alpha=0.3), False),
    (1, 2, 1, 3, dict(kind="jsd", beta=0.5, temperature=2.0, alpha=0.2,
                      loss_reduction="sample"), True),
    (2, 2, 2, 3, dict(kind="reverse_kl", logit_softcapping=6.0, loss_reduction="square"), False),
    (2, 2, 1, 0, dict(kind="jsd", beta=0.3, temperature=2.0, chunk_size=7), False),
]


def _config(hidden):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=24,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=SEQ, tie_word_embeddings=False)


def _states():
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    student = LlamaForCausalLM(_config(HIDDEN))
    teacher = LlamaForCausalLM(_config(T_HIDDEN))
    with torch.no_grad():  # a teacher sharper than its random init, so the KL is not tiny
        teacher.lm_head.weight.mul_(20.0)
    return ({k: v.clone() for k, v in student.state_dict().items()},
            {k: v.clone() for k, v in teacher.state_dict().items()})


def _data():
    from megaloss import causal_shift
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (STEPS, GLOBAL_ROWS, SEQ), generator=g)
    labels = causal_shift(ids)
    labels = labels.masked_fill(torch.rand(labels.shape, generator=g) < 0.3, -100)
    labels[0, 0] = -100  # a sample without any valid token
    return ids, labels


def _teacher(state, dtype):
    from transformers import LlamaForCausalLM
    t = LlamaForCausalLM(_config(T_HIDDEN))
    t.load_state_dict(state)
    return t.to(dtype).eval()


def _topk(teacher_state, ids, temperature):
    """[STEPS, ROWS, SEQ, K] ids and log-probs at ``temperature`` of the float64 teacher."""
    from tests.helpers.distillation_reference import teacher_topk
    teacher = _teacher(teacher_state, torch.float64)
    with torch.no_grad():
        hidden = teacher.model(input_ids=ids.flatten(0, 1)).last_hidden_state
        top_ids, lp = teacher_topk(hidden, teacher.lm_head.weight, K, temperature)
    return top_ids.view(STEPS, GLOBAL_ROWS, SEQ, K), lp.view(STEPS, GLOBAL_ROWS, SEQ, K)


def _row_weights(labels, loss_reduction):
    """Calibration weights of one step's global batch, rows = samples (written out here)."""
    valid = (labels != -100).double()
    n = valid.sum(1, keepdim=True)
    if loss_reduction == "token":
        u = valid
    elif loss_reduction == "sample":
        u = valid / n.clamp_min(1)
    else:
        u = valid / n.clamp_min(1).sqrt()
    return u / u.sum()


def _reference(student_state, teacher_state, ids, labels, section, topk):
    from transformers import LlamaForCausalLM

    from tests.helpers.distillation_reference import reference_distillation
    opts = {k: v for k, v in section.items() if k not in ("loss_reduction", "chunk_size")}
    reduction = section.get("loss_reduction", "token")
    model = LlamaForCausalLM(_config(HIDDEN))
    model.load_state_dict(student_state)
    model.double()
    teacher = _teacher(teacher_state, torch.float64)
    top = _topk(teacher_state, ids, opts.get("temperature", 1.0)) if topk else None
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for s in range(STEPS):
        sgd.zero_grad()
        hidden = model.model(input_ids=ids[s]).last_hidden_state
        if topk:
            tk = dict(teacher_topk_ids=top[0][s], teacher_topk_log_probs=top[1][s])
        else:
            with torch.no_grad():
                t_hidden = teacher.model(input_ids=ids[s]).last_hidden_state
            tk = dict(teacher_hidden_states=t_hidden, teacher_weight=teacher.lm_head.weight)
        w = _row_weights(labels[s], reduction)
        loss, d, ce, matches = reference_distillation(
            hidden, model.lm_head.weight, labels[s], loss_weights=w, reduction="sum",
            parts=True, **tk, **opts)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        out.append((loss.item(), norm, float(d), float(ce),
                    int(matches) / int((labels[s] != -100).sum())))
        sgd.step()
    return {k: v.detach() for k, v in model.named_parameters()}, out


def _layout_topology(dp, tp):
    from torch.distributed.device_mesh import init_device_mesh

    from megaloss import Topology
    mesh = init_device_mesh("cpu", (WORLD // (dp * tp), dp, tp),
                            mesh_dim_names=("replica", "dp", "tp"))
    return Topology(dp_group=mesh["dp"].get_group(), tp_group=mesh["tp"].get_group(), mesh=mesh)


def _train_layout(dp, tp, gas, stage, section, topk, student_state, teacher_state, ids, labels):
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param
    from transformers import LlamaForCausalLM

    from megaloss.integrations.deepspeed import initialize, load_megaloss_config, train_step
    from megaloss.integrations.hf import CausalLMWithDistillation

    topo = _layout_topology(dp, tp)
    micro = GLOBAL_ROWS // (gas * dp)
    ds_config = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP, "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "megaloss": {"tensor_parallel_size": tp, "distillation": dict(section)},
    }
    model = LlamaForCausalLM(_config(HIDDEN))
    model.load_state_dict(student_state)
    options = load_megaloss_config(ds_config).distillation.options()
    teacher = None if topk else _teacher(teacher_state, torch.float32)
    wrapper = CausalLMWithDistillation(model, teacher, options=options, tp_group=topo.tp_group)
    me = initialize(wrapper, ds_config, topology=topo,
                    optimizer=torch.optim.SGD(wrapper.parameters(), lr=LR))
    top = _topk(teacher_state, ids, section.get("temperature", 1.0)) if topk else None
    metrics = []
    for s in range(STEPS):
        rows = torch.arange(GLOBAL_ROWS).split(micro)
        mbs = []
        for i in range(gas):
            r = rows[i * dp + topo.dp_rank]
            mb = {"input_ids": ids[s][r], "shift_labels": labels[s][r]}
            if topk:
                mb["teacher_topk_ids"] = top[0][s][r]
                mb["teacher_topk_log_probs"] = top[1][s][r].float()
            mbs.append(mb)
        m = train_step(me, mbs, log=False)
        metrics.append((m.loss, m.grad_norm, m.divergence, m.ce_loss, m.top1_agreement))
    params = {}
    for name, p in wrapper.named_parameters():
        full = safe_get_full_fp32_param(p)
        full = (p.data if full is None else full).detach().clone()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(full) for _ in range(tp)]
            dist.all_gather(parts, full, group=topo.tp_group)
            full = torch.cat(parts)[:VOCAB]
        params[name.removeprefix("model.")] = full
    me.engine.destroy()
    return params, metrics


def _worker(rank, world):
    student_state, teacher_state = _states()
    ids, labels = _data()
    out = {}
    for i, (dp, tp, gas, stage, section, topk) in enumerate(LAYOUTS):
        # each rank computes one layout's reference (they are cheap, the parent stays light)
        ref = (_reference(student_state, teacher_state, ids, labels, section, topk)
               if i % world == rank else None)
        out[i] = (ref, _train_layout(dp, tp, gas, stage, section, topk, student_state,
                                     teacher_state, ids, labels))
    return out


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.timeout(600)
def test_distillation_matches_single_process_training():
    results = run_distributed(_worker, WORLD, timeout=580)
    failures = []
    for i, layout in enumerate(LAYOUTS):
        ref_params, ref_steps = results[i % WORLD][i][0]
        assert all(norm > CLIP for _, norm, *_ in ref_steps), "clipping must be active"
        assert all(d > 1e-3 for _, _, d, _, _ in ref_steps), "a divergence worth matching"
        for rank in range(WORLD):
            params, steps = results[rank][i][1]
            where = f"rank {rank}, layout {layout[:4]} {layout[4]} top-k={layout[5]}"
            for s, (got, want) in enumerate(zip(steps, ref_steps)):
                for name, g, w in zip(("loss", "grad norm", "divergence", "ce"), got, want):
                    if g is None or abs(g - w) > REL_TOL * abs(w) + 1e-12:
                        failures.append(f"{where}: step {s} {name} {g} != {w}")
                if not math.isclose(got[4], want[4], abs_tol=1e-9):
                    failures.append(f"{where}: step {s} top-1 agreement {got[4]} != {want[4]}")
            for name, ref in ref_params.items():
                rel = _rel(params[name], ref) if params[name].shape == ref.shape else float("inf")
                if rel > REL_TOL:
                    failures.append(f"{where}: {name} relative error {rel:.2e}")
    assert not failures, "\n".join(failures)
