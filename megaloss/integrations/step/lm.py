"""The language-model loss family of the calibrated step: a module whose forward computes its own
weighted loss, ``module(input_ids, shift_labels=, loss_weights=, ...)`` returning a
:class:`megaloss.CrossEntropyOutput` (e.g. :class:`megaloss.CausalLMWithLoss`) or a
:class:`megaloss.DistillationOutput` (:class:`megaloss.CausalLMWithDistillation`); and the
held-out cross-entropy of such a module (:func:`evaluate_lm`).

The calibration: the micro-batches' shifted targets (``shift_labels``, or Hugging Face
``labels`` shifted), with packed-sample boundaries from ``cu_seqlens`` or ``position_ids``
restarting at 0 (the ``sample`` / ``square`` reductions), one all-reduce over ``dp x sp``.
Under sequence parallelism each SP rank forwards its contiguous slice of the tokens (and of a
stored top-k teacher), cut as the calibration cuts the labels, with the *global*
``position_ids`` Ulysses needs. The metrics: the global z-loss (CE) or the global calibrated
divergence, hard-label CE and teacher-student top-1 agreement (distillation), one all-reduce.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from ...calibration.calibrator import LossCalibrator, StepCalibration
from ...calibration.weights import split_for_sequence_parallel
from ...losses.distillation import DistillationOutput
from ...losses.router_options import RouterLossOptions
from ...ops.labels import causal_shift
from ...parallel.comm import all_reduce_sum_
from ...parallel.topology import Topology
from .checks import check_floating, check_same_shape, integer_tensor
from .loop import StepLoss, batch_to_device
from .metrics import EvalResult, StepMetrics, StepOutcome
from .router import StepRouter, router_stats

__all__ = ["LanguageModelLoss", "NLLLoss", "TOPK_KEYS", "check_lm_micro_batch",

           "micro_batch_targets", "sample_boundaries", "model_inputs", "evaluate_lm"]

# a stored top-k teacher's keys of an LM micro-batch
TOPK_KEYS = ("teacher_topk_ids", "teacher_topk_log_probs")


def micro_batch_targets(mb: Mapping[str, Any], ignore_index: int) -> torch.Tensor:
    """The micro-batch's shifted targets: ``shift_labels`` as given, or HF ``labels`` shifted."""
    if mb.get("shift_labels") is not None:
        return mb["shift_labels"]
    if mb.get("labels") is None:
        raise ValueError("each micro-batch needs 'labels' (unshifted) or 'shift_labels'")
    return causal_shift(mb["labels"], ignore_index)


def sample_boundaries(mbs: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Where packed samples start, per micro-batch, for the calibration: ``cu_seqlens`` when
    given, else ``position_ids`` (a sample starts where the position restarts at 0, Hugging
    Face's flattening convention, which its attention honours too); rows otherwise."""
    cu = [mb.get("cu_seqlens") for mb in mbs]
    pos = [mb.get("position_ids") if c is None else None for mb, c in zip(mbs, cu)]
    return {"cu_seqlens": cu if any(c is not None for c in cu) else None,
            "position_ids": pos if any(p is not None for p in pos) else None}


def check_lm_micro_batch(i: int, mb: Mapping[str, Any]) -> None:
    """What the LM step reads from ``micro_batches[i]``: integer ``input_ids``;
    ``shift_labels`` or ``labels``, integer, of its shape; ``position_ids`` (the calibration's
    sample boundaries) of that shape; the top-k teacher's two ``[..., k]`` tensors together,
    over ``input_ids``' shape (under sequence parallelism too: each SP rank takes its slice
    along the sequence).

    Raises:
        ValueError / TypeError: naming the key and the expected shape or dtype.
    """
    where = f"micro_batches[{i}]"
    ids = integer_tensor(f"{where}['input_ids']", mb.get("input_ids"))
    shape = tuple(ids.shape)
    key = "shift_labels" if mb.get("shift_labels") is not None else "labels"
    if mb.get(key) is None:
        raise ValueError(f"{where} needs 'labels' (unshifted) or 'shift_labels'")
    check_same_shape(f"{where}['{key}']", integer_tensor(f"{where}['{key}']", mb[key]), shape)
    if mb.get("position_ids") is not None and mb.get("cu_seqlens") is None:
        check_same_shape(f"{where}['position_ids']", mb["position_ids"], shape)
    ids_k, lp_k = (mb.get(k) for k in TOPK_KEYS)
    if ids_k is None and lp_k is None:
        return
    if ids_k is None or lp_k is None:
        raise ValueError(f"{where}: teacher_topk_ids and teacher_topk_log_probs go together")
    integer_tensor(f"{where}['teacher_topk_ids']", ids_k)
    k = ids_k.shape[-1] if ids_k.dim() > 0 else 0
    check_same_shape(f"{where}['teacher_topk_ids']", ids_k, shape + (k,), "input_ids + (k,)")
    check_floating(f"{where}['teacher_topk_log_probs']", lp_k, [shape + (k,)])


def model_inputs(mb: Mapping[str, Any], topology: Topology) -> Dict[str, Any]:
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
    :func:`~megaloss.calibration.weights.split_for_sequence_parallel` cuts it, the padding a copy
    of the last position (a valid top-k teacher there, whose label is ``ignore_index``: weight
    0)."""
    length = x.shape[1]
    pad = -(-length // sp) * sp - length
    if pad and length:
        x = torch.cat([x, x[:, -1:].expand(-1, pad, *x.shape[2:])], dim=1)
    return split_for_sequence_parallel(x, rank, sp, 0, dim=1)


def _distillation_sums(out: DistillationOutput) -> torch.Tensor:
    """``[divergence, ce_loss, top-1 matches, valid tokens]`` of one micro-batch, float64."""
    return torch.stack([out.divergence.detach().to(torch.float64),
                        out.ce_loss.detach().to(torch.float64),
                        out.num_top1_matches.to(torch.float64),
                        out.num_valid_tokens.to(torch.float64)])


class LanguageModelLoss(StepLoss):
    """The family of a module that computes its own weighted CE or distillation loss (module
    docstring). ``check_teacher``: an extra check run with the micro-batch checks (the
    DeepSpeed step's Ulysses teacher check). ``router``: a mixture-of-experts module's router
    losses (:class:`megaloss.losses.router_options.RouterLossOptions`), each micro-batch's
    pool handed to the module's forward as ``router_loss=``
    (:mod:`megaloss.integrations.step.router`; the ``"step"`` scope's counts from a pre-pass).
    :meth:`result` is a :class:`StepMetrics`."""

    def __init__(self, check_teacher: Optional[Callable[[], None]] = None,
                 router: Optional[RouterLossOptions] = None) -> None:
        self.check_teacher = check_teacher
        self.router = StepRouter(router)

    def check(self, i: int, mb: Mapping[str, Any], topology: Topology) -> None:
        if i == 0 and self.check_teacher is not None:
            self.check_teacher()
        check_lm_micro_batch(i, mb)
        self.router.check(i, mb, topology)

    def calibrate(self, calibrator: LossCalibrator,
                  micro_batches: Sequence[Mapping[str, Any]]) -> StepCalibration:
        ignore = calibrator.ignore_index
        return calibrator.begin_step([micro_batch_targets(mb, ignore) for mb in micro_batches],
                                     **sample_boundaries(micro_batches))

    def prepare(self, forward, step: StepCalibration,
                micro_batches: Sequence[Mapping[str, Any]]) -> None:
        def counts(mb: Mapping[str, Any]) -> Callable[[Any], Any]:
            inputs = model_inputs(mb, step.topology)
            return lambda pool: forward(inputs["input_ids"], router_loss=pool,
                                        **{k: v for k, v in inputs.items() if k != "input_ids"})

        self.router.prepare(step.topology, [counts(mb) for mb in micro_batches])

    def loss(self, forward, step: StepCalibration, i: int,
             mb: Mapping[str, Any]) -> Tuple[torch.Tensor, Any]:
        inputs = model_inputs(mb, step.topology)
        out = forward(inputs.pop("input_ids"), shift_labels=step.local_labels(i),
                      loss_weights=step.weights(i),
                      **self.router.kwargs(step.topology, step.num_micro_batches), **inputs)
        router = self.router.output(out)
        router = None if router is None else router_stats(router)
        if _is_distillation(out):
            return out.loss, (_distillation_sums(out), router)
        return out.loss, (out.z_loss.detach().to(torch.float64).reshape(1), router)

    def metrics(self, step: StepCalibration, stats: List[Any],
                topology: Topology) -> Dict[str, Any]:
        # z-loss sums ([1] each) or distillation sums ([4] each), added up in micro-batch
        # order and reduced once
        local = stats[0][0].clone()
        for s, _ in stats[1:]:
            local += s
        total = all_reduce_sum_(local, topology.dp_sp_group)
        extra = self.router.metrics([r for _, r in stats], topology)
        if local.numel() == 1:
            return {"z_loss": float(total[0]), **extra}
        valid = float(total[3])
        return {"z_loss": 0.0, "divergence": float(total[0]), "ce_loss": float(total[1]),
                "top1_agreement": float(total[2]) / valid if valid > 0 else 0.0, **extra}

    def result(self, outcome: StepOutcome) -> StepMetrics:
        m = outcome.metrics
        return StepMetrics(
            step=outcome.step, loss=outcome.loss, z_loss=m["z_loss"],
            num_tokens=outcome.num_tokens, lr=outcome.lr, grad_norm=outcome.grad_norm,
            tokens_per_s=outcome.tokens_per_s, peak_memory_mib=outcome.peak_memory_mib,
            step_time_s=outcome.step_time_s, samples=outcome.samples,
            divergence=m.get("divergence"), ce_loss=m.get("ce_loss"),
            top1_agreement=m.get("top1_agreement"),
            router_aux_loss=m.get("router_aux_loss"),
            router_seq_aux_loss=m.get("router_seq_aux_loss"),
            router_z_loss=m.get("router_z_loss"), expert_load_max=m.get("expert_load_max"))


def _is_distillation(out: Any) -> bool:
    """A distillation module's output (a :class:`megaloss.DistillationOutput`, or a
    mixture-of-experts student's with its router fields after the same ones)."""
    return isinstance(out, DistillationOutput) or hasattr(out, "divergence")


@torch.no_grad()
def evaluate_lm(forward: Callable[..., Any], batches: Iterable[Mapping[str, torch.Tensor]],
                topology: Topology, *, ignore_index: int,
                device: torch.device) -> EvalResult:
    """Token-mean CE over held-out batches, global over ``dp x sp`` (one all-reduce at the end),
    of a module of this family (``forward``: the module's forward; the caller switches it to
    eval mode).

    Every rank must pass the same *number* of batches (an empty iterable is fine: the
    all-reduce is still entered). Batches hold ``labels`` or ``shift_labels`` (full sequences;
    with sequence parallelism each SP rank scores its slice). The module's z-loss part is
    subtracted (the plain cross-entropy, with its label smoothing, if any); with a
    distillation module the value is the student's own cross-entropy (its hard-label part).
    """
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for mb in batches:
        mb = batch_to_device(mb, device)
        labels = split_for_sequence_parallel(micro_batch_targets(mb, ignore_index),
                                             topology.sp_rank, topology.sp_size, ignore_index)
        inputs = model_inputs(mb, topology)
        out = forward(inputs.pop("input_ids"), shift_labels=labels, **inputs)
        if _is_distillation(out):  # the student's own CE (its hard-label part)
            sums[0] += out.ce_loss.to(torch.float64)
        else:
            sums[0] += (out.loss - out.z_loss).to(torch.float64)
        sums[1] += out.num_valid_tokens.to(torch.float64)
    all_reduce_sum_(sums, topology.dp_sp_group)
    n = float(sums[1])
    loss = float(sums[0]) / n if n > 0 else 0.0
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), num_tokens=n)


class NLLLoss(LanguageModelLoss):
    """Supervised fine-tuning on a *log-probs* module (``module(input_ids, shift_labels=)``
    returning per-token ``log_probs`` of the labels' shape, e.g.
    :class:`megaloss.CausalLMWithLogProbs`, the module a policy step trains): the calibrated
    negative log-likelihood ``-sum_t w_t log p_t`` (plus the module's router losses with
    ``router=``), the calibration and checks of :class:`LanguageModelLoss`. :meth:`result` is a
    :class:`StepMetrics` (``z_loss`` 0)."""

    def loss(self, forward, step: StepCalibration, i: int,
             mb: Mapping[str, Any]) -> Tuple[torch.Tensor, Any]:
        inputs = model_inputs(mb, step.topology)
        out = forward(inputs.pop("input_ids"), shift_labels=step.local_labels(i),
                      **self.router.kwargs(step.topology, step.num_micro_batches), **inputs)
        loss = -(out.log_probs * step.weights(i)).sum()
        router = self.router.output(out)
        if router is None:
            return loss, None
        return loss + router.loss.to(loss.dtype), router_stats(router)

    def metrics(self, step: StepCalibration, stats: List[Any],
                topology: Topology) -> Dict[str, Any]:
        return {"z_loss": 0.0, **self.router.metrics(stats, topology)}
