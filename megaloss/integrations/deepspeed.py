"""DeepSpeed engine set-up for megaloss: DP x TP groups, a validated ds_config, the measured
gradient scale, and metrics through ``engine.monitor``.

What :func:`initialize` wires, and why:

- **Groups.** :func:`build_parallel` makes a ``("dp", "tp")`` DeviceMesh and the matching
  :class:`~megaloss.distributed.mpu.DeepSpeedMPU`; handed to ``deepspeed.initialize(mpu=...)``,
  ZeRO partitions and averages gradients over the DP group only, and gradient clipping counts the
  ``tensor_model_parallel`` vocab shards once per TP group.
- **Calibration.** The engine's effective gradient scale is *measured* once with a probe through
  a real DeepSpeed engine of the same config and groups
  (:func:`megaloss.calibration.probe_deepspeed`), then a
  :class:`~megaloss.calibration.LossCalibrator` turns each optimizer step's labels into global
  per-token loss weights (one all-reduce) and per-rank loss multipliers that undo the engine's
  ``1 / (GAS x DP)``. The training loop (:mod:`megaloss.integrations.trainer`) uses
  ``engine.backward``, so every gradient, decoder and lm_head alike, is scaled the same way.
- **Metrics.** :func:`write_metrics` sends ``(tag, value, step)`` events to
  ``engine.monitor.write_events``, so the ds_config's ``csv_monitor`` / ``wandb`` /
  ``tensorboard`` sections work unchanged (the monitor writes on global rank 0).

``deepspeed`` itself is imported inside the functions that need it, so importing this module is
cheap.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from ..calibration import EngineScale, LossCalibrator, probe_deepspeed
from ..distributed.deepspeed_compat import skip_cpu_shm_comm_build
from ..distributed.mpu import DeepSpeedMPU, init_dp_tp_mesh
from ..distributed.topology import Topology
from .config import MegalossConfig, load_megaloss_config

__all__ = ["ParallelState", "MegalossEngine", "build_parallel", "load_ds_config", "initialize",
           "write_metrics", "skip_cpu_shm_comm_build", "configure_launched_process",
           "MONITOR_SECTIONS"]

MONITOR_SECTIONS = ("csv_monitor", "tensorboard", "wandb", "comet")


def configure_launched_process(log_level: int = logging.WARNING) -> None:
    """Per-process start-up of a job run by the ``deepspeed`` launcher, before
    ``deepspeed.init_distributed``.

    - DeepSpeed's logger at ``log_level`` (its INFO lines drown the job's own log).
    - On CPU, unless ``OMP_NUM_THREADS`` is set: torch threads = cores / processes on this node
      (``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``). The launcher starts one process per "GPU";
      on CPU each would otherwise use every core and they fight over them (measured: ~20x slower
      steps on 2 cores).
    - :func:`skip_cpu_shm_comm_build` (no JIT build of DeepSpeed's optional CPU all-reduce op).
    """
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(log_level)
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    skip_cpu_shm_comm_build()


@dataclass(frozen=True)
class ParallelState:
    """The DP x TP layout of this rank: ``mesh`` (DeviceMesh or None for one process),
    ``topology`` (:class:`~megaloss.Topology`) and ``mpu`` (for ``deepspeed.initialize``)."""

    mesh: Any
    topology: Topology
    mpu: Optional[DeepSpeedMPU]

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size

    @property
    def tp_size(self) -> int:
        return self.topology.tp_size


def build_parallel(tensor_parallel_size: int = 1, *,
                   device_type: Optional[str] = None) -> ParallelState:
    """DP x TP groups from a DeviceMesh (collective: every rank calls it).

    Without torch.distributed (a single process), returns an empty topology and no mpu; then
    ``tensor_parallel_size`` must be 1.

    Raises:
        ValueError: ``tensor_parallel_size`` < 1 or not a divisor of the world size.
    """
    if not dist.is_initialized():
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs "
                             "torch.distributed to be initialised")
        return ParallelState(None, Topology(), None)
    mesh = init_dp_tp_mesh(tensor_parallel_size, device_type=device_type)
    mpu = DeepSpeedMPU.from_device_mesh(mesh)
    return ParallelState(mesh, mpu.topology, mpu)


def load_ds_config(ds_config: Union[str, os.PathLike, Mapping[str, Any]], *,
                   output_dir: Optional[str] = None) -> Tuple[Dict[str, Any], MegalossConfig]:
    """Read a ds_config (path or dict), validate its ``"megaloss"`` section, and point the
    monitors without an ``output_path`` at ``output_dir``.

    Returns:
        ``(ds_config dict (a deep copy), MegalossConfig)``.

    Raises:
        ValueError / TypeError / FileNotFoundError: see
            :func:`~megaloss.integrations.config.load_megaloss_config`.
    """
    if isinstance(ds_config, (str, os.PathLike)):
        with open(ds_config, encoding="utf-8") as f:
            cfg = json.load(f)
    elif isinstance(ds_config, Mapping):
        cfg = copy.deepcopy(dict(ds_config))
    else:
        raise TypeError(f"ds_config must be a path or a dict, got {type(ds_config).__name__}")
    ml = load_megaloss_config(cfg)
    if output_dir is not None:
        for key in MONITOR_SECTIONS:
            section = cfg.get(key)
            # wandb and comet log to their own services (or WANDB_DIR), not to a path.
            if (key in ("csv_monitor", "tensorboard") and isinstance(section, dict)
                    and section.get("enabled") and not section.get("output_path")):
                section["output_path"] = os.path.join(output_dir, "monitor")
    return cfg, ml


@dataclass
class MegalossEngine:
    """What :func:`initialize` returns.

    Attributes:
        engine: the ``deepspeed.DeepSpeedEngine``.
        optimizer, lr_scheduler: as ``deepspeed.initialize`` returns them.
        calibrator: :class:`~megaloss.calibration.LossCalibrator` (reduction from the config,
            the measured engine scale).
        config: the validated :class:`MegalossConfig`.
        ds_config: the ds_config dict the engine was built from.
        parallel: the :class:`ParallelState`.
    """

    engine: Any
    optimizer: Any
    lr_scheduler: Any
    calibrator: LossCalibrator
    config: MegalossConfig
    ds_config: Dict[str, Any]
    parallel: ParallelState

    @property
    def engine_scale(self) -> EngineScale:
        return self.calibrator.engine_scale

    @property
    def topology(self) -> Topology:
        return self.parallel.topology


def initialize(module: nn.Module, ds_config: Union[str, os.PathLike, Mapping[str, Any]], *,
               parallel: ParallelState, optimizer: Optional[torch.optim.Optimizer] = None,
               lr_scheduler: Any = None, output_dir: Optional[str] = None,
               ignore_index: int = -100) -> MegalossEngine:
    """Build the DeepSpeed engine with megaloss's groups, gradient-scale probe and calibrator.

    Collective: every rank calls it. The probe builds a tiny second engine from the same
    ds_config and groups (a few ms) before the real one.

    Args:
        module: the model whose forward returns the loss (e.g.
            :class:`~megaloss.integrations.hf.CausalLMWithLoss`).
        ds_config: path or dict; its ``"megaloss"`` section is validated, and its
            ``tensor_parallel_size`` must equal ``parallel.tp_size``.
        parallel: from :func:`build_parallel`.
        optimizer: a ``torch.optim`` optimizer, or None to let the ds_config's ``"optimizer"``
            section build one (use ``"torch_adam": true`` on CPU: DeepSpeed's fused/CPU Adam
            would JIT-compile an op).
        lr_scheduler: optional client scheduler (else the ds_config's ``"scheduler"``).
        output_dir: where monitors without an ``output_path`` write (``<output_dir>/monitor``).
        ignore_index: label value without loss (calibration).

    Raises:
        ValueError: bad ``"megaloss"`` section, or a TP size that differs from ``parallel``.
        megaloss.calibration.EngineScaleError: the engine reduces gradients in a way megaloss
            cannot compensate.
    """
    import deepspeed

    skip_cpu_shm_comm_build()
    cfg, ml = load_ds_config(ds_config, output_dir=output_dir)
    if ml.tensor_parallel_size != parallel.tp_size:
        raise ValueError(f"megaloss.tensor_parallel_size={ml.tensor_parallel_size} but the process "
                         f"groups have tp={parallel.tp_size}")
    # The probe allows its own SGD under ZeRO on its copy of the config (engine_scale).
    scale = probe_deepspeed(cfg, group=parallel.topology.dp_sp_group, mpu=parallel.mpu,
                            backward="engine")
    params = [p for p in module.parameters() if p.requires_grad]
    engine, opt, _, sched = deepspeed.initialize(
        model=module, model_parameters=params if optimizer is None else None,
        optimizer=optimizer, lr_scheduler=lr_scheduler, config=cfg, mpu=parallel.mpu)
    calibrator = LossCalibrator(parallel.topology, reduction=ml.ce.reduction, engine_scale=scale,
                                ignore_index=ignore_index)
    return MegalossEngine(engine, opt, sched, calibrator, ml, cfg, parallel)


def write_metrics(engine: Any, metrics: Mapping[str, float], step: int,
                  prefix: str = "Train/megaloss/") -> None:
    """Send ``{name: value}`` to the engine's monitors as ``(prefix + name, value, step)``.

    DeepSpeed's ``MonitorMaster`` writes on global rank 0 only and does nothing when no monitor
    section is enabled; every rank may call this. ``None`` values are skipped.
    """
    monitor = getattr(engine, "monitor", None)
    if monitor is None or not getattr(monitor, "enabled", False):
        return
    events = [(prefix + k, float(v), int(step)) for k, v in metrics.items() if v is not None]
    monitor.write_events(events)
