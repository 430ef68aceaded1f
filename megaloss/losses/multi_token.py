r"""Multi-token prediction (MTP) loss of DeepSeek-V3 (arXiv:2412.19437, sec. 2.2): the main
next-token cross-entropy plus, for each extra depth ``k = 1..D``, the cross-entropy of the
token ``k + 1`` places ahead, every depth through the *shared* output head, each one chunked
(:func:`megaloss.losses.cross_entropy.linear_cross_entropy`, on one device or vocab-parallel):
no ``[tokens, V]`` logits, for any depth.

Math. With ``y`` the shifted targets (``y[t]`` = token ``t + 1``, Hugging Face's
``shift_labels``) and ``h^k`` the hidden states of depth ``k`` (``h^0`` the main model's)::

    y^k[t] = y[t + k]  when position t + k is in the sample of position t,
             ignore_index otherwise (and past the end)                          (mtp_labels)
    CE_k   = cross-entropy of h^k @ W.T against y^k      (W the shared lm_head weight [V, H])
    loss   = CE_0 + (scaling_factor / D) * sum_{k=1..D} CE_k

``y^k`` is ``y`` rolled left by ``k`` inside each packed sample, as Megatron-LM's ``roll_tensor``
rolls labels and loss mask once per depth (``megatron/core/transformer/
multi_token_prediction.py``, ``_roll_tensor_packed_seq``); the scaling is its
``mtp_loss_scaling_factor / mtp_num_layers`` (0.1 by default there and here).

Calibration over the global batch. Each depth has its own valid tokens (rolling drops the last
``k`` positions of every sample), so each depth is normalised by its *own* global count:
:func:`mtp_loss_weights` gives, per micro-batch, one ``loss_weights`` tensor per depth (the
main loss's included) from :func:`megaloss.calibration.weights.compute_loss_weights`' rule,
with one all-reduce for all depths; with ``reduction="sum"`` the sum of the per-micro-batch
losses over every micro-batch and rank is then each depth's global token mean, whatever the
split. Megatron-LM divides each micro-batch's MTP loss by that micro-batch's own rolled count
(``process_mtp_loss``), which weights the tokens of short micro-batches more; torchtitan's
DeepSeek-V3 (``torchtitan/models/deepseek_v3``) divides by the global valid count but forms
each depth's logits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence

import torch

from ..calibration.weights import (
    LossWeights,
    compute_loss_weights,
    sample_ids_from_boundaries,
    split_for_sequence_parallel,
)
from ..ops.cross_entropy_options import CrossEntropyOptions
from ..parallel.comm import all_reduce_sum_
from ..parallel.groups import SINGLE_RANK, GroupLike, group_rank, group_size
from .cross_entropy import linear_cross_entropy
from .vocab_parallel import VocabParallelOptions, check_vocab_parallel_options

__all__ = ["mtp_labels", "MTPLossWeights", "mtp_loss_weights", "MultiTokenPredictionOutput",
           "multi_token_prediction_loss", "MTP_LOSS_SCALING_FACTOR"]

# Megatron-core's default ``mtp_loss_scaling_factor`` (TransformerConfig)
MTP_LOSS_SCALING_FACTOR = 0.1


def _check_depth(depth, name: str = "depth") -> int:
    if isinstance(depth, bool) or not isinstance(depth, int):
        raise TypeError(f"{name} must be an int >= 1, got {depth!r}")
    if depth < 1:
        raise ValueError(f"{name} must be >= 1, got {depth}")
    return depth


def mtp_labels(labels: torch.Tensor, depth: int, *, ignore_index: int = -100,
               position_ids: Optional[torch.Tensor] = None,
               cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The targets of MTP depth ``depth``: ``labels`` rolled left by ``depth`` inside each sample.

    Position ``t`` of depth ``k`` predicts token ``t + k + 1``, whose shifted target sits at
    ``labels[t + k]``; it is kept when position ``t + k`` belongs to the same sample as ``t``
    (the sample's last ``k`` positions, and a row's, get ``ignore_index``). A target that
    ``labels`` ignores stays ignored. Megatron-LM's ``roll_tensor`` applied ``k`` times
    (``megatron/core/transformer/multi_token_prediction.py``).

    Args:
        labels: ``[B, T]`` or ``[T]`` integer, already shifted (Hugging Face's
            ``shift_labels``: the target of position ``t`` at ``t``).
        depth: ``k >= 1`` (int).
        ignore_index: the label of positions without loss.
        position_ids: optional, shape of ``labels``: a sample starts where it is 0 (Hugging
            Face's flattened packing) and at every row start.
        cu_seqlens: optional ``[S + 1]`` offsets into the flattened ``labels`` (flash-attn's
            varlen convention), from 0 to ``labels.numel()``. At most one of the two; neither:
            each row is one sample (a ``[T]`` tensor, one sample). See
            :func:`megaloss.calibration.weights.sample_ids_from_boundaries`.

    Returns:
        A new tensor of ``labels``' shape and dtype.

    Raises:
        TypeError: ``labels`` not an integer tensor; ``depth`` not an int.
        ValueError: ``depth < 1``; ``labels`` not 1-D or 2-D; both or ill-fitting boundaries.
    """
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must be an integer torch.Tensor, got "
                        f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if labels.dim() not in (1, 2):
        raise ValueError(f"labels must be [B, T] or [T], got shape {tuple(labels.shape)}")
    k = _check_depth(depth)
    sid = sample_ids_from_boundaries(labels, cu_seqlens=cu_seqlens, position_ids=position_ids)
    flat = labels.reshape(-1)
    out = torch.full_like(flat, ignore_index)
    n = flat.numel()
    if k < n:
        same = sid[:n - k] == sid[k:]
        out[:n - k] = torch.where(same, flat[k:], out[:n - k])
    return out.view(labels.shape)


@dataclass
class MTPLossWeights:
    """What :func:`mtp_loss_weights` returns: the step's calibration of every depth.

    Attributes:
        depths: ``D + 1`` :class:`~megaloss.calibration.weights.LossWeights`, index 0 the main
            loss's, index ``k`` depth ``k``'s (its own global ``denominator``, ``num_tokens``
            and ``num_samples``).
        labels: per micro-batch, the ``D`` rolled targets of this rank (its SP slice, padded
            with ``ignore_index``), what ``depth_labels=`` of
            :func:`multi_token_prediction_loss` takes.
    """

    depths: List[LossWeights]
    labels: List[List[torch.Tensor]]

    def weights(self, i: int) -> List[torch.Tensor]:
        """``loss_weights`` of micro-batch ``i``: ``D + 1`` tensors (the main loss's first)."""
        return [d.weights[i] for d in self.depths]

    def depth_labels(self, i: int) -> List[torch.Tensor]:
        """The ``D`` rolled targets of micro-batch ``i`` on this rank."""
        return self.labels[i]


def mtp_loss_weights(labels: Sequence[torch.Tensor], depth: int, loss_reduction: str = "token",
                     *, group: GroupLike = None, sp_group: GroupLike = SINGLE_RANK,
                     ignore_index: int = -100,
                     cu_seqlens: Optional[Sequence[Optional[torch.Tensor]]] = None,
                     position_ids: Optional[Sequence[Optional[torch.Tensor]]] = None,
                     dtype: torch.dtype = torch.float32) -> MTPLossWeights:
    """Per-depth global loss weights of one optimizer step: the main loss's and each depth's,
    every one normalised by its own global count (:mod:`megaloss.calibration.weights`' rule on
    the depth's rolled targets, :func:`mtp_labels`).

    One SUM all-reduce of ``3 (D + 1)`` float64 numbers over ``group``, entered by every rank
    (also with no valid token).

    Args:
        labels: one integer tensor per micro-batch (``[B, T]`` or ``[T]``), already shifted;
            with ``sp_group`` of size > 1 the *full* sequences of the SP group.
        depth: ``D >= 1``, the number of MTP depths.
        loss_reduction: ``"token"``, ``"sample"`` or ``"square"`` (XTuner's; see
            :func:`~megaloss.calibration.weights.compute_loss_weights`).
        group: the ``dp x sp`` group (``None``: torch's default group;
            :data:`~megaloss.parallel.SINGLE_RANK`: one rank).
        sp_group: the sequence-parallel group (default: none).
        ignore_index: the label of positions without loss.
        cu_seqlens / position_ids: optional, one per micro-batch (entries may be ``None``): the
            packed samples, for the roll and for ``"sample"`` / ``"square"``.
        dtype: floating dtype of the weights.

    Returns:
        :class:`MTPLossWeights`; ``.weights(i)`` feeds ``loss_weights=`` of
        :func:`multi_token_prediction_loss` with ``reduction="sum"``.

    Raises:
        TypeError / ValueError: as :func:`compute_loss_weights` and :func:`mtp_labels`.
    """
    d = _check_depth(depth)
    if isinstance(labels, torch.Tensor):
        labels = [labels]
    labels = list(labels)
    if not labels:
        raise ValueError("labels must hold at least one micro-batch")
    n = len(labels)
    cus = [None] * n if cu_seqlens is None else list(cu_seqlens)
    poss = [None] * n if position_ids is None else list(position_ids)
    if len(cus) != n or len(poss) != n:
        raise ValueError(f"cu_seqlens / position_ids must have one entry per micro-batch ({n})")
    rolled = [[mtp_labels(y, k, ignore_index=ignore_index, position_ids=p, cu_seqlens=c)
               for y, c, p in zip(labels, cus, poss)] for k in range(1, d + 1)]
    # Each depth's local statistics (no collective), then one all-reduce for all depths.
    local = [compute_loss_weights(y, loss_reduction, group=SINGLE_RANK, sp_group=sp_group,
                                  ignore_index=ignore_index, cu_seqlens=cu_seqlens,
                                  position_ids=position_ids, dtype=torch.float64)
             for y in [labels] + rolled]
    stats = torch.stack([torch.stack([w.denominator, w.num_tokens, w.num_samples])
                         for w in local])
    all_reduce_sum_(stats, group)
    depths = []
    for w, (denom, tokens, samples) in zip(local, stats):
        # w.weights = u / D_local (u / 1 when D_local = 0, then u = 0): rescale to u / D_global.
        scale = (torch.where(w.denominator > 0, w.denominator, torch.ones_like(denom))
                 / torch.where(denom > 0, denom, torch.ones_like(denom)))
        depths.append(LossWeights(weights=[(x * scale).to(dtype) for x in w.weights],
                                  denominator=denom, num_tokens=tokens, num_samples=samples))
    sp, rank = group_size(sp_group), group_rank(sp_group)
    local_labels = [[split_for_sequence_parallel(rolled[k][i], rank, sp, ignore_index)
                     for k in range(d)] for i in range(n)]
    return MTPLossWeights(depths=depths, labels=local_labels)


class MultiTokenPredictionOutput(NamedTuple):
    """What :func:`multi_token_prediction_loss` returns.

    Attributes:
        loss: ``main_loss + scaling_factor / D * depth_losses.sum()``, differentiable; a
            scalar, fp32 (fp64 for fp64 inputs).
        main_loss: the main next-token cross-entropy, detached.
        depth_losses: ``[D]``, depth ``k``'s cross-entropy at index ``k - 1`` (before the
            scaling), detached. With calibrated ``loss_weights`` each is this micro-batch's
            part of the depth's global mean (their sum over micro-batches and ranks is the mean).
    """

    loss: torch.Tensor
    main_loss: torch.Tensor
    depth_losses: torch.Tensor


def _check_tensor_list(x, count: int, name: str) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor) or not isinstance(x, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(x).__name__}")
    if len(x) != count:
        raise ValueError(f"{name} must hold {count} tensors, got {len(x)}")
    for i, t in enumerate(x):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return list(x)


def multi_token_prediction_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    depth_hidden_states: Sequence[torch.Tensor],
    *,
    bias: Optional[torch.Tensor] = None,
    scaling_factor: float = MTP_LOSS_SCALING_FACTOR,
    loss_weights: Optional[Sequence[torch.Tensor]] = None,
    depth_labels: Optional[Sequence[torch.Tensor]] = None,
    position_ids: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    options: Optional[CrossEntropyOptions] = None,
    vocab_parallel_options: Optional[VocabParallelOptions] = None,
) -> MultiTokenPredictionOutput:
    """DeepSeek-V3's multi-token prediction loss through the shared lm_head, every depth chunked:
    ``CE(h, y) + scaling_factor / D * sum_k CE(h^k, y^k)`` (module docstring).

    Each of the ``D + 1`` terms is one :func:`~megaloss.losses.cross_entropy.linear_cross_entropy`
    call with ``options`` (so ``"mean"`` is each term's own token mean, ``"sum"`` with
    calibrated ``loss_weights`` its part of the global mean); under ``vocab_parallel_options``
    each is the vocab-parallel one (two ``[tokens]`` all-reduces per chunk, no logits
    gathered).

    Args:
        hidden_states: ``[..., H]`` float, the main model's final hidden states (what its
            lm_head reads).
        weight: ``[V, H]`` the shared lm_head weight (this rank's vocab shard with
            ``vocab_parallel_options``).
        labels: ``[B, T]`` or ``[T]`` integer shifted targets of the main loss (Hugging Face's
            ``shift_labels``), shape ``hidden_states.shape[:-1]``.
        depth_hidden_states: ``D >= 1`` tensors, depth ``k``'s output at index ``k - 1`` (after
            its own final norm), each of ``hidden_states``' shape: position ``t`` of depth ``k``
            predicts token ``t + k + 1``.
        bias: optional ``[V]`` (``[Vp]``) lm_head bias.
        scaling_factor: Megatron-core's ``mtp_loss_scaling_factor`` (a finite number >= 0),
            divided by ``D``; DeepSeek-V3's lambda (0.3 for its first 10T tokens, then 0.1).
        loss_weights: optional ``D + 1`` per-token weight tensors (shape of ``labels``), the
            main loss's first: :meth:`MTPLossWeights.weights` of :func:`mtp_loss_weights`.
        depth_labels: optional ``D`` targets, depth ``k``'s at ``k - 1``; default
            :func:`mtp_labels` of ``labels``. Needed when ``labels`` is a slice of the
            sequences (sequence parallelism, Megatron's ``sequence_parallel``): roll the full
            sequences, then slice (:meth:`MTPLossWeights.depth_labels`).
        position_ids / cu_seqlens: the packed samples of ``labels``, for the roll (see
            :func:`mtp_labels`); unused with ``depth_labels``.
        options: a :class:`~megaloss.CrossEntropyOptions` for every term (default: its
            defaults, ``reduction="mean"``); ``reduction="none"`` is refused.
        vocab_parallel_options: a :class:`~megaloss.losses.vocab_parallel.VocabParallelOptions`
            (``weight`` is then this rank's vocab shard); ``None``: one device.

    Returns:
        :class:`MultiTokenPredictionOutput`.

    Raises:
        TypeError: ``depth_hidden_states`` / ``loss_weights`` / ``depth_labels`` not a list or
            tuple of tensors; ``scaling_factor`` not a number; ``options`` not a
            ``CrossEntropyOptions``; what :func:`linear_cross_entropy` raises.
        ValueError: no depth; a depth's hidden states not of ``hidden_states``' shape; a
            ``loss_weights`` count other than ``D + 1`` or a ``depth_labels`` count other than
            ``D`` (or not of ``labels``' shape); ``scaling_factor`` negative or not finite;
            ``reduction="none"``; ``sequence_parallel`` without ``depth_labels``; what
            :func:`mtp_labels` and :func:`linear_cross_entropy` raise. These checks are local:
            under tensor parallelism give every TP rank the same shapes (as the hidden states
            replicated over TP are).
    """
    if isinstance(depth_hidden_states, torch.Tensor) or not isinstance(
            depth_hidden_states, (list, tuple)):
        raise TypeError("depth_hidden_states must be a list or tuple of tensors (one per depth), "
                        f"got {type(depth_hidden_states).__name__}")
    if not depth_hidden_states:
        raise ValueError("depth_hidden_states must hold at least one depth")
    d = len(depth_hidden_states)
    depth_hidden = _check_tensor_list(depth_hidden_states, d, "depth_hidden_states")
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got "
                        f"{type(hidden_states).__name__}")
    for k, h in enumerate(depth_hidden, start=1):
        if h.shape != hidden_states.shape:
            raise ValueError(f"depth_hidden_states[{k - 1}] (depth {k}) must have the shape of "
                             f"hidden_states {tuple(hidden_states.shape)}, got {tuple(h.shape)}")
    if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, (int, float)):
        raise TypeError(f"scaling_factor must be a number, got {scaling_factor!r}")
    if not math.isfinite(scaling_factor) or scaling_factor < 0:
        raise ValueError(f"scaling_factor must be a finite number >= 0, got {scaling_factor!r}")
    if options is None:
        options = CrossEntropyOptions()
    if not isinstance(options, CrossEntropyOptions):
        raise TypeError(f"options must be a CrossEntropyOptions, got {type(options).__name__}")
    if options.reduction == "none":
        raise ValueError("reduction='none' is not supported: the MTP loss adds the depths into "
                         "one scalar (use 'mean', or 'sum' with mtp_loss_weights)")
    check_vocab_parallel_options(vocab_parallel_options)
    weights = [None] * (d + 1)
    if loss_weights is not None:
        weights = _check_tensor_list(loss_weights, d + 1, "loss_weights (main loss first)")
    if depth_labels is None:
        if vocab_parallel_options is not None and vocab_parallel_options.sequence_parallel:
            raise ValueError("with sequence_parallel=True the labels are a slice of the tokens: "
                             "pass depth_labels (mtp_labels of the full sequences, sliced)")
        targets = [mtp_labels(labels, k, ignore_index=options.ignore_index,
                              position_ids=position_ids, cu_seqlens=cu_seqlens)
                   for k in range(1, d + 1)]
    else:
        targets = _check_tensor_list(depth_labels, d, "depth_labels")
        for k, y in enumerate(targets, start=1):
            if y.shape != labels.shape:
                raise ValueError(f"depth_labels[{k - 1}] must have the shape of labels "
                                 f"{tuple(labels.shape)}, got {tuple(y.shape)}")

    def ce(h: torch.Tensor, y: torch.Tensor, w: Optional[torch.Tensor]) -> torch.Tensor:
        return linear_cross_entropy(h, weight, y, bias=bias, loss_weights=w, options=options,
                                    vocab_parallel_options=vocab_parallel_options)

    main = ce(hidden_states, labels, weights[0])
    depth_losses = torch.stack([ce(h, y, w)
                                for h, y, w in zip(depth_hidden, targets, weights[1:])])
    total = main + (scaling_factor / d) * depth_losses.sum()
    return MultiTokenPredictionOutput(total, main.detach(), depth_losses.detach())
