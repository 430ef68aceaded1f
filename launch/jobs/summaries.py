"""The before / after figures both jobs of a task report, whichever loop trained them: the LM
jobs' ``metrics.csv`` (training rows with the held-out CE / perplexity where evaluated) and loss
plot, and the rows of the LM and retrieval summary tables (:mod:`launch.jobs.reporting` writes
and prints them). Call on one rank.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Mapping, Sequence, Tuple

from .reporting import Curve, plot_loss_curve, write_metrics_csv, write_summary_json

__all__ = ["write_lm_outputs", "lm_summary_rows", "retrieval_summary_rows"]


def write_lm_outputs(out_dir: Path, rows: Sequence[Mapping[str, Any]],
                     evals: Sequence[Mapping[str, Any]], summary: Mapping[str, Any],
                     title: str) -> None:
    """``metrics.csv`` (``rows``, one per logged step, with ``eval_loss`` / ``eval_perplexity``
    from ``evals`` at the steps evaluated, else empty), ``summary.json`` and ``loss_curve.png``
    (train loss and held-out CE in nats / token against the step) in ``out_dir``."""
    eval_at = {e["step"]: e for e in evals}
    write_metrics_csv(out_dir / "metrics.csv", [
        {**r, "eval_loss": eval_at.get(r["step"], {}).get("loss", ""),
         "eval_perplexity": eval_at.get(r["step"], {}).get("perplexity", "")} for r in rows])
    write_summary_json(out_dir / "summary.json", summary)
    plot_loss_curve(
        out_dir / "loss_curve.png",
        [Curve("train (global loss)", [r["step"] for r in rows], [r["loss"] for r in rows]),
         Curve("held-out CE", [e["step"] for e in evals], [e["loss"] for e in evals], "o-")],
        title=title, ylabel="cross-entropy (nats / token)", grid=True)


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
