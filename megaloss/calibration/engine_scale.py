"""Measure how a training engine scales gradients, to undo it exactly.

Each rank ``r`` of the ``dp x sp`` group backwards, for micro-batch ``i`` of an optimizer step, a
loss ``L_ri``; after the step's last backward the engine leaves on every rank the gradient

    g = c * sum_{r, i} dL_ri / dtheta

for an *effective gradient scale* ``c`` that depends on the engine: 1 with no engine, ``1/D`` for
DDP (average over its ``D`` ranks, sum over micro-batches), ``1/(G * D)`` for DeepSpeed with
``engine.backward`` (divides the loss by the ``G`` accumulation steps, averages over DP) — and
other values for other paths (DeepSpeed 0.19's ``runtime/engine.py``: a direct ``loss.backward()``
is divided through hooks on ``engine.forward`` outputs; ZeRO-3's reduce-scatter divides by its
whole partition group). Version tables lie, so megaloss *measures* ``c`` once at start-up: a probe
with a tiny
parameter ``theta`` and ``L_ri = a_ri * sum(theta)`` for coefficients ``a_ri`` distinct per
*global* rank goes through the engine's real path, and ``c = g / sum_{r in group, i} a_ri``. The
per-rank loss
multiplier is ``1 / c``: with calibrated weights (``sum_{r,i} L_ri`` = global loss), backwarding
``L_ri / c`` gives exactly the single-device gradient.

The group the probe accounts for is the one the engine reduces over, read from the engine
(DDP's ``process_group``, DeepSpeed's sequence-data-parallel group), never a default. Because the
coefficients differ per global rank, an engine that reduces over another set of ranks than that
group gives each rank a different ``c`` (or one that is no ``1/k``), and the probe fails loudly
(:class:`EngineScaleError`): when ``c`` is not one uniform factor on all ranks of the world, is not
finite and positive, or is not ``1/k`` or ``k`` for an integer ``k`` (some non-linear step such as
clipping or loss scaling leaked into the gradient).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..parallel.comm import all_reduce_max_
from ..parallel.groups import SINGLE_RANK, GroupLike, group_ranks, group_size, resolve_group

__all__ = ["EngineScale", "EngineScaleError", "measure_grad_scale", "probe_no_engine",
           "probe_ddp", "probe_coefficients", "ProbeModule"]

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
        gradient_factor: ``c`` (module docstring), as snapped to ``1/k`` or ``k``: what the engine
            multiplies the sum of all ranks' micro-batch gradients by.
        loss_multiplier: ``1 / c``: multiply each rank's calibrated micro-batch loss by it.
        gradient_accumulation_steps: ``G`` used by the probe.
        group_size: size of the group the engine reduces over (the ``dp x sp`` group).
        measured: the raw ``g / sum a`` before snapping.
        group_ranks: global ranks of that group, in group order.
    """

    engine: str
    gradient_factor: float
    loss_multiplier: float
    gradient_accumulation_steps: int
    group_size: int
    measured: float
    group_ranks: Tuple[int, ...] = (0,)

    @classmethod
    def identity(cls) -> "EngineScale":
        """No engine, one process: gradients are plain sums (``c = 1``)."""
        return cls("none", 1.0, 1.0, 1, 1, 1.0, (0,))


def probe_coefficients(rank: int, gas: int) -> List[float]:
    """The probe's ``a_ri`` for *global* rank ``rank``, ``i < gas``: distinct numbers in [1, 2)
    (fractional parts of multiples of the golden ratio), so that sums over different sets of
    ranks differ and an engine reducing over other ranks than assumed is caught."""
    phi = (math.sqrt(5.0) - 1.0) / 2.0
    return [1.0 + ((rank * gas + i + 1) * phi) % 1.0 for i in range(gas)]


def snap_scale(m: float) -> float:
    """``m`` rounded to the integer or the reciprocal integer it is within _REL_TOL of, or NaN."""
    if m >= 1.0:
        k = round(m)
        return float(k) if abs(m - k) <= _REL_TOL * m else math.nan
    k = round(1.0 / m)
    return 1.0 / k if k >= 1 and abs(1.0 / m - k) <= _REL_TOL / m else math.nan


def measure_grad_scale(run_step: Callable[[Sequence[float]], torch.Tensor], *,
                       group: GroupLike, gas: int, engine: str,
                       device: Optional[torch.device] = None,
                       coefficient_ids: Optional[Tuple[int, Sequence[int]]] = None
                       ) -> EngineScale:
    """Run one probed optimizer step through an engine and derive its gradient factor.

    Collective over the default group: every rank of the world calls it (TP replicas included).

    Args:
        run_step: ``run_step(coeffs)`` must, for each ``a`` in ``coeffs`` (one per micro-batch),
            backward ``a * theta.sum()`` through the engine's real path (forward, backward,
            accumulation boundary) for a probe parameter ``theta``, and return ``theta``'s full
            gradient after the step's last backward (any shape; every element must be equal).
        group: the group the engine reduces gradients over (read from the engine by the
            ``probe_*`` functions; :data:`~megaloss.parallel.SINGLE_RANK` for none).
        gas: gradient accumulation steps ``G`` of the engine (>= 1).
        engine: name stored in the result.
        device: device of the small consensus all-reduce (default: the gradient's).
        coefficient_ids: ``(this rank's id, the ids of the group's members)`` that pick the
            coefficients (:func:`probe_coefficients`) instead of global ranks: for engines where
            the loss of one rank drives the gradients of others (the stages of one pipeline all
            get the last stage's loss, so the pipeline's data-parallel index is the id).
            ``run_step`` is then given the coefficients of this rank's id.

    Returns:
        :class:`EngineScale`, identical on all ranks.

    Raises:
        ValueError: ``gas`` < 1.
        EngineScaleError: the factor is not uniform over the world, finite, positive, and ``k``
            or ``1/k``.
    """
    if isinstance(gas, bool) or not isinstance(gas, int) or gas < 1:
        raise ValueError(f"gas must be an int >= 1, got {gas!r}")
    group = resolve_group(group)
    members = group_ranks(group)
    world = group_size(group)
    me = group_ranks(SINGLE_RANK)[0]  # this process's global rank
    ids = members
    if coefficient_ids is not None:
        me, ids = int(coefficient_ids[0]), [int(i) for i in coefficient_ids[1]]
        if len(ids) != world:
            raise ValueError(f"coefficient_ids must name {world} members, got {ids}")
    coeffs = probe_coefficients(me, gas)
    total = sum(sum(probe_coefficients(r, gas)) for r in ids)
    grad = run_step(coeffs)
    if grad is None:
        raise EngineScaleError(f"{engine}: the probe parameter got no gradient")
    grad = grad.detach().to(torch.float64).reshape(-1)
    spread = float((grad.max() - grad.min()).abs()) if grad.numel() else math.nan
    local = float(grad.mean()) / total if grad.numel() else math.nan
    # One tiny all-reduce over the *default* group: does every rank measure the same c? (MAX of c
    # and of -c.) Over the world, not the assumed group, so a wrong assumption cannot hide.
    probe = torch.tensor([local, -local, spread], dtype=torch.float64,
                         device=device if device is not None else grad.device)
    all_reduce_max_(probe, None)
    c_max, c_min, spread = float(probe[0]), -float(probe[1]), float(probe[2])
    where = (f"{engine}: probe with G={gas}, assuming the engine reduces over global ranks "
             f"{members}, measured gradient factor c in [{c_min:.6g}, {c_max:.6g}] "
             "(g = c * sum of those ranks' micro-batch gradients)")
    if not all(math.isfinite(v) for v in (c_max, c_min, spread)) or c_min <= 0:
        raise EngineScaleError(f"{where}: not finite and positive; the engine does not reduce "
                               "gradients as a scaled sum")
    if spread > _REL_TOL * abs(c_max * total) or c_max - c_min > _REL_TOL * c_max:
        raise EngineScaleError(f"{where}: differs across ranks or elements, so the engine reduces "
                               "over other ranks than assumed; megaloss cannot compensate it "
                               "(check the mpu / process groups given to the engine)")
    m = snap_scale(1.0 / c_max)
    if math.isnan(m):
        raise EngineScaleError(f"{where}: 1/c = {1.0 / c_max:.6g} is not an integer or its "
                               "reciprocal; the engine reduces over other ranks than assumed, "
                               "or a non-linear step (clipping, loss scaling) is in the path")
    return EngineScale(engine=engine, gradient_factor=1.0 / m, loss_multiplier=m,
                       gradient_accumulation_steps=gas, group_size=world, measured=c_max,
                       group_ranks=tuple(members))


class ProbeModule(nn.Module):
    """``forward(a) = a * theta.sum()`` computed inside forward (so DeepSpeed's output hooks and
    ZeRO-3's parameter gathering apply as they do to a real model)."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.theta = nn.Parameter(torch.ones(_PROBE_NUMEL, dtype=dtype))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return (a * self.theta).sum()


def probe_no_engine(*, gas: int = 1) -> EngineScale:
    """Factor of plain ``loss.backward()`` accumulation with no gradient reduction across ranks
    (``c = 1``). Every rank of the world calls it."""
    module = ProbeModule(torch.float64)

    def run(coeffs):
        for a in coeffs:
            module(torch.tensor(a, dtype=torch.float64)).backward()
        return module.theta.grad

    return measure_grad_scale(run, group=SINGLE_RANK, gas=gas, engine="none")


def probe_ddp(*, gas: int = 1, process_group: GroupLike = None, use_no_sync: bool = True,
              device: Optional[torch.device] = None) -> EngineScale:
    """Factor of ``torch.nn.parallel.DistributedDataParallel`` over ``process_group``.

    Args:
        gas: micro-batches per optimizer step.
        process_group: DDP's group (``None``: the default group, as DDP's own default); the
            probe accounts for exactly this group.
        use_no_sync: accumulate the first ``gas - 1`` micro-batches under ``no_sync()`` (the
            usual DDP accumulation); False reduces every micro-batch.
        device: device of the probe parameter (default CPU; use the model's for NCCL).

    Raises:
        EngineScaleError: see :func:`measure_grad_scale`.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = torch.device("cpu") if device is None else torch.device(device)
    module = ProbeModule(torch.float32).to(device)
    process_group = resolve_group(process_group)
    ddp = DDP(module, process_group=process_group,
              device_ids=[device] if device.type == "cuda" else None)

    def run(coeffs):
        for i, a in enumerate(coeffs):
            last = i == len(coeffs) - 1
            ctx = ddp.no_sync() if use_no_sync and not last else contextlib.nullcontext()
            with ctx:
                ddp(torch.tensor(a, device=device)).backward()
        return module.theta.grad

    return measure_grad_scale(run, group=process_group, gas=gas, engine="ddp", device=device)
