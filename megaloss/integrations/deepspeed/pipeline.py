"""DeepSpeed's pipeline engine (``PipelineModule``, ``train_batch``) with megaloss's chunked /
vocab-parallel cross-entropy as the last stage's loss, globally calibrated over
``dp x pp x gradient_accumulation_steps`` (x ``tp``).

What the pipeline engine does (read in DeepSpeed 0.19.8, ``runtime/pipe/engine.py``):

- ``train_batch()`` pulls ``gradient_accumulation_steps`` micro-batches ``(inputs, labels)``
  from the data iterator, on the first stage (``inputs``) and the last (``labels``). The last
  stage calls ``module.loss_fn(outputs, labels)`` once per micro-batch and backwards it with the
  ordinary ``DeepSpeedEngine.backward`` (which divides by the accumulation steps); every stage
  then averages its gradients over its data-parallel group (``allreduce_gradients``), tied
  modules are all-reduced across the stages holding them, and the optimizer steps.
- it returns (and writes to the monitors as ``Train/Samples/train_loss``) the micro-batch losses
  summed, divided by the accumulation steps, averaged over data parallel and broadcast over the
  pipeline.
- ZeRO stages 0 and 1 only (an assert in ``PipelineEngine.__init__``).

The labels reach the last stage one micro-batch at a time, so the step's global normaliser must
be known before ``train_batch()`` starts. :func:`pipeline_train_step` reads the step's
micro-batches first and calibrates them (:meth:`~megaloss.calibration.LossCalibrator.begin_step`,
one all-reduce over each stage's data-parallel group: every stage of a pipeline sees the same
labels, so every stage computes the same weights and no rank waits on another stage), then hands
``train_batch()`` an iterator of ``(input_ids, (shift_labels, loss_weights))``.

Both things the engine does to the per-micro-batch losses are *measured* once at start-up on a
tiny pipeline engine of the same ds_config and layout (:func:`probe_pipeline`, the method of
:mod:`megaloss.calibration.engine_scale`): the gradient factor and the factor of the loss it
returns. The last stage's loss then has the *value* ``local x`` (logged-loss multiplier) and the
*gradient* of ``local x`` (gradient multiplier): the gradients are the single-device ones and
``train_batch()`` returns the global loss.

What this shares with the one calibrated step (:mod:`megaloss.integrations.step`) and what it
cannot: the micro-batch checks agreed on by every rank and the calibration are the step's first
half (:class:`~megaloss.integrations.step.CalibratedStep` with the LM family), and the learning
rate, gradient norm, counts and monitor writes are the DeepSpeed adapter's
(:class:`~.step_engine.DeepSpeedStepEngine`). The micro-batch loop itself is the pipeline
engine's schedule (``train_batch()`` interleaves the stages' forwards and backwards and calls the
loss on the last stage), so the forward, the loss for backward
(:class:`PipelineCrossEntropyLoss`, scaled by the measured factors above, not
:meth:`~megaloss.calibration.StepCalibration.loss_for_backward`) and the global loss (the last
stage's float64 sums, :func:`~.pipeline_loss.last_stage_sums`) stay here.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Union

import torch

from ...calibration import EngineScale, LossCalibrator
from ...calibration.weights import loss_weight_dtype
from ...parallel.comm import all_reduce_max_
from ...parallel.groups import group_ranks
from ...parallel.topology import Topology
from ..config import MegalossConfig
from ..step.lm import LanguageModelLoss, micro_batch_targets
from ..step.loop import CalibratedStep, batch_to_device
from ..step.metrics import EvalResult, StepMetrics, peak_memory_mib
from .compat import skip_cpu_shm_comm_build
from .engine import load_ds_config
from .monitor import write_metrics
from .pipeline_layout import (
    PIPELINE_ZERO_STAGES,
    PipelineLayout,
    build_pipeline_layout,
    grid_topology,
)
from .pipeline_loss import CrossEntropyHeadStage, PipelineCrossEntropyLoss, last_stage_sums
from .pipeline_probe import PipelineScale, probe_pipeline
from .step_engine import DeepSpeedStepEngine

__all__ = ["PipelineLayout", "build_pipeline_layout", "PipelineScale", "probe_pipeline",
           "CrossEntropyHeadStage", "PipelineCrossEntropyLoss", "MegalossPipelineEngine",
           "initialize_pipeline", "pipeline_train_step", "pipeline_evaluate", "PipelineStepMetrics",
           "PIPELINE_ZERO_STAGES"]


# engine -----------------------------------------------------------------------------------------
@dataclass
class MegalossPipelineEngine(DeepSpeedStepEngine):
    """What :func:`initialize_pipeline` returns (its learning rate, gradient norm, counts and
    monitors those of :class:`~.step_engine.DeepSpeedStepEngine`).

    Attributes:
        engine: DeepSpeed's ``PipelineEngine``.
        optimizer, lr_scheduler: as ``deepspeed.initialize`` returns them.
        calibrator: the :class:`~megaloss.calibration.LossCalibrator` (each stage's
            data-parallel group, the measured gradient factor).
        scale: the measured :class:`PipelineScale`.
        loss: the :class:`PipelineCrossEntropyLoss` (None off the last stage).
        layout: the :class:`PipelineLayout`.
        config, ds_config: the validated ``"megaloss"`` section and the ds_config dict used.
    """

    engine: Any
    optimizer: Any
    lr_scheduler: Any
    calibrator: LossCalibrator
    scale: PipelineScale
    loss: Optional[PipelineCrossEntropyLoss]
    layout: PipelineLayout
    config: MegalossConfig
    ds_config: Dict[str, Any]

    @property
    def topology(self) -> Topology:
        return self.layout.topology

    @property
    def engine_scale(self) -> EngineScale:
        return self.scale.gradient


def _agree(bad: bool) -> bool:
    """Whether any rank of the world is ``bad`` (so all raise together, none waits alone)."""
    from deepspeed.accelerator import get_accelerator

    # on the accelerator: NCCL reduces device tensors only
    flag = torch.tensor([float(bad)], device=get_accelerator().current_device_name())
    return float(all_reduce_max_(flag, None)[0]) > 0


def _checkpointing_config(pipe: Dict[str, Any], interval: int) -> int:
    """The activation-checkpoint interval the engine will use, with ``pipe`` (the ds_config's
    ``"pipeline"`` section) given ``use_reentrant: false`` when it is > 0 and the key is unset.

    Why: the first stage's input is the micro-batch's token ids (integers). DeepSpeed 0.19.8's
    reentrant checkpoint (``runtime/activation_checkpointing/checkpointing.py``, a
    ``torch.autograd.Function``) only back-propagates into a block whose inputs require grad,
    and the pipeline engine sets ``requires_grad`` on floating first-stage inputs only
    (``PipelineEngine._exec_load_micro_batch``, ``runtime/pipe/engine.py``), so a checkpointed
    block holding the embedding outputs a tensor without grad ("element 0 of tensors does not
    require grad" in ``backward``). The non-reentrant checkpoint has no such limit; the engine
    switches the module to it when ``use_reentrant`` is false (``PipelineEngine.__init__``).
    """
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ValueError(f"activation_checkpoint_interval must be an int >= 0, got {interval!r}")
    # DeepSpeed's engine overrides the module's interval with a positive configured one
    configured = int(pipe.get("activation_checkpoint_interval", 0) or 0)
    interval = configured if configured > 0 else interval
    if interval > 0 and pipe.get("use_reentrant") is None:
        pipe["use_reentrant"] = False
    return interval


def _first_block_checkpointed(funcs: Sequence[Any], interval: int) -> bool:
    """Whether ``PipelineModule.forward`` checkpoints the block ``funcs[:interval]``: with no
    ``checkpointable_layers``, a block is checkpointed when one of its modules has parameters
    (``PipelineModule._is_checkpointable``, DeepSpeed 0.19.8 ``runtime/pipe/module.py``; a
    ``TiedLayerSpec``'s ``forward_fn`` is a function, not a module, and counts for none)."""
    if interval <= 0:
        return False
    return any(isinstance(f, torch.nn.Module) and any(True for _ in f.parameters())
               for f in funcs[:interval])


def _tied_weights_reloaded(module: Any) -> None:
    """Make ``module.load_state_dir`` (what the pipeline engine's ``load_checkpoint`` calls)
    leave every copy of a tied module with the weights it loaded, outside autograd.

    Why, in DeepSpeed 0.19.8 (``runtime/pipe/module.py``): ``save_state_dict`` writes one file
    per layer that has a ``state_dict``, so a ``TiedLayerSpec`` place with a ``forward_fn`` (a
    ``functools.partial``) is written and loaded by no stage; ``load_state_dir`` then broadcasts
    each tied module from the lowest stage holding it (``_synchronize_tied_weights``). When the
    lowest place is the one with the ``forward_fn`` (the tied embedding of
    :func:`~.pipeline_llama.llama_pipeline_layers`: the first stage's place embeds through a
    ``forward_fn``, the last stage's, the head, is the module itself), that stage's weights,
    never loaded, overwrite the loaded ones. Here the module's ``_synchronize_tied_weights``
    (called by ``load_state_dir`` only, once the module is built) broadcasts each tied module
    from the stage of its first place without ``forward_fn``, the one whose layer file was
    loaded (the lowest stage, as DeepSpeed's, when no such place is lower). And the load runs
    under ``torch.no_grad()``, as the module's construction does here: in grad mode autograd
    records the in-place ``c10d::broadcast_`` on the tied weight (a warning at every backward,
    "an autograd kernel was not registered")."""
    from deepspeed import comm as ds_dist
    from deepspeed.pipe import TiedLayerSpec

    places: Dict[str, list] = {}
    for idx, spec in enumerate(module._layer_specs):
        if isinstance(spec, TiedLayerSpec):
            places.setdefault(spec.key, []).append((module.stage_owner(idx), spec))
    sources = {}  # key -> index of the loaded copy's rank in tied_comms[key]["ranks"]
    for key, found in places.items():
        stages = sorted({stage for stage, _ in found})  # tied_comms' rank order
        saved = [stage for stage, spec in found if spec.forward_fn is None]
        sources[key] = stages.index(saved[0]) if saved else 0

    def synchronize_tied_weights() -> None:
        for key, comm in module.tied_comms.items():  # sorted by key on every rank
            for t in [*comm["module"].parameters(), *comm["module"].buffers()]:
                ds_dist.broadcast(t.data, src=comm["ranks"][sources[key]], group=comm["group"])

    load_state_dir = module.load_state_dir

    def load_state_dir_no_grad(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return load_state_dir(*args, **kwargs)

    module._synchronize_tied_weights = synchronize_tied_weights
    module.load_state_dir = load_state_dir_no_grad


def initialize_pipeline(layers: Sequence[Any], ds_config: Union[str, os.PathLike,
                                                                Mapping[str, Any]], *,
                        layout: PipelineLayout, optimizer: Any = None,
                        lr_scheduler: Any = None, output_dir: Optional[str] = None,
                        partition_method: str = "uniform",
                        activation_checkpoint_interval: int = 0,
                        ignore_index: int = -100) -> MegalossPipelineEngine:
    """Build DeepSpeed's pipeline engine over ``layout`` with megaloss's loss and calibration.

    Collective: every rank calls it. The probe (:func:`probe_pipeline`) builds a tiny pipeline
    engine of the same ds_config and layout first.

    Args:
        layers: the ``PipelineModule`` layers (modules or ``deepspeed.pipe.LayerSpec``, which
            build on their own stage only); the first takes the micro-batch's ``input_ids``,
            the last must be a :class:`CrossEntropyHeadStage` (or a ``TiedLayerSpec`` of one
            without ``forward_fn``: a head tied to the first stage's embedding, as
            :func:`~.pipeline_llama.llama_pipeline_layers` builds it).
        ds_config: path or dict. ZeRO stage 0 or 1 (the pipeline engine's limit);
            ``megaloss.pipeline_parallel_size`` / ``tensor_parallel_size`` must match
            ``layout``; no sequence parallelism. ``pipeline.pipe_partitioned`` and
            ``grad_partitioned`` default to false here (whole activations between stages).
        layout: from :func:`build_pipeline_layout`.
        optimizer: None (the ds_config's ``"optimizer"`` section), or a callable
            ``optimizer(parameters) -> torch.optim.Optimizer`` called with this stage's
            parameters (the stages are built here, so no optimizer can exist before).
        lr_scheduler: optional client scheduler (else the ds_config's ``"scheduler"``).
        output_dir: where monitors without an ``output_path`` write (``<output_dir>/monitor``).
        partition_method: ``PipelineModule``'s (``"uniform"``: the same number of layers per
            stage; ``"parameters"`` builds every layer on every rank to count).
        activation_checkpoint_interval: ``PipelineModule``'s: recompute the activations of
            every block of this many layers in the backward (0: none; a positive
            ``pipeline.activation_checkpoint_interval`` of the ds_config wins, as in DeepSpeed).
            With checkpointing on, ``pipeline.use_reentrant`` defaults to false here: DeepSpeed's
            default (true, its reentrant checkpoint) back-propagates into no checkpointed block
            whose input is the first stage's token ids.
        ignore_index: label without loss.

    The engine's ``load_checkpoint`` restores a tied module (``TiedLayerSpec``) on every stage
    holding it from the one stage that saved it (:func:`_tied_weights_reloaded`), so a resumed
    run continues bitwise.

    Raises:
        ValueError: a ZeRO stage other than 0 / 1, sizes that differ from ``layout``, sequence
            parallelism, or the engine's groups not those of ``layout``; a negative
            ``activation_checkpoint_interval``; ``pipeline.use_reentrant`` true while the
            first stage's first checkpointed block holds parameters (the token ids cannot
            require grad: that block would get no gradient).
        TypeError: ``layout`` not a PipelineLayout; ``optimizer`` neither None nor callable;
            the last layer not a CrossEntropyHeadStage.
        EngineScaleError: see :func:`probe_pipeline`.
    """
    import deepspeed
    from deepspeed.pipe import PipelineModule

    skip_cpu_shm_comm_build()
    if not isinstance(layout, PipelineLayout):
        raise TypeError(f"layout must be a PipelineLayout, got {type(layout).__name__}")
    if optimizer is not None and (not callable(optimizer)
                                  or isinstance(optimizer, torch.optim.Optimizer)):
        raise TypeError("optimizer must be None or a callable parameters -> Optimizer (the "
                        f"stages are built inside), got {type(optimizer).__name__}")
    cfg, ml = load_ds_config(ds_config, output_dir=output_dir)
    stage = int(cfg.get("zero_optimization", {}).get("stage", 0))
    if stage not in PIPELINE_ZERO_STAGES:
        raise ValueError(f"zero_optimization.stage={stage}: DeepSpeed's pipeline engine supports "
                         f"ZeRO stages {PIPELINE_ZERO_STAGES} only")
    topo = layout.topology
    for key, want in (("pipeline_parallel_size", topo.pp_size),
                      ("tensor_parallel_size", topo.tp_size), ("sequence_parallel_size", 1)):
        if getattr(ml, key) != want:
            raise ValueError(f"megaloss.{key}={getattr(ml, key)} but the pipeline layout has "
                             f"{want}" + (" (no sequence parallelism under the pipeline engine)"
                                          if key == "sequence_parallel_size" else ""))
    # DeepSpeed splits stage activations over the TP ranks by default (``pipe_partitioned``,
    # ``grad_partitioned``); its all_gather_into_tensor fails on gloo, and megaloss's decoder is
    # replicated over TP, so whole activations travel unless the ds_config says otherwise.
    pipe = cfg.setdefault("pipeline", {})
    pipe.setdefault("pipe_partitioned", False)
    pipe.setdefault("grad_partitioned", False)
    interval = _checkpointing_config(pipe, activation_checkpoint_interval)
    # no_grad: PipelineModule broadcasts tied weights (TiedLayerSpec) in place, and a c10d
    # broadcast recorded by autograd warns at every backward
    with torch.no_grad():
        module = PipelineModule(layers=list(layers), topology=layout.process_topology,
                                partition_method=partition_method,
                                activation_checkpoint_interval=interval)
    _tied_weights_reloaded(module)
    # the same config on every rank: the collective only when the answer can be yes
    if interval > 0 and pipe.get("use_reentrant") is True and _agree(
            layout.stage_id == 0 and _first_block_checkpointed(module.forward_funcs, interval)):
        raise ValueError(
            f"ds_config pipeline.use_reentrant=true with activation_checkpoint_interval="
            f"{interval}: the first stage's first block of layers holds parameters and takes "
            "the token ids, which DeepSpeed's reentrant checkpoint cannot make require grad, so "
            "that block would get no gradient; set pipeline.use_reentrant to false (the default "
            "here when checkpointing) or the interval to 0")
    grid = module.mpu()
    mine = grid_topology(grid)
    groups_differ = any(group_ranks(getattr(mine, g)) != group_ranks(getattr(topo, g))
                        for g in ("dp_group", "tp_group", "pp_group"))
    head = module.forward_funcs[-1] if layout.is_last_stage else None
    not_head = layout.is_last_stage and not isinstance(head, CrossEntropyHeadStage)
    if _agree(groups_differ):
        raise ValueError("the PipelineModule's groups differ from the layout's; build both from "
                         "the same build_pipeline_layout()")
    if _agree(not_head):
        raise TypeError("the last layer must be a CrossEntropyHeadStage (got "
                        f"{type(head).__name__ if not_head else 'one on another rank'})")
    scale = probe_pipeline(cfg, layout)
    loss = PipelineCrossEntropyLoss(head, scale) if head is not None else None
    module.loss_fn = loss
    params = [p for p in module.parameters() if p.requires_grad]
    engine, opt, _, sched = deepspeed.initialize(
        model=module, model_parameters=params if optimizer is None else None,
        optimizer=None if optimizer is None else optimizer(params), lr_scheduler=lr_scheduler,
        config=cfg)
    calibrator = LossCalibrator(topo, loss_reduction=ml.ce.loss_reduction,
                                engine_scale=scale.gradient, ignore_index=ignore_index,
                                weight_dtype=loss_weight_dtype(module))
    return MegalossPipelineEngine(engine, opt, sched, calibrator, scale, loss, layout, ml, cfg)


# training step and evaluation -------------------------------------------------------------------
@dataclass
class PipelineStepMetrics(StepMetrics):
    """:class:`~.train_step.StepMetrics` plus ``engine_loss``: the loss ``train_batch()``
    returned and wrote to the monitors (float32 sums; equal to ``loss`` to float32 rounding)."""

    engine_loss: float = 0.0


_UNSUPPORTED_KEYS = ("attention_mask", "position_ids", "cu_seqlens")


class _PipelineLoss(LanguageModelLoss):
    """The LM family's checks and calibration, for micro-batches of ``input_ids`` and labels
    only (what the stages carry)."""

    def check(self, i: int, mb: Mapping[str, Any], topology: Topology) -> None:
        extra = [k for k in _UNSUPPORTED_KEYS if mb.get(k) is not None]
        if extra:
            raise ValueError(f"the pipeline stages take input_ids only; micro-batch keys {extra} "
                             "are not passed between stages (use full causal rows)")
        super().check(i, mb, topology)


def pipeline_train_step(me: MegalossPipelineEngine,
                        micro_batches: Sequence[Mapping[str, torch.Tensor]], *,
                        log: bool = True) -> PipelineStepMetrics:
    """One calibrated optimizer step of the pipeline engine: ``train_batch()`` over this
    pipeline's micro-batches.

    Args:
        me: from :func:`initialize_pipeline`.
        micro_batches: exactly ``gradient_accumulation_steps`` dicts with ``input_ids [B, T]``
            and ``labels [B, T]`` (unshifted, Hugging Face convention) or ``shift_labels``.
            Every stage (and TP rank) of one pipeline passes the same batches; a micro-batch
            may have no valid token.
        log: write the metrics through ``engine.monitor`` as :func:`~.train_step.train_step`
            does.

    Returns:
        :class:`PipelineStepMetrics`: ``loss`` the global loss (float64 sums of the last
        stage), ``engine_loss`` the value ``train_batch()`` returned and logged.

    Raises:
        ValueError: a wrong number of micro-batches, or keys the stages do not carry.
    """
    engine = me.engine
    t0 = time.perf_counter()
    step = CalibratedStep(_PipelineLoss(), me.calibrator, micro_batches, device=engine.device,
                          gradient_accumulation_steps=me.gradient_accumulation_steps())
    cal = step.calibration
    data = [(mb["input_ids"], (cal.local_labels(i), cal.weights(i)))
            for i, mb in enumerate(step.micro_batches)]
    if me.loss is not None:
        me.loss.reset()
    logged = engine.train_batch(iter(data))
    device = engine.device
    sums = last_stage_sums(None if me.loss is None else me.loss._sums, me.layout, device)
    elapsed = time.perf_counter() - t0
    num_tokens = float(cal.num_tokens)
    metrics = PipelineStepMetrics(
        step=me.step_count(), loss=float(sums[0]), z_loss=float(sums[1]), num_tokens=num_tokens,
        lr=me.lr(), grad_norm=me.grad_norm(), tokens_per_s=num_tokens / max(elapsed, 1e-9),
        peak_memory_mib=peak_memory_mib(device), step_time_s=elapsed, samples=me.samples(),
        engine_loss=float(logged))
    if log:
        me.log(metrics)
    return metrics


@torch.no_grad()
def pipeline_evaluate(me: MegalossPipelineEngine,
                      batches: Iterable[Mapping[str, torch.Tensor]], *,
                      log: bool = False) -> EvalResult:
    """Held-out token-mean CE (z-loss left out) through ``eval_batch()``, one micro-batch per
    batch, global over data parallel; every rank passes the same number of batches.

    Batches hold ``input_ids`` and ``labels`` / ``shift_labels`` as in
    :func:`pipeline_train_step`, all of the training micro-batch's shape (the engine keeps its
    stage buffers). ``log``: write ``Eval/megaloss/loss`` and ``.../perplexity`` through
    ``engine.monitor``.
    """
    engine = me.engine
    device = engine.device
    if me.loss is not None:
        me.loss.reset()
    ignore = me.calibrator.ignore_index
    for mb in batches:
        _PipelineLoss().check(0, mb, me.topology)
        mb = batch_to_device(mb, device)
        labels = micro_batch_targets(mb, ignore)
        ones = (labels != ignore).to(torch.float32)
        engine.eval_batch(iter([(mb["input_ids"], (labels, ones))]), num_micro_batches=1,
                          bcast_loss=False)
    engine.train()
    sums = last_stage_sums(None if me.loss is None else me.loss._sums, me.layout, device)
    n = float(sums[2])
    loss = float(sums[0]) / n if n > 0 else 0.0
    result = EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), num_tokens=n)
    if log:
        write_metrics(engine, {"loss": result.loss, "perplexity": result.perplexity},
                      prefix="Eval/megaloss/")
    return result
