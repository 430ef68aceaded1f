"""megaloss's log-probs, entropy and distillation on the lm_head shard DeepSpeed AutoTP built, and
DeepSpeed's own AutoTP loss as a second reference for megaloss's cross-entropy.

A tiny ``LlamaForCausalLM`` (vocab 37, untied) is sharded by ``deepspeed.initialize`` with
``"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": true}`` on 2 gloo ranks
(DeepSpeed's split: 19 + 18 rows). Then, with the options
:func:`~megaloss.integrations.autotp.autotp_vocab_parallel_options` reads from that
``VocabParallelLinear``:

- float64 hidden states on the head's shard (cast to float64): ``linear_log_probs`` (log-probs
  and entropy) and ``linear_distillation_loss`` (forward and reverse KL, a teacher head split
  the same way) and their gradients w.r.t. the hidden states and the shard, against full
  float64 logits of the gathered weight (1e-12);
- the model in float32: :func:`autotp_causal_lm_loss` against the loss of the engine's own
  forward with ``labels`` (DeepSpeed's vocab-parallel cross-entropy on the ``[B, T, V / 2]``
  logits, ``deepspeed/sequence/cross_entropy.py``), loss and every parameter gradient (2e-6
  relative: both fp32).
"""
import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.deepspeed_pool]  # shared ranks: see conftest.py

VOCAB, HIDDEN, SEQ, ROWS, N = 37, 16, 8, 2, 23


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _gather_rows(x, group):
    import torch.distributed as dist

    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, x.detach().clone(), group=group)
    return torch.cat(parts, dim=0)


def _max_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1.0))


def _shard_losses(head, opts, group):
    """log-probs / entropy / KL on the head's shard vs full float64 logits: max errors."""
    import torch.nn.functional as F

    import megaloss

    g = torch.Generator().manual_seed(3)
    start, stop = head.vocab_start_index, head.vocab_end_index
    hidden = torch.randn(N, HIDDEN, generator=g, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (N,), generator=g)
    labels[::5] = -100
    teacher_full = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    teacher_hidden = torch.randn(N, HIDDEN, generator=g, dtype=torch.float64)
    coef = torch.rand(N, generator=g, dtype=torch.float64)
    w_full = _gather_rows(head.weight.detach().double(), group)
    errs = {}

    h = hidden.clone().requires_grad_()
    w = head.weight.detach().double().clone().requires_grad_()
    out = megaloss.linear_log_probs(h, w, labels, return_entropy=True, chunk_size=5,
                                    vocab_parallel_options=opts)
    valid = labels != -100
    ((out.log_probs * coef).sum() + (out.entropy * coef).sum()).backward()
    hr, wr = hidden.clone().requires_grad_(), w_full.clone().requires_grad_()
    logp = F.log_softmax(hr @ wr.t(), dim=-1)
    ref_lp = logp.gather(1, labels.clamp_min(0)[:, None])[:, 0] * valid
    ref_h = -(logp.exp() * logp).sum(-1) * valid  # megaloss: 0 on ignored tokens
    ((ref_lp * coef).sum() + (ref_h * coef).sum()).backward()
    errs["log_probs"] = max(_max_err(out.log_probs * valid, ref_lp),
                            _max_err(out.entropy, ref_h))
    errs["log_probs_grads"] = max(_max_err(h.grad, hr.grad),
                                  _max_err(w.grad, wr.grad[start:stop]))

    for kind in ("forward", "reverse"):
        h = hidden.clone().requires_grad_()
        w = head.weight.detach().double().clone().requires_grad_()
        loss = megaloss.linear_distillation_loss(
            h, w, labels, teacher_hidden_states=teacher_hidden,
            teacher_weight=teacher_full[start:stop], kind=f"{kind}_kl", chunk_size=5,
            vocab_parallel_options=opts)
        loss.backward()
        hr, wr = hidden.clone().requires_grad_(), w_full.clone().requires_grad_()
        s_logp = F.log_softmax(hr @ wr.t(), dim=-1)
        t_logp = F.log_softmax(teacher_hidden @ teacher_full.t(), dim=-1)
        p, q = (t_logp, s_logp) if kind == "forward" else (s_logp, t_logp)
        ref = ((p.exp() * (p - q)).sum(-1) * valid).sum() / valid.sum()
        ref.backward()
        errs[f"kl_{kind}"] = _max_err(loss.detach(), ref.detach())
        errs[f"kl_{kind}_grads"] = max(_max_err(h.grad, hr.grad),
                                       _max_err(w.grad, wr.grad[start:stop]))
    return errs


def _worker(rank, world):
    import deepspeed

    from megaloss.integrations.autotp import (
        autotp_causal_lm_loss,
        autotp_lm_head,
        autotp_topology,
        autotp_vocab_parallel_options,
    )

    deepspeed.init_distributed(dist_backend="gloo")
    ds_config = {"train_micro_batch_size_per_gpu": ROWS, "steps_per_print": 10**9,
                 "zero_optimization": {"stage": 0},
                 "tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}}
    engine, *_ = deepspeed.initialize(model=_llama(), config=ds_config,
                                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    topo = autotp_topology(engine)
    head = autotp_lm_head(engine)
    opts = autotp_vocab_parallel_options(head, topo.tp_group)
    out = {"rows": tuple(head.weight.shape), "errs": _shard_losses(head, opts, topo.tp_group)}

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    params = [p for p in engine.module.parameters() if p.requires_grad]
    ours = autotp_causal_lm_loss(engine, ids, labels, tp_group=topo.tp_group)
    g_ours = torch.autograd.grad(ours, params)
    theirs = engine.module(input_ids=ids, labels=labels, use_cache=False).loss
    g_theirs = torch.autograd.grad(theirs, params)
    out["ce"] = _max_err(ours.detach(), theirs.detach())
    out["ce_grads"] = max(float((a - b).norm() / b.norm().clamp_min(1e-30))
                          for a, b in zip(g_ours, g_theirs))
    out["logits_shape"] = tuple(engine.module(input_ids=ids, use_cache=False).logits.shape)
    engine.destroy()
    return out


@pytest.mark.timeout(400)
def test_log_probs_distillation_and_deepspeeds_own_loss_on_the_autotp_shard():
    results = run_distributed(_worker, 2, timeout=380)
    assert [r["rows"] for r in results] == [(19, HIDDEN), (18, HIDDEN)]
    for r in results:
        # what DeepSpeed's own loss runs on: the [B, T, V / 2] logits of the shard
        assert r["logits_shape"] == (ROWS, SEQ, r["rows"][0])
        for name, err in r["errs"].items():
            assert err <= 1e-12, (name, err)
        assert r["ce"] <= 2e-6 and r["ce_grads"] <= 2e-6, r
