"""Measure the gradient factor of PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``), 1-D or
HSDP, by a real backward through a ``fully_shard``-ed probe (:mod:`.engine_scale` explains the
probe and how the calibrator uses the result).

What FSDP2 does to gradients (torch 2.13, ``torch/distributed/fsdp/_fully_shard/``):
``FSDPParamGroup.post_backward`` (``_fsdp_param_group.py``) hands the unsharded gradients to
``foreach_reduce`` (``_fsdp_collectives.py``), which reduce-scatters them over the mesh's shard
dimension and, for HSDP (a 2-D ``replicate x shard`` mesh), all-reduces the shards over the
replicate dimension. The division is chosen by ``_get_gradient_divide_factors``: with no
``set_gradient_divide_factor`` both collectives average (``ReduceOp.AVG``: ``c = 1 / (R * S)``);
with a factor ``f`` the reduce-scatter uses ``PREMUL_SUM(1/f)`` (or ``AVG`` when ``f`` is the
shard size) and the all-reduce ``SUM`` (``c = 1/f``); for reduce dtypes other than float32 and
bfloat16 (float16, float64: "overflow risk"), or with ``set_force_sum_reduction_for_comms``,
both collectives ``SUM`` and the gradient is divided by ``f`` (default ``R * S``) before and
after them. ``set_requires_gradient_sync(False)`` keeps the unsharded gradients of non-final
micro-batches local (accumulated in the reduce dtype) and reduces their sum at the next synced
backward; HSDP's ``set_requires_all_reduce(False)`` reduce-scatters each micro-batch and
all-reduces their sum once. In every path the gradient of each rank's micro-batch losses is
multiplied by one ``c``: what :func:`probe_fsdp` measures instead of assuming.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from .engine_scale import EngineScale, EngineScaleError, ProbeModule, measure_grad_scale

__all__ = ["probe_fsdp", "FSDP_ACCUMULATION", "fsdp_meshes", "mesh_group"]

FSDP_ACCUMULATION = ("no_sync", "reduce_scatter", "sync")


def _probe_dtype(reduce_dtype: torch.dtype) -> torch.dtype:
    """The dtype the probe runs and reduces in: float32 where FSDP2 reduces in float32 or
    bfloat16 (``_get_gradient_divide_factors``'s branch without overflow risk: ReduceOp.AVG /
    PREMUL_SUM), float64 for every other dtype (its SUM branch with pre-/post-division). The same
    ops and divisions as the model's; a bfloat16 probe would round its coefficients to 3
    digits and could not tell ``1/k`` from ``1/(k+1)`` at large ``k``."""
    return torch.float32 if reduce_dtype in (torch.float32, torch.bfloat16) else torch.float64


def _mesh_key(mesh) -> Tuple:
    return (tuple(mesh.mesh.reshape(-1).tolist()), tuple(mesh.mesh.shape),
            tuple(mesh.mesh_dim_names or ()))


def _settings_of_module(module) -> List[Dict[str, Any]]:
    """The distinct reduction settings of the FSDP2 parameter groups under ``module`` (in module
    order): mesh, effective reduce dtype, divide factor, sum-only flag, custom comm / hook."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    found: Dict[Tuple, Dict[str, Any]] = {}
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state()
        for pg in getattr(state, "_fsdp_param_groups", ()):
            trainable = [p for p in pg.fsdp_params if p.sharded_param.requires_grad]
            if not trainable:
                continue
            info = pg.mesh_info
            if getattr(info, "is_spmd_mesh", False) or not isinstance(info, FSDPMeshInfo):
                raise NotImplementedError(
                    "probe_fsdp supports fully_shard on a 1-D mesh or a 2-D (replicate, shard) "
                    f"HSDP mesh, not {type(info).__name__} with dp_mesh_dims / replicate-only "
                    "meshes")
            orig = trainable[0].sharded_param.dtype
            mp = pg.mp_policy
            param_dtype = mp.param_dtype if (mp.param_dtype is not None
                                             and orig.is_floating_point) else orig
            reduce_dtype = mp.reduce_dtype if mp.reduce_dtype is not None else param_dtype
            comm = getattr(pg, "_reduce_scatter_comm", None)
            comm = None if comm is None or isinstance(comm, DefaultReduceScatter) else comm
            hook = getattr(pg, "_all_reduce_hook", None)
            setting = dict(mesh=info.mesh, reduce_dtype=reduce_dtype,
                           gradient_divide_factor=pg.gradient_divide_factor,
                           force_sum_reduction_for_comms=bool(
                               getattr(pg, "force_sum_reduction_for_comms", False)),
                           reduce_scatter_comm=comm, all_reduce_hook=hook,
                           all_reduce_hook_stream=getattr(pg, "_all_reduce_hook_stream", None))
            key = (_mesh_key(info.mesh), _probe_dtype(reduce_dtype),
                   setting["gradient_divide_factor"], setting["force_sum_reduction_for_comms"],
                   id(comm), id(hook))
            found.setdefault(key, setting)
    return list(found.values())


def fsdp_meshes(module) -> List[Any]:
    """The device meshes of the FSDP2 (``fully_shard``) parameter groups under ``module`` that
    hold trainable parameters, one per distinct reduction setting, in module order.

    Raises:
        NotImplementedError: a layout :func:`probe_fsdp` does not support (module docstring).
    """
    return [s["mesh"] for s in _settings_of_module(module)]


def mesh_group(mesh):
    """A process group of all ranks of ``mesh`` (both dimensions for HSDP)."""
    import torch.distributed as dist
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return mesh._flatten().get_group()  # torchtitan's way to a group over several mesh dims


def _probe_one(setting: Dict[str, Any], gas: int, accumulation: str) -> EngineScale:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = setting["mesh"]
    dtype = _probe_dtype(setting["reduce_dtype"])
    probe = ProbeModule(dtype)
    fully_shard(probe, mesh=mesh, reshard_after_forward=True,
                mp_policy=MixedPrecisionPolicy(reduce_dtype=dtype))
    if setting["gradient_divide_factor"] is not None:
        probe.set_gradient_divide_factor(setting["gradient_divide_factor"])
    if setting["force_sum_reduction_for_comms"]:
        probe.set_force_sum_reduction_for_comms(True)
    if setting.get("reduce_scatter_comm") is not None:
        probe.set_custom_reduce_scatter(setting["reduce_scatter_comm"])
    if setting.get("all_reduce_hook") is not None:
        probe.set_all_reduce_hook(setting["all_reduce_hook"],
                                  stream=setting.get("all_reduce_hook_stream"))
    device = probe.theta.to_local().device
    hsdp = mesh.ndim == 2
    reduce = str(setting["reduce_dtype"]).removeprefix("torch.")
    name = (f"fsdp2{'-hsdp' if hsdp else ''}/{accumulation}/reduce={reduce}"
            f"/divide={setting['gradient_divide_factor']}"
            f"{'/sum-only' if setting['force_sum_reduction_for_comms'] else ''}")

    def run(coeffs):
        with torch.enable_grad():
            for i, a in enumerate(coeffs):
                last = i == len(coeffs) - 1
                if accumulation == "no_sync":
                    probe.set_requires_gradient_sync(last)
                elif accumulation == "reduce_scatter":
                    probe.set_requires_all_reduce(last)
                probe(torch.tensor(a, dtype=dtype, device=device)).backward()
        grad = probe.theta.grad
        return None if grad is None else grad.full_tensor()  # collective over the mesh

    return measure_grad_scale(run, group=mesh_group(mesh), gas=gas, engine=name,
                              device=device)


def probe_fsdp(module_or_mesh: Any, *, gas: int = 1, accumulation: str = "no_sync",
               reduce_dtype: Optional[torch.dtype] = None,
               gradient_divide_factor: Optional[float] = None,
               force_sum_reduction_for_comms: Optional[bool] = None) -> EngineScale:
    """Factor of FSDP2 (``fully_shard``) gradients, measured by a backward through a probe.

    A 4-element probe parameter is ``fully_shard``-ed on the same mesh, with the same reduction
    settings, and trained one step of ``gas`` micro-batches ``L_ri = a_ri * sum(theta)``
    (coefficients distinct per global rank, :func:`~megaloss.calibration.engine_scale.
    probe_coefficients`); ``c`` is its full gradient (``DTensor.full_tensor()``) over the sum of
    the coefficients of all ranks of the mesh (see
    :func:`~megaloss.calibration.engine_scale.measure_grad_scale`). Collective: every rank of
    the world calls it, after ``fully_shard`` and any ``set_gradient_divide_factor`` /
    ``set_force_sum_reduction_for_comms`` on the model, before training (the probe's
    collectives run on the model's mesh, over its process groups).

    Args:
        module_or_mesh: the ``fully_shard``-ed model (an ``FSDPModule`` or a module holding
            some): the mesh, the reduce dtype (``MixedPrecisionPolicy.reduce_dtype``, else its
            ``param_dtype``, else the parameters' dtype), ``gradient_divide_factor``, the
            sum-only flag and a custom reduce-scatter / all-reduce hook are read from each of
            its FSDP parameter groups, and each distinct setting is probed. Or a
            ``DeviceMesh`` as given to ``fully_shard``: 1-D (FSDP) or 2-D ``(replicate,
            shard)`` with ``mesh_dim_names`` (HSDP); the settings are then the keywords below.
        gas: micro-batches per optimizer step (>= 1).
        accumulation: how the training loop accumulates the ``gas`` micro-batches:
            ``"no_sync"`` (``set_requires_gradient_sync(False)`` before the non-final ones,
            ``True`` before the last: no communication until the last backward), ``"sync"``
            (every backward reduces, FSDP2 adds the reduced shards), ``"reduce_scatter"``
            (HSDP: ``set_requires_all_reduce(False)`` before the non-final ones; on a 1-D mesh
            the same as ``"sync"``).
        reduce_dtype: mesh only: the dtype gradients are reduced in (default float32). The probe
            reduces in float32 for float32 / bfloat16 and in float64 for other dtypes: the same
            branch of ``_get_gradient_divide_factors`` (ops and divisions), without bfloat16's
            rounding of the probe's coefficients.
        gradient_divide_factor: mesh only: as ``FSDPModule.set_gradient_divide_factor``
            (default: none set, FSDP2 divides by the mesh's size).
        force_sum_reduction_for_comms: mesh only: as
            ``FSDPModule.set_force_sum_reduction_for_comms`` (default False).

    Returns:
        :class:`~megaloss.calibration.engine_scale.EngineScale` over the mesh's ranks (both
        dimensions for HSDP), identical on all ranks: ``loss_multiplier`` is ``1 / c``, e.g.
        the mesh's size by default and ``f`` after ``set_gradient_divide_factor(f)``; pass it as
        ``LossCalibrator(engine_scale=...)`` with a topology whose ``dp x sp`` group is the
        mesh's ranks.

    Raises:
        ValueError: ``accumulation`` unknown; a module without FSDP2 parameters; the
            ``reduce_dtype`` / ``gradient_divide_factor`` / ``force_sum_reduction_for_comms``
            keywords given with a module (they are read from it).
        TypeError: ``module_or_mesh`` neither a module nor a ``DeviceMesh``.
        NotImplementedError: a parameter group on an SPMD mesh (``dp_mesh_dims``) or a
            replicate-only mesh.
        EngineScaleError: see :func:`~megaloss.calibration.engine_scale.measure_grad_scale`;
            also when the model's FSDP units reduce with different factors (one loss multiplier
            cannot undo both).
        RuntimeError, AssertionError: from ``fully_shard`` or the backend, as the model's own
            set-up or backward would raise them (gloo has no ``PREMUL_SUM``: a float32
            reduction with a divide factor other than the shard size is a RuntimeError; a 2-D
            mesh without ``mesh_dim_names`` an AssertionError).
    """
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    if accumulation not in FSDP_ACCUMULATION:
        raise ValueError(f"accumulation must be one of {FSDP_ACCUMULATION}, got "
                         f"{accumulation!r}")
    given = {k: v for k, v in (("reduce_dtype", reduce_dtype),
                               ("gradient_divide_factor", gradient_divide_factor),
                               ("force_sum_reduction_for_comms", force_sum_reduction_for_comms))
             if v is not None}
    if isinstance(module_or_mesh, DeviceMesh):
        if module_or_mesh.ndim not in (1, 2):
            raise ValueError(f"the mesh must be 1-D (FSDP) or 2-D (HSDP), got "
                             f"{module_or_mesh.ndim}-D")
        factor = gradient_divide_factor
        settings = [dict(mesh=module_or_mesh,
                         reduce_dtype=torch.float32 if reduce_dtype is None else reduce_dtype,
                         gradient_divide_factor=None if factor is None else float(factor),
                         force_sum_reduction_for_comms=bool(force_sum_reduction_for_comms))]
    elif isinstance(module_or_mesh, nn.Module):
        if given:
            raise ValueError(f"{sorted(given)} are read from the fully_shard-ed module; pass "
                             "them only with a DeviceMesh")
        settings = _settings_of_module(module_or_mesh)
        if not settings:
            raise ValueError("module_or_mesh holds no fully_shard-ed (FSDP2) trainable "
                             "parameters: call fully_shard first, or pass its DeviceMesh")
    else:
        raise TypeError("module_or_mesh must be a fully_shard-ed nn.Module or a DeviceMesh, got "
                        f"{type(module_or_mesh).__name__}")
    scales = [_probe_one(s, gas, accumulation) for s in settings]
    first = scales[0]
    for other in scales[1:]:
        if (other.group_ranks != first.group_ranks
                or not math.isclose(other.loss_multiplier, first.loss_multiplier)):
            raise EngineScaleError(
                "the model's FSDP units reduce gradients differently: "
                + "; ".join(f"{s.engine} over ranks {list(s.group_ranks)}: c = "
                            f"{s.gradient_factor:g}" for s in scales)
                + "; one loss multiplier cannot undo both (give them one divide factor)")
    return first
