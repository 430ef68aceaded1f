"""What the jobs that read the whole model on every rank share (``launch/train_dpo.py``:
its reference snapshot and held-out evaluation; ``launch/train_grpo.py``: ``generate()``): the
refusal of a layout that splits those weights (:func:`refuse_sharded_weights`) and a data
parallel rank's share of a step's rows (:func:`rank_share`).
"""
from __future__ import annotations

from typing import Any, Dict, TypeVar

__all__ = ["refuse_sharded_weights", "rank_share"]

Rows = TypeVar("Rows")


def refuse_sharded_weights(ds_config: Dict[str, Any], ml: Any, config: str, *, lm_head: str,
                           zero3: str) -> None:
    """Refuse what a job that reads the whole model cannot honour (the same verdict on every
    rank).

    Args:
        ds_config: the ds_config dict; ml: its ``"megaloss"`` section
            (:class:`megaloss.integrations.config.MegalossConfig`).
        config: the ds_config's path, named in the message.
        lm_head: why the job needs the whole lm_head on every rank.
        zero3: what reads the weights whole (after "ZeRO-3 partitions the weights").

    Raises:
        SystemExit: ``megaloss.tensor_parallel_size`` or ``sequence_parallel_size`` is not 1;
            ZeRO stage 3.
    """
    if ml.tensor_parallel_size != 1 or ml.sequence_parallel_size != 1:
        raise SystemExit(f"{config}: {lm_head}; set megaloss.tensor_parallel_size and "
                         "sequence_parallel_size to 1")
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage == 3:
        raise SystemExit(f"{config}: ZeRO-3 partitions the weights {zero3}; use ZeRO stage 0, 1 "
                         "or 2")


def rank_share(rows: Rows, dp: int, rank: int) -> Rows:
    """Data-parallel rank ``rank``'s share of ``rows`` (the same on every rank): the ``rank``-th
    of ``dp`` equal slices, the remainder dropped. ``rows``: a tensor (its first dimension) or
    anything with ``len`` and ``rows(start, stop)``
    (:class:`launch.jobs.preference_data.Pairs`)."""
    n = len(rows) // dp  # type: ignore[arg-type]
    if hasattr(rows, "rows"):
        return rows.rows(rank * n, (rank + 1) * n)  # type: ignore[attr-defined]
    return rows[rank * n:(rank + 1) * n]  # type: ignore[index]
