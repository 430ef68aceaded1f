"""``megaloss.integrations.deepspeed.initialize`` / ``train_step`` with DeepSpeed AutoTP in the
ds_config (``"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": true}``) against
single-process float64 training on the global batch.

A tiny untied ``transformers.LlamaForCausalLM`` (vocab 37: AutoTP's lm_head shards are 19 + 18
rows; one key-value head, so a head not named exactly ``lm_head`` would be split 37 + 0, see
``AutoTPCausalLMWithLoss``) is given to ``initialize`` on 2 gloo ranks (TP 2, DP 1): it wraps it
(``AutoTPCausalLMWithLoss``), measures the engine's gradient factor on a probe engine with
AutoTP's groups, builds the AutoTP engine and reads megaloss's topology from its groups. ZeRO 0
and 2, ``gradient_accumulation_steps`` 2, the calibrations ``token`` / ``sample`` / ``square``;
the micro-batches have uneven valid tokens and step 1's second one has none. A few SGD steps;
the reference: the same initial state dict in float64, full logits, per-sample weights
``u / D`` (``megaloss/calibration/weights.py``) over both micro-batches, gradients clipped to
global norm 1.5: active on steps 1 and 2 only, so a wrong gradient scale shows in step 0's
update (clipping on every step would hide it). Each step's loss and every parameter after the
steps (the shards gathered along AutoTP's split dim) within 1e-5 relative.
"""
import math

import pytest
import torch

from megaloss.testing import run_distributed
from tests.helpers.autotp import gathered, relative_error

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.deepspeed_pool]  # shared ranks: see conftest.py

VOCAB, HIDDEN, SEQ, ROWS, GAS, STEPS, LR, CLIP = 37, 16, 8, 2, 2, 3, 0.5, 1.5
STAGES, REDUCTIONS = (0, 2), ("token", "sample", "square")
# tied input / output embeddings: AutoTP's VocabParallelEmbedding on the head's own shard
TIED = ((2, "sample"),)
REL_TOL = 1e-5


def _llama(tied=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                      max_position_embeddings=32, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # visible norm weights (HF initialises them to 1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _data():
    """``[step][micro]`` dicts of ``input_ids`` / unshifted ``labels``: uneven valid tokens per
    row and micro-batch, step 1's micro-batch 1 all ignored."""
    g = torch.Generator().manual_seed(1)
    steps = []
    for s in range(STEPS):
        mbs = []
        for m in range(GAS):
            ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
            labels = ids.clone()
            labels[0, :3 + m] = -100  # a prompt
            labels[1, SEQ - 2 - s:] = -100  # a shorter answer
            if (s, m) == (1, 1):
                labels[:] = -100
            mbs.append({"input_ids": ids, "labels": labels})
        steps.append(mbs)
    return steps


def _reference(state, steps, loss_reduction, tied=False):
    import torch.nn.functional as F

    from megaloss.integrations.hf.causal_lm import shifted_targets

    model = _llama(tied).double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for mbs in steps:
        terms, denom = [], 0.0
        for mb in mbs:
            logits = model(input_ids=mb["input_ids"], use_cache=False).logits
            y = shifted_targets(mb["input_ids"], mb["labels"], None, -100)
            for r in range(ROWS):
                n = int((y[r] != -100).sum())
                if n == 0:
                    continue
                u = {"token": 1.0, "sample": 1.0 / n, "square": n ** -0.5}[loss_reduction]
                terms.append(u * F.cross_entropy(logits[r], y[r], ignore_index=-100,
                                                 reduction="sum"))
                denom += u * n
        loss = sum(terms) / denom
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


def _train(stage, loss_reduction, state, steps, tied=False):
    from megaloss.integrations.deepspeed import autotp_lm_head, initialize, train_step

    model = _llama(tied)
    model.load_state_dict(state)
    cfg = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": GAS,
           "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage}, "gradient_clipping": CLIP,
           "tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True},
           "megaloss": {"ce": {"loss_reduction": loss_reduction}}}
    me = initialize(model, cfg, optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    head = autotp_lm_head(me.engine)
    topo = me.topology
    layout = (topo.tp_size, topo.dp_size, me.mpu, tuple(head.weight.shape),
              me.engine_scale.gradient_factor, me.engine_scale.group_size)
    losses = [train_step(me, mbs, log=False).loss for mbs in steps]
    module = me.engine.module  # the wrapper: the *ForCausalLM's children and parameter names
    params = {n: gathered(module, n, p, topo.tp_group)
              for n, p in module.named_parameters(remove_duplicate=False)}
    me.engine.destroy()
    return layout, params, losses


def _worker(rank, world):
    import deepspeed

    from megaloss.integrations.deepspeed import configure_launched_process

    configure_launched_process()
    deepspeed.init_distributed(dist_backend="gloo")
    steps = _data()
    state = {k: v.clone() for k, v in _llama().state_dict().items()}
    out = {}
    for loss_reduction in REDUCTIONS:
        reference = _reference(state, steps, loss_reduction) if rank == 0 else None
        for stage in STAGES:
            out[stage, loss_reduction] = reference, _train(stage, loss_reduction, state, steps)
    for stage, loss_reduction in TIED:
        tied_state = {k: v.clone() for k, v in _llama(tied=True).state_dict().items()}
        reference = (_reference(tied_state, steps, loss_reduction, tied=True) if rank == 0
                     else None)
        out[stage, loss_reduction, "tied"] = reference, _train(stage, loss_reduction,
                                                               tied_state, steps, tied=True)
    return out


@pytest.mark.timeout(560)
def test_initialize_and_train_step_under_autotp_match_float64_global_batch_training():
    results = run_distributed(_worker, 2, timeout=540)
    failures, worst = [], 0.0
    cases = [(st, r) for st in STAGES for r in REDUCTIONS] + [(*c, "tied") for c in TIED]
    for case in cases:
        stage, loss_reduction = case[:2]
        ref_params, ref_losses, ref_norms = results[0][case][0]
        assert ref_losses[0] != ref_losses[-1], "the steps must change the model"
        assert min(ref_norms) < CLIP < max(ref_norms), ("clip some steps", ref_norms)
        for rank in range(2):
            layout, params, losses = results[rank][case][1]
            where = f"rank {rank}, ZeRO {stage}, {loss_reduction}{', tied' * (len(case) > 2)}"
            # TP 2 x DP 1, no megaloss mpu, AutoTP's 19 + 18 rows; the probe measured
            # DeepSpeed's 1 / GAS over a DP group of 1 rank
            assert layout == (2, 1, None, ((19, 18)[rank], HIDDEN), 1 / GAS, 1), (
                where, layout)
            for s in range(STEPS):
                worst = max(worst, abs(losses[s] - ref_losses[s]) / abs(ref_losses[s]))
                if not math.isclose(losses[s], ref_losses[s], rel_tol=REL_TOL):
                    failures.append(f"{where}: step {s} loss {losses[s]} != {ref_losses[s]}")
            assert set(params) == set(ref_params), (where, sorted(params))
            for name, ref in ref_params.items():
                rel = (relative_error(params[name], ref) if params[name].shape == ref.shape
                       else float("inf"))
                worst = max(worst, rel)
                if rel > REL_TOL:
                    failures.append(f"{where}: {name} relative error {rel:.2e}")
    print(f"max relative error {worst:.2e}")
    assert not failures, "\n".join(failures)


def test_autotp_initialize_refuses_a_topology_and_a_built_optimizer():
    pytest.importorskip("deepspeed")
    from megaloss import Topology
    from megaloss.integrations.deepspeed import initialize

    cfg = {"train_micro_batch_size_per_gpu": 1,
           "tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}}
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="topology=None"):
        initialize(model, cfg, topology=Topology.build(1))
    with pytest.raises(TypeError, match="callable"):
        initialize(model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="ForCausalLM"):
        initialize(model, cfg)
