"""Measure how a training engine scales gradients, to undo it exactly.

Each rank ``r`` of the ``dp x sp`` group backwards, for micro-batch ``i`` of an optimizer step, a
loss ``L_ri``; after the step's last backward the engine leaves on every rank the gradient

    g = c * sum_{r, i} dL_ri / dtheta

for an *effective gradient scale* ``c`` that depends on the engine: 1 with no engine, ``1/D`` for
DDP (average over its ``D`` ranks, sum over micro-batches), ``1/(G * D)`` for DeepSpeed with
``engine.backward`` (divides the loss by the ``G`` accumulation steps, averages over DP) — and
other values for other paths (FIELD-NOTES: DeepSpeed's direct ``loss.backward()`` divides through
hooks on ``engine.forward`` outputs; ZeRO-3's reduce-scatter divides by its whole partition
group). Version tables lie, so megaloss *measures* ``c`` once at start-up: a probe with a tiny
parameter ``theta`` and ``L_ri = a_ri * sum(theta)`` for distinct known coefficients ``a_ri``
goes through the engine's real path, and ``c = g / sum_{r, i} a_ri``. The per-rank loss
multiplier is ``1 / c``: with calibrated weights (``sum_{r,i} L_ri`` = global loss), backwarding
``L_ri / c`` gives exactly the single-device gradient.

The probe fails loudly (:class:`EngineScaleError`) when ``c`` is not one uniform factor on all
ranks (the engine does not reduce over the whole ``dp x sp`` group, or reduces differently per
rank), is not finite and positive, or is not ``1/k`` or ``k`` for an integer ``k`` (some
non-linear step such as clipping or loss scaling leaked into the gradient).
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..distributed.collectives import all_reduce_max_
from ..distributed.deepspeed_compat import skip_cpu_shm_comm_build
from ..distributed.topology import group_rank, group_size

__all__ = ["EngineScale", "EngineScaleError", "measure_grad_scale", "probe_no_engine",
           "probe_ddp", "probe_deepspeed", "probe_coefficients"]

_REL_TOL = 1e-4  # fp32 engines sum a few numbers in [1, 2): errors ~1e-7; generous but decisive
_PROBE_NUMEL = 4


class EngineScaleError(RuntimeError):
    """The engine's measured gradient scale is not one megaloss can compensate."""


@dataclass(frozen=True)
class EngineScale:
    """Measured effective gradient scale of an engine path.

    Attributes:
        engine: short name of the probed path, e.g. ``"ddp"``,
            ``"deepspeed-zero2/engine.backward"``.
        grad_scale: ``c`` (module docstring), as snapped to ``1/k`` or ``k``.
        loss_multiplier: ``1 / c``: multiply each rank's calibrated micro-batch loss by it.
        gradient_accumulation_steps: ``G`` used by the probe.
        group_size: ``dp x sp`` ranks the probe spread distinct coefficients over.
        measured: the raw ``g / sum a`` before snapping.
    """

    engine: str
    grad_scale: float
    loss_multiplier: float
    gradient_accumulation_steps: int
    group_size: int
    measured: float

    @classmethod
    def identity(cls) -> "EngineScale":
        """No engine, one process: gradients are plain sums (``c = 1``)."""
        return cls("none", 1.0, 1.0, 1, 1, 1.0)


def probe_coefficients(rank: int, gas: int) -> List[float]:
    """The probe's ``a_ri`` for ``dp x sp`` rank ``rank``, ``i < gas``: distinct numbers in
    [1, 2) (fractional parts of multiples of the golden ratio), so that sums over different sets
    of ranks differ and an engine reducing over a sub-group is caught."""
    phi = (math.sqrt(5.0) - 1.0) / 2.0
    return [1.0 + ((rank * gas + i + 1) * phi) % 1.0 for i in range(gas)]


def _snap(m: float) -> float:
    """``m`` rounded to the integer or the reciprocal integer it is within _REL_TOL of, or NaN."""
    if m >= 1.0:
        k = round(m)
        return float(k) if abs(m - k) <= _REL_TOL * m else math.nan
    k = round(1.0 / m)
    return 1.0 / k if k >= 1 and abs(1.0 / m - k) <= _REL_TOL / m else math.nan


def measure_grad_scale(run_step: Callable[[Sequence[float]], torch.Tensor], *,
                       group: Optional[ProcessGroup], gas: int, engine: str,
                       device: Optional[torch.device] = None) -> EngineScale:
    """Run one probed optimizer step through an engine and derive its gradient scale.

    Args:
        run_step: ``run_step(coeffs)`` must, for each ``a`` in ``coeffs`` (one per micro-batch),
            backward ``a * theta.sum()`` through the engine's real path (forward, backward,
            accumulation boundary) for a probe parameter ``theta``, and return ``theta``'s full
            gradient after the step's last backward (any shape; every element must be equal).
        group: the ``dp x sp`` group over which the calibrated loss is spread (one small
            all-reduce checks that all its ranks measured the same ``c``). TP replicas use their
            dp x sp rank's coefficients.
        gas: gradient accumulation steps ``G`` of the engine (>= 1).
        engine: name stored in the result.
        device: device of the small consensus all-reduce (default: the gradient's).

    Returns:
        :class:`EngineScale`, identical on all ranks.

    Raises:
        ValueError: ``gas`` < 1.
        EngineScaleError: the scale is not uniform, finite, positive, and ``k`` or ``1/k``.
    """
    if isinstance(gas, bool) or not isinstance(gas, int) or gas < 1:
        raise ValueError(f"gas must be an int >= 1, got {gas!r}")
    world, rank = group_size(group), group_rank(group)
    coeffs = probe_coefficients(rank, gas)
    total = sum(sum(probe_coefficients(r, gas)) for r in range(world))
    grad = run_step(coeffs)
    if grad is None:
        raise EngineScaleError(f"{engine}: the probe parameter got no gradient")
    grad = grad.detach().to(torch.float64).reshape(-1)
    spread = float((grad.max() - grad.min()).abs()) if grad.numel() else math.nan
    local = float(grad.mean()) / total if grad.numel() else math.nan
    # One tiny all-reduce over the dp x sp group: does every rank measure the same c? (MAX of c
    # and of -c.) TP replicas each check within their own dp x sp group.
    probe = torch.tensor([local, -local, spread], dtype=torch.float64,
                         device=device if device is not None else grad.device)
    all_reduce_max_(probe, group)
    c_max, c_min, spread = float(probe[0]), -float(probe[1]), float(probe[2])
    where = (f"{engine}: probe with G={gas} over {world} dp x sp ranks measured gradient scale "
             f"c in [{c_min:.6g}, {c_max:.6g}] (g = c * sum of all ranks' micro-batch gradients)")
    if not all(math.isfinite(v) for v in (c_max, c_min, spread)) or c_min <= 0:
        raise EngineScaleError(f"{where}: not finite and positive; the engine does not reduce "
                               "gradients as a scaled sum")
    if spread > _REL_TOL * abs(c_max * total) or c_max - c_min > _REL_TOL * c_max:
        raise EngineScaleError(f"{where}: differs across ranks or elements, so the engine does "
                               "not reduce over the whole dp x sp group; megaloss cannot "
                               "compensate it (check the mpu / process groups given to the engine)")
    m = _snap(1.0 / c_max)
    if math.isnan(m):
        raise EngineScaleError(f"{where}: 1/c = {1.0 / c_max:.6g} is not an integer or its "
                               "reciprocal; a non-linear step (clipping, loss scaling) or an "
                               "unknown reduction is in the path")
    return EngineScale(engine=engine, grad_scale=1.0 / m, loss_multiplier=m,
                       gradient_accumulation_steps=gas, group_size=world, measured=c_max)


class _ProbeModule(nn.Module):
    """``forward(a) = a * theta.sum()`` computed inside forward (so DeepSpeed's output hooks and
    ZeRO-3's parameter gathering apply as they do to a real model)."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.theta = nn.Parameter(torch.ones(_PROBE_NUMEL, dtype=dtype))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return (a * self.theta).sum()


def probe_no_engine(*, gas: int = 1, group: Optional[ProcessGroup] = None) -> EngineScale:
    """Scale of plain ``loss.backward()`` accumulation (one process, or ranks that reduce
    nothing: then ``group`` must be ``None``, else the probe fails as it should)."""
    module = _ProbeModule(torch.float64)

    def run(coeffs):
        for a in coeffs:
            module(torch.tensor(a, dtype=torch.float64)).backward()
        return module.theta.grad

    return measure_grad_scale(run, group=group, gas=gas, engine="none")


def probe_ddp(*, gas: int = 1, group: Optional[ProcessGroup] = None,
              process_group: Optional[ProcessGroup] = None, use_no_sync: bool = True,
              device: Optional[torch.device] = None) -> EngineScale:
    """Scale of ``torch.nn.parallel.DistributedDataParallel``.

    Args:
        gas: micro-batches per optimizer step.
        group: the ``dp x sp`` group of the calibration.
        process_group: DDP's group (``None``: WORLD, as DDP's own default).
        use_no_sync: accumulate the first ``gas - 1`` micro-batches under ``no_sync()`` (the
            usual DDP accumulation); False reduces every micro-batch.
        device: device of the probe parameter (default CPU; use the model's for NCCL).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = torch.device("cpu") if device is None else torch.device(device)
    module = _ProbeModule(torch.float32).to(device)
    ddp = DDP(module, process_group=process_group,
              device_ids=[device] if device.type == "cuda" else None)

    def run(coeffs):
        for i, a in enumerate(coeffs):
            last = i == len(coeffs) - 1
            ctx = ddp.no_sync() if use_no_sync and not last else contextlib.nullcontext()
            with ctx:
                ddp(torch.tensor(a, device=device)).backward()
        return module.theta.grad

    return measure_grad_scale(run, group=group, gas=gas, engine="ddp", device=device)


# Sections that do not change the effective scale but would change what the probe reads or
# build things (optimizers, monitors): mixed precision is unscaled inside step(), clipping
# happens in step(), and the probe brings its own torch optimizer (no JIT-built op).
_DROPPED_DS_KEYS = ("optimizer", "scheduler", "fp16", "bf16", "amp", "gradient_clipping",
                    "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler",
                    "wall_clock_breakdown", "checkpoint", "megaloss")


def probe_deepspeed(config: Mapping[str, Any], *, group: Optional[ProcessGroup] = None,
                    mpu: Any = None, backward: str = "engine") -> EngineScale:
    """Scale of a DeepSpeed engine built from ``config`` (and ``mpu``), on a tiny probe engine.

    The probe engine uses the same DeepSpeed version, ZeRO stage and options, accumulation
    steps and process groups as the training engine, and the same per-micro-batch protocol
    (``engine(x)`` -> backward -> ``engine.step()``); the gradient is read with
    ``deepspeed.utils.safe_get_full_grad`` after the last backward of the step. Call it on every
    rank of the world, with the ``config`` and ``mpu`` given to ``deepspeed.initialize``.

    The probe's loss is computed inside the module's forward and returned by ``engine.forward``,
    as megaloss requires of models: with a direct ``loss.backward()`` DeepSpeed divides by GAS
    through hooks on forward outputs, so a gradient that bypasses them (a parameter used outside
    forward) is not divided and is not what this probe measures.

    Args:
        config: the ds_config dict (not modified). Mixed precision, optimizer, scheduler,
            clipping and monitor sections are left out of the probe (see ``_DROPPED_DS_KEYS``);
            ``zero_allow_untested_optimizer`` is set on the probe's copy (the probe uses
            ``torch.optim.SGD``), so the config needs no such flag.
        group: the ``dp x sp`` group of the calibration (``Topology.dp_sp_group``).
        mpu: the ``mpu`` passed to ``deepspeed.initialize`` (or None).
        backward: ``"engine"`` for ``engine.backward(loss)``; ``"loss"`` for a direct
            ``loss.backward()`` on a loss returned by ``engine.forward`` (ZeRO 1-3 only).

    Raises:
        ValueError: ``backward`` unknown, or ``config`` not a mapping.
        EngineScaleError: see :func:`measure_grad_scale`.
    """
    if backward not in ("engine", "loss"):
        raise ValueError(f"backward must be 'engine' or 'loss', got {backward!r}")
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a ds_config dict, got {type(config).__name__}")
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    skip_cpu_shm_comm_build()  # the probe may be the first engine: no JIT build on CPU
    cfg = {k: copy.deepcopy(v) for k, v in config.items() if k not in _DROPPED_DS_KEYS}
    # ZeRO only knows its own optimizers and refuses others as "untested" unless allowed; the
    # probe's torch SGD (lr 0) never updates anything, and the flag is set on this copy only, so
    # the caller's config (and its training engine) is unaffected.
    cfg["zero_allow_untested_optimizer"] = True
    module = _ProbeModule(torch.float32)
    engine, *_ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(),
                                                                              lr=0.0),
                                      config=cfg, mpu=mpu)
    gas = int(engine.gradient_accumulation_steps())
    stage = int(engine.zero_optimization_stage())
    name = f"deepspeed-zero{stage}/{'engine.backward' if backward == 'engine' else 'loss.backward'}"

    def run(coeffs):
        grad = None
        for i, a in enumerate(coeffs):
            loss = engine(torch.tensor(a, dtype=torch.float32, device=engine.device))
            if backward == "engine":
                engine.backward(loss)
            else:
                loss.backward()
            if i == len(coeffs) - 1:
                grad = safe_get_full_grad(engine.module.theta)
                grad = None if grad is None else grad.detach().clone()
            engine.step()
        return grad

    try:
        return measure_grad_scale(run, group=group, gas=gas, engine=name, device=engine.device)
    finally:
        if hasattr(engine, "destroy"):
            engine.destroy()
