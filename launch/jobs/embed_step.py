"""The embedding job's optimizer step (``launch/train_embed.py``): gathered MNR over this rank's
micro-batches of (query, document) pairs, on an engine whose module computes the loss in its
forward (:class:`megaloss.integrations.hf.EmbeddingModelWithMNR`), optionally through GradCache
(:func:`megaloss.integrations.hf.cached_mnr_forward`: the encoder's activations of one
mini-batch at a time, the same loss and gradients).

It is megaloss's one calibrated step (:func:`megaloss.integrations.step.run_step`) with its MNR
family (:class:`megaloss.integrations.step.mnr.MNRStepLoss`) on the DeepSpeed engine: each
micro-batch's loss is weighted by its share of the step's global pairs (one all-reduce; all ones
when every micro-batch has the same global size) times the engine's measured loss multiplier,
so the update is the query mean over the whole global batch, for any DP x GAS split.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from megaloss.integrations.grad_cache import inner_replay_backward
from megaloss.integrations.hf import cached_mnr_forward
from megaloss.integrations.step import StepOutcome, run_step
from megaloss.integrations.step.mnr import MNRStepLoss

__all__ = ["embed_step"]


def embed_step(me: Any, micro_batches: Sequence[Mapping[str, torch.Tensor]], *,
               mini: Optional[int]) -> StepOutcome:
    """One optimizer step over this rank's micro-batches (``query_input_ids`` /
    ``query_attention_mask`` ``[B, Tq]``, ``document_input_ids`` / ``document_attention_mask``
    ``[B, Td]``, int64; :func:`launch.jobs.pair_data.encode_pairs`' rows).

    Args:
        me: the :class:`megaloss.integrations.deepspeed.MegalossEngine` of an
            ``EmbeddingModelWithMNR``.
        mini: GradCache's mini-batch size (None: the whole micro-batch at once).

    Returns:
        The step's :class:`megaloss.integrations.step.StepOutcome`: ``metrics["mnr_loss"]`` and
        ``metrics["accuracy"]``, the step's global MNR loss and in-batch top-1 accuracy
        (``sum_m (n_m / N) (L_m, acc_m)``), ``grad_norm`` (None when the engine has none);
        identical on every rank.
    """
    engine = me.engine

    def grad_cache(batch: Mapping[str, torch.Tensor], weight: torch.Tensor) -> Any:
        # the replays but the last run as accumulation passes
        return cached_mnr_forward(engine, batch, mini_batch_size=mini,
                                  backward=inner_replay_backward(engine), loss_weight=weight)

    return run_step(me, MNRStepLoss(cached=None if mini is None else grad_cache),
                    micro_batches, log=False)
