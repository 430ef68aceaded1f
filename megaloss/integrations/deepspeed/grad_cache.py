"""GradCache replays as DeepSpeed accumulation passes, so ZeRO 0-3 accept them.

:func:`megaloss.losses.grad_cache.grad_cache_step` back-propagates one mini-batch at a time. Inside one
``engine.backward`` (sentence-transformers' ``CachedMultipleNegativesRankingLoss`` runs its
replays from a backward hook) ZeRO-2 stops with "Gradient computed twice for this partition" and
ZeRO-3 with an assertion in its reduce: every parameter's gradient hook fires once per replay.
Here every replay is its own ``engine.backward`` with the engine told that it is not the
gradient-accumulation boundary (``engine.set_gradient_accumulation_boundary(False)``, the
documented way to run several backward passes before one ``engine.step()``); the last replay is
the caller's ordinary ``engine.backward`` at the micro-step's own boundary state. So:

- scaling: every replay is divided by the gradient accumulation steps exactly as the
  non-cached ``engine.backward(loss)`` would be (and a Trainer's ``scale_wrt_gas=False`` backward
  of its GAS-divided loss is the same division); the sum of the replays is the non-cached
  gradient, so the engine factor measured by :mod:`megaloss.calibration.engine_scale` applies
  unchanged;
- communication: ZeRO-0/1 accumulate the replays locally and reduce once at the boundary; ZeRO-2/3
  reduce(-scatter) in every backward, i.e. once per replay (``num_replays`` times the gradient
  traffic of the non-cached step, the price of keeping only a gradient partition);
- the engine's own boundary state (its micro-step counter, or what accelerate set) is restored
  after each replay, so ``engine.step()`` and the next micro-step see what they would without
  caching.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["inner_replay_backward"]


def inner_replay_backward(engine) -> Callable[[torch.Tensor], None]:
    """The ``backward`` for :func:`megaloss.losses.grad_cache.grad_cache_step` under a DeepSpeed engine.

    Args:
        engine: the ``deepspeed.DeepSpeedEngine`` whose module ``encode`` runs through (call the
            engine, not its ``.module``, so its forward hooks fire).

    Returns:
        ``backward(surrogate)``: ``engine.backward(surrogate)`` outside the accumulation boundary.

    Raises:
        ValueError: the engine runs with ``managed_gradient_accumulation=False`` (there the
            caller owns the boundary: plain ``engine.backward`` per replay is already right).
    """
    managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
    if not managed:
        raise ValueError("inner_replay_backward needs managed_gradient_accumulation=True; with "
                         "it off, pass backward=engine.backward to grad_cache_step instead")

    def backward(surrogate: torch.Tensor) -> None:
        # The engine's override (None: follow its micro-step counter), restored afterwards; the
        # ZeRO optimizer mirrors it again in the next backward's prologue.
        saved = engine._is_gradient_accumulation_boundary
        engine.set_gradient_accumulation_boundary(False)
        try:
            engine.backward(surrogate)
        finally:
            engine._is_gradient_accumulation_boundary = saved

    return backward
