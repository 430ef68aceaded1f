"""megaloss under DeepSpeed: the ``"megaloss"`` ds_config section, the ``mpu``, the measured
gradient factor, the engine set-up, the calibrated training step and metrics through
``engine.monitor``.

- :mod:`.config`: the validated ``"megaloss"`` section (:class:`MegalossConfig`).
- :mod:`.compat`: process start-up (no JIT build of DeepSpeed's CPU shm op; threads per rank;
  the imports frozen out of the cyclic GC).
- :mod:`.mpu`: :class:`DeepSpeedMPU`, a Topology's groups as DeepSpeed reads them.
- :mod:`.probe`: :func:`probe_deepspeed`, the gradient factor of a DeepSpeed engine.
- :mod:`.engine`: :func:`initialize` -> :class:`MegalossEngine` (engine + calibrator).
- :mod:`.train_step`: :func:`train_step` and :func:`evaluate`.
- :mod:`.policy_step`: :func:`policy_train_step` (GRPO family, CISPO) and
  :func:`dpo_train_step` (DPO / IPO), :func:`preference_train_step` (DPO, CPO, SimPO, ORPO,
  KTO by the options' type), calibrated over the global batch.
- :mod:`.step_checks`: the steps' micro-batch checks, agreed on by every rank before the first
  collective (one error everywhere, no rank left waiting).
- :mod:`.monitor`: :func:`write_metrics` (every event at the engine's global sample count, the
  x-axis DeepSpeed's own events use), :func:`continue_monitors`, :func:`close_monitors`.
- :mod:`.checkpoint`: :func:`save_checkpoint` / :func:`load_checkpoint` (DeepSpeed's own, plus
  per-rank RNG states and an atomic ``latest``).
- :mod:`.autotp`: megaloss's CE on the ``VocabParallelLinear`` lm_head shard of DeepSpeed AutoTP
  (``"tensor_parallel": {"autotp_size": N, "vocab_parallel_lm_head": true}``).
- :mod:`.grad_cache`: :func:`~.grad_cache.inner_replay_backward`, GradCache's replays as
  DeepSpeed accumulation passes (so ZeRO-2/3 accept them).

Importing this package does not import ``deepspeed``; the functions import it when called.
"""
from ...calibration.deepspeed_scale import probe_deepspeed
from ..autotp import (
    AutoTPCausalLMWithLoss,
    autotp_causal_lm_loss,
    autotp_lm_head,
    autotp_topology,
    autotp_vocab_parallel_options,
)
from ..config import (
    CEConfig,
    DistillationConfig,
    DPOConfig,
    MegalossConfig,
    MNRConfig,
    PolicyConfig,
    check_top_level_keys,
    load_megaloss_config,
)
from .checkpoint import load_checkpoint, resolve_checkpoint, save_checkpoint
from .compat import configure_launched_process, freeze_imported_objects, skip_cpu_shm_comm_build
from .engine import MegalossEngine, initialize, keep_wandb_cache_in_run_dir, load_ds_config
from .monitor import (
    MONITOR_SECTIONS,
    close_monitors,
    continue_monitors,
    monitor_step,
    write_metrics,
)
from .mpu import DeepSpeedMPU
from .policy_step import (
    PolicyStepMetrics,
    dpo_train_step,
    policy_train_step,
    preference_train_step,
)
from .train_step import EvalResult, StepMetrics, evaluate, peak_memory_mib, train_step

__all__ = [
    "MegalossConfig", "CEConfig", "MNRConfig", "DistillationConfig", "load_megaloss_config",
    "load_ds_config",
    "DeepSpeedMPU", "probe_deepspeed", "initialize", "MegalossEngine", "train_step", "evaluate",
    "StepMetrics", "EvalResult", "peak_memory_mib", "write_metrics", "MONITOR_SECTIONS",
    "skip_cpu_shm_comm_build", "configure_launched_process", "freeze_imported_objects",
    "check_top_level_keys",
    "monitor_step", "continue_monitors", "close_monitors", "save_checkpoint", "load_checkpoint",
    "resolve_checkpoint", "keep_wandb_cache_in_run_dir", "PolicyConfig", "DPOConfig",
    "policy_train_step", "dpo_train_step", "preference_train_step", "PolicyStepMetrics",
    "autotp_lm_head", "autotp_topology", "autotp_vocab_parallel_options", "autotp_causal_lm_loss",
    "AutoTPCausalLMWithLoss",
]
