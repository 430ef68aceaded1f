"""The calibrated step's checks, agreed on by every rank before the step's first collective, and
the small argument checks each loss family's micro-batch check is made of.

A step's first collective (the calibration's all-reduce in
:meth:`megaloss.LossCalibrator.begin_step`) and those after it (the engine's forward and
gradient reduction) are entered by every rank. A check that fails on one rank only (a
``completion_mask`` of the wrong shape on one DP rank) would raise there and leave the others
waiting in that collective: gloo's "Connection closed by peer" seconds later, a hang under NCCL.
:func:`agreed_checks` runs a step's checks on every rank, then one all-gather of a failure flag
over the topology's ``dp x sp`` group and one over its TP group (together the engine's ranks)
let every rank raise the same error, the first failed rank's, naming the argument and the
ranks (:func:`megaloss.parallel.comm.raise_on_every_rank`).

Each loss family (:mod:`megaloss.integrations.step`) checks what the step itself reads from
the micro-batches (their keys, the targets' and masks' shapes against ``input_ids``, the
per-sequence tensors of the policy and preference losses); the model's own inputs
(``attention_mask``) are the model's to check.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

import torch

from ...parallel.comm import raise_on_every_rank
from ...parallel.topology import Topology

__all__ = ["agreed_checks", "agreed_forward", "check_count", "integer_tensor", "check_floating",
           "check_same_shape", "rows_shape"]

T = TypeVar("T")


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


def integer_tensor(name: str, x: Any) -> torch.Tensor:
    """``x``, checked to be an integer tensor (``ValueError`` when missing, ``TypeError`` when
    not an integer tensor), the message naming ``name``."""
    if x is None:
        raise ValueError(f"{name} is missing")
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex():
        raise TypeError(f"{name} must be an integer torch.Tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    return x


def check_floating(name: str, x: Any, shapes: Sequence[tuple]) -> None:
    """``x`` is a floating tensor (else ``TypeError``) of one of ``shapes`` (else
    ``ValueError``), the message naming ``name``."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name} must be a floating torch.Tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if tuple(x.shape) not in [tuple(s) for s in shapes]:
        want = " or ".join(str(tuple(s)) for s in shapes)
        raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")


def check_same_shape(name: str, x: Any, shape: tuple, of: str = "input_ids") -> None:
    """``x`` is a tensor of ``shape`` (``of``'s shape), else ``ValueError`` naming ``name``."""
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must have the shape of {of} {shape}, got {got}")


def rows_shape(i: int, mb: Mapping[str, Any]) -> tuple:
    """The ``[B, T]`` shape of ``micro_batches[i]["input_ids"]`` (integer, 2-D)."""
    ids = integer_tensor(f"micro_batches[{i}]['input_ids']", mb.get("input_ids"))
    if ids.dim() != 2:
        raise ValueError(f"micro_batches[{i}]['input_ids'] must be [B, T], got "
                         f"{tuple(ids.shape)}")
    return tuple(ids.shape)
