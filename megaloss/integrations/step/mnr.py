"""The gathered contrastive (MNR) family of the calibrated step: a module whose forward returns
the micro-batch's *global* MNR loss (every data-parallel rank's queries against every rank's
documents, :func:`megaloss.mnr_loss`), ``module(**micro_batch, loss_weight=w)`` returning an
object with ``loss`` (``w`` times the value), ``value`` and ``accuracy`` (e.g.
:class:`megaloss.integrations.hf.EmbeddingModelWithMNR`).

The calibration (:func:`step_loss_weights`, one all-reduce of the step's query counts): the
loss of micro-batch ``m`` is the same on every rank and its backward already sums over the ``D``
ranks, so ``w_m = (n_m / N) * M / D`` (``n_m`` its global queries, ``N`` the step's, ``M`` the
engine's measured loss multiplier) makes the step's gradient that of the query mean over the
whole step. The multiplier sits inside the weight (GradCache's replays back-propagate inside
the micro-batch's forward at the scale of its loss, :mod:`megaloss.integrations.grad_cache`), so
the calibration's own multiplier is 1 and its global loss divides by ``M``
(:class:`MNRCalibration`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ...calibration.calibrator import LossCalibrator, StepCalibration
from ...calibration.weights import LossWeights
from ...parallel.comm import all_reduce_sum_
from ...parallel.groups import GroupLike, group_size
from ...parallel.topology import Topology
from .checks import integer_tensor
from .loop import StepLoss

__all__ = ["MNRStepLoss", "MNRCalibration", "step_loss_weights", "mnr_step_weights"]

# the micro-batch keys the family reads (the module takes them as keyword arguments)
_KEYS = ("query_input_ids", "query_attention_mask", "document_input_ids",
         "document_attention_mask")


def mnr_step_weights(local_sizes: Sequence[int], group: GroupLike, *,
                     loss_multiplier: Optional[float] = None,
                     device: Optional[torch.device] = None,
                     dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(weights [G], N)``: :func:`step_loss_weights` and the step's global number of queries
    ``N`` (float64 scalar), from the same one all-reduce."""
    if len(local_sizes) == 0 or min(local_sizes) < 0:
        raise ValueError(f"local_sizes must be a non-empty list of counts >= 0, got {local_sizes}")
    world = group_size(group)
    if loss_multiplier is None:
        loss_multiplier = float(len(local_sizes) * world)
    if not loss_multiplier > 0:
        raise ValueError(f"loss_multiplier must be > 0, got {loss_multiplier}")
    # counts all-reduced in float32 (exact below 2**24 rows per micro-batch, and 4 bytes each on
    # the wire), the weights formed in float64 and returned in the loss's dtype
    sizes = torch.tensor([float(n) for n in local_sizes], dtype=torch.float32, device=device)
    all_reduce_sum_(sizes, group)
    sizes = sizes.double()
    total = sizes.sum()
    return (sizes * (loss_multiplier / world / total.clamp_min(1.0))).to(dtype), total


def step_loss_weights(local_sizes: Sequence[int], group: GroupLike, *,
                      loss_multiplier: Optional[float] = None,
                      device: Optional[torch.device] = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-micro-batch ``loss_weight`` that makes a GAS step the query-weighted global mean.

    The engine leaves ``c * sum_{r, m} grad(loss_rm)`` (``c = 1 / loss_multiplier``; DeepSpeed
    with ``engine.backward``: ``c = 1 / (G * D)``), and ``mnr_loss``'s backward already gives
    ``sum_r grad(loss_rm) = D * grad(L_m)`` over the ``D`` ranks of ``group``. So backwarding
    ``w_m * L_m`` with ``w_m = (n_m / N) * loss_multiplier / D`` leaves
    ``sum_m (n_m / N) grad(L_m)``: the gradient of the step's global mean over queries.

    Args:
        local_sizes: this rank's number of queries in each of the step's ``G`` micro-batches
            (known before the first forward: prefetch the step's batches).
        group: the data-parallel group of the loss (``None``: torch's default group).
        loss_multiplier: ``1 / c`` as measured on the real engine
            (:func:`megaloss.calibration.engine_scale.probe_deepspeed`); ``None`` assumes
            DeepSpeed's ``engine.backward``, ``G * D``.
        device: where the result lives (CPU by default).
        dtype: of the result (computed in float64): the loss's compute dtype
            (:func:`megaloss.calibration.weights.loss_weight_dtype` of the model).

    Returns:
        ``[G]`` tensor ``w_m`` of ``dtype`` (all ones for DeepSpeed when every micro-batch has the
        same global size; zeros when ``N = 0``). One all-reduce over ``group``, entered by every
        rank.

    Raises:
        ValueError: ``local_sizes`` empty or with a negative entry; ``loss_multiplier`` <= 0.
    """
    return mnr_step_weights(local_sizes, group, loss_multiplier=loss_multiplier, device=device,
                            dtype=dtype)[0]


class MNRCalibration(StepCalibration):
    """A step's MNR calibration (module docstring): micro-batch ``m``'s scalar weight ``w_m``
    (:meth:`weights`), the engine's multiplier inside it (the calibration's own is 1), the
    step's global queries as :attr:`num_tokens` / :attr:`num_samples`, and :meth:`global_loss`
    the query mean over the step (the ranks' sums divided by the engine's multiplier: every
    rank holds the same global loss of each micro-batch)."""

    def __init__(self, weights: torch.Tensor, num_queries: torch.Tensor, topology: Topology,
                 engine_multiplier: float) -> None:
        lw = LossWeights(weights=list(weights.unbind(0)), denominator=num_queries,
                         num_tokens=num_queries, num_samples=num_queries)
        super().__init__(lw, [None] * len(weights), topology, 1.0)
        self.engine_multiplier = float(engine_multiplier)

    def global_loss(self) -> torch.Tensor:
        if self._global is None:
            self._global = super().global_loss() / self.engine_multiplier
        return self._global


class MNRStepLoss(StepLoss):
    """The gathered MNR family (module docstring). Micro-batches: ``query_input_ids``,
    ``query_attention_mask``, ``document_input_ids``, ``document_attention_mask`` ``[B, T]``
    (``B`` may differ per rank, or be 0), optionally ``negative_input_ids`` /
    ``negative_attention_mask`` ``[B, K, T]`` and ``duplicate_ids [B]``.

    Args:
        cached: GradCache's forward of one micro-batch, ``cached(micro_batch, loss_weight)``
            (e.g. :func:`megaloss.integrations.hf.cached_mnr_forward` bound to the engine, its
            ``mini_batch_size`` and :func:`megaloss.integrations.grad_cache.inner_replay_backward`);
            None: the module's forward.

    :meth:`metrics`: ``mnr_loss`` and ``accuracy``, the step's query-weighted means (every rank
    holds them already: no collective).
    """

    def __init__(self, *, cached: Optional[Callable[[Mapping[str, Any], torch.Tensor], Any]]
                 = None) -> None:
        self.cached = cached

    def check(self, i: int, mb: Mapping[str, Any], topology: Topology) -> None:
        for key in _KEYS:
            integer_tensor(f"micro_batches[{i}]['{key}']", mb.get(key))

    def calibrate(self, calibrator: LossCalibrator,
                  micro_batches: Sequence[Mapping[str, Any]]) -> StepCalibration:
        topology = calibrator.topology
        multiplier = calibrator.engine_scale.loss_multiplier
        device = micro_batches[0]["query_input_ids"].device if micro_batches else None
        weights, total = mnr_step_weights(
            [len(mb["query_input_ids"]) for mb in micro_batches], topology.dp_sp_group,
            loss_multiplier=multiplier, device=device, dtype=calibrator.weight_dtype)
        return MNRCalibration(weights, total, topology, multiplier)

    def loss(self, forward, step: MNRCalibration, i: int,
             mb: Mapping[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
        w = step.weights(i)
        out = forward(**mb, loss_weight=w) if self.cached is None else self.cached(mb, w)
        # the micro-batch's share of the step's queries, w_m * D / M, for the metrics
        share = w * (step.topology.dp_sp_size / step.engine_multiplier)
        return out.loss, share * torch.stack([out.value, out.accuracy]).float()

    def metrics(self, step: StepCalibration, stats: List[torch.Tensor],
                topology: Topology) -> Dict[str, Any]:
        total = stats[0].clone() if stats else torch.zeros(2)
        for s in stats[1:]:
            total += s
        loss, accuracy = total.tolist()
        return {"mnr_loss": loss, "accuracy": accuracy}
