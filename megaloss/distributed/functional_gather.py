"""Uneven autograd all-gather along dim 0 on torch's functional collectives, with a fallback.

torch 2.13 deprecates ``torch.distributed.nn.functional.all_gather`` (FutureWarning) in favour of
the functional collectives (``torch.distributed._functional_collectives``), whose
``all_gather_single`` carries autograd (backward: reduce-scatter SUM) and is traceable by
``torch.compile``. Those collectives need equal sizes on every rank (gloo rejects uneven ones), so
:func:`gather_dim0_uneven_autograd` pads every rank's rows to the largest count, gathers, and keeps
the real rows with one ``index_select`` (its backward scatters the gradient back into the padded
layout, so the padding gets zero gradient and never reaches the caller).

Which path runs is decided once, at import, by feature detection (never by catching a failed
collective, which could leave ranks out of step):

1. ``all_gather_single_autograd`` (torch >= 2.6 spelling; the plain ``all_gather_single`` is
   autograd-aware in 2.13),
2. ``all_gather_tensor_autograd`` (older spelling, deprecated in 2.13),
3. :func:`megaloss.distributed.collectives.gather_along_dim0_uneven` (a hand-written
   ``autograd.Function``; same math).

Backward semantics are those of every gather in :mod:`megaloss.distributed.collectives`: each rank
receives the SUM over ranks of the gradient of its own slice.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence

import torch
from torch.distributed import ProcessGroup

from .collectives import all_gather_sizes, gather_along_dim0_uneven
from .topology import group_size

__all__ = ["gather_dim0_uneven_autograd", "functional_gather_available"]


def _find_functional_gather() -> Optional[Callable[..., torch.Tensor]]:
    try:
        import torch.distributed._functional_collectives as fc
    except ImportError:  # torch built without distributed
        return None
    fn = getattr(fc, "all_gather_single_autograd", None)
    if fn is None:
        fn = getattr(fc, "all_gather_tensor_autograd", None)
    if fn is None or not hasattr(fc, "wait_tensor"):
        return None
    wait = fc.wait_tensor

    def gather(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        with warnings.catch_warnings():
            # the older spelling warns on every call; the choice is made above, knowingly
            warnings.simplefilter("ignore", FutureWarning)
            out = fn(x, 0, group)
        return wait(out)

    return gather


_FUNCTIONAL_GATHER = _find_functional_gather()


def functional_gather_available() -> bool:
    """Whether torch offers an autograd-aware functional all-gather (else the fallback runs)."""
    return _FUNCTIONAL_GATHER is not None


def gather_dim0_uneven_autograd(x: torch.Tensor, group: Optional[ProcessGroup],
                                sizes: Optional[Sequence[int]] = None, *,
                                use_functional: bool = True) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0, any sizes (0 included), gradients flowing back.

    Args:
        x: ``[n_r, ...]`` on rank r; trailing dims and dtype must agree across ranks.
        group: process group; ``None`` or a size-1 group returns ``x`` unchanged.
        sizes: every rank's ``n_r`` in rank order if already known (saves one small all-gather).
        use_functional: use torch's functional collectives when available (the default); ``False``
            forces the hand-written fallback. Every rank must pass the same value.

    Returns:
        ``[sum_r n_r, ...]`` in rank order. Backward: each rank receives the SUM over ranks of the
        gradient of its own slice (the gradient of the sum of every rank's loss).
    """
    if group is None or group_size(group) == 1:
        return x
    if sizes is None:
        sizes = all_gather_sizes(x.shape[0], group, x.device)
    sizes = [int(s) for s in sizes]
    if not use_functional or _FUNCTIONAL_GATHER is None:
        return gather_along_dim0_uneven(x, group, sizes)
    width = max(sizes)
    if width == 0:  # nothing anywhere: every rank returns here, none waits in a collective
        return x
    pad = width - x.shape[0]
    if pad:
        x = torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))])
    gathered = _FUNCTIONAL_GATHER(x.contiguous(), group)
    if all(n == width for n in sizes):
        return gathered
    keep = torch.cat([torch.arange(r * width, r * width + n, device=x.device)
                      for r, n in enumerate(sizes)])
    return gathered.index_select(0, keep)
