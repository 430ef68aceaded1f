"""DeepSpeed's pipeline engine with megaloss's loss: gradients, parameters and the logged loss
against single-process float64 training on the global batch.

A tiny Llama (2 decoder layers, odd vocab 37 so TP=2 vocab shards need padding) split into
pipeline stages (megaloss.integrations.deepspeed.pipeline_llama) trains 3 optimizer steps, one
per reduction (``token``, ``sample``, ``square``), on the same global batches (8 sequences per
step, uneven valid tokens, a micro-batch without any in step 0), under five layouts in one
spawn of 4 processes: untied, DP2 x PP2 with ZeRO-1 (GAS 2), and DP1 x PP2 x TP2 with ZeRO-1
(GAS 4) and ZeRO-0 (GAS 1); tied embeddings (the embedding on the first stage and the lm_head
on the last, one weight through DeepSpeed's ``TiedLayerSpec``; under TP one vocab shard per TP
rank), DP2 x PP2 with ZeRO-0 (GAS 4) and DP1 x PP2 x TP2 with ZeRO-1 (GAS 4). The reference is
one process, no engine, float64, the same (tied or untied) ``LlamaForCausalLM``: the calibrated
CE (+ z-loss) over each step's global batch, SGD.

DP1 x PP2 without TP needs a world of 2 (DeepSpeed's ``PipelineParallelGrid`` spans the whole
world): a second spawn of 2 processes, GAS 1 at ZeRO-0 untied and GAS 4 at ZeRO-1 tied.

Tolerance: every parameter tensor within 1e-5 relative (Frobenius norm of the difference over
that of the reference) after 3 steps of fp32 training; the step's global loss (float64 sums of
the last stage) and the loss ``train_batch()`` returns and logs (fp32 sums) within 1e-5 relative
of the reference's (measured: parameters within 1.5e-7, losses within 6e-8). A wrong GAS / DP
factor, a per-micro-batch or per-rank normaliser, or the engine's own mean as the logged loss
all fail it; so does a tied weight whose two uses' gradients are not summed (or are summed
across TP ranks).
"""
import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.deepspeed_pool]  # shared ranks: see conftest.py

VOCAB, HIDDEN, SEQ, LAYERS = 37, 16, 12, 2
STEPS, GLOBAL_ROWS = 3, 8
LR, Z_LOSS = 0.5, 1e-3
REDUCTIONS = ("token", "sample", "square")  # step s uses REDUCTIONS[s]
REL_TOL = 1e-5
# (dp, tp, ZeRO, GAS, tied); pp 2
LAYOUTS = [(2, 1, 1, 2, False), (1, 2, 1, 4, False), (1, 2, 0, 1, False), (2, 1, 0, 4, True),
           (1, 2, 1, 4, True)]
WORLD, PP = 4, 2
LAYOUTS_WORLD_2 = [(1, 1, 0, 1, False), (1, 1, 1, 4, True)]  # DP1 x PP2, no TP


def _llama_config(tied):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                       num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=SEQ, tie_word_embeddings=tied)


def _initial_state(tied):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(tied))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _data():
    """[STEPS, GLOBAL_ROWS, SEQ] input ids and shifted labels with random ignored positions;
    rows 0-1 of step 0 have none (a whole micro-batch when it holds <= 2 rows)."""
    from megaloss import causal_shift
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (STEPS, GLOBAL_ROWS, SEQ), generator=g)
    labels = causal_shift(ids)
    drop = torch.rand(labels.shape, generator=g) < torch.linspace(0.1, 0.8, GLOBAL_ROWS)[:, None]
    labels = labels.masked_fill(drop, -100)
    labels[0, :2] = -100
    return ids, labels


def _reference(tied, state, ids, labels):
    """float64 single-process training; final params and per-step losses."""
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM(_llama_config(tied))
    model.load_state_dict(state)
    model.double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        logits = model.lm_head(model.model(input_ids=ids[s]).last_hidden_state)
        y = labels[s]
        valid = y != -100
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100,
                             reduction="none").reshape(y.shape)
        per_token = ce + Z_LOSS * torch.logsumexp(logits, -1) ** 2
        n = valid.sum(-1, keepdim=True).double()  # valid tokens per sample (row)
        u = {"token": torch.ones_like(n), "sample": 1.0 / n.clamp_min(1),
             "square": n.clamp_min(1).rsqrt()}[REDUCTIONS[s]].expand_as(ce) * valid
        loss = (u * per_token).sum() / u.sum()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}, losses


def _train_layout(dp, tp, stage, gas, tied, state, ids, labels):
    import torch.distributed as dist

    from megaloss.integrations.deepspeed import load_megaloss_config
    from megaloss.integrations.deepspeed.pipeline import (
        build_pipeline_layout,
        initialize_pipeline,
        pipeline_train_step,
    )
    from megaloss.integrations.deepspeed.pipeline_llama import (
        hf_parameter_name,
        llama_pipeline_layers,
    )
    from megaloss.parallel.groups import group_ranks

    layout = build_pipeline_layout(PP, tp)
    topo = layout.topology
    assert (topo.dp_size, topo.tp_size, topo.pp_size) == (dp, tp, PP)
    micro = GLOBAL_ROWS // (gas * dp)
    ds_config = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
        "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0
        "zero_optimization": {"stage": stage},
        "megaloss": {"tensor_parallel_size": tp, "pipeline_parallel_size": PP,
                     "ce": {"chunk_size": 5, "z_loss": Z_LOSS}},
    }
    options = load_megaloss_config(ds_config).ce.options()
    layers = llama_pipeline_layers(_llama_config(tied), options=options, tp_group=topo.tp_group,
                                   state_dict=state)
    me = initialize_pipeline(layers, ds_config, layout=layout,
                             optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    losses, logged = [], []
    for s in range(STEPS):
        me.calibrator.loss_reduction = REDUCTIONS[s]
        pieces = list(zip(ids[s].split(micro), labels[s].split(micro)))
        mbs = [{"input_ids": pieces[i * dp + topo.dp_rank][0],
                "shift_labels": pieces[i * dp + topo.dp_rank][1]} for i in range(gas)]
        m = pipeline_train_step(me, mbs, log=False)
        losses.append(m.loss)
        logged.append(m.engine_loss)
    params = {}
    for name, p in me.engine.module.named_parameters():
        full = p.data.detach().clone()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(full) for _ in range(tp)]
            dist.all_gather(parts, full, group=topo.tp_group)
            full = torch.cat(parts)[:VOCAB]
        params[hf_parameter_name(name, LAYERS)] = full
    scale = (me.scale.gradient.loss_multiplier, me.scale.loss_log_multiplier)
    # the tie group: this rank's (data, model) coordinate on the first and the last stage
    tie = me.engine.module.tied_comms.get("embed_tokens", {}).get("ranks")
    if tied and tie != group_ranks(topo.pp_group):
        raise AssertionError(f"rank {dist.get_rank()}: tie group {tie}, want the pipeline "
                             f"{group_ranks(topo.pp_group)}")
    me.engine.destroy()
    return params, losses, logged, scale


def _worker(rank, world, layouts):
    states = {tied: _initial_state(tied) for tied in (False, True)}
    ids, labels = _data()
    reference = ({tied: _reference(tied, states[tied], ids, labels) for tied in (False, True)}
                 if rank == 0 else None)
    return reference, {layout: _train_layout(*layout, states[layout[-1]], ids, labels)
                       for layout in layouts}


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.timeout(420)
def test_pipeline_matches_single_process_training():
    _check(run_distributed(_worker, WORLD, LAYOUTS, timeout=400), LAYOUTS)


@pytest.mark.timeout(300)
def test_pipeline_without_tp_matches_single_process_training():
    _check(run_distributed(_worker, 2, LAYOUTS_WORLD_2, timeout=280), LAYOUTS_WORLD_2)


def _check(results, layouts):
    references = results[0][0]
    failures = []
    for layout in layouts:
        dp, tp, stage, gas, tied = layout
        ref_params, ref_losses = references[tied]
        where = (f"DP={dp} x PP={PP} x TP={tp}, ZeRO-{stage}, GAS {gas}, "
                 f"{'tied' if tied else 'untied'}")
        merged = {}
        for rank, (_, per_layout) in enumerate(results):
            params, losses, logged, scale = per_layout[layout]
            if scale != (gas * dp, gas * dp):
                failures.append(f"{where}, rank {rank}: measured multipliers {scale}")
            for s in range(STEPS):
                for what, value in (("loss", losses[s]), ("logged loss", logged[s])):
                    if abs(value - ref_losses[s]) > REL_TOL * abs(ref_losses[s]):
                        failures.append(f"{where}, rank {rank}: step {s} ({REDUCTIONS[s]}) "
                                        f"{what} {value} != {ref_losses[s]}")
            merged.update(params)
            # every rank's copy (a tied weight is on the first and the last stage)
            for name, value in params.items():
                ref = ref_params.get(name)
                rel = (float("inf") if ref is None or value.shape != ref.shape
                       else _rel(value, ref))
                if rel > REL_TOL:
                    failures.append(f"{where}, rank {rank}: {name} relative error {rel:.2e}")
        if set(merged) != set(ref_params):
            failures.append(f"{where}: parameter names {sorted(set(merged) ^ set(ref_params))}")
    assert not failures, "\n".join(failures)
