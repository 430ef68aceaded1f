"""The before / after rows both jobs of a task show, whichever loop trained them: the LM and
retrieval summary tables (:mod:`launch.jobs.reporting` prints them). Call on one rank.
"""
from __future__ import annotations

from typing import Any, List, Mapping, Sequence, Tuple

__all__ = ["lm_summary_rows", "retrieval_summary_rows"]


def _before_after(summary: Mapping[str, Any], metrics: Sequence[Tuple[str, str, str]],
                  train_label: str) -> List[Tuple[str, str, str]]:
    before, after = summary["eval_before"], summary["eval_after"] or {}
    rows = [(label, fmt.format(before[key]), fmt.format(after[key]) if after else "-")
            for label, key, fmt in metrics]
    if summary["last_loss"] is not None:
        rows.append((train_label, f"{summary['first_loss']:.4f}", f"{summary['last_loss']:.4f}"))
    return rows


def lm_summary_rows(summary: Mapping[str, Any], train_label: str
                    ) -> List[Tuple[str, str, str]]:
    """``(metric, before, after)`` rows: held-out perplexity and CE (``"-"`` after a run
    stopped before its final evaluation), and the train loss of the first / last ``train_label``
    step when any ran."""
    return _before_after(summary, [("held-out perplexity", "perplexity", "{:.1f}"),
                                   ("held-out CE (nats/token)", "loss", "{:.4f}")], train_label)


def retrieval_summary_rows(summary: Mapping[str, Any], train_label: str
                           ) -> List[Tuple[str, str, str]]:
    """``(metric, before, after)`` rows: held-out MRR@10 and recall@1, and the train MNR loss of
    the first / last step (``train_label``) when any ran."""
    return _before_after(summary, [("held-out MRR@10", "mrr@10", "{:.4f}"),
                                   ("held-out recall@1", "recall@1", "{:.4f}")], train_label)
