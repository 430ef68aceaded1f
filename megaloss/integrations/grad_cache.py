"""GradCache replays as an engine's accumulation passes, so DeepSpeed's ZeRO 0-3 accept them
(used by megaloss's DeepSpeed loop and by the sentence-transformers loss under a DeepSpeed engine).

:func:`megaloss.losses.grad_cache.grad_cache_step` back-propagates one mini-batch at a time.
Inside one
``engine.backward`` (sentence-transformers' ``CachedMultipleNegativesRankingLoss`` runs its
replays from a backward hook) ZeRO-2 stops with "Gradient computed twice for this partition" and
ZeRO-3 with an assertion in its reduce: every parameter's gradient hook fires once per replay.
Here every replay is its own ``engine.backward`` with the engine told that it is not the
gradient-accumulation boundary (``engine.set_gradient_accumulation_boundary(False)``, the
documented way to run several backward passes before one ``engine.step()``); the last replay is
the caller's ordinary ``engine.backward`` at the micro-step's own boundary state. So:

- scaling: every replay must take the scale the caller's own backward applies to the returned
  loss. ``inner_replay_backward(engine)`` matches a caller that runs ``engine.backward(loss)``
  (the engine divides by its configured gradient accumulation steps ``G``, also in a window
  shorter than ``G``); ``inner_replay_backward(engine, scale=s)`` matches one that runs
  ``engine.backward(s * loss, scale_wrt_gas=False)``, as the Hugging Face Trainer does with
  ``s = 1 / (the micro-batches of its current window)``. Then the sum of the replays is the
  non-cached gradient, so the engine factor measured by
  :mod:`megaloss.calibration.engine_scale` applies unchanged (a mismatch is raised by
  :func:`megaloss.losses.grad_cache.grad_cache_step` in the caller's backward);
- communication: ZeRO-0/1 accumulate the replays locally and reduce once at the boundary; ZeRO-2/3
  reduce(-scatter) in every backward, i.e. once per replay (``num_replays`` times the gradient
  traffic of the non-cached step, the price of keeping only a gradient partition);
- the engine's own boundary state (its micro-step counter, or what accelerate set) is restored
  after each replay, so ``engine.step()`` and the next micro-step see what they would without
  caching.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

__all__ = ["inner_replay_backward"]


def inner_replay_backward(engine, *, scale: Optional[float] = None
                          ) -> Callable[[torch.Tensor], None]:
    """The ``backward`` for :func:`megaloss.losses.grad_cache.grad_cache_step` under a DeepSpeed
    engine.

    Args:
        engine: the ``deepspeed.DeepSpeedEngine`` whose module ``encode`` runs through (call the
            engine, not its ``.module``, so its forward hooks fire).
        scale: ``None`` when the caller back-propagates the returned loss with
            ``engine.backward(loss)`` (divided by the engine's gradient accumulation steps);
            a float ``s > 0`` when it runs ``engine.backward(s * loss, scale_wrt_gas=False)``
            (the Hugging Face Trainer: ``s = 1 / len(window)``).

    Returns:
        ``backward(surrogate)``: ``engine.backward`` of the surrogate, scaled as the caller's,
        outside the accumulation boundary.

    Raises:
        ValueError: the engine runs with ``managed_gradient_accumulation=False`` (there the
            caller owns the boundary: plain ``engine.backward`` per replay is already right);
            ``scale`` not a finite number > 0.
    """
    managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
    if not managed:
        raise ValueError("inner_replay_backward needs managed_gradient_accumulation=True; with "
                         "it off, pass backward=engine.backward to grad_cache_step instead")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not 0 < scale < math.inf):
        raise ValueError(f"scale must be None or a finite number > 0, got {scale!r}")

    def backward(surrogate: torch.Tensor) -> None:
        # The engine's override (None: follow its micro-step counter), restored afterwards; the
        # ZeRO optimizer mirrors it again in the next backward's prologue.
        saved = engine._is_gradient_accumulation_boundary
        engine.set_gradient_accumulation_boundary(False)
        try:
            if scale is None:
                engine.backward(surrogate)
            else:
                engine.backward(surrogate * scale, scale_wrt_gas=False)
        finally:
            engine._is_gradient_accumulation_boundary = saved

    return backward
