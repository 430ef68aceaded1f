"""The calibrated training step and evaluation of a :class:`~.engine.MegalossEngine` whose module
returns a :class:`megaloss.CrossEntropyOutput` (e.g.
:class:`~megaloss.integrations.hf.CausalLMWithLoss`).

One optimizer step (:func:`train_step`) over ``G`` micro-batches (``G`` = the ds_config's
``gradient_accumulation_steps``):

1. the labels of all ``G`` micro-batches are known up front: the calibrator turns them into
   global per-token weights with ONE all-reduce over ``dp x sp`` (TP replicas hold the same
   tokens and are not counted twice);
2. per micro-batch: ``engine(...)`` runs decoder + fused CE inside the module (ZeRO-3 gathers the
   lm_head there), ``engine.backward(loss x measured multiplier)``, ``engine.step()``;
3. at the boundary: the global loss (one all-reduce, identical on all ranks, equal to what one
   device computes on the whole global batch), global z-loss, global valid tokens, learning rate,
   gradient norm, tokens/s and peak memory, written through ``engine.monitor`` at the engine's
   global sample count, the x-axis DeepSpeed's own events use (:mod:`.monitor`).

The module may instead return a :class:`megaloss.DistillationOutput` (e.g.
:class:`~megaloss.integrations.hf.distillation.CausalLMWithDistillation`): the same calibrated
step, and the metrics add the global calibrated divergence, the hard-label CE and the
teacher-student top-1 agreement. Micro-batches may carry a stored top-k teacher
(``teacher_topk_ids`` / ``teacher_topk_log_probs``, ``[B, T, k]``), passed to the module.
Under sequence parallelism each SP rank forwards its slice of the tokens (and of the top-k
teacher); a teacher module attends over the whole sequence through Ulysses as the student does
(:func:`megaloss.integrations.hf.ulysses.enable_ulysses_attention` with ``teacher=``). The
divergence is per token, so the calibrated sums over ``dp x sp`` are the one-device loss.

Before the step's first collective every rank checks its micro-batches, and an all-gather of a
failure flag over the ``dp x sp`` and the TP group lets all raise the same error
(:mod:`megaloss.integrations.step.checks`); the other host syncs are at the boundary, for logging.

Both are thin calls of the one engine-neutral step (:func:`megaloss.integrations.step.run_step`
with the :mod:`~megaloss.integrations.step.lm` family; the engine's adapter is
:class:`~.step_engine.DeepSpeedStepEngine`, which the :class:`~.engine.MegalossEngine` is).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

import torch

from ..step.lm import LanguageModelLoss, evaluate_lm, micro_batch_targets
from ..step.loop import batch_to_device, run_step
from ..step.metrics import EvalResult, StepMetrics, peak_memory_mib
from .engine import MegalossEngine
from .monitor import write_metrics
from .step_engine import reduced_grad_norm

__all__ = ["StepMetrics", "EvalResult", "train_step", "evaluate", "peak_memory_mib",
           "batch_to_device", "micro_batch_targets", "reduced_grad_norm"]


def _check_sp_teacher(me: MegalossEngine) -> None:
    """Distillation under sequence parallelism: a teacher *module* must attend over the whole
    sequence too, i.e. its attention routed through Ulysses by
    :func:`megaloss.integrations.hf.ulysses.enable_ulysses_attention` (``teacher=``)."""
    teacher = getattr(getattr(me.engine, "module", None), "teacher", None)
    if me.topology.sp_size == 1 or teacher is None:
        return
    if getattr(teacher, "_megaloss_ulysses_sp", None) != me.topology.sp_size:
        raise ValueError("distillation under sequence parallelism (sp > 1) needs the teacher's "
                         "attention over the whole sequence: pass teacher=<the teacher> to "
                         "megaloss.integrations.hf.ulysses.enable_ulysses_attention (else it "
                         "would see only this rank's slice)")


def train_step(me: MegalossEngine, micro_batches: Sequence[Mapping[str, torch.Tensor]], *,
               log: bool = True) -> StepMetrics:
    """One calibrated optimizer step over this rank's micro-batches.

    Args:
        me: from :func:`~.engine.initialize`.
        micro_batches: exactly ``gradient_accumulation_steps`` dicts with ``input_ids [B, T]``
            and either Hugging Face ``labels [B, T]`` (unshifted; shifted here) or
            ``shift_labels [B, T]`` (already shifted); optional ``attention_mask``,
            ``position_ids``, ``cu_seqlens``. Packed samples: ``cu_seqlens``, or else
            ``position_ids`` restarting at 0 where a sample starts, mark them for the
            ``sample`` / ``square`` calibration. TP ranks of one DP rank must pass the same
            batches.
        log: write the metrics through ``engine.monitor`` (tags ``Train/megaloss/<name>``
            and ``Train/megaloss/optimizer_step``, at the global sample count DeepSpeed's own
            ``Train/Samples/*`` events use).

    Returns:
        :class:`StepMetrics`.

    Raises:
        ValueError: the number of micro-batches differs from the engine's accumulation steps;
            a micro-batch without ``labels`` / ``shift_labels``, or with targets,
            ``position_ids`` or a top-k teacher of another shape than ``input_ids``; a
            distillation module under sequence parallelism whose teacher module was not given
            to :func:`megaloss.integrations.hf.ulysses.enable_ulysses_attention` (it would see
            only this rank's slice). The micro-batch checks are agreed on by every rank before
            the step's first collective (:mod:`megaloss.integrations.step.checks`): the same
            error on every rank, naming the failed ranks. So are the loss's own checks in each
            forward (a label outside the vocabulary, NaN or inf hidden states:
            :func:`megaloss.integrations.step.checks.agreed_forward`), before its backward.
        TypeError: non-integer ``input_ids`` / targets / top-k ids, non-floating top-k
            log-probs (agreed on likewise).
    """
    router = me.config.router.options() if me.config.router is not None else None
    return run_step(me, LanguageModelLoss(check_teacher=lambda: _check_sp_teacher(me),
                                          router=router),
                    micro_batches, log=log)


@torch.no_grad()
def evaluate(me: MegalossEngine, batches: Iterable[Mapping[str, torch.Tensor]], *,
             log: bool = False, log_step: Optional[int] = None) -> EvalResult:
    """Token-mean CE over held-out batches, global over ``dp x sp`` (one all-reduce at the end).

    Every rank must pass the same *number* of batches (an empty iterable is fine: the all-reduce
    is still entered). With a distillation module the value is the student's own cross-entropy.
    Batches hold ``labels`` or ``shift_labels`` as in :func:`train_step`
    (full sequences; with sequence parallelism each SP rank scores its slice). The
    module's z-loss part is subtracted, so the
    value is the plain cross-entropy (with the configured label smoothing, if any).

    Args:
        log: write ``Eval/megaloss/loss`` and ``.../perplexity`` through ``engine.monitor`` at
            the engine's global sample count (the x-axis of every monitor event).
        log_step: older spelling of ``log=True`` (the value is not used: the x value is the
            sample count, so W&B keeps the events).
    """
    engine = me.engine
    was_training = engine.training
    engine.eval()
    result = evaluate_lm(engine, batches, me.topology, ignore_index=me.calibrator.ignore_index,
                         device=engine.device)
    if was_training:
        engine.train()
    if log or log_step is not None:
        write_metrics(engine, {"loss": result.loss, "perplexity": result.perplexity},
                      prefix="Eval/megaloss/")
    return result
