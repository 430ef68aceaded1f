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
"""
from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from ...calibration import EngineScale, EngineScaleError, LossCalibrator, loss_weight_dtype
from ...calibration.engine_scale import _snap, measure_grad_scale, probe_coefficients
from ...losses.cross_entropy import CrossEntropyOutput, linear_cross_entropy
from ...losses.vocab_parallel_head import VocabParallelLMHead
from ...ops.options import CrossEntropyOptions
from ...parallel.comm import all_reduce_max_, all_reduce_sum_
from ...parallel.groups import SINGLE_RANK, GroupLike, group_ranks, group_size
from ...parallel.topology import Topology
from .compat import skip_cpu_shm_comm_build
from .config import MegalossConfig
from .engine import load_ds_config
from .monitor import write_metrics
from .probe import _DROPPED_DS_KEYS
from .train_step import EvalResult, StepMetrics, _shift_labels, _to_device, peak_memory_mib

__all__ = ["PipelineLayout", "build_pipeline_layout", "PipelineScale", "probe_pipeline",
           "CrossEntropyHeadStage", "PipelineCrossEntropyLoss", "MegalossPipelineEngine",
           "initialize_pipeline", "pipeline_train_step", "pipeline_evaluate", "PipelineStepMetrics",
           "PIPELINE_ZERO_STAGES"]

PIPELINE_ZERO_STAGES = (0, 1)  # what PipelineEngine.__init__ accepts (DeepSpeed 0.19.8)


# layout -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PipelineLayout:
    """A ``pp x dp x tp`` layout: DeepSpeed's ``ProcessTopology`` (axes ``pipe``, ``data``,
    ``model``; the model (TP) axis innermost, so TP groups are neighbouring ranks, and the pipe
    axis outermost) and the megaloss :class:`~megaloss.Topology` of this rank over it (``dp``,
    ``tp`` and ``pp`` groups, the same ranks the pipeline engine's own grid uses).

    Build it with :func:`build_pipeline_layout`.
    """

    process_topology: Any
    topology: Topology

    @property
    def num_stages(self) -> int:
        return self.topology.pp_size

    @property
    def stage_id(self) -> int:
        return self.topology.pp_rank

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def build_pipeline_layout(pipeline_parallel_size: int, tensor_parallel_size: int = 1
                          ) -> PipelineLayout:
    """The groups of a ``pp x dp x tp`` layout over the whole world (collective: every rank
    calls it; ``dp = world // (pp * tp)``), as DeepSpeed's ``PipelineParallelGrid`` builds them
    from ``PipeModelDataParallelTopology`` (``runtime/pipe/topology.py``).

    Build the model's stages with ``layout.topology.tp_group`` (the vocab-parallel head), then
    pass the layout to :func:`initialize_pipeline`.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: a size < 1, or ``pp * tp`` does not divide the world size.
    """
    _check_size("pipeline_parallel_size", pipeline_parallel_size)
    _check_size("tensor_parallel_size", tensor_parallel_size)
    if not dist.is_initialized():
        raise RuntimeError("build_pipeline_layout needs torch.distributed to be initialised")
    world = dist.get_world_size()
    if world % (pipeline_parallel_size * tensor_parallel_size):
        raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} x "
                         f"tensor_parallel_size={tensor_parallel_size} does not divide the world "
                         f"size {world}")
    import deepspeed
    from deepspeed.runtime.pipe.topology import (
        PipelineParallelGrid,
        PipeModelDataParallelTopology,
    )

    skip_cpu_shm_comm_build()
    deepspeed.init_distributed()  # the grid asks deepspeed.comm; wraps the existing group
    topo = PipeModelDataParallelTopology(
        num_pp=pipeline_parallel_size, num_mp=tensor_parallel_size,
        num_dp=world // (pipeline_parallel_size * tensor_parallel_size))
    grid = PipelineParallelGrid(topology=topo)
    return PipelineLayout(topo, _grid_topology(grid))


def _grid_topology(grid: Any) -> Topology:
    # The grid's "model parallel" group is pipe x model (DeepSpeed's overflow checks); the
    # tensor-parallel group is its "slice parallel" group.
    return Topology(dp_group=grid.get_data_parallel_group(),
                    tp_group=grid.get_slice_parallel_group(),
                    pp_group=grid.get_pipe_parallel_group())


# probe ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PipelineScale:
    """What a pipeline engine does to the last stage's per-micro-batch losses, measured.

    Attributes:
        gradient: the gradient factor (:class:`~megaloss.calibration.EngineScale`, over each
            stage's data-parallel group; the same on every stage).
        loss_log_multiplier: ``1 / f`` for the factor ``f`` that ``train_batch()``'s returned
            (and logged) loss applies to the sum of all data-parallel ranks' micro-batch losses
            (``1 / (gradient_accumulation_steps x dp)`` in DeepSpeed 0.19.8).
    """

    gradient: EngineScale
    loss_log_multiplier: float


class _ProbeStage(nn.Module):
    """``x -> x + sum(theta - theta.detach())``: the value passes unchanged, and every element
    of ``theta`` gets the gradient of the activation. The last stage's ``theta`` is used in the
    loss function only, as the real head is (outside the stage's forward)."""

    def __init__(self, last: bool):
        super().__init__()
        self.last = last
        self.theta = nn.Parameter(torch.zeros(4))

    def tap(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.theta - self.theta.detach()).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.last else self.tap(x)


def probe_pipeline(config: Mapping[str, Any], layout: PipelineLayout) -> PipelineScale:
    """Gradient factor and logged-loss factor of DeepSpeed's pipeline engine for ``config`` over
    ``layout``, measured on a tiny ``PipelineModule`` (one probe stage per pipeline stage) through
    the real ``train_batch()``.

    Pipeline ``d`` (its data-parallel index) feeds the losses ``a_di * sum(theta)``, ``a_di``
    from :func:`~megaloss.calibration.engine_scale.probe_coefficients` of ``d``; every stage's
    ``theta`` is read after the step through the parameter update of ``torch.optim.SGD(lr=1)``
    from 0 (``theta = -g``: ``train_batch()`` steps the optimizer itself). Collective: every
    rank of the world calls it.

    Raises:
        EngineScaleError: either factor is not one uniform ``k`` or ``1/k`` on all ranks (see
            :func:`~megaloss.calibration.measure_grad_scale`).
    """
    import deepspeed
    from deepspeed.pipe import PipelineModule

    skip_cpu_shm_comm_build()
    cfg = {k: copy.deepcopy(v) for k, v in config.items() if k not in _DROPPED_DS_KEYS}
    cfg["zero_allow_untested_optimizer"] = True
    cfg["gradient_clipping"] = 0.0  # DeepSpeed's default is 1.0; the update must be -g
    pp = layout.num_stages
    module = PipelineModule(layers=[_ProbeStage(k == pp - 1) for k in range(pp)],
                            topology=layout.process_topology, partition_method="uniform")
    stage = module.forward_funcs[-1]
    module.loss_fn = lambda out, a: (a * stage.tap(out)).sum()
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.SGD(module.parameters(), lr=1.0), config=cfg)
    try:
        gas = int(engine.gradient_accumulation_steps())
        topo = layout.topology
        dp = topo.dp_size
        logged: List[float] = []

        def run(coeffs):
            data = [(torch.ones(1), torch.tensor([a], dtype=torch.float32)) for a in coeffs]
            logged.append(float(engine.train_batch(iter(data))))
            return -stage.theta.detach().clone()

        name = f"deepspeed-pipeline-zero{int(engine.zero_optimization_stage())}/train_batch"
        gradient = measure_grad_scale(run, group=topo.dp_group, gas=gas, engine=name,
                                      device=engine.device,
                                      coefficient_ids=(topo.dp_rank, range(dp)))
        total = sum(sum(probe_coefficients(d, gas)) for d in range(dp))
        f = logged[0] / total
        probe = torch.tensor([f, -f], dtype=torch.float64, device=engine.device)
        all_reduce_max_(probe, None)
        f_max, f_min = float(probe[0]), -float(probe[1])
        m = _snap(1.0 / f_max) if f_min > 0 and math.isfinite(f_max) else math.nan
        if math.isnan(m) or f_max - f_min > 1e-4 * f_max:
            raise EngineScaleError(f"{name}: the loss train_batch() returns is "
                                   f"[{f_min:.6g}, {f_max:.6g}] x the sum of the micro-batch "
                                   "losses, not one 1/k on all ranks")
        return PipelineScale(gradient, m)
    finally:
        if hasattr(engine, "destroy"):
            engine.destroy()


# the last stage ---------------------------------------------------------------------------------
class CrossEntropyHeadStage(nn.Module):
    """The last pipeline stage's layer: the final norm in ``forward`` and the lm_head with the
    fused (TP > 1: vocab-parallel) cross-entropy in :meth:`loss`, which the pipeline's
    ``loss_fn`` (:class:`PipelineCrossEntropyLoss`) calls. No ``[tokens, vocab]`` logits.

    Args:
        lm_head: the full ``nn.Linear`` ``[V, H]`` lm_head; with ``tp_group`` of size > 1 this
            rank keeps its vocab rows (:class:`megaloss.VocabParallelLMHead`, parameters tagged
            ``tensor_model_parallel``).
        options: CE options (``reduction="sum"``, the default, is required: the calibration
            weights the tokens).
        tp_group: the tensor-parallel group (``PipelineLayout.topology.tp_group``).
        norm: the decoder's final norm (``forward`` applies it), or None.

    Raises:
        TypeError: ``lm_head`` not an ``nn.Linear``; ``options`` not CrossEntropyOptions.
        ValueError: ``options.reduction`` is not ``"sum"``.
    """

    def __init__(self, lm_head: nn.Linear, *, options: Optional[CrossEntropyOptions] = None,
                 tp_group: GroupLike = SINGLE_RANK, norm: Optional[nn.Module] = None) -> None:
        super().__init__()
        if not isinstance(lm_head, nn.Linear):
            raise TypeError(f"lm_head must be an nn.Linear, got {type(lm_head).__name__}")
        options = CrossEntropyOptions(reduction="sum") if options is None else options
        if not isinstance(options, CrossEntropyOptions):
            raise TypeError(f"options must be a CrossEntropyOptions, got "
                            f"{type(options).__name__}")
        if options.reduction != "sum":
            raise ValueError(f"options.reduction must be 'sum' (the calibration weights the "
                             f"tokens), got {options.reduction!r}")
        self.options = options
        self.norm = norm
        if group_size(tp_group) > 1:
            vocab, hidden = lm_head.weight.shape
            head = VocabParallelLMHead(hidden, vocab, tp_group=tp_group,
                                       bias=lm_head.bias is not None, dtype=lm_head.weight.dtype,
                                       device=lm_head.weight.device, options=options)
            head.load_full_weight(lm_head.weight.detach(),
                                  None if lm_head.bias is None else lm_head.bias.detach())
            self.lm_head: nn.Module = head
        else:
            self.lm_head = lm_head

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states if self.norm is None else self.norm(hidden_states)

    def loss(self, hidden_states: torch.Tensor, labels: torch.Tensor, *,
             loss_weights: Optional[torch.Tensor] = None) -> CrossEntropyOutput:
        """Fused CE of ``hidden_states [..., H]`` against *shifted* ``labels [...]`` with
        per-token ``loss_weights`` (same shape), as :class:`megaloss.CrossEntropyOutput`."""
        if isinstance(self.lm_head, VocabParallelLMHead):
            return self.lm_head(hidden_states, labels, loss_weights=loss_weights,
                                return_stats=True)
        return linear_cross_entropy(hidden_states, self.lm_head.weight, labels,
                                    bias=self.lm_head.bias, loss_weights=loss_weights,
                                    options=self.options, return_stats=True)


class PipelineCrossEntropyLoss:
    """The pipeline's ``loss_fn(outputs, labels)`` on the last stage, ``labels`` =
    ``(shift_labels, loss_weights)`` as :func:`pipeline_train_step` feeds them.

    Training: returns a scalar whose value is ``local x loss_log_multiplier`` and whose gradient
    is that of ``local x gradient multiplier`` (``local = sum_t w_t * l_t``), so the engine's
    gradients and its returned loss are both the global ones (:class:`PipelineScale`). Eval
    (the stage in ``eval()`` mode): the plain CE sum (z-loss left out). The detached sums and
    valid-token counts are kept for :meth:`global_sums`.
    """

    def __init__(self, stage: CrossEntropyHeadStage, scale: PipelineScale) -> None:
        self.stage = stage
        self.gradient_multiplier = float(scale.gradient.loss_multiplier)
        self.log_multiplier = float(scale.loss_log_multiplier)
        self.reset()

    def reset(self) -> None:
        self._sums = torch.zeros(3, dtype=torch.float64)  # loss, z-loss, valid tokens

    def __call__(self, outputs: torch.Tensor, labels: Sequence[torch.Tensor]) -> torch.Tensor:
        shift_labels, weights = labels
        out = self.stage.loss(outputs, shift_labels, loss_weights=weights)
        local = out.loss if self.stage.training else out.loss - out.z_loss
        self._sums = self._sums.to(local.device)
        self._sums += torch.stack([local.detach().double(), out.z_loss.detach().double(),
                                   out.num_valid_tokens.detach().double()])
        if not self.stage.training:
            return local
        g, m = self.gradient_multiplier, self.log_multiplier
        return local * g + local.detach() * (m - g)

    def global_sums(self, layout: PipelineLayout, device: torch.device) -> torch.Tensor:
        """``[loss, z-loss, valid tokens]`` summed over the last stage's data-parallel group
        since :meth:`reset`, float64, on every rank (broadcast over the pipeline from its last
        stage). Collective: every rank calls it."""
        return _last_stage_sums(self._sums, layout, device)


def _last_stage_sums(sums: Optional[torch.Tensor], layout: PipelineLayout,
                     device: torch.device) -> torch.Tensor:
    topo = layout.topology
    out = torch.zeros(3, dtype=torch.float64, device=device)
    if layout.is_last_stage and sums is not None:
        out += sums.to(device)
        all_reduce_sum_(out, topo.dp_group)
    if topo.pp_size > 1:
        src = group_ranks(topo.pp_group)[-1]
        dist.broadcast(out, src=src, group=topo.pp_group)
    return out


# engine -----------------------------------------------------------------------------------------
@dataclass
class MegalossPipelineEngine:
    """What :func:`initialize_pipeline` returns.

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
        activation_checkpoint_interval: ``PipelineModule``'s.
        ignore_index: label without loss.

    Raises:
        ValueError: a ZeRO stage other than 0 / 1, sizes that differ from ``layout``, sequence
            parallelism, or the engine's groups not those of ``layout``.
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
    # no_grad: PipelineModule broadcasts tied weights (TiedLayerSpec) in place, and a c10d
    # broadcast recorded by autograd warns at every backward
    with torch.no_grad():
        module = PipelineModule(layers=list(layers), topology=layout.process_topology,
                                partition_method=partition_method,
                                activation_checkpoint_interval=activation_checkpoint_interval)
    grid = module.mpu()
    mine = _grid_topology(grid)
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


def _check_micro_batch(mb: Mapping[str, Any]) -> None:
    extra = [k for k in _UNSUPPORTED_KEYS if mb.get(k) is not None]
    if extra:
        raise ValueError(f"the pipeline stages take input_ids only; micro-batch keys {extra} "
                         "are not passed between stages (use full causal rows)")


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
    gas = int(engine.gradient_accumulation_steps())
    if len(micro_batches) != gas:
        raise ValueError(f"micro_batches must hold gradient_accumulation_steps={gas} entries, got "
                         f"{len(micro_batches)}")
    for mb in micro_batches:
        _check_micro_batch(mb)
    t0 = time.perf_counter()
    device = engine.device
    mbs = [_to_device(mb, device) for mb in micro_batches]
    ignore = me.calibrator.ignore_index
    step = me.calibrator.begin_step([_shift_labels(mb, ignore) for mb in mbs])
    data = [(mb["input_ids"], (step.local_labels(i), step.weights(i))) for i, mb in enumerate(mbs)]
    if me.loss is not None:
        me.loss.reset()
    logged = engine.train_batch(iter(data))
    sums = _last_stage_sums(None if me.loss is None else me.loss._sums, me.layout, device)
    elapsed = time.perf_counter() - t0
    grad_norm = engine.get_global_grad_norm()
    num_tokens = float(step.num_tokens)
    metrics = PipelineStepMetrics(
        step=int(engine.global_steps), loss=float(sums[0]), z_loss=float(sums[1]),
        num_tokens=num_tokens, lr=float(engine.get_lr()[0]),
        grad_norm=None if grad_norm is None else float(grad_norm),
        tokens_per_s=num_tokens / max(elapsed, 1e-9), peak_memory_mib=peak_memory_mib(device),
        step_time_s=elapsed, samples=int(getattr(engine, "global_samples", 0)),
        engine_loss=float(logged))
    if log:
        d = asdict(metrics)
        d["optimizer_step"] = d.pop("step")
        d.pop("samples")
        write_metrics(engine, d)
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
        _check_micro_batch(mb)
        mb = _to_device(mb, device)
        labels = _shift_labels(mb, ignore)
        ones = (labels != ignore).to(torch.float32)
        engine.eval_batch(iter([(mb["input_ids"], (labels, ones))]), num_micro_batches=1,
                          bcast_loss=False)
    engine.train()
    sums = _last_stage_sums(None if me.loss is None else me.loss._sums, me.layout, device)
    n = float(sums[2])
    loss = float(sums[0]) / n if n > 0 else 0.0
    result = EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), num_tokens=n)
    if log:
        write_metrics(engine, {"loss": result.loss, "perplexity": result.perplexity},
                      prefix="Eval/megaloss/")
    return result

