"""megaloss under DeepSpeed: the engine set-up, its adapter to the one calibrated step, the
calibrated training steps, metrics through ``engine.monitor`` and checkpoints.

- :mod:`.engine`: :func:`initialize` -> :class:`MegalossEngine` (engine + calibrator, the
  measured gradient factor), :func:`load_ds_config`.
- :mod:`.step_engine`: :class:`~.step_engine.DeepSpeedStepEngine`, DeepSpeed's adapter to the
  one calibrated step (:mod:`megaloss.integrations.step`), which :class:`MegalossEngine` is.
- :mod:`.train_step`: :func:`train_step` and :func:`evaluate` (cross-entropy and distillation).
- :mod:`.policy_step`: :func:`policy_train_step` (GRPO family, CISPO),
  :func:`preference_train_step` (DPO, CPO, SimPO, ORPO, KTO by the options' type) and
  :func:`dpo_train_step`.
- :mod:`.pipeline`: DeepSpeed's pipeline engine with megaloss's loss on the last stage
  (:func:`~.pipeline.initialize_pipeline`, :func:`~.pipeline.pipeline_train_step`).
- :mod:`.monitor`: :func:`write_metrics` (every event at the engine's global sample count, the
  x-axis DeepSpeed's own events use), :func:`~.monitor.continue_monitors`,
  :func:`~.monitor.close_monitors`.
- :mod:`.checkpoint`: :func:`save_checkpoint` / :func:`load_checkpoint` (DeepSpeed's own, plus
  per-rank RNG states and an atomic ``latest``).
- :mod:`.mpu`: :class:`~.mpu.DeepSpeedMPU`, a Topology's groups as DeepSpeed reads them.
- :mod:`.compat`: process start-up (no JIT build of DeepSpeed's CPU shm op; threads per rank;
  the imports frozen out of the cyclic GC).

Engine-neutral pieces it uses, shared with the other adapters: the ``"megaloss"`` ds_config
section (:mod:`megaloss.integrations.config`), the gradient-factor probe
(:func:`probe_deepspeed`, in :mod:`megaloss.calibration.deepspeed_scale`), the AutoTP wrapper
(:mod:`megaloss.integrations.autotp`) and GradCache's replays
(:mod:`megaloss.integrations.grad_cache`).

Importing this package does not import ``deepspeed``; the functions import it when called.
"""
from ...calibration.deepspeed_scale import probe_deepspeed
from ..autotp import AutoTPCausalLMWithLoss
from ..config import MegalossConfig, load_megaloss_config
from .checkpoint import load_checkpoint, save_checkpoint
from .engine import MegalossEngine, initialize, load_ds_config
from .monitor import write_metrics
from .policy_step import (
    PolicyStepMetrics,
    dpo_train_step,
    policy_train_step,
    preference_train_step,
)
from .train_step import EvalResult, StepMetrics, evaluate, train_step

__all__ = [
    "initialize", "MegalossEngine", "load_ds_config", "MegalossConfig", "load_megaloss_config",
    "train_step", "evaluate", "policy_train_step", "preference_train_step", "dpo_train_step",
    "StepMetrics", "PolicyStepMetrics", "EvalResult", "write_metrics", "save_checkpoint",
    "load_checkpoint", "probe_deepspeed", "AutoTPCausalLMWithLoss",
]
