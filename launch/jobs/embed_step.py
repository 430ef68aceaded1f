"""The embedding job's optimizer step (``launch/train_embed.py``): gathered MNR over this rank's
micro-batches of (query, document) pairs, on an engine whose module computes the loss in its
forward (:class:`megaloss.integrations.hf.EmbeddingModelWithMNR`), optionally through GradCache
(:func:`megaloss.integrations.hf.cached_mnr_forward`: the encoder's activations of one
mini-batch at a time, the same loss and gradients).

Each micro-batch's loss is weighted by its share of the step's global pairs
(:func:`megaloss.integrations.hf.step_loss_weights`, one all-reduce; all ones when every
micro-batch has the same global size) times the engine's measured loss multiplier, so the
update is the query mean over the whole global batch, for any DP x GAS split.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Tuple

import torch

__all__ = ["embed_step"]


def embed_step(engine: Any, micro_batches: Sequence[Mapping[str, torch.Tensor]], *, group: Any,
               multiplier: float, dp_size: int, mini: Optional[int]) -> Tuple[float, float, float]:
    """One optimizer step over this rank's micro-batches (``query_input_ids`` /
    ``query_attention_mask`` ``[B, Tq]``, ``document_input_ids`` / ``document_attention_mask``
    ``[B, Td]``, int64; :func:`launch.jobs.pair_data.encode_pairs`' rows).

    Args:
        engine: the DeepSpeed engine of an ``EmbeddingModelWithMNR``.
        group: the data-parallel group (the MNR's negatives come from all of it).
        multiplier: the engine's measured loss multiplier (``me.engine_scale``).
        dp_size: the size of ``group``.
        mini: GradCache's mini-batch size (None: the whole micro-batch at once).

    Returns:
        ``(loss, accuracy, grad_norm)``: the step's global MNR loss and in-batch top-1 accuracy
        (``sum_m (n_m / N) (L_m, acc_m)``), the gradient norm (NaN when the engine has none);
        identical on every rank.
    """
    from megaloss.integrations.grad_cache import inner_replay_backward
    from megaloss.integrations.hf import cached_mnr_forward
    from megaloss.integrations.hf.embedding import step_loss_weights

    # The step's micro-batches, known up front: their sizes give the GAS compensation
    # weights (one all-reduce); all ones when every micro-batch has the same global
    # size.
    weights = step_loss_weights([len(b["query_input_ids"]) for b in micro_batches],
                                group, loss_multiplier=multiplier, device=engine.device)
    # The step's global loss and accuracy, sum_m (n_m / N) (L_m, acc_m), and the
    # gradient norm (a device tensor under ZeRO-1/2) stay on the device until one read
    # per step.
    stats = torch.zeros(3, device=engine.device)
    for b, w in zip(micro_batches, weights):
        batch = {k: v.to(engine.device) for k, v in b.items()}
        if mini is None:
            out = engine(**batch, loss_weight=w)
        else:  # GradCache: the replays but the last run as accumulation passes
            out = cached_mnr_forward(engine, batch, mini_batch_size=mini,
                                     backward=inner_replay_backward(engine), loss_weight=w)
        engine.backward(out.loss)
        engine.step()
        share = w * (dp_size / multiplier)
        stats[:2] += share * torch.stack([out.value, out.accuracy]).float()
    norm = engine.get_global_grad_norm()
    stats[2] = float("nan") if norm is None else norm
    loss, accuracy, grad_norm = stats.tolist()  # the step's one host sync
    return loss, accuracy, grad_norm
