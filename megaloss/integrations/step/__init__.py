"""The one calibrated optimizer step, engine-neutral: every engine and every loss family through
the same loop (:mod:`.loop`).

- :mod:`.loop`: :func:`run_step` and :class:`CalibratedStep` (checks, calibration, the
  micro-batch loop, the metrics reduced once), :class:`StepEngine` (what an engine adapter
  supplies) and :class:`StepLoss` (what a loss family supplies).
- :mod:`.checks`: the checks agreed on by every rank before the step's first collective.
- :mod:`.metrics`: :class:`StepMetrics`, :class:`PolicyStepMetrics`, :class:`EvalResult`.
- The loss families: :mod:`.lm` (a module computing its own CE or distillation loss; NLL of a
  log-probs module; held-out CE), :mod:`.policy` (:func:`megaloss.policy_loss`),
  :mod:`.preference` (DPO, CPO / SimPO, ORPO, KTO), :mod:`.mnr` (the gathered contrastive
  loss); :mod:`.log_probs`, what the policy and preference families share.

A new engine is a :class:`StepEngine` in its adapter (DeepSpeed:
:class:`megaloss.integrations.deepspeed.MegalossEngine`; FSDP2 / DDP:
:class:`megaloss.integrations.fsdp.FSDPStepEngine`); a new loss family is one
:class:`StepLoss` module here.
"""
from .lm import LanguageModelLoss
from .loop import CalibratedStep, StepEngine, StepLoss, run_step
from .metrics import EvalResult, PolicyStepMetrics, StepMetrics, StepOutcome

__all__ = ["run_step", "CalibratedStep", "StepEngine", "StepLoss", "LanguageModelLoss",
           "StepOutcome", "StepMetrics", "PolicyStepMetrics", "EvalResult"]
