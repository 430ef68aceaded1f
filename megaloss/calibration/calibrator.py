"""Per-step loss calibration object for training loops and engine integrations.

Usage, once per optimizer step (the labels of all ``G`` micro-batches are known up front)::

    calib = LossCalibrator(topology, loss_reduction="token", engine_scale=probe_deepspeed(cfg,
    mpu=mpu))
    step = calib.begin_step([mb["labels"] for mb in micro_batches])      # ONE all-reduce
    for i, mb in enumerate(micro_batches):
        labels = step.local_labels(i)       # this SP rank's slice (the labels when sp = 1)
        w = step.weights(i)                 # same shape, already / global denominator
        local = linear_cross_entropy(h, W, labels, loss_weights=w, reduction="sum")
        engine.backward(step.loss_for_backward(local))   # x engine multiplier, no collective
        engine.step()
    loss = step.global_loss()               # ONE all-reduce: the single-device loss, all ranks

Why this gives single-device gradients: with weights ``w`` from
:func:`~megaloss.calibration.weights.compute_loss_weights`, the sum over all ``dp x sp`` ranks and
micro-batches of the local sums is the global loss ``L``. The engine leaves
``c * sum_{r,i} grad(loss_ri)`` (``c`` measured by :mod:`~megaloss.calibration.engine_scale`), so
backwarding ``loss_ri = local_ri / c`` gives ``grad(L)`` exactly. The logged value needs no
autograd trick: the detached local sums are added up and all-reduced once at the end of the step.
(XTuner's alternative, an autograd ``all_reduce_sum`` of each local loss, costs a collective per
micro-batch in forward and backward and a ``x world`` factor that only an averaging engine undoes.)
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..parallel.comm import all_reduce_sum_
from ..parallel.groups import group_ranks
from ..parallel.topology import Topology
from .engine_scale import EngineScale
from .weights import (
    LOSS_REDUCTIONS,
    LossWeights,
    SpSplitFn,
    compute_loss_weights,
    split_for_sequence_parallel,
)

__all__ = ["LossCalibrator", "StepCalibration"]


class StepCalibration:
    """The calibration of one optimizer step (made by :meth:`LossCalibrator.begin_step`).

    Attributes:
        loss_weights: the :class:`~megaloss.calibration.weights.LossWeights` of the step.
        loss_multiplier: per-rank factor applied by :meth:`loss_for_backward` (``1 / c``).
        count_empty_samples: whether :attr:`num_samples` (and the ``"sample"`` denominator)
            counts samples without a valid token (the calibrator's option).
    """

    def __init__(self, loss_weights: LossWeights, local_labels: List[torch.Tensor],
                 topology: Topology, loss_multiplier: float, *,
                 count_empty_samples: bool = False,
                 labels: Optional[List[torch.Tensor]] = None):
        self.loss_weights = loss_weights
        self.count_empty_samples = count_empty_samples
        self._labels = local_labels
        self._full_labels = local_labels if labels is None else labels
        self._topology = topology
        self.loss_multiplier = float(loss_multiplier)
        self._logged: Optional[torch.Tensor] = None
        self._global: Optional[torch.Tensor] = None

    @property
    def num_micro_batches(self) -> int:
        return len(self._labels)

    def weights(self, i: int) -> torch.Tensor:
        """``loss_weights`` of micro-batch ``i`` on this rank (its SP slice), shape of
        :meth:`local_labels`; 0 on ignored and SP-padding tokens."""
        self._check_index(i)
        return self.loss_weights.weights[i]

    def local_labels(self, i: int) -> torch.Tensor:
        """Labels of micro-batch ``i`` on this rank: its SP slice, padded with ``ignore_index``
        (the labels as given when ``sp`` has size 1)."""
        self._check_index(i)
        return self._labels[i]

    @property
    def topology(self) -> Topology:
        """The process groups the step was calibrated over."""
        return self._topology

    def full_labels(self, i: int) -> torch.Tensor:
        """Labels of micro-batch ``i`` as given to :meth:`LossCalibrator.begin_step`: the
        *whole* sequences, also when ``sp`` > 1 (what decides whether a sample has a valid token
        on any SP rank)."""
        self._check_index(i)
        return self._full_labels[i]

    def loss_for_backward(self, local_weighted_sum: torch.Tensor) -> torch.Tensor:
        """The loss this rank backwards for one micro-batch.

        Args:
            local_weighted_sum: scalar ``sum_t w_t * l_t`` over this rank's tokens of one
                micro-batch (a CE loss with ``loss_weights=self.weights(i)``,
                ``reduction="sum"``), differentiable.

        Returns:
            ``local_weighted_sum * loss_multiplier`` (differentiable). Its detached value is also
            added to the step's logged loss (see :meth:`global_loss`). No collective.

        Raises:
            ValueError: ``local_weighted_sum`` is not a scalar tensor.
        """
        if not isinstance(local_weighted_sum, torch.Tensor) or local_weighted_sum.numel() != 1:
            raise ValueError("local_weighted_sum must be a scalar tensor (use reduction='sum')")
        value = local_weighted_sum.detach().reshape(()).to(torch.float64)
        self._logged = value if self._logged is None else self._logged + value
        self._global = None
        return local_weighted_sum * self.loss_multiplier

    def global_loss(self) -> torch.Tensor:
        """The step's loss as one device would compute it on the whole global batch: float64
        scalar, identical on all ranks. One SUM all-reduce over the ``dp x sp`` group (cached;
        every rank must call it). 0 when no rank had a valid token."""
        if self._global is None:
            local = (self._logged.clone() if self._logged is not None
                     else torch.zeros((), dtype=torch.float64,
                                      device=self.loss_weights.denominator.device))
            self._global = all_reduce_sum_(local, self._topology.dp_sp_group)
        return self._global

    @property
    def num_tokens(self) -> torch.Tensor:
        """Global valid tokens of the step (float64 scalar, no extra collective)."""
        return self.loss_weights.num_tokens

    @property
    def num_samples(self) -> torch.Tensor:
        """Global samples with >= 1 valid token, or every sample with ``count_empty_samples``
        (float64 scalar, no extra collective)."""
        return self.loss_weights.num_samples

    def _check_index(self, i: int) -> None:
        if not 0 <= i < len(self._labels):
            raise IndexError(f"micro-batch index must be in [0, {len(self._labels)}), got {i}")


class LossCalibrator:
    """Global loss calibration across ``dp x sp`` and gradient accumulation.

    Args:
        topology: process groups (weights are all-reduced over ``topology.dp_sp_group``; the SP
            slice comes from ``topology.sp_group``). Default: :meth:`Topology.default`.
        loss_reduction: ``"token"``, ``"sample"`` or ``"square"`` (see :mod:`.weights`; XTuner's
            name and definitions).
        engine_scale: measured gradient factor of the engine path (``probe_ddp``,
            ``megaloss.calibration.deepspeed_scale.probe_deepspeed``, ...); default
            :meth:`EngineScale.identity` (one process, plain ``backward``). It must have been
            measured over the topology's ``dp x sp`` group.
        ignore_index: label of tokens without loss.
        weight_dtype: dtype of the weights handed to the loss (statistics stay float64).
        sp_split: how a full sequence is cut into this SP rank's slice (default
            :func:`~megaloss.calibration.weights.split_for_sequence_parallel`); it must match how
            the inputs are split.
        count_empty_samples: count samples without a valid token too, in
            :attr:`StepCalibration.num_samples` and the ``"sample"`` denominator (see
            :func:`~megaloss.calibration.weights.compute_loss_weights`; bool).

    Raises:
        ValueError: unknown ``loss_reduction``; an ``engine_scale`` measured over a group of
            another size than the topology's ``dp x sp`` group.
        TypeError: ``engine_scale`` or ``topology`` of the wrong type, ``count_empty_samples``
            not a bool.
    """

    def __init__(self, topology: Optional[Topology] = None, *, loss_reduction: str = "token",
                 engine_scale: Optional[EngineScale] = None, ignore_index: int = -100,
                 weight_dtype: torch.dtype = torch.float32,
                 sp_split: SpSplitFn = split_for_sequence_parallel,
                 count_empty_samples: bool = False):
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got "
                             f"{loss_reduction!r}")
        topology = Topology.default() if topology is None else topology
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a megaloss Topology, got {type(topology).__name__}")
        engine_scale = EngineScale.identity() if engine_scale is None else engine_scale
        if not isinstance(engine_scale, EngineScale):
            raise TypeError("engine_scale must be an EngineScale, got "
                            f"{type(engine_scale).__name__}")
        if engine_scale.group_size != topology.dp_sp_size:
            raise ValueError(
                f"engine_scale was measured over a group of {engine_scale.group_size} rank(s) "
                f"(global ranks {list(engine_scale.group_ranks)}) but the topology's dp x sp "
                f"group has {topology.dp_sp_size} (global ranks "
                f"{group_ranks(topology.dp_sp_group)}): probe the engine that reduces over "
                "topology.dp_sp_group (build its mpu from this topology, or pass "
                "process_group=topology.dp_sp_group to probe_ddp)")
        self.topology = topology
        self.loss_reduction = loss_reduction
        self.engine_scale = engine_scale
        self.ignore_index = ignore_index
        self.weight_dtype = weight_dtype
        self.sp_split = sp_split
        if not isinstance(count_empty_samples, bool):
            raise TypeError(f"count_empty_samples must be a bool, got {count_empty_samples!r}")
        self.count_empty_samples = count_empty_samples

    def begin_step(self, labels: Sequence[torch.Tensor], *,
                   cu_seqlens: Optional[Sequence[Optional[torch.Tensor]]] = None,
                   position_ids: Optional[Sequence[Optional[torch.Tensor]]] = None
                   ) -> StepCalibration:
        """Calibrate one optimizer step: every rank of the ``dp x sp`` group must call it (also
        with only ignored labels); one all-reduce.

        Args:
            labels: one shifted int label tensor per micro-batch of the step (``[B, T]`` or
                ``[T]``; the *full* sequences when ``sp`` > 1).
            cu_seqlens / position_ids: optional per micro-batch sample boundaries of packed
                sequences (see :func:`~megaloss.calibration.weights.sample_ids_from_boundaries`).

        Raises:
            ValueError, TypeError: see :func:`~megaloss.calibration.weights.compute_loss_weights`.
        """
        topo = self.topology
        lw = compute_loss_weights(labels, self.loss_reduction, group=topo.dp_sp_group,
                                  sp_group=topo.sp_group, ignore_index=self.ignore_index,
                                  cu_seqlens=cu_seqlens, position_ids=position_ids,
                                  dtype=self.weight_dtype, sp_split=self.sp_split,
                                  count_empty_samples=self.count_empty_samples)
        labels = [labels] if isinstance(labels, torch.Tensor) else list(labels)
        local = [self.sp_split(y, topo.sp_rank, topo.sp_size, self.ignore_index) for y in labels]
        return StepCalibration(lw, local, topo, self.engine_scale.loss_multiplier,
                               count_empty_samples=self.count_empty_samples, labels=labels)

    def __repr__(self) -> str:
        return (f"LossCalibrator(loss_reduction={self.loss_reduction!r}, {self.topology!r}, "
                f"engine={self.engine_scale.engine!r}, "
                f"loss_multiplier={self.engine_scale.loss_multiplier:g})")
