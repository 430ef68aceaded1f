"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) and DDP's adapter to the one calibrated
step (:mod:`megaloss.integrations.step`): :class:`FSDPStepEngine`.

A torch module whose forward computes megaloss's loss (:class:`megaloss.CausalLMWithLoss` built
*before* ``fully_shard``, so the loss head runs inside an FSDP-managed forward), a torch
optimizer and a :class:`megaloss.LossCalibrator` whose engine scale was measured on that module
(:func:`megaloss.calibration.probe_fsdp`, :func:`megaloss.calibration.probe_ddp`) are all the
step needs::

    from megaloss.integrations.fsdp import FSDPStepEngine
    from megaloss.integrations.step import LanguageModelLoss, run_step

    engine = FSDPStepEngine(model, optimizer, calibrator, max_grad_norm=1.0)
    metrics = run_step(engine, LanguageModelLoss(), micro_batches)   # one optimizer step

Per micro-batch the module's forward and ``loss.backward()``; the gradient reduction is kept for
the step's last micro-batch (FSDP2's ``set_requires_gradient_sync(False)`` on the others, as
:func:`megaloss.calibration.probe_fsdp`'s ``accumulation="no_sync"`` measures it; DDP's
``no_sync()``); after it the learning rate of the step (``lr_schedule``), the global gradient
norm (clipped to ``max_grad_norm`` when > 0), ``optimizer.step()`` and ``zero_grad``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

from ..calibration.calibrator import LossCalibrator
from ..parallel.comm import all_reduce_sum_
from .lm_head import refuse_unsummed
from .step.loop import StepEngine

__all__ = ["FSDPStepEngine", "global_grad_norm"]


def global_grad_norm(params: Sequence[torch.nn.Parameter], max_norm: float = 0.0,
                     tensor_parallel_size: int = 1) -> float:
    """The global L2 norm of the (sharded) gradients of ``params``, clipped in place to
    ``max_norm`` when it is > 0.

    FSDP2's gradients are DTensors (``Shard(0)`` over the data-parallel mesh), which
    ``torch.nn.utils.clip_grad_norm_`` reduces itself. Under FSDP2 x tensor parallelism
    (``tensor_parallel_size > 1``) they live on two meshes (the decoder's on the data-parallel
    dimension, replicated over TP; the vocab-parallel lm_head's on both), which it does not
    combine: each local shard's squares are divided by the number of ranks holding the same
    shard, summed over the world (one all-reduce), and the gradients scaled in place.
    """
    if tensor_parallel_size > 1:
        import torch.distributed as dist
        from torch.distributed.tensor import Replicate

        grads = [p.grad for p in params if p.grad is not None]
        total = torch.zeros((), dtype=torch.float64, device=grads[0].device)
        for g in grads:
            mesh = g.device_mesh
            copies = dist.get_world_size() // mesh.size()
            for size, placement in zip(mesh.shape, g.placements):
                copies *= size if isinstance(placement, Replicate) else 1
            total += g.to_local().detach().to(torch.float64).pow(2).sum() / copies
        norm = float(all_reduce_sum_(total).sqrt())
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            with torch.no_grad():
                for g in grads:
                    g.mul_(coef)
        return norm
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if hasattr(norm, "full_tensor"):  # a DTensor (Partial / Replicate over the mesh)
        norm = norm.full_tensor()
    return float(norm)


class FSDPStepEngine(StepEngine):
    """The :class:`~megaloss.integrations.step.StepEngine` of a ``fully_shard``-ed (FSDP2) or
    ``DistributedDataParallel`` module, or of a plain module on one process (module docstring).

    Args:
        module: the module whose forward computes megaloss's loss (``module(input_ids,
            shift_labels=, loss_weights=, ...)``).
        optimizer: a torch optimizer over its parameters.
        calibrator: a :class:`megaloss.LossCalibrator` whose ``engine_scale`` was measured on
            this module (:func:`megaloss.calibration.probe_fsdp` /
            :func:`megaloss.calibration.probe_ddp`).
        max_grad_norm: clip the global gradient norm to this (0: no clipping, the norm still
            computed).
        lr_schedule: ``step -> learning rate`` of optimizer step ``step`` (1-based), set on
            every parameter group before it; None keeps the optimizer's.
        gradient_accumulation_steps: the number of micro-batches a step must hold (checked), or
            None (any).
        tensor_parallel_size: the TP size of an FSDP2 x TP layout (see
            :func:`global_grad_norm`).
        steps_done: optimizer steps already done (a resumed run's), the count the next step
            continues from.

    Raises:
        TypeError: ``calibrator`` is not a :class:`megaloss.LossCalibrator`.
    """

    def __init__(self, module: torch.nn.Module, optimizer: Any, calibrator: LossCalibrator, *,
                 max_grad_norm: float = 0.0,
                 lr_schedule: Optional[Callable[[int], float]] = None,
                 gradient_accumulation_steps: Optional[int] = None,
                 tensor_parallel_size: int = 1, steps_done: int = 0) -> None:
        if not isinstance(calibrator, LossCalibrator):
            raise TypeError(f"calibrator must be a megaloss LossCalibrator, got "
                            f"{type(calibrator).__name__}")
        refuse_unsummed(module, "FSDPStepEngine")
        self.module = module
        self.optimizer = optimizer
        self.calibrator = calibrator
        self.topology = calibrator.topology
        self.max_grad_norm = max_grad_norm
        self.lr_schedule = lr_schedule
        self.accumulation_steps = gradient_accumulation_steps
        self.tensor_parallel_size = tensor_parallel_size
        self.steps_done = steps_done
        self._grad_norm: Optional[float] = None

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def gradient_accumulation_steps(self) -> Optional[int]:
        return self.accumulation_steps

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def micro_batch(self, last: bool) -> ContextManager:
        """FSDP2: reduce-scatter at the last micro-batch only
        (``set_requires_gradient_sync(last)``); DDP: ``no_sync()`` on the others."""
        if hasattr(self.module, "set_requires_gradient_sync"):
            self.module.set_requires_gradient_sync(last)
        elif not last and hasattr(self.module, "no_sync"):
            return self.module.no_sync()
        return contextlib.nullcontext()

    def after_backward(self, last: bool) -> None:
        if not last:
            return
        step = self.steps_done + 1
        if self.lr_schedule is not None:
            lr = self.lr_schedule(step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        params = [p for p in self.module.parameters() if p.requires_grad]
        self._grad_norm = global_grad_norm(params, self.max_grad_norm, self.tensor_parallel_size)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done = step

    def grad_norm(self) -> Optional[float]:
        return self._grad_norm

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step_count(self) -> int:
        return self.steps_done
