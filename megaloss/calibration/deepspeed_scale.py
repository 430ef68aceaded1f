"""Measure the gradient factor of a DeepSpeed engine (:mod:`megaloss.calibration.engine_scale`
explains the probe), on a tiny engine built from the training engine's ds_config and groups;
beside DDP's (:func:`~megaloss.calibration.probe_ddp`) and FSDP2's
(:func:`~megaloss.calibration.probe_fsdp`), so that every engine adapter (megaloss's DeepSpeed
loop, the Hugging Face Trainer on accelerate's DeepSpeed engine) measures the same way. What
building that engine needs is here too: the ds_config's AutoTP size
(:func:`ds_config_autotp_size`) and, on CPU, no JIT build of DeepSpeed's shared-memory op
(:func:`skip_cpu_shm_comm_build`).

The group the probe accounts for is the one DeepSpeed itself reduces over: the engine's
sequence-data-parallel group (``engine.seq_data_parallel_group`` in DeepSpeed 0.19's
``runtime/engine.py``; the data-parallel group when there is no sequence parallelism), which
DeepSpeed takes from the ``mpu`` when one is given and otherwise is the whole world.
"""
from __future__ import annotations

import copy
from typing import Any, Mapping

import torch

from ..parallel.comm import all_reduce_max_
from ..parallel.groups import GroupLike, group_ranks
from .engine_scale import EngineScale, ProbeModule, measure_grad_scale

__all__ = ["probe_deepspeed", "engine_reduce_group", "ds_config_autotp_size",
           "skip_cpu_shm_comm_build", "DROPPED_DS_KEYS"]

# Sections that do not change the effective factor but would change what the probe reads or
# build things (optimizers, monitors): mixed precision is unscaled inside step(), clipping
# happens in step(), and the probe brings its own torch optimizer (no JIT-built op).
DROPPED_DS_KEYS = ("optimizer", "scheduler", "fp16", "bf16", "amp", "gradient_clipping",
                   "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler",
                   "wall_clock_breakdown", "checkpoint", "megaloss")

_UNSET = object()


def skip_cpu_shm_comm_build() -> bool:
    """On DeepSpeed's CPU accelerator, do not JIT-compile its optional shared-memory all-reduce.

    DeepSpeed 0.19.8 builds ``deepspeed_shm_comm`` (a C++ op, ~1-3 minutes on 2 busy cores, then
    cached under ``~/.cache/torch_extensions``) the first time its comm backend starts on CPU.
    It is only a faster intra-node all-reduce; gloo does the same work. Marking the op
    incompatible in DeepSpeed's own cache of op compatibility (``deepspeed.ops.__compatible_ops__``,
    which ``deepspeed.comm.torch.build_shm_op`` consults) keeps start-up free of compilation.
    Call it before the first ``deepspeed.init_distributed`` / ``deepspeed.initialize``; a no-op on
    other accelerators, and idempotent.

    Returns:
        True when the build was disabled (CPU accelerator), False otherwise.
    """
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return True


def ds_config_autotp_size(ds_config: Any) -> int:
    """``tensor_parallel.autotp_size`` of a ds_config dict (DeepSpeed's older spelling
    ``tensor_parallel.tp_size`` too); 1 when absent or not an int."""
    section = ds_config.get("tensor_parallel") if isinstance(ds_config, Mapping) else None
    if not isinstance(section, Mapping):
        return 1
    size = section.get("autotp_size", section.get("tp_size", 1))
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 1 else 1


def engine_reduce_group(engine: Any) -> Any:
    """The group a DeepSpeed engine reduces (averages) gradients over: its
    sequence-data-parallel group (= its data-parallel group without sequence parallelism)."""
    group = getattr(engine, "seq_data_parallel_group", None)
    if group is None:
        group = getattr(engine, "data_parallel_group", None)
    return group  # None: DeepSpeed's own default, the world


def probe_deepspeed(config: Mapping[str, Any], *, mpu: Any = None, group: GroupLike = _UNSET,
                    backward: str = "engine") -> EngineScale:
    """Factor of a DeepSpeed engine built from ``config`` (and ``mpu``), on a tiny probe engine.

    The probe engine uses the same DeepSpeed version, ZeRO stage and options, accumulation
    steps and process groups as the training engine, and the same per-micro-batch protocol
    (``engine(x)`` -> backward -> ``engine.step()``); the gradient is read with
    ``deepspeed.utils.safe_get_full_grad`` after the last backward of the step. Collective: call
    it on every rank of the world with the ``config`` and ``mpu`` given to
    ``deepspeed.initialize``.

    The probe's loss is computed inside the module's forward and returned by ``engine.forward``,
    as megaloss requires of models: with a direct ``loss.backward()`` DeepSpeed divides by GAS
    through hooks on forward outputs, so a gradient that bypasses them (a parameter used outside
    forward) is not divided and is not what this probe measures.

    Args:
        config: the ds_config dict (not modified). Mixed precision, optimizer, scheduler,
            clipping and monitor sections are left out of the probe;
            ``zero_allow_untested_optimizer`` is set on the probe's copy (the probe uses
            ``torch.optim.SGD``), so the config needs no such flag.
        mpu: the ``mpu`` passed to ``deepspeed.initialize`` (or None).
        group: optional check only: the ``dp x sp`` group the caller calibrates over. The probe
            always measures over the group the engine reduces over; if ``group`` is given and
            holds other ranks, it raises.
        backward: ``"engine"`` for ``engine.backward(loss)``; ``"loss"`` for a direct
            ``loss.backward()`` on a loss returned by ``engine.forward`` (ZeRO 1-3 only).

    Raises:
        ValueError: ``backward`` unknown, ``config`` not a mapping, or ``group`` holding other
            ranks than the engine's reduction group.
        EngineScaleError: see :func:`megaloss.calibration.engine_scale.measure_grad_scale`.
    """
    if backward not in ("engine", "loss"):
        raise ValueError(f"backward must be 'engine' or 'loss', got {backward!r}")
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a ds_config dict, got {type(config).__name__}")
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    skip_cpu_shm_comm_build()  # the probe may be the first engine: no JIT build on CPU
    cfg = {k: copy.deepcopy(v) for k, v in config.items() if k not in DROPPED_DS_KEYS}
    # ZeRO only knows its own optimizers and refuses others as "untested" unless allowed; the
    # probe's torch SGD (lr 0) never updates anything, and the flag is set on this copy only.
    cfg["zero_allow_untested_optimizer"] = True
    module = ProbeModule(torch.float32)
    if ds_config_autotp_size(cfg) > 1:
        # AutoTP: the engine builds its tensor- and data-parallel groups and reduces over the
        # latter (deepspeed 0.19.8 runtime/engine.py, _configure_tensor_parallel_states); the
        # flag skips the sharding of the probe's one parameter (_apply_autotp_partitioning
        # returns at once), which has no transformer layers or lm_head to shard.
        module.ds_autotp_parsed = True
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.0), config=cfg, mpu=mpu)
    check = getattr(engine, "first_dataloader_check", None)
    if check is not None:
        # AutoTP's engine asserts on its first forward that the TP ranks got equal inputs
        # (runtime/engine.py, check_dataloader_inputs_same_across_ranks); the probe's
        # coefficients differ per global rank on purpose, and each rank measures only over its
        # own reduction group (the DP group), which holds no TP peer.
        check.remove()
        engine.first_dataloader_check = None
    try:
        reduce_group = engine_reduce_group(engine)
        mismatch = group is not _UNSET and group_ranks(group) != group_ranks(reduce_group)
        # Agree across ranks first: a rank raising alone would leave the others in a collective.
        flag = all_reduce_max_(torch.tensor([float(mismatch)], device=engine.device), None)
        if mismatch:
            raise ValueError(
                f"group holds global ranks {group_ranks(group)} but this DeepSpeed engine reduces "
                f"gradients over {group_ranks(reduce_group)}; pass the engine's data-parallel "
                "group (Topology.dp_sp_group of the topology the mpu was built from), or omit "
                "group")
        if float(flag[0]) > 0:
            raise ValueError("another rank passed a group that differs from the DeepSpeed "
                             "engine's reduction group (see its error)")
        gas = int(engine.gradient_accumulation_steps())
        stage = int(engine.zero_optimization_stage())
        name = (f"deepspeed-zero{stage}/"
                f"{'engine.backward' if backward == 'engine' else 'loss.backward'}")

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

        return measure_grad_scale(run, group=reduce_group, gas=gas, engine=name,
                                  device=engine.device)
    finally:
        if hasattr(engine, "destroy"):
            engine.destroy()
