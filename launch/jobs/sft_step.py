"""The GRPO job's supervised warm-up: one calibrated optimizer step of the negative
log-likelihood of the answer tokens, on an engine whose module returns per-token log-probs
(:class:`launch.jobs.policy_model.CausalLMLogProbs`), so SFT and GRPO train the same module.

The step's calibrator (the ds_config's ``megaloss.ce.loss_reduction``, ``token`` by default)
turns the labels of every micro-batch into global weights with one all-reduce, and
``engine.backward(step.loss_for_backward(...))`` undoes the engine's measured ``1 / (GAS x
DP)``: the update is the one a single device makes on the whole global batch.
"""
from __future__ import annotations

from typing import Dict, Mapping, Sequence

import torch

__all__ = ["sft_step"]


def sft_step(me, micro_batches: Sequence[Mapping[str, torch.Tensor]]) -> Dict[str, float]:
    """One step over this rank's ``gradient_accumulation_steps`` micro-batches of
    ``input_ids [B, T]`` and ``shift_labels [B, T]`` (``-100`` off the answer).

    Returns:
        ``{"step", "loss" (global NLL per answer token), "num_tokens", "lr"}``, identical on
        every rank.

    Raises:
        ValueError: the number of micro-batches differs from the engine's accumulation steps.
    """
    engine = me.engine
    gas = int(engine.gradient_accumulation_steps())
    if len(micro_batches) != gas:
        raise ValueError(f"micro_batches must hold gradient_accumulation_steps={gas} entries, got "
                         f"{len(micro_batches)}")
    mbs = [{k: v.to(engine.device) for k, v in mb.items()} for mb in micro_batches]
    step = me.calibrator.begin_step([mb["shift_labels"] for mb in mbs])
    for i, mb in enumerate(mbs):
        out = engine(mb["input_ids"], shift_labels=step.local_labels(i))
        nll = -(out.log_probs * step.weights(i)).sum()
        engine.backward(step.loss_for_backward(nll))
        engine.step()
    return {"step": int(engine.global_steps), "loss": float(step.global_loss()),
            "num_tokens": float(step.num_tokens), "lr": float(engine.get_lr()[0])}
