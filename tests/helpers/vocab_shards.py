"""A tensor-parallel rank's rows of a full tensor, as megaloss's vocab-parallel losses take them
(for the tests that compare the sharded losses with the unsharded float64 reference)."""
import math

import torch

__all__ = ["shard_rows"]


def shard_rows(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``ceil(V / tp)`` rows of ``t [V, ...]``: rows ``[rank * Vp, (rank + 1) *
    Vp)`` of ``t`` zero-padded to ``tp * Vp`` rows (``Vp = ceil(V / tp)``)."""
    rows = math.ceil(t.shape[0] / tp)
    padded = torch.zeros((rows * tp,) + tuple(t.shape[1:]), dtype=t.dtype)
    padded[: t.shape[0]] = t
    return padded[rank * rows: (rank + 1) * rows]
