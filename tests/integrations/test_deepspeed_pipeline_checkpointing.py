"""Activation checkpointing under DeepSpeed's pipeline engine
(``initialize_pipeline(..., activation_checkpoint_interval=k)``) with the Llama stages of
megaloss.integrations.deepspeed.pipeline_llama: the first stage's input is the token ids.

DP1 x PP2 on 2 processes, ZeRO-0, GAS 2, 2 SGD steps from one initial state on the same
batches, each case against the same layout without checkpointing (the engine's own
non-checkpointed run is the reference; its exactness against single-process float64 training
is tests/integrations/test_deepspeed_pipeline.py):

- untied, interval 1: the embedding is a checkpointed block of its own;
- tied, interval 2: the first block is the tied embedding's ``forward_fn`` and decoder layer 0;
- untied, interval 1 with ``pipeline.use_reentrant: true`` asked for explicitly: refused on
  every rank with a ValueError naming the key.

With DeepSpeed's default reentrant checkpoint the first two fail in ``train_batch()`` ("element 0
of tensors does not require grad"). Tolerance: each step's loss within 1e-6 relative, and every
parameter's update over the two steps (``-lr x`` the summed gradients) within 1e-5 relative
(Frobenius norm) of the run without checkpointing: recomputation repeats the same fp32 kernels.

Single-process: how the ds_config's ``pipeline`` section is completed (``use_reentrant`` false
by default when checkpointing) and the interval's check.
"""
import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = pytest.mark.deepspeed_pool  # shared ranks: see conftest.py

VOCAB, HIDDEN, SEQ, LAYERS = 37, 16, 12, 2
STEPS, ROWS, GAS, LR = 2, 4, 2, 0.5
CASES = [(False, 1), (True, 2)]  # (tied, checkpoint interval)
LOSS_TOL, UPDATE_TOL = 1e-6, 1e-5


def _config(tied):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                       num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=SEQ, tie_word_embeddings=tied)


def _state(tied):
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return {k: v.clone() for k, v in LlamaForCausalLM(_config(tied)).state_dict().items()}


def _train(tied, interval, state, ids, pipeline=None):
    """Per-step losses, the parameters before and after ``len(ids)`` steps (names of the
    PipelineModule)."""
    from megaloss.integrations.deepspeed.pipeline import (
        build_pipeline_layout,
        initialize_pipeline,
        pipeline_train_step,
    )
    from megaloss.integrations.deepspeed.pipeline_llama import llama_pipeline_layers

    layout = build_pipeline_layout(2, 1)
    ds_config = {"train_micro_batch_size_per_gpu": ROWS // GAS, "gradient_accumulation_steps": GAS,
                 "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
                 "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
                 "megaloss": {"pipeline_parallel_size": 2}}
    if pipeline is not None:
        ds_config["pipeline"] = dict(pipeline)
    layers = llama_pipeline_layers(_config(tied), state_dict=state)
    me = initialize_pipeline(layers, ds_config, layout=layout,
                             optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                             activation_checkpoint_interval=interval)
    try:
        initial = {n: p.detach().clone() for n, p in me.engine.module.named_parameters()}
        losses = []
        for s in range(len(ids)):
            mbs = [{"input_ids": x, "labels": x} for x in ids[s].split(ROWS // GAS)]
            losses.append(pipeline_train_step(me, mbs, log=False).loss)
        return losses, initial, {n: p.detach().clone()
                                 for n, p in me.engine.module.named_parameters()}
    finally:
        me.engine.destroy()


def _worker(rank, world):
    ids = torch.randint(0, VOCAB, (STEPS, ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    out = {}
    for tied, interval in CASES:
        state = _state(tied)
        out[tied, interval] = (_train(tied, 0, state, ids), _train(tied, interval, state, ids))
    try:
        _train(False, 1, _state(False), ids[:0], pipeline={"use_reentrant": True})
        out["reentrant"] = None
    except ValueError as e:
        out["reentrant"] = str(e)
    return out


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(400)
def test_activation_checkpointing_matches_the_run_without():
    results = run_distributed(_worker, 2, timeout=380)
    failures = []
    for rank, out in enumerate(results):
        for tied, interval in CASES:
            where = f"rank {rank}, {'tied' if tied else 'untied'}, interval {interval}"
            (ref_losses, initial, ref_params), (losses, start, params) = out[tied, interval]
            for s, (a, b) in enumerate(zip(losses, ref_losses)):
                if abs(a - b) > LOSS_TOL * abs(b):
                    failures.append(f"{where}: step {s} loss {a} != {b}")
            assert params.keys() == ref_params.keys() == initial.keys()
            for name, p in params.items():
                assert torch.equal(start[name], initial[name]), f"{where}: {name} initial"
                ref_update = ref_params[name] - initial[name]
                assert ref_update.norm() > 0, f"{where}: {name} did not train"
                err = _rel(p - initial[name], ref_update)
                if err > UPDATE_TOL:
                    failures.append(f"{where}: {name} update off by {err:.2e}")
        message = out["reentrant"]
        if message is None or "pipeline.use_reentrant" not in message:
            failures.append(f"rank {rank}: use_reentrant=true not refused ({message!r})")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("pipe,interval,want_interval,want_reentrant", [
    ({}, 0, 0, None),  # no checkpointing: DeepSpeed's default left alone
    ({}, 1, 1, False),
    ({"use_reentrant": True}, 2, 2, True),  # asked for: kept (refused later if it cannot work)
    ({"activation_checkpoint_interval": 3}, 1, 3, False),  # the config's wins, as in DeepSpeed
])
def test_checkpointing_defaults_to_non_reentrant(pipe, interval, want_interval, want_reentrant):
    from megaloss.integrations.deepspeed.pipeline import _checkpointing_config
    pipe = dict(pipe)
    assert _checkpointing_config(pipe, interval) == want_interval
    assert pipe.get("use_reentrant") is want_reentrant


@pytest.mark.parametrize("interval", [-1, 1.0, True])
def test_checkpointing_interval_must_be_a_non_negative_int(interval):
    from megaloss.integrations.deepspeed.pipeline import _checkpointing_config
    with pytest.raises(ValueError, match="activation_checkpoint_interval"):
        _checkpointing_config({}, interval)
