"""The GRPO and DPO jobs' supervised warm-up: one calibrated optimizer step of the negative
log-likelihood of the answer tokens, on an engine whose module returns per-token log-probs
(:class:`launch.jobs.policy_model.CausalLMLogProbs`), so SFT and the policy / preference phase
train the same module.

It is megaloss's one calibrated step (:func:`megaloss.integrations.step.run_step`) with its NLL
family (:class:`megaloss.integrations.step.lm.NLLLoss`) on the DeepSpeed engine: the step's
calibrator (the ds_config's ``megaloss.ce.loss_reduction``, ``token`` by default) turns the
labels of every micro-batch into global weights with one all-reduce, and the engine's measured
``1 / (GAS x DP)`` is undone: the update is the one a single device makes on the whole global
batch.
"""
from __future__ import annotations

from typing import Dict, Mapping, Sequence

import torch

from megaloss.integrations.step import run_step
from megaloss.integrations.step.lm import NLLLoss

__all__ = ["sft_step"]


def sft_step(me, micro_batches: Sequence[Mapping[str, torch.Tensor]]) -> Dict[str, float]:
    """One step over this rank's ``gradient_accumulation_steps`` micro-batches of
    ``input_ids [B, T]`` and ``shift_labels [B, T]`` (``-100`` off the answer).

    Returns:
        ``{"step", "loss" (global NLL per answer token), "num_tokens", "lr"}``, identical on
        every rank.

    Raises:
        ValueError: the number of micro-batches differs from the engine's accumulation steps
            (on every rank alike).
    """
    router = me.config.router.options() if me.config.router is not None else None
    m = run_step(me, NLLLoss(router=router), micro_batches, log=False)
    return {"step": m.step, "loss": m.loss, "num_tokens": m.num_tokens, "lr": m.lr}
