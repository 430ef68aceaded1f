"""megaloss in the engines users train with: an engine-neutral layer, then thin adapters.

The engine-neutral layer (imported by every adapter; no adapter imports another):

- :mod:`.config`: the ``"megaloss"`` ds_config section (:class:`~.config.MegalossConfig`), which
  the DeepSpeed loop, the Hugging Face Trainer, FSDP2 and DDP all read.
- :mod:`.step`: the one calibrated optimizer step (:func:`~.step.run_step`,
  :class:`~.step.CalibratedStep`): agreed checks, the calibration, the micro-batch loop, the
  metrics reduced once; what an engine supplies (:class:`~.step.StepEngine`) and what a loss
  family supplies (:class:`~.step.StepLoss`; the families :mod:`.step.lm`,
  :mod:`.step.policy`, :mod:`.step.preference`).
- :mod:`.lm_head` and :mod:`.head_config`: what megaloss reads of a causal LM's output head and
  the logit transforms of its config; :mod:`.autotp`: the wrapper of a ``*ForCausalLM`` for
  DeepSpeed AutoTP; :mod:`.grad_cache`: GradCache's replays as engine accumulation passes.

The adapters, each a :class:`~.step.StepEngine` (or, for a loop that owns its backward, the two
halves of :class:`~.step.CalibratedStep`) plus what is particular to its engine:

- :mod:`.deepspeed`: :func:`~.deepspeed.initialize` -> :class:`~.deepspeed.MegalossEngine`, the
  training steps, the pipeline engine, monitors, checkpoints;
- :mod:`.fsdp`: :class:`~.fsdp.FSDPStepEngine` for FSDP2 (``fully_shard``) and DDP;
- :mod:`.hf`: the Hugging Face model wrappers, the Trainer (``compute_loss`` on the one step),
  sentence-transformers and TRL.

Adding an engine: a :class:`~.step.StepEngine` in its adapter module. Adding a loss family: a
:class:`~.step.StepLoss` module in :mod:`.step`. Importing these packages imports neither
``deepspeed`` nor ``transformers``.
"""
