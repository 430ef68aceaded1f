"""megaloss's cross-entropy inside DeepSpeed AutoTP (``"tensor_parallel": {"autotp_size": 2,
"vocab_parallel_lm_head": true}``) against single-process float64 training.

A tiny ``transformers.LlamaForCausalLM`` (hidden 16, 2 layers, untied, vocab 37: DeepSpeed
splits the lm_head 19 + 18 rows, not megaloss's padded 19 + 19) is sharded by
``deepspeed.initialize`` on 2 gloo ranks (TP 2, DP 1), ZeRO 0, 1 and 2, plus vocab 100 with
``tp_grain_size`` 64 (64 + 36 rows), in one spawn; the loss is
:func:`megaloss.integrations.autotp.autotp_causal_lm_loss` (decoder, then
``linear_cross_entropy`` on the ``VocabParallelLinear`` shard, no logits), a few SGD steps. The
reference: the same initial state dict in float64 on one process, full logits,
``F.cross_entropy``, gradients clipped to global norm 1 (DeepSpeed's default clipping, active
on every step). Each step's loss and every parameter after the steps (the shards gathered
along AutoTP's split dim) within 1e-5 relative.
"""
import math

import pytest
import torch

from megaloss.testing import run_distributed
from tests.helpers.autotp import gathered, relative_error

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.deepspeed_pool]  # shared ranks: see conftest.py

VOCAB, HIDDEN, SEQ, ROWS, STEPS, LR, CLIP = 37, 16, 8, 2, 3, 0.5, 1.0
# (ZeRO stage, vocab, tp_grain_size, tied embeddings) -> DeepSpeed's lm_head rows per rank
CASES = {(0, VOCAB, 1, False): (19, 18), (1, VOCAB, 1, False): (19, 18),
         (2, VOCAB, 1, False): (19, 18),
         (0, 100, 64, False): (64, 36),  # whole grains, the last rank the remainder
         # tied: AutoTP makes the embedding a VocabParallelEmbedding on the head's own shard
         (0, VOCAB, 1, True): (19, 18), (2, VOCAB, 1, True): (19, 18)}
REL_TOL = 1e-5


def _llama(vocab=VOCAB, tied=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # visible head / norm weights (HF initialises norms to 1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _data(vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (STEPS, ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[:, 0, :3] = -100  # a prompt that does not count
    return ids, labels


def _reference(vocab, tied, state, ids, labels):
    import torch.nn.functional as F

    from megaloss.integrations.lm_head import shifted_targets

    model = _llama(vocab, tied).double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for s in range(STEPS):
        logits = model(input_ids=ids[s], use_cache=False).logits
        y = shifted_targets(ids[s], labels[s], None, -100)
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, norms


def _train(stage, vocab, grain, tied, state, ids, labels):
    import deepspeed

    from megaloss.integrations.autotp import (
        autotp_causal_lm_loss,
        autotp_lm_head,
        autotp_topology,
    )

    model = _llama(vocab, tied)
    model.load_state_dict(state)
    ds_config = {"train_micro_batch_size_per_gpu": ROWS, "steps_per_print": 10**9,
                 "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage},
                 "gradient_clipping": CLIP,
                 "tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True,
                                     "tp": {"tp_grain_size": grain}}}
    # a callable: AutoTP replaces the sharded layers' Parameters inside initialize, so an
    # optimizer built on model.parameters() beforehand would hold the unsharded originals
    engine, *_ = deepspeed.initialize(model=model, config=ds_config,
                                      optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    topo = autotp_topology(engine)
    head = autotp_lm_head(engine)
    layout = (topo.tp_size, topo.dp_size, tuple(head.weight.shape), head.vocab_start_index,
              head.vocab_end_index)
    losses = []
    for s in range(STEPS):
        loss = autotp_causal_lm_loss(engine, ids[s], labels[s], tp_group=topo.tp_group)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    params = {n: gathered(engine.module, n, p, topo.tp_group)
              for n, p in engine.module.named_parameters(remove_duplicate=False)}
    engine.destroy()
    return layout, params, losses


def _worker(rank, world):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for stage, vocab, grain, tied in CASES:
        ids, labels = _data(vocab)
        state = {k: v.clone() for k, v in _llama(vocab, tied).state_dict().items()}
        reference = _reference(vocab, tied, state, ids, labels) if rank == 0 else None
        out[stage, vocab, grain, tied] = reference, _train(stage, vocab, grain, tied, state, ids,
                                                           labels)
    return out


@pytest.mark.timeout(400)
def test_autotp_vocab_parallel_head_matches_single_process_float64_training():
    results = run_distributed(_worker, 2, timeout=380)
    failures, worst = [], 0.0
    for case, split in CASES.items():
        ref_params, ref_losses, ref_norms = results[0][case][0]
        assert all(n > CLIP for n in ref_norms), "clipping must be active for the test to bite"
        assert ref_losses[0] != ref_losses[-1], "the steps must change the model"
        for rank in range(2):
            layout, params, losses = results[rank][case][1]
            where = f"rank {rank}, (ZeRO, vocab, tp_grain_size, tied)={case}"
            start = sum(split[:rank])
            assert layout == (2, 1, (split[rank], HIDDEN), start, start + split[rank]), (
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


def test_a_model_without_autotp_vocab_parallel_head_is_named_with_the_key():
    from megaloss.integrations.autotp import autotp_lm_head

    model = torch.nn.Sequential(torch.nn.Linear(4, 5))
    with pytest.raises(ValueError, match=r"found 0.*\"vocab_parallel_lm_head\": true"):
        autotp_lm_head(model)
    with pytest.raises(TypeError, match="engine or an nn.Module"):
        autotp_lm_head(object())
