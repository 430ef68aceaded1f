"""DeepSpeed engine set-up for megaloss: the topology's groups as an mpu, a validated ds_config,
the measured gradient factor and the calibrator.

What :func:`initialize` wires, and why:

- **Groups.** From a :class:`~megaloss.Topology` (``Topology.build(tp)`` makes the
  ``("dp", "tp")`` DeviceMesh) it builds the :class:`~.mpu.DeepSpeedMPU`; handed to
  ``deepspeed.initialize(mpu=...)``, ZeRO partitions and averages gradients over the DP group
  only, and gradient clipping counts the ``tensor_model_parallel`` vocab shards once per TP group.
- **Calibration.** The engine's gradient factor is *measured* once with a probe through a real
  DeepSpeed engine of the same config and groups (:func:`~.probe.probe_deepspeed`), then a
  :class:`~megaloss.calibration.LossCalibrator` turns each optimizer step's labels into global
  per-token loss weights (one all-reduce) and per-rank loss multipliers that undo the engine's
  ``1 / (GAS x DP)``. The training step (:mod:`.train_step`) uses ``engine.backward``, so every
  gradient, decoder and lm_head alike, is scaled the same way.

``deepspeed`` itself is imported inside the functions that need it, so importing this module is
cheap.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from ...calibration import EngineScale, LossCalibrator
from ...calibration.deepspeed_scale import ds_config_autotp_size, probe_deepspeed
from ...calibration.weights import loss_weight_dtype
from ...parallel.topology import Topology
from ..config import MegalossConfig, load_megaloss_config
from ..lm_head import refuse_unsummed
from .compat import skip_cpu_shm_comm_build
from .mpu import DeepSpeedMPU
from .step_engine import DeepSpeedStepEngine

__all__ = ["MegalossEngine", "load_ds_config", "initialize", "needs_output_dir",
           "default_output_dir"]


def load_ds_config(ds_config: Union[str, os.PathLike, Mapping[str, Any]], *,
                   output_dir: Optional[str] = None) -> Tuple[Dict[str, Any], MegalossConfig]:
    """Read a ds_config (path or dict), validate its ``"megaloss"`` section (and catch a
    misspelled one, :func:`~.config.check_top_level_keys`), and point the file-writing monitors
    without an ``output_path`` (``csv_monitor``, ``tensorboard``) at ``<output_dir>/monitor``.

    W&B takes no path from the ds_config: :func:`initialize` points ``WANDB_DIR`` at
    ``output_dir``.

    Returns:
        ``(ds_config dict (a deep copy), MegalossConfig)``.

    Raises:
        ValueError / TypeError / FileNotFoundError: see
            :func:`~.config.load_megaloss_config`.
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
        for key in _FILE_MONITORS:
            section = cfg.get(key)
            if (isinstance(section, dict) and section.get("enabled")
                    and not section.get("output_path")):
                section["output_path"] = os.path.join(output_dir, "monitor")
    return cfg, ml


_FILE_MONITORS = ("csv_monitor", "tensorboard")  # the monitors DeepSpeed writes to a path


def _enabled(cfg: Mapping[str, Any], key: str) -> bool:
    section = cfg.get(key)
    return isinstance(section, Mapping) and bool(section.get("enabled"))


def needs_output_dir(cfg: Mapping[str, Any]) -> bool:
    """Whether an enabled monitor would write relative to the current directory: a
    ``csv_monitor`` / ``tensorboard`` section without ``output_path``, or ``wandb`` without
    ``WANDB_DIR``."""
    return (any(_enabled(cfg, k) and not cfg[k].get("output_path") for k in _FILE_MONITORS)
            or (_enabled(cfg, "wandb") and not _user_wandb_dir()))


_OWN_WANDB_DIR = [None]  # the WANDB_DIR initialize set last (a later run in the process resets it)


def _user_wandb_dir() -> Optional[str]:
    """``WANDB_DIR`` when the user set it (not when an earlier :func:`initialize` did)."""
    value = os.environ.get("WANDB_DIR")
    return value if value and value != _OWN_WANDB_DIR[0] else None


_OWN_WANDB_CACHE_DIR = [None]


def keep_wandb_cache_in_run_dir() -> None:
    """Point ``WANDB_CACHE_DIR`` at ``WANDB_DIR`` unless the user set it: wandb-core writes its
    ``logs/core-debug-*.log`` under ``WANDB_CACHE_DIR`` (default ``~/.cache/wandb``), so without
    this a run with ``WANDB_DIR`` set still leaves files in the home directory (measured with
    wandb 0.31). With both set, everything W&B writes lies under ``<WANDB_DIR>/wandb``."""
    run_dir = os.environ.get("WANDB_DIR")
    current = os.environ.get("WANDB_CACHE_DIR")
    if run_dir and (not current or current == _OWN_WANDB_CACHE_DIR[0]):
        os.environ["WANDB_CACHE_DIR"] = _OWN_WANDB_CACHE_DIR[0] = run_dir


def default_output_dir() -> str:
    """A fresh folder for one run's monitor output, ``runs/<date>-<time>`` under the current
    directory (``-2``, ``-3``, ... appended when it exists). Not collective: DeepSpeed's monitors
    write on global rank 0 only, so rank 0's choice is the one that counts."""
    import time

    base = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    name, n = base, 1
    while os.path.exists(name):
        n += 1
        name = f"{base}-{n}"
    return name


@dataclass
class MegalossEngine(DeepSpeedStepEngine):
    """What :func:`initialize` returns; the DeepSpeed engine's adapter to the one calibrated
    step (:class:`~.step_engine.DeepSpeedStepEngine`: ``run_step(me, loss, micro_batches)``).

    Attributes:
        engine: the ``deepspeed.DeepSpeedEngine``.
        optimizer, lr_scheduler: as ``deepspeed.initialize`` returns them.
        calibrator: :class:`~megaloss.calibration.LossCalibrator` (``loss_reduction`` from the
            config, the measured engine scale).
        config: the validated :class:`MegalossConfig`.
        ds_config: the ds_config dict the engine was built from.
        topology: the :class:`~megaloss.Topology`.
        mpu: the :class:`~.mpu.DeepSpeedMPU` given to DeepSpeed (None for one process).
    """

    engine: Any
    optimizer: Any
    lr_scheduler: Any
    calibrator: LossCalibrator
    config: MegalossConfig
    ds_config: Dict[str, Any]
    topology: Topology
    mpu: Optional[DeepSpeedMPU]

    @property
    def engine_scale(self) -> EngineScale:
        return self.calibrator.engine_scale


def initialize(module: nn.Module, ds_config: Union[str, os.PathLike, Mapping[str, Any]], *,
               topology: Optional[Topology] = None,
               optimizer: Union[None, torch.optim.Optimizer, Callable[..., Any]] = None,
               lr_scheduler: Any = None, output_dir: Optional[str] = None,
               ignore_index: int = -100) -> MegalossEngine:
    """Build the DeepSpeed engine with megaloss's groups, gradient-scale probe and calibrator.

    Collective: every rank calls it. The probe builds a tiny second engine from the same
    ds_config and groups (a few ms) before the real one.

    Args:
        module: the model whose forward returns the loss (e.g.
            :class:`~megaloss.integrations.hf.CausalLMWithLoss`).
        ds_config: path or dict; its ``"megaloss"`` section is validated, and its
            ``tensor_parallel_size`` must equal ``topology.tp_size``.
        topology: the process groups (e.g. ``Topology.build(tensor_parallel_size)``); an
            ``sp`` of size 1. ``None`` (and only ``None``) under DeepSpeed AutoTP
            (``"tensor_parallel": {"autotp_size": N, "vocab_parallel_lm_head": true}``): the
            groups are AutoTP's, built inside ``deepspeed.initialize``
            (:func:`megaloss.integrations.autotp.autotp_topology`); ``module`` is then a
            ``*ForCausalLM`` (wrapped here in
            :class:`megaloss.integrations.autotp.AutoTPCausalLMWithLoss` with the config's CE
            options) or that wrapper, sharded by AutoTP, the loss computed on its lm_head
            shard, and the gradient factor measured on a probe engine with AutoTP's groups.
        optimizer: a ``torch.optim`` optimizer, or None to let the ds_config's ``"optimizer"``
            section build one (use ``"torch_adam": true`` on CPU: DeepSpeed's fused/CPU Adam
            would JIT-compile an op). Under AutoTP a callable ``params -> optimizer`` instead of
            an optimizer: AutoTP replaces the sharded layers' Parameters inside
            ``deepspeed.initialize``, so an optimizer built beforehand holds the unsharded ones.
        lr_scheduler: optional client scheduler (else the ds_config's ``"scheduler"``).
        output_dir: the run's output folder: monitors without an ``output_path`` write to
            ``<output_dir>/monitor``, and W&B (unless ``WANDB_DIR`` is set) to
            ``<output_dir>/wandb``. When None and such a monitor is enabled, a fresh
            ``runs/<date>-<time>`` folder under the current directory (logged), so no monitor
            writes into the current directory or mixes with another run.
        ignore_index: label value without loss (calibration).

    Raises:
        ValueError: bad ``"megaloss"`` section, or a TP size that differs from ``topology``.
        TypeError: ``topology`` is not a Topology; under AutoTP a ``torch.optim.Optimizer``
            instance, or a module that is neither a ``*ForCausalLM`` nor the AutoTP wrapper.
        megaloss.calibration.EngineScaleError: the engine reduces gradients in a way megaloss
            cannot compensate.
    """
    import deepspeed

    skip_cpu_shm_comm_build()
    cfg, ml = load_ds_config(ds_config)
    if output_dir is None and needs_output_dir(cfg):
        output_dir = default_output_dir()
        from deepspeed.utils import log_dist

        log_dist(f"megaloss.initialize: no output_dir given; monitor output goes to "
                 f"{os.path.abspath(output_dir)}", ranks=[0], level=30)
    if output_dir is not None:
        cfg, ml = load_ds_config(cfg, output_dir=output_dir)
        if _enabled(cfg, "wandb") and not _user_wandb_dir():
            # DeepSpeed's wandb.init takes no dir: W&B reads WANDB_DIR (default: the cwd).
            os.makedirs(output_dir, exist_ok=True)
            os.environ["WANDB_DIR"] = _OWN_WANDB_DIR[0] = os.path.abspath(output_dir)
    if _enabled(cfg, "wandb"):
        keep_wandb_cache_in_run_dir()
    if ds_config_autotp_size(cfg) > 1:
        return _initialize_autotp(module, cfg, ml, topology=topology, optimizer=optimizer,
                                  lr_scheduler=lr_scheduler, ignore_index=ignore_index)
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a megaloss Topology, got {type(topology).__name__}")
    if ml.tensor_parallel_size != topology.tp_size:
        raise ValueError(f"megaloss.tensor_parallel_size={ml.tensor_parallel_size} but the process "
                         f"groups have tp={topology.tp_size}")
    if ml.pipeline_parallel_size != 1:
        raise ValueError(f"megaloss.pipeline_parallel_size={ml.pipeline_parallel_size} needs "
                         "DeepSpeed's pipeline engine: build the stages and call "
                         "megaloss.integrations.deepspeed.pipeline.initialize_pipeline")
    if ml.sequence_parallel_size != topology.sp_size:
        raise ValueError(f"megaloss.sequence_parallel_size={ml.sequence_parallel_size} but the "
                         f"process groups have sp={topology.sp_size}")
    import torch.distributed as dist

    refuse_unsummed(module, "megaloss.integrations.deepspeed.initialize")
    mpu = DeepSpeedMPU(topology) if dist.is_initialized() else None
    # The probe reads the group from the engine it builds and allows its own SGD under ZeRO on
    # its copy of the config.
    scale = probe_deepspeed(cfg, mpu=mpu, backward="engine")
    params = [p for p in module.parameters() if p.requires_grad]
    engine, opt, _, sched = deepspeed.initialize(
        model=module, model_parameters=params if optimizer is None else None,
        optimizer=optimizer, lr_scheduler=lr_scheduler, config=cfg, mpu=mpu)
    calibrator = LossCalibrator(topology, loss_reduction=ml.loss_reduction,
                                engine_scale=scale, ignore_index=ignore_index,
                                weight_dtype=loss_weight_dtype(module))
    return MegalossEngine(engine, opt, sched, calibrator, ml, cfg, topology, mpu)


def _initialize_autotp(module: nn.Module, cfg: Dict[str, Any], ml: MegalossConfig, *,
                       topology: Optional[Topology], optimizer: Any, lr_scheduler: Any,
                       ignore_index: int) -> MegalossEngine:
    """:func:`initialize` under DeepSpeed AutoTP (the ds_config's ``tensor_parallel`` section is
    already checked by :func:`~.config.load_megaloss_config`): no megaloss mpu (AutoTP's engine
    sets its own, ``deepspeed.utils.groups``), the probe built with the same config (so with
    AutoTP's groups), then the engine and the topology read from its groups."""
    import deepspeed

    from ..autotp import AutoTPCausalLMWithLoss, autotp_topology
    from ..lm_head import is_loss_head

    if topology is not None:
        raise ValueError("under AutoTP (ds_config tensor_parallel.autotp_size > 1) the process "
                         "groups are AutoTP's, built inside deepspeed.initialize: pass "
                         "topology=None (megaloss reads them with autotp_topology)")
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("under AutoTP pass the optimizer as a callable params -> optimizer (e.g. "
                        "lambda params: torch.optim.AdamW(params, lr=...)) or a ds_config "
                        "'optimizer' section: AutoTP replaces the sharded layers' Parameters "
                        "inside deepspeed.initialize, so an optimizer built before holds the "
                        "unsharded ones")
    head = getattr(module, "get_output_embeddings", lambda: None)()
    if is_loss_head(head):
        raise TypeError("under AutoTP pass the *ForCausalLM itself (or AutoTPCausalLMWithLoss): "
                        f"{type(module).__name__} replaced its nn.Linear lm_head, which AutoTP "
                        "shards")
    if not isinstance(module, AutoTPCausalLMWithLoss):
        if not (hasattr(module, "base_model") and hasattr(module, "get_output_embeddings")):
            raise TypeError(f"under AutoTP the module must be a Hugging Face *ForCausalLM (or "
                            f"AutoTPCausalLMWithLoss), got {type(module).__name__}: AutoTP "
                            "shards its nn.Linear lm_head inside deepspeed.initialize")
        module = AutoTPCausalLMWithLoss(module, options=ml.ce.options(ignore_index))
    scale = probe_deepspeed(cfg, mpu=None, backward="engine")
    # lazily read: DeepSpeed consumes it after AutoTP's replacement (runtime/engine.py)
    params = (p for p in module.parameters() if p.requires_grad)
    engine, opt, _, sched = deepspeed.initialize(
        model=module, model_parameters=params if optimizer is None else None,
        optimizer=optimizer, lr_scheduler=lr_scheduler, config=cfg)
    topology = autotp_topology(engine)
    calibrator = LossCalibrator(topology, loss_reduction=ml.loss_reduction,
                                engine_scale=scale, ignore_index=ignore_index,
                                weight_dtype=loss_weight_dtype(module))
    return MegalossEngine(engine, opt, sched, calibrator, ml, cfg, topology, None)
