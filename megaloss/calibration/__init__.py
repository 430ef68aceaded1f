"""Global loss calibration across data parallel x sequence parallel x gradient accumulation.

- :mod:`.weights`: per-token loss weights (``token`` / ``sample`` / ``square``, XTuner's
  ``loss_reduction``) normalised by one global denominator (one all-reduce per optimizer step).
- :mod:`.engine_scale`: measure, with a probe through the real engine path, the factor an engine
  (none, DDP) applies to gradients, and the per-rank loss multiplier undoing it (the DeepSpeed
  probe is :func:`megaloss.calibration.deepspeed_scale.probe_deepspeed`).
- :mod:`.fsdp_scale`: the same for PyTorch FSDP2 (``fully_shard``, 1-D or HSDP):
  :func:`probe_fsdp`.
- :mod:`.calibrator`: :class:`LossCalibrator` / :class:`StepCalibration`, the per-step object a
  training loop or engine integration calls.

``__all__`` is what a training loop calls (the calibrator, its step, the engine factor and its
probes); the weight functions and the probe machinery are imported from their modules.
"""
from .calibrator import LossCalibrator, StepCalibration
from .engine_scale import EngineScale, EngineScaleError, probe_ddp
from .fsdp_scale import probe_fsdp

__all__ = ["LossCalibrator", "StepCalibration", "EngineScale", "EngineScaleError", "probe_ddp",
           "probe_fsdp"]
