"""The micro-batch checks of the DeepSpeed training steps, agreed on by every rank before the
step's first collective.

A step's first collective (the calibration's all-reduce in
:meth:`megaloss.LossCalibrator.begin_step`) and those after it (the engine's forward and
gradient reduction) are entered by every rank. A check that fails on one rank only (a
``completion_mask`` of the wrong shape on one DP rank) would raise there and leave the others
waiting in that collective: gloo's "Connection closed by peer" seconds later, a hang under NCCL.
:func:`agreed_checks` runs a step's checks on every rank, then one all-gather of a failure flag
over the topology's ``dp x sp`` group and one over its TP group (together the engine's ranks)
let every rank raise the same error, the first failed rank's, naming the argument and the
ranks (:func:`megaloss.parallel.comm.raise_on_every_rank`).

The checks cover what the step itself reads from the micro-batches (their keys, the targets' and
masks' shapes against ``input_ids``, the per-sequence tensors of the policy and DPO losses);
the model's own inputs (``attention_mask``) are the model's to check.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

import torch

from ...losses.preference import PREFERENCE_LOSSES
from ...parallel.comm import raise_on_every_rank
from ...parallel.topology import Topology

__all__ = ["agreed_checks", "agreed_forward", "check_count", "check_lm_micro_batch",
           "check_policy_micro_batch", "check_dpo_micro_batch", "check_preference_micro_batch",
           "PREFERENCE_LOSSES", "KTO_KL_KEYS"]

T = TypeVar("T")

# the top-k teacher's keys of an LM micro-batch (train_step reads them too)
TOPK_KEYS = ("teacher_topk_ids", "teacher_topk_log_probs")


def agreed_checks(checks: Callable[[], T], topology: Topology) -> T:
    """Run ``checks()`` (raising ``ValueError`` / ``TypeError``) on this rank and agree on the
    outcome with every rank of the engine (``topology``'s ``dp x sp`` group, then its TP group:
    one all-gather of an int64 failure flag over each that is not trivial); returns what
    ``checks`` returned.

    Raises:
        ValueError / TypeError: on every rank alike when ``checks`` failed on any: the first
            failed rank's error, ``(raised on rank(s) [...])`` appended (global ranks). On an
            engine of one rank, the error as it is.
    """
    return _agreed((topology.dp_sp_group, topology.tp_group), checks)


def agreed_forward(topology: Topology, forward: Callable[..., T], *args: Any,
                   **kwargs: Any) -> T:
    """``forward(*args, **kwargs)`` (the engine's forward through its loss), with the loss's own
    input checks agreed on over the topology's ``dp x sp`` group before the backward that
    follows.

    The loss checks what only its forward can see (a label outside the vocabulary, NaN or inf
    in the hidden states of a diverged replica) and agrees on it over its TP group itself; a
    replica raising alone would leave the other DP (or SP) ranks in the backward's gradient
    reduction. Its forward collectives are done by then (ZeRO-3 gathers a module's parameters
    before its forward; the loss comes last). One all-gather of an int64 flag over ``dp x sp``
    per micro-batch (none when that group is trivial).

    Raises:
        ValueError / TypeError: on every rank alike when the forward raised one on any: the
            first failed rank's error, ``(raised on rank(s) [...])`` appended.
    """
    return _agreed((topology.dp_sp_group,), forward, *args, **kwargs)


def _agreed(groups: Sequence[Any], fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on this rank, its ``ValueError`` / ``TypeError`` (or success)
    agreed on over ``groups`` in turn (:func:`megaloss.parallel.comm.raise_on_every_rank`)."""
    error: Optional[Exception] = None
    result = None
    try:
        result = fn(*args, **kwargs)
    except (ValueError, TypeError) as err:
        error = err
    raise_on_every_rank(error, *groups)
    return result  # type: ignore[return-value]


def check_count(micro_batches: Sequence[Mapping[str, Any]], gas: int) -> None:
    """``micro_batches`` holds ``gas`` (the engine's gradient accumulation steps) entries."""
    if len(micro_batches) != gas:
        raise ValueError(f"micro_batches must hold gradient_accumulation_steps={gas} entries, got "
                         f"{len(micro_batches)}")


def _integer(name: str, x: Any) -> torch.Tensor:
    if x is None:
        raise ValueError(f"{name} is missing")
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex():
        raise TypeError(f"{name} must be an integer torch.Tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    return x


def _floating(name: str, x: Any, shapes: Sequence[tuple]) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating torch.Tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if tuple(x.shape) not in [tuple(s) for s in shapes]:
        want = " or ".join(str(tuple(s)) for s in shapes)
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")


def _same_shape(name: str, x: Any, shape: tuple, of: str = "input_ids") -> None:
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must have the shape of {of} {shape}, got {got}")


def _rows(i: int, mb: Mapping[str, Any]) -> tuple:
    """The ``[B, T]`` shape of ``micro_batches[i]["input_ids"]`` (integer, 2-D)."""
    ids = _integer(f"micro_batches[{i}]['input_ids']", mb.get("input_ids"))
    if ids.dim() != 2:
        raise ValueError(f"micro_batches[{i}]['input_ids'] must be [B, T], got "
                         f"{tuple(ids.shape)}")
    return tuple(ids.shape)


def check_lm_micro_batch(i: int, mb: Mapping[str, Any]) -> None:
    """What :func:`~.train_step.train_step` reads from ``micro_batches[i]``: integer
    ``input_ids``; ``shift_labels`` or ``labels``, integer, of its shape; ``position_ids`` (the
    calibration's sample boundaries) of that shape; the top-k teacher's two ``[..., k]``
    tensors together, over ``input_ids``' shape (under sequence parallelism too: each SP rank
    takes its slice along the sequence)."""
    where = f"micro_batches[{i}]"
    ids = _integer(f"{where}['input_ids']", mb.get("input_ids"))
    shape = tuple(ids.shape)
    key = "shift_labels" if mb.get("shift_labels") is not None else "labels"
    if mb.get(key) is None:
        raise ValueError(f"{where} needs 'labels' (unshifted) or 'shift_labels'")
    _same_shape(f"{where}['{key}']", _integer(f"{where}['{key}']", mb[key]), shape)
    if mb.get("position_ids") is not None and mb.get("cu_seqlens") is None:
        _same_shape(f"{where}['position_ids']", mb["position_ids"], shape)
    ids_k, lp_k = (mb.get(k) for k in TOPK_KEYS)
    if ids_k is None and lp_k is None:
        return
    if ids_k is None or lp_k is None:
        raise ValueError(f"{where}: teacher_topk_ids and teacher_topk_log_probs go together")
    _integer(f"{where}['teacher_topk_ids']", ids_k)
    k = ids_k.shape[-1] if ids_k.dim() > 0 else 0
    _same_shape(f"{where}['teacher_topk_ids']", ids_k, shape + (k,), "input_ids + (k,)")
    _floating(f"{where}['teacher_topk_log_probs']", lp_k, [shape + (k,)])


def check_policy_micro_batch(i: int, mb: Mapping[str, Any], *, beta: float) -> None:
    """What :func:`~.policy_step.policy_train_step` reads from ``micro_batches[i]``: integer
    ``input_ids [B, T]``; ``completion_mask`` of that shape; floating ``advantages [B]`` or
    ``[B, T]``; floating ``old_log_probs`` / ``ref_log_probs [B, T]`` where given,
    ``ref_log_probs`` required when ``beta > 0``."""
    where = f"micro_batches[{i}]"
    shape = _rows(i, mb)
    _same_shape(f"{where}['completion_mask']", mb.get("completion_mask"), shape)
    _floating(f"{where}['advantages']", mb.get("advantages"), [shape[:1], shape])
    if beta > 0 and mb.get("ref_log_probs") is None:
        raise ValueError(f"{where} lacks ref_log_probs, required when beta > 0 (the KL penalty)")
    for name in ("old_log_probs", "ref_log_probs"):
        if mb.get(name) is not None:
            _floating(f"{where}['{name}']", mb[name], [shape])


def check_dpo_micro_batch(i: int, mb: Mapping[str, Any]) -> None:
    """What :func:`~.policy_step.dpo_train_step` reads from ``micro_batches[i]``: integer
    ``input_ids [2P, T]`` (chosen rows, then rejected); ``completion_mask`` of that shape;
    floating ``ref_chosen_log_probs`` and ``ref_rejected_log_probs [P]``."""
    where = f"micro_batches[{i}]"
    shape = _rows(i, mb)
    if shape[0] % 2:
        raise ValueError(f"{where}: input_ids must hold 2P rows (chosen, then rejected), got "
                         f"{shape[0]}")
    _same_shape(f"{where}['completion_mask']", mb.get("completion_mask"), shape)
    for name in ("ref_chosen_log_probs", "ref_rejected_log_probs"):
        _floating(f"{where}['{name}']", mb.get(name), [(shape[0] // 2,)])


KTO_KL_KEYS = ("kl_input_ids", "kl_completion_mask", "ref_kl_log_probs")


def check_preference_micro_batch(i: int, mb: Mapping[str, Any], *, loss: str) -> None:
    """What :func:`~.policy_step.preference_train_step` reads from ``micro_batches[i]`` for
    ``loss`` (one of :data:`PREFERENCE_LOSSES`): ``"dpo"`` as :func:`check_dpo_micro_batch`;
    ``"cpo"`` / ``"orpo"``: integer ``input_ids [2P, T]`` (chosen rows, then rejected) and
    ``completion_mask`` of that shape; ``"kto"``: integer ``input_ids [B, T]`` (one example a
    row), ``completion_mask`` of that shape, integer or bool ``desirable [B]``, floating
    ``ref_log_probs [B]``, and either none or all of :data:`KTO_KL_KEYS` (``kl_input_ids
    [K, T']``, ``kl_completion_mask`` of its shape, floating ``ref_kl_log_probs [K]``)."""
    if loss == "dpo":
        check_dpo_micro_batch(i, mb)
        return
    where = f"micro_batches[{i}]"
    shape = _rows(i, mb)
    _same_shape(f"{where}['completion_mask']", mb.get("completion_mask"), shape)
    if loss in ("cpo", "orpo"):
        if shape[0] % 2:
            raise ValueError(f"{where}: input_ids must hold 2P rows (chosen, then rejected), got "
                             f"{shape[0]}")
        return
    desirable = _integer(f"{where}['desirable']", mb.get("desirable"))
    if tuple(desirable.shape) != shape[:1]:
        raise ValueError(f"{where}['desirable'] must have shape {shape[:1]}, got "
                         f"{tuple(desirable.shape)}")
    _floating(f"{where}['ref_log_probs']", mb.get("ref_log_probs"), [shape[:1]])
    given = [k for k in KTO_KL_KEYS if mb.get(k) is not None]
    if given and len(given) != len(KTO_KL_KEYS):
        missing = [k for k in KTO_KL_KEYS if k not in given]
        raise ValueError(f"{where} has {', '.join(given)} but lacks {', '.join(missing)} (KTO's "
                         "KL rows need all three)")
    if given:
        kl_ids = _integer(f"{where}['kl_input_ids']", mb["kl_input_ids"])
        if kl_ids.dim() != 2:
            raise ValueError(f"{where}['kl_input_ids'] must be [K, T], got "
                             f"{tuple(kl_ids.shape)}")
        kl_shape = tuple(kl_ids.shape)
        _same_shape(f"{where}['kl_completion_mask']", mb["kl_completion_mask"], kl_shape,
                    of="kl_input_ids")
        _floating(f"{where}['ref_kl_log_probs']", mb["ref_kl_log_probs"], [kl_shape[:1]])
