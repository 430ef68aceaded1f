"""What the sequence-level preference losses of :mod:`megaloss.losses.orpo`,
:mod:`megaloss.losses.simpo` and :mod:`megaloss.losses.kto` share: input checks, the per-row and
NLL weights of a step (:func:`preference_weights`) and the metric reduction."""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..calibration.calibrator import StepCalibration
from ..parallel.comm import all_reduce_sum_
from ..parallel.groups import GroupLike

WEIGHT_CONVENTIONS = ("global", "micro_batch")


class PreferenceWeights(NamedTuple):
    """The weights of one micro-batch (:func:`preference_weights`): ``pair_weights`` ``[P]``
    (one per pair, or per example for KTO) and ``nll_weight`` (a scalar tensor, the weight of
    each NLL token)."""

    pair_weights: torch.Tensor
    nll_weight: torch.Tensor


def preference_weights(step: StepCalibration, i: int, *, convention: str = "global",
                       ignore_index: int = -100) -> PreferenceWeights:
    """The row weights and the NLL token weight of micro-batch ``i`` (no collective).

    Args:
        step: a :class:`~megaloss.calibration.LossCalibrator` step (``loss_reduction="sample"``)
            begun on one ``[P, T]`` label tensor per micro-batch whose valid tokens are those the
            NLL term counts: the chosen completions (``completion_labels(chosen_mask)``; CPO's
            NLL, and KTO's rows), or the chosen prompt and completion (TRL's ORPO NLL). A row
            counts when it has a valid token.
        i: the micro-batch.
        convention: ``"global"`` (megaloss): ``pair_weights = 1 / N_pairs`` and ``nll_weight =
            1 / N_tokens`` of the whole step (every DP / SP rank and accumulation step), so any
            split gives the single-device loss and gradient. ``"micro_batch"`` (TRL's trainers
            under HF ``Trainer`` + DDP): each micro-batch's mean over its own pairs and tokens,
            averaged over the step's ``G x dp`` micro-batches (``1 / (P_i G dp)``,
            ``1 / (T_i G dp)``); needs ``sp = 1``.
        ignore_index: the label of tokens outside the NLL term.

    Under sequence parallelism (the step's topology has ``sp > 1``, the labels given to
    ``begin_step`` the whole sequences) a row counts when it has a valid token on *any* SP rank
    (read from :meth:`~megaloss.calibration.StepCalibration.full_labels`), and its weights are
    on SP rank 0 alone (``pair_weights`` and ``nll_weight`` 0 on the others): the losses take
    the pair terms and the NLL from sequence sums, which must then be the whole sequences'
    (``sequence_log_probs(..., sp_group=...)``), so each pair and each NLL token counts once and
    its gradient reaches every slice through that autograd all-reduce.

    Raises:
        ValueError: unknown ``convention``; ``"micro_batch"`` with sequence parallelism.
        IndexError: ``i`` out of range.
    """
    if convention not in WEIGHT_CONVENTIONS:
        raise ValueError(f"convention must be one of {WEIGHT_CONVENTIONS}, got {convention!r}")
    topology = step.topology
    full = step.full_labels(i)
    valid = full != ignore_index
    rows = valid.reshape(full.shape[0], -1).any(-1).to(torch.float64)
    counted = 1.0
    if topology.sp_size != 1 and topology.sp_rank != 0:
        rows, counted = torch.zeros_like(rows), 0.0
    if convention == "global":
        pairs, tokens = step.num_samples, step.num_tokens
    else:
        if topology.sp_size != 1:
            raise ValueError("convention='micro_batch' needs sp = 1 (a micro-batch's own mean "
                             "over an SP-split sequence would need a collective)")
        copies = float(step.num_micro_batches * topology.dp_size)
        pairs = rows.sum() * copies
        tokens = valid.sum().to(torch.float64) * copies  # sp = 1: the full labels are local
    one = torch.ones((), dtype=torch.float64, device=rows.device)
    pairs = torch.where(pairs > 0, pairs, one)
    tokens = torch.where(tokens > 0, tokens, one)
    dtype = step.weights(i).dtype
    return PreferenceWeights((rows / pairs).to(dtype), (counted / tokens).to(dtype))


def check_vector(name: str, x: torch.Tensor, n: Optional[int], first: str) -> int:
    """``x`` must be a floating ``[n]`` tensor (``n`` from the argument ``first``)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 1:
        raise ValueError(f"{name} must be a floating [P] torch.Tensor, got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if n is not None and x.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) (that of {first}), got "
                         f"{tuple(x.shape)}")
    return x.shape[0]


def check_lengths(name: str, x: Optional[torch.Tensor], n: int, why: str,
                  dtype: torch.dtype) -> torch.Tensor:
    """``x``: ``[n]`` token counts, returned in ``dtype`` and at least 1 (a row without tokens
    has a zero log-prob sum, so its average is 0)."""
    if x is None:
        raise ValueError(f"{name} is required ({why})")
    if not isinstance(x, torch.Tensor) or x.shape != (n,):
        raise ValueError(f"{name} must be a [{n}] tensor, got {getattr(x, 'shape', x)}")
    return x.to(dtype).clamp(min=1.0)


def check_weights(name: str, w: Optional[torch.Tensor], n: int, like: torch.Tensor
                  ) -> torch.Tensor:
    """``[n]`` row weights, ``None``: the mean over this call's ``n`` rows."""
    if w is None:
        return torch.full((n,), 1.0 / max(n, 1), dtype=like.dtype, device=like.device)
    if not isinstance(w, torch.Tensor) or w.shape != (n,):
        raise ValueError(f"{name} must be a [{n}] tensor, got {getattr(w, 'shape', w)}")
    return w.to(like.dtype)


def check_scalar_weight(name: str, w: Union[None, float, torch.Tensor], like: torch.Tensor,
                        default: Optional[torch.Tensor]) -> torch.Tensor:
    """A scalar weight (float or one-element tensor), ``default`` when ``None``."""
    if w is None:
        return default
    if isinstance(w, torch.Tensor):
        if w.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(w.shape)}")
        return w.reshape(()).to(like.dtype)
    if isinstance(w, bool) or not isinstance(w, (int, float)):
        raise ValueError(f"{name} must be a float or a scalar tensor, got {w!r}")
    return torch.tensor(float(w), dtype=like.dtype, device=like.device)


def reduce_metrics(stats: Union[torch.Tensor, Sequence[torch.Tensor]], size: int, output: str,
                   group: GroupLike) -> Tuple[float, ...]:
    """The sums of ``stats`` (one or more ``[size]`` tensors) over this call's list and ``group``
    (ONE all-reduce)."""
    if isinstance(stats, torch.Tensor):
        stats = [stats]
    stats = list(stats)
    if not stats or any(not isinstance(s, torch.Tensor) or s.shape != (size,) for s in stats):
        raise ValueError(f"stats must be one or more {output}.stats tensors [{size}]")
    return tuple(all_reduce_sum_(torch.stack(stats).sum(0).to(torch.float64), group).tolist())


def ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def means(names: Sequence[str], sums: Sequence[float], count: float) -> Dict[str, float]:
    return {name: ratio(s, count) for name, s in zip(names, sums)}
