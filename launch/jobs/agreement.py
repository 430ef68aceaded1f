"""Agreement across ranks on a piece of set-up: :func:`agreed` runs it (on global rank 0, or on
every rank) and, when it fails anywhere, every rank exits with the cause (:class:`AgreedExit`
on the ranks told of it), so the launcher's last lines name it rather than another rank's
``Connection closed by peer``; :func:`rank0_decides` also hands rank 0's result to every rank.
Single-process use (``torch.distributed`` not initialised) works too: nothing to agree with.
"""
from __future__ import annotations

from typing import Callable, List, Optional, TypeVar

__all__ = ["agreed", "rank0_decides", "AgreedExit", "distributed_or_none"]

T = TypeVar("T")


def distributed_or_none():
    """``torch.distributed`` when it is initialised with several ranks, else None."""
    import torch.distributed as dist

    return dist if dist.is_initialized() and dist.get_world_size() > 1 else None


def agreed(fn: Callable[[], T], *, everywhere: bool = False, what: str = "set-up") -> Optional[T]:
    """Run ``fn`` on global rank 0 (or on every rank with ``everywhere``) and agree on failure.

    Collective when ``torch.distributed`` is initialised with several ranks: every rank calls it
    (it replaces the barrier after rank-0-only work). When ``fn`` raises on some rank, the rank
    that failed re-raises its own error (with its traceback) and every other rank exits with a
    ``SystemExit`` naming the failing rank and the cause, so whatever lines the launcher shows
    last name the cause.

    Returns:
        ``fn()``'s result where it ran, None elsewhere.
    """
    d = distributed_or_none()
    rank = d.get_rank() if d else 0
    result, error, message = None, None, None
    if everywhere or rank == 0:
        try:
            result = fn()
        except SystemExit as e:  # a job's own error message
            error, message = e, str(e.code)
        except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised
            error, message = e, f"{type(e).__name__}: {e}"
    if d is None:
        if error is not None:
            raise error
        return result
    messages: List[Optional[str]] = [None] * d.get_world_size()
    d.all_gather_object(messages, message)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return result
    r, m = failed[0]
    if error is not None and r == rank:
        raise error
    # Reported by rank r (the first that failed): this rank exits with the same status and no
    # message of its own, so the cause is printed once and the ranks' lines never interleave.
    raise AgreedExit(f"error on rank {r} ({what}): {m}")


def rank0_decides(fn: Callable[[], T], *, what: str = "set-up") -> T:
    """:func:`agreed` of ``fn`` on global rank 0, its result (a picklable object) broadcast to
    every rank. Collective."""
    out = [agreed(fn, what=what)]
    d = distributed_or_none()
    if d is not None:
        d.broadcast_object_list(out, src=0)
    return out[0]


class AgreedExit(SystemExit):
    """The exit of a rank whose set-up failed on another rank (:func:`agreed`): status 1 and
    nothing printed (the failing rank prints the cause); ``message`` names the rank and cause."""

    def __init__(self, message: str) -> None:
        super().__init__(1)
        self.message = message
