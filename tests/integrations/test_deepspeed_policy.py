"""The policy-gradient and DPO losses through the DeepSpeed engine against single-process float64
training on the global batch: every ``loss_type`` x DP {1, 2} x GAS {1, 2} x ZeRO {0, 2, 3}, and
TP = 2 (vocab-parallel ``linear_log_probs``, odd vocab so the shards are padded) x GAS {1, 2} x
ZeRO {0, 2, 3}, all in ONE spawn of 2 processes (a 1-rank layout runs as two replicas).

A tiny policy (embedding, tanh layer, lm_head) with ``megaloss.linear_log_probs`` (entropy
included) trains 10 optimizer steps (SGD, gradients clipped to global norm 1, active on some
steps), one per case: ``grpo`` (KL + entropy bonus), ``bnpo``, ``dapo`` with GSPO's sequence
ratio, ``dr_grpo`` (KL), ``cispo`` (entropy bonus), ``grpo`` on a step where one DP rank has no
completion at all, DPO sigmoid, IPO, then ``grpo`` (KL + entropy bonus) and ``dr_grpo`` with
``count_empty_rows=True`` (TRL's row count: rows without a completion token count as
sequences, here 3 of 8). Completion lengths are uneven (1 to 6 tokens, a row
without any), one micro-batch of the DP = 2 x GAS = 2 split is all padding; old / reference
log-probs are the reference's current ones plus noise, so clipping is active. The reference:
the same model in float64, full logits (``log_softmax``), one call of
:func:`megaloss.policy_loss` / :func:`megaloss.dpo_loss` on the whole global batch (those match
TRL 1.16's own ``_compute_loss`` on one batch: ``tests/losses/test_policy*.py``).

Tolerances: parameters within 1e-5 relative (Frobenius norm) after the 10 fp32 steps, each
step's global loss within 1e-5 relative (+1e-7 absolute), the metrics within 1e-5 absolute.
A per-rank or per-micro-batch normaliser, a wrong GAS / DP factor or a TP shard counted twice
fails them (the uneven lengths make every such error visible).
"""
import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.deepspeed_pool]  # shared ranks: see conftest.py

VOCAB, HIDDEN, SEQ, ROWS = 13, 8, 9, 8
LR, CLIP = 0.5, 1.0
WORLD = 2
REL_TOL, METRIC_TOL = 1e-5, 1e-5
LAYOUTS = ([(dp, 1, gas, z) for dp in (1, 2) for gas in (1, 2) for z in (0, 2, 3)]
           + [(1, 2, gas, z) for gas in (1, 2) for z in (0, 2, 3)])  # (dp, tp, gas, ZeRO)


def _cases():
    from megaloss import DPOOptions, PolicyLossOptions
    P = PolicyLossOptions
    return [P(loss_type="grpo", beta=0.05, entropy_coef=0.01),
            P(loss_type="bnpo", epsilon_high=0.28),
            P(loss_type="dapo", importance_sampling_level="sequence", epsilon_low=0.05,
              epsilon_high=0.05),
            P(loss_type="dr_grpo", max_completion_length=SEQ, beta=0.02),
            P(loss_type="cispo", epsilon_high=1.05, entropy_coef=0.02),
            P(loss_type="grpo", epsilon_high=0.28),  # a DP rank without completions
            DPOOptions(loss_type="sigmoid", beta=0.2),
            DPOOptions(loss_type="ipo", beta=0.5),
            # TRL's row count: fully masked rows (an empty micro-batch among them) count too
            P(loss_type="grpo", beta=0.05, entropy_coef=0.01, count_empty_rows=True),
            P(loss_type="dr_grpo", max_completion_length=SEQ, count_empty_rows=True)]


NO_COMPLETIONS_STEP = 5  # rows of DP rank 1 of the DP = 2 layouts have no completion token
COUNT_EMPTY_STEPS = (8, 9)  # count_empty_rows=True


class _Policy(torch.nn.Module):
    def __init__(self, state, tp=1, tp_rank=0, tp_group=None):
        from megaloss.losses.vocab_parallel import vocab_shard_range
        from megaloss.parallel import mark_tensor_parallel
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.embed.weight.data.copy_(state["embed"])
        self.proj.weight.data.copy_(state["proj_w"])
        self.proj.bias.data.copy_(state["proj_b"])
        start, stop, rows = vocab_shard_range(VOCAB, tp, tp_rank)
        shard = torch.zeros(rows, HIDDEN, dtype=state["lm_head"].dtype)
        shard[:stop - start] = state["lm_head"][start:stop]
        self.lm_head = torch.nn.Parameter(shard)
        self.tp, self.tp_group = tp, tp_group
        if tp > 1:
            mark_tensor_parallel(self.lm_head)

    def hidden(self, input_ids):
        return torch.tanh(self.proj(self.embed(input_ids)))

    def forward(self, input_ids, shift_labels):
        from megaloss import VocabParallelOptions, linear_log_probs
        vp = VocabParallelOptions(self.tp_group, vocab_size=VOCAB) if self.tp > 1 else None
        return linear_log_probs(self.hidden(input_ids), self.lm_head, shift_labels,
                                return_entropy=True, chunk_size=5, vocab_parallel_options=vp)


def _initial_state():
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(VOCAB, HIDDEN, generator=g),
            "proj_w": torch.randn(HIDDEN, HIDDEN, generator=g) * 0.5,
            "proj_b": torch.randn(HIDDEN, generator=g) * 0.1,
            "lm_head": torch.randn(VOCAB, HIDDEN, generator=g)}


def _data():
    """Per step: input ids [ROWS, SEQ] and a completion mask aligned with the shifted targets."""
    g = torch.Generator().manual_seed(1)
    steps = []
    for s in range(len(_cases())):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        prompt = torch.randint(1, 3, (ROWS,), generator=g)
        length = torch.randint(1, 7, (ROWS,), generator=g)
        t = torch.arange(SEQ)[None]
        mask = ((t >= prompt[:, None] - 1) & (t < prompt[:, None] - 1 + length[:, None]))
        mask[:, -1] = False  # the last position has no next token
        # a row without completion (for DPO a rejected row: a pair counts by its chosen one)
        mask[(3 * s) % ROWS if s < NO_COMPLETIONS_STEP + 1 else ROWS // 2 + s % 4] = False
        if s == 1 or s in COUNT_EMPTY_STEPS:
            mask[2:4] = False  # micro-batch 0 of DP rank 1 (DP = 2, GAS = 2): all padding
        if s == NO_COMPLETIONS_STEP:
            mask[2:4] = mask[6:8] = False  # DP rank 1 of DP = 2 holds rows 2, 3, 6, 7
        adv = torch.randn(ROWS, generator=g, dtype=torch.float64)
        noise = torch.randn(2, ROWS, SEQ, generator=g, dtype=torch.float64)
        steps.append((ids, mask.long(), adv, noise))
    return steps


def _full_log_probs(model, ids, mask):
    from megaloss import causal_shift
    logits = torch.nn.functional.linear(model.hidden(ids), model.lm_head)
    logp = torch.log_softmax(logits, -1)
    target = causal_shift(ids, 0).clamp(min=0)
    lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros((), dtype=lp.dtype)
    return torch.where(mask != 0, lp, zero), torch.where(mask != 0, ent, zero)


def _reference(state, data):
    """float64 single-process training; returns params, per-step losses / metrics and the
    per-step old and reference log-probs the engines use."""
    from megaloss import (
        SINGLE_RANK,
        PolicyLossOptions,
        dpo_loss,
        dpo_metrics,
        policy_loss,
        policy_metrics,
        sequence_log_probs,
    )
    model = _Policy({k: v.double() for k, v in state.items()}).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, metrics, side, norms = [], [], [], []
    half = ROWS // 2  # DPO: rows 0..3 chosen, 4..7 rejected (pair p is rows p and p + 4)
    for opts, (ids, mask, adv, noise) in zip(_cases(), data):
        opt.zero_grad()
        lp, ent = _full_log_probs(model, ids, mask)
        if isinstance(opts, PolicyLossOptions):
            old = lp.detach() + 0.15 * noise[0]
            ref = lp.detach() + 0.1 * noise[1]
            out = policy_loss(lp, old, adv, mask, ref_log_probs=ref, entropy=ent, options=opts,
                              return_stats=True)
            m = policy_metrics(out.stats, opts, group=SINGLE_RANK)
            side.append((old.float(), ref.float()))
        else:
            seq = sequence_log_probs(lp, mask)
            ref = (seq.detach() + noise[0, :, 0])
            n = mask.sum(-1)
            out = dpo_loss(seq[:half], seq[half:], ref[:half], ref[half:],
                           chosen_lengths=n[:half], rejected_lengths=n[half:], options=opts,
                           return_stats=True)
            m = dpo_metrics(out.stats, group=SINGLE_RANK)
            side.append((ref[:half].float(), ref[half:].float()))
        out.loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        losses.append(float(out.loss.detach()))
        metrics.append(m)
        opt.step()
    assert any(n > CLIP for n in norms) and any(n < CLIP for n in norms), norms
    return {k: v.detach() for k, v in model.named_parameters()}, losses, metrics, side


def _topology(dp, tp):
    from torch.distributed.device_mesh import init_device_mesh

    from megaloss import Topology
    mesh = init_device_mesh("cpu", (WORLD // (dp * tp), dp, tp),
                            mesh_dim_names=("replica", "dp", "tp"))
    return Topology(dp_group=mesh["dp"].get_group(), tp_group=mesh["tp"].get_group(), mesh=mesh)


def _train(layout, state, data, side):
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    from megaloss import PolicyLossOptions
    from megaloss.integrations.deepspeed import dpo_train_step, initialize, policy_train_step
    dp, tp, gas, stage = layout
    topo = _topology(dp, tp)
    d = topo.dp_rank
    micro = ROWS // (gas * dp)
    ds_config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
                 "gradient_clipping": CLIP, "steps_per_print": 10**9,
                 "zero_allow_untested_optimizer": True,
                 "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                 "megaloss": {"tensor_parallel_size": tp}}
    model = _Policy(state, tp, topo.tp_rank, topo.tp_group)
    me = initialize(model, ds_config, topology=topo,
                    optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    losses, metrics = [], []
    half, pairs = ROWS // 2, ROWS // 2 // (gas * dp)
    for s, (opts, (ids, mask, adv, _)) in enumerate(zip(_cases(), data)):
        if isinstance(opts, PolicyLossOptions):
            old, ref = side[s]
            piece = [slice(j * micro, (j + 1) * micro) for j in range(gas * dp)]
            mbs = [{"input_ids": ids[r], "completion_mask": mask[r], "advantages": adv[r].float(),
                    "old_log_probs": old[r], "ref_log_probs": ref[r]}
                   for r in (piece[i * dp + d] for i in range(gas))]
            m = policy_train_step(me, mbs, options=opts, log=False)
        else:  # pairs j*pairs .. (j+1)*pairs: their chosen rows, then their rejected rows
            ref_c, ref_r = side[s]
            mbs = []
            for i in range(gas):
                j = i * dp + d
                c = slice(j * pairs, (j + 1) * pairs)
                r = slice(half + j * pairs, half + (j + 1) * pairs)
                mbs.append({"input_ids": torch.cat([ids[c], ids[r]]),
                            "completion_mask": torch.cat([mask[c], mask[r]]),
                            "ref_chosen_log_probs": ref_c[c], "ref_rejected_log_probs": ref_r[c]})
            m = dpo_train_step(me, mbs, options=opts, log=False)
        losses.append(m.loss)
        metrics.append(m.metrics)
    params = {}
    for name, p in model.named_parameters():
        full = safe_get_full_fp32_param(p)
        full = (p.data if full is None else full).detach().clone()
        if name == "lm_head" and tp > 1:
            parts = [torch.empty_like(full) for _ in range(tp)]
            dist.all_gather(parts, full, group=topo.tp_group)
            full = torch.cat(parts)[:VOCAB]
        params[name] = full
    me.engine.destroy()
    return params, losses, metrics


def _worker(rank, world):
    state, data = _initial_state(), _data()
    reference = _reference(state, data)
    results = {layout: _train(layout, state, data, reference[3]) for layout in LAYOUTS}
    return reference[:3] if rank == 0 else None, results


@pytest.mark.timeout(480)
def test_policy_and_dpo_steps_match_single_process_training():
    results = run_distributed(_worker, WORLD, timeout=460)
    ref_params, ref_losses, ref_metrics = results[0][0]
    assert ref_metrics[0]["clip_ratio/region_mean"] > 0, "clipping must be active to bite"
    failures = []
    for rank, (_, per_layout) in enumerate(results):
        for (dp, tp, gas, stage), (params, losses, metrics) in per_layout.items():
            where = f"rank {rank}, DP={dp} x TP={tp}, GAS={gas}, ZeRO-{stage}"
            for s, (loss, ref) in enumerate(zip(losses, ref_losses)):
                if abs(loss - ref) > REL_TOL * abs(ref) + 1e-7:
                    failures.append(f"{where}: step {s} loss {loss} != {ref}")
                for name, value in ref_metrics[s].items():
                    if abs(metrics[s].get(name, float("nan")) - value) > METRIC_TOL:
                        failures.append(f"{where}: step {s} {name} {metrics[s].get(name)} "
                                        f"!= {value}")
            for name, ref in ref_params.items():
                rel = float((params[name].double() - ref).norm() / ref.norm())
                if rel > REL_TOL:
                    failures.append(f"{where}: {name} relative error {rel:.2e}")
    assert not failures, "\n".join(failures[:40])
