"""Tied input embedding and lm_head under TP = 2 through the whole DeepSpeed path, against
single-process float64 training on the global batch.

A tiny Llama with ``tie_word_embeddings=True`` (odd vocab 37, so the shards are padded) wrapped
by ``CausalLMWithLoss(tp_group=...)``: the input embedding becomes a ``VocabParallelEmbedding``
on the head's shard. Cases, all in ONE spawn of 2 processes (DP 1 x TP 2), 2 optimizer steps
of GAS 2: tied under ZeRO 0, 1, 2 and 3 with every ``loss_reduction`` (token / sample /
square), and untied with sample and square (the untied token case is
``test_deepspeed_equivalence.py``). Valid tokens are uneven across samples and one micro-batch
has none. The reference: one process, no engine, float64, XTuner's calibration written out
(``u_t = 1 | 1 / n_s | 1 / sqrt(n_s)``, divided by their sum over the step's batch), clipping by
the global norm, SGD.

Tolerance: every parameter within 1e-5 relative (Frobenius norm) after the steps, and each step's
global loss and gradient norm within 1e-5 relative (fp32 training vs float64; measured over all
cases: at most 5.4e-8 on losses, 1.2e-7 on gradient norms, 7.8e-8 on parameters). Clipping is
active, so a tied shard counted once per use or per TP rank in the gradient norm fails too.
"""
import math

import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.deepspeed_pool]  # shared ranks: see conftest.py

VOCAB, HIDDEN, SEQ = 37, 16, 10
STEPS, GAS, ROWS = 2, 2, 4
LR, CLIP, Z_LOSS = 0.5, 0.3, 1e-3
REL_TOL = 1e-5
CASES = [(True, reduction, stage) for stage in (0, 1, 2, 3)
         for reduction in ("token", "sample", "square")]
CASES += [(False, "sample", 2), (False, "square", 3)]


def _llama(tie):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=SEQ, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _data():
    from megaloss import causal_shift
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (STEPS, ROWS, SEQ), generator=g)
    labels = causal_shift(ids)
    labels = labels.masked_fill(torch.rand(labels.shape, generator=g) < 0.4, -100)
    labels[0, : ROWS // GAS] = -100  # step 0: its first micro-batch has no valid token
    return ids, labels


def _raw_weights(labels, reduction):
    valid = labels != -100
    n = valid.sum(-1, keepdim=True).double().clamp_min(1)
    u = {"token": torch.ones_like(n), "sample": 1 / n, "square": 1 / n.sqrt()}[reduction]
    return u * valid


def _reference(tie, reduction, ids, labels):
    import torch.nn.functional as F
    model = _llama(tie).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for s in range(STEPS):
        opt.zero_grad()
        logits = model.lm_head(model.model(input_ids=ids[s]).last_hidden_state)
        y = labels[s]
        per_tok = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100,
                                  reduction="none").view(y.shape)
        per_tok = per_tok + Z_LOSS * torch.logsumexp(logits, -1) ** 2
        u = _raw_weights(y, reduction)
        loss = (u * per_tok).sum() / u.sum()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        losses.append(loss.item())
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}, losses, norms


def _train(tie, reduction, stage, ids, labels):
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    from megaloss import Topology, VocabParallelEmbedding
    from megaloss.integrations.deepspeed import initialize, load_megaloss_config, train_step
    from megaloss.integrations.hf import CausalLMWithLoss

    topo = Topology.build(2)
    ds_config = {
        "train_micro_batch_size_per_gpu": ROWS // GAS, "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP, "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "megaloss": {"tensor_parallel_size": 2,
                     "ce": {"chunk_size": 5, "z_loss": Z_LOSS, "loss_reduction": reduction}},
    }
    wrapper = CausalLMWithLoss(_llama(tie), options=load_megaloss_config(ds_config).ce.options(),
                               tp_group=topo.tp_group)
    wrapper.tie_weights()  # what transformers calls after loading: must keep the shard tied
    emb = wrapper.get_input_embeddings()
    assert isinstance(emb, VocabParallelEmbedding) == tie
    assert (emb.weight is wrapper.head.weight) == tie
    me = initialize(wrapper, ds_config, topology=topo,
                    optimizer=torch.optim.SGD(wrapper.parameters(), lr=LR))
    losses, norms = [], []
    micro = ROWS // GAS
    for s in range(STEPS):
        mbs = [{"input_ids": i, "shift_labels": y}
               for i, y in zip(ids[s].split(micro), labels[s].split(micro))]
        m = train_step(me, mbs, log=False)
        losses.append(m.loss)
        norms.append(m.grad_norm)
    params = {}
    for name, p in wrapper.named_parameters():
        full = safe_get_full_fp32_param(p)  # None without a ZeRO optimizer (stage 0)
        full = (p.data if full is None else full).detach().clone()
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(full) for _ in range(2)]
            dist.all_gather(parts, full, group=topo.tp_group)
            full = torch.cat(parts)[:VOCAB]
        params[name.removeprefix("model.")] = full
    me.engine.destroy()
    return params, losses, norms


def _worker(rank, world):
    ids, labels = _data()
    out = {}
    for case in CASES:
        reference = _reference(case[0], case[1], ids, labels) if rank == 0 else None
        out[case] = (reference, _train(*case, ids, labels))
    return out


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.timeout(480)
def test_tied_embeddings_under_tp2_match_single_process_training():
    results = run_distributed(_worker, 2, timeout=450)
    failures = []
    for case in CASES:
        ref_params, ref_losses, ref_norms = results[0][case][0]
        assert all(n > CLIP for n in ref_norms), "clipping must be active for the test to bite"
        assert ("model.embed_tokens.weight" in ref_params) and (
            ("lm_head.weight" in ref_params) != case[0])
        for rank in range(2):
            params, losses, norms = results[rank][case][1]
            where = f"rank {rank}, tied={case[0]}, loss_reduction={case[1]}, ZeRO-{case[2]}"
            for s in range(STEPS):
                if not math.isclose(losses[s], ref_losses[s], rel_tol=REL_TOL):
                    failures.append(f"{where}: step {s} loss {losses[s]} != {ref_losses[s]}")
                if not math.isclose(norms[s], ref_norms[s], rel_tol=REL_TOL):
                    failures.append(f"{where}: step {s} grad norm {norms[s]} != {ref_norms[s]}")
            if set(params) != set(ref_params):
                failures.append(f"{where}: parameter names {sorted(params)}")
                continue
            for name, ref in ref_params.items():
                rel = _rel(params[name], ref) if params[name].shape == ref.shape else float("inf")
                if rel > REL_TOL:
                    failures.append(f"{where}: {name} relative error {rel:.2e}")
    assert not failures, "\n".join(failures)
