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
(:mod:`.step_checks`); the other host syncs are at the boundary, for logging.
"""
from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence

import torch

from ...calibration.weights import split_for_sequence_parallel
from ...losses.distillation import DistillationOutput
from ...ops.labels import causal_shift
from ...parallel.comm import all_reduce_sum_
from ...parallel.param_tags import is_tensor_parallel
from ...parallel.topology import Topology
from .engine import MegalossEngine
from .monitor import write_metrics
from .step_checks import (
    TOPK_KEYS,
    agreed_checks,
    agreed_forward,
    check_count,
    check_lm_micro_batch,
)

__all__ = ["StepMetrics", "EvalResult", "train_step", "evaluate", "peak_memory_mib"]


@dataclass
class StepMetrics:
    """Metrics of one optimizer step (identical on all ranks except ``peak_memory_mib``).

    ``loss``: global calibrated loss (z-loss included); ``z_loss``: its z-loss part;
    ``num_tokens``: global valid tokens; ``lr``; ``grad_norm`` (None when the engine does not
    compute it); ``tokens_per_s``: global valid tokens / step wall time; ``peak_memory_mib``:
    this process's peak (CUDA allocator, or max RSS on CPU); ``step``: optimizer steps done;
    ``samples``: the engine's global sample count after the step (the monitors' x value).
    With a distillation module (its forward returns a :class:`megaloss.DistillationOutput`):
    ``divergence`` and ``ce_loss``, the global calibrated divergence and hard-label CE (the
    loss's two parts before their factors), and ``top1_agreement``, the fraction of valid
    tokens whose student and teacher top-1 tokens agree; ``None`` otherwise.
    """

    step: int
    loss: float
    z_loss: float
    num_tokens: float
    lr: float
    grad_norm: Optional[float]
    tokens_per_s: float
    peak_memory_mib: float
    step_time_s: float
    samples: int = 0
    divergence: Optional[float] = None
    ce_loss: Optional[float] = None
    top1_agreement: Optional[float] = None

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass
class EvalResult:
    """Held-out token-mean cross-entropy (nats, z-loss excluded), its perplexity, and the
    global number of valid tokens it covers."""

    loss: float
    perplexity: float
    num_tokens: float


def peak_memory_mib(device: Optional[torch.device] = None) -> float:
    """Peak memory of this process in MiB: the CUDA caching allocator's peak on a CUDA device,
    else the peak resident set size (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def reduced_grad_norm(module: torch.nn.Module, topology: Topology) -> torch.Tensor:
    """L2 norm of the whole model's gradients (as DeepSpeed's clipping computes it): TP-sharded
    parameters counted on every TP rank, replicated ones on TP rank 0 only, SUM over TP. For
    ZeRO-0 with a plain torch optimizer, where DeepSpeed clips but does not keep the norm; call
    it after the boundary's backward (gradients already averaged over DP), before ``step()``."""
    first = next(module.parameters())
    total = torch.zeros((), dtype=torch.float64, device=first.device)
    for p in module.parameters():
        if p.grad is not None and (is_tensor_parallel(p) or topology.tp_rank == 0):
            total += p.grad.detach().to(torch.float64).pow(2).sum()
    return all_reduce_sum_(total, topology.tp_group).sqrt()


def batch_to_device(mb: Mapping[str, Any], device: torch.device) -> Dict[str, Any]:
    """The micro-batch ``mb`` with its tensors moved to ``device`` (non-blocking)."""
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
            for k, v in mb.items()}


def micro_batch_targets(mb: Mapping[str, Any], ignore_index: int) -> torch.Tensor:
    """The micro-batch's shifted targets: ``shift_labels`` as given, or HF ``labels`` shifted."""
    if mb.get("shift_labels") is not None:
        return mb["shift_labels"]
    if mb.get("labels") is None:
        raise ValueError("each micro-batch needs 'labels' (unshifted) or 'shift_labels'")
    return causal_shift(mb["labels"], ignore_index)


def _sample_boundaries(mbs: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Where packed samples start, per micro-batch, for the calibration: ``cu_seqlens`` when
    given, else ``position_ids`` (a sample starts where the position restarts at 0, Hugging
    Face's flattening convention, which its attention honours too); rows otherwise."""
    cu = [mb.get("cu_seqlens") for mb in mbs]
    pos = [mb.get("position_ids") if c is None else None for mb, c in zip(mbs, cu)]
    return {"cu_seqlens": cu if any(c is not None for c in cu) else None,
            "position_ids": pos if any(p is not None for p in pos) else None}


def _model_inputs(mb: Mapping[str, Any], topology: Topology) -> Dict[str, Any]:
    """``input_ids`` and the decoder's keyword inputs of this rank. With sequence parallelism
    (``sp > 1``) this SP rank's contiguous slice of the tokens, cut (and right-padded) exactly as
    the calibration cuts the labels, with the *global* ``position_ids`` Ulysses needs; the
    attention mask is dropped (Ulysses attends causally over the gathered sequence)."""
    out = {"input_ids": mb["input_ids"]}
    out.update({k: mb[k] for k in ("attention_mask", "position_ids") + TOPK_KEYS
                if mb.get(k) is not None})
    if topology.sp_size == 1:
        return out
    ids = out["input_ids"]
    pos = out.get("position_ids")
    if pos is None:
        pos = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    sp, rank = topology.sp_size, topology.sp_rank
    sliced = {"input_ids": split_for_sequence_parallel(ids, rank, sp, 0),
              "position_ids": split_for_sequence_parallel(pos, rank, sp, 0)}
    for k in TOPK_KEYS:  # [B, T, k]: the slice along T, padded with a copy of the last place
        if k in out:
            sliced[k] = _edge_split(out[k], rank, sp)
    return sliced


def _edge_split(x: torch.Tensor, rank: int, sp: int) -> torch.Tensor:
    """SP rank ``rank``'s slice of ``x [B, T, ...]`` along ``T`` as
    :func:`~megaloss.calibration.split_for_sequence_parallel` cuts it, the padding a copy of the
    last position (a valid top-k teacher there, whose label is ``ignore_index``: weight 0)."""
    length = x.shape[1]
    pad = -(-length // sp) * sp - length
    if pad and length:
        x = torch.cat([x, x[:, -1:].expand(-1, pad, *x.shape[2:])], dim=1)
    return split_for_sequence_parallel(x, rank, sp, 0, dim=1)


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


def _distillation_sums(out: DistillationOutput) -> torch.Tensor:
    """``[divergence, ce_loss, top-1 matches, valid tokens]`` of one micro-batch, float64."""
    return torch.stack([out.divergence.detach().to(torch.float64),
                        out.ce_loss.detach().to(torch.float64),
                        out.num_top1_matches.to(torch.float64),
                        out.num_valid_tokens.to(torch.float64)])


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
            only this rank's slice). The
            micro-batch checks are agreed on by every rank before the step's first collective
            (:mod:`.step_checks`): the same error on every rank, naming the failed ranks. So
            are the loss's own checks in each forward (a label outside the vocabulary, NaN or
            inf hidden states: :func:`.step_checks.agreed_forward`), before its backward.
        TypeError: non-integer ``input_ids`` / targets / top-k ids, non-floating top-k
            log-probs (agreed on likewise).
    """
    engine = me.engine
    gas = int(engine.gradient_accumulation_steps())

    def checks() -> None:  # agreed on by every rank before the calibration's all-reduce
        check_count(micro_batches, gas)
        _check_sp_teacher(me)
        for i, mb in enumerate(micro_batches):
            check_lm_micro_batch(i, mb)

    agreed_checks(checks, me.topology)
    t0 = time.perf_counter()
    device = engine.device
    mbs = [batch_to_device(mb, device) for mb in micro_batches]
    ignore = me.calibrator.ignore_index
    step = me.calibrator.begin_step([micro_batch_targets(mb, ignore) for mb in mbs],
                                    **_sample_boundaries(mbs))
    z_local = torch.zeros((), dtype=torch.float64, device=device)
    kd_local: Optional[torch.Tensor] = None
    own_norm = None
    for i, mb in enumerate(mbs):
        inputs = _model_inputs(mb, me.topology)
        out = agreed_forward(me.topology, engine, inputs.pop("input_ids"),
                             shift_labels=step.local_labels(i), loss_weights=step.weights(i),
                             **inputs)
        if isinstance(out, DistillationOutput):
            sums = _distillation_sums(out)
            kd_local = sums if kd_local is None else kd_local + sums
        else:
            z_local += out.z_loss.detach().to(torch.float64)
        engine.backward(step.loss_for_backward(out.loss))
        if i == gas - 1 and engine.zero_optimization_stage() == 0:
            own_norm = reduced_grad_norm(engine.module, me.topology)
        engine.step()
    loss = step.global_loss()
    z = all_reduce_sum_(z_local, me.topology.dp_sp_group)
    kd = None if kd_local is None else all_reduce_sum_(kd_local, me.topology.dp_sp_group)
    elapsed = time.perf_counter() - t0
    grad_norm = engine.get_global_grad_norm()
    if grad_norm is None:
        grad_norm = own_norm
    num_tokens = float(step.num_tokens)
    metrics = StepMetrics(
        step=int(engine.global_steps), loss=float(loss), z_loss=float(z), num_tokens=num_tokens,
        lr=float(engine.get_lr()[0]),
        grad_norm=None if grad_norm is None else float(grad_norm),
        tokens_per_s=num_tokens / max(elapsed, 1e-9), peak_memory_mib=peak_memory_mib(device),
        step_time_s=elapsed, samples=int(getattr(engine, "global_samples", 0)))
    if kd is not None:
        metrics.divergence, metrics.ce_loss = float(kd[0]), float(kd[1])
        metrics.top1_agreement = float(kd[2]) / float(kd[3]) if float(kd[3]) > 0 else 0.0
    if log:
        d = metrics.as_dict()
        d["optimizer_step"] = d.pop("step")
        d.pop("samples")
        write_metrics(engine, d)
    return metrics


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
    device = engine.device
    was_training = engine.training
    engine.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for mb in batches:
        mb = batch_to_device(mb, device)
        ignore, topo = me.calibrator.ignore_index, me.topology
        labels = split_for_sequence_parallel(micro_batch_targets(mb, ignore), topo.sp_rank,
                                             topo.sp_size, ignore)
        inputs = _model_inputs(mb, topo)
        out = engine(inputs.pop("input_ids"), shift_labels=labels, **inputs)
        if isinstance(out, DistillationOutput):  # the student's own CE (its hard-label part)
            sums[0] += out.ce_loss.to(torch.float64)
        else:
            sums[0] += (out.loss - out.z_loss).to(torch.float64)
        sums[1] += out.num_valid_tokens.to(torch.float64)
    all_reduce_sum_(sums, me.topology.dp_sp_group)
    if was_training:
        engine.train()
    n = float(sums[1])
    loss = float(sums[0]) / n if n > 0 else 0.0
    result = EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), num_tokens=n)
    if log or log_step is not None:
        write_metrics(engine, {"loss": result.loss, "perplexity": result.perplexity},
                      prefix="Eval/megaloss/")
    return result
