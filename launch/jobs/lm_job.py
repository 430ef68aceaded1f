"""What the LM jobs of the runner (:mod:`launch.jobs.runner`) share: :class:`LMReports`, the
reports of a causal LM trained on text blocks (held-out CE and perplexity before / after,
``metrics.csv`` with the held-out CE of the evaluated steps, the loss plot, the before / after
table), also those of the Hugging Face Trainer's LM job; and :class:`LMJob`, a megaloss-loop LM
job (``launch/train_lm.py``, ``launch/train_lm_fsdp.py``, the distillation job's phases): the
per-rank batches of :class:`~launch.jobs.text_data.StepBatches` from the resumed step on, an
evaluation every ``--eval_every`` steps, the checkpoint record and the summary's LM figures.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

from .reporting import Curve
from .runner import Job, Table
from .summaries import lm_summary_rows
from .text_data import StepBatches

__all__ = ["LMReports", "LMJob"]


class LMReports:
    """The reports of an LM job (a :class:`~launch.jobs.runner.Job` mixin): evaluations are
    ``{"step", "loss", "perplexity", ...}``."""

    train_label = "train loss (first / last step)"
    run: Any

    def plot_title(self, summary: Mapping[str, Any]) -> str:
        raise NotImplementedError

    def on_eval(self, when: str, entry: Dict[str, Any]) -> None:
        self.run.log(f"{when} training: held-out CE {entry['loss']:.4f}, perplexity "
                     f"{entry['perplexity']:.1f}")

    def eval_rows(self, result: Dict[str, Any]) -> List[Tuple[str, str]]:
        return [("held-out perplexity", f"{result['perplexity']:.1f}"),
                ("held-out CE (nats/token)", f"{result['loss']:.4f}")]

    def csv_rows(self) -> List[Dict[str, Any]]:
        """The training rows with ``eval_loss`` / ``eval_perplexity`` at the steps evaluated
        (else empty)."""
        eval_at = {e["step"]: e for e in self.run.evals}
        return [{**r, "eval_loss": eval_at.get(r["step"], {}).get("loss", ""),
                 "eval_perplexity": eval_at.get(r["step"], {}).get("perplexity", "")}
                for r in self.run.rows]

    def plot(self, summary: Mapping[str, Any]) -> Dict[str, Any]:
        """Train loss and held-out CE in nats / token against the step."""
        rows, evals = self.run.rows, self.run.evals
        return {"curves": [
            Curve("train (global loss)", [r["step"] for r in rows], [r["loss"] for r in rows]),
            Curve("held-out CE", [e["step"] for e in evals], [e["loss"] for e in evals], "o-")],
            "title": self.plot_title(summary), "ylabel": "cross-entropy (nats / token)",
            "grid": True}

    def lm_table(self, summary: Mapping[str, Any], title: str, info: str) -> Table:
        """Held-out perplexity and CE before / after (``step <k>`` for a stopped run's last
        evaluation) and the train loss of the first / last step."""
        after, stopped = summary["eval_after"], summary.get("stopped")
        last = "after" if not (stopped and after) else f"step {after['step']}"
        return Table(title, lm_summary_rows(summary, self.train_label), info,
                     ("metric", "before", last))


class LMJob(LMReports, Job):
    """A megaloss-loop LM job. Its ``build`` sets ``tok``, ``train_blocks``, ``held``,
    ``data_key``, ``micro``, ``gas``, ``dp`` and ``dp_rank``; ``name`` is its checkpoints'
    record name."""

    name = "lm"
    tok: Any
    train_blocks: Dict[str, Any]
    held: List[Dict[str, Any]]
    data_key: str
    micro = gas = dp = 1
    dp_rank = 0

    @property
    def eval_every(self) -> int:  # type: ignore[override]
        return self.args.eval_every

    def begin(self, start: int) -> None:
        self.batches = StepBatches(self.train_blocks, micro=self.micro, gas=self.gas,
                                   dp_size=self.dp, dp_rank=self.dp_rank,
                                   seed=self.args.seed).iter_from(start)

    def record(self) -> Dict[str, Any]:
        return {"name": self.name, "data_key": self.data_key, "seed": self.args.seed,
                "seq_len": self.args.seq_len}

    def progress(self, row: Dict[str, Any]) -> Dict[str, str]:
        return {"loss": f"{row['loss']:.3f}",
                "ppl_eval": f"{self.run.evals[-1]['perplexity']:.0f}",
                "tok_s": f"{row['tokens_per_s']:.0f}"}

    def lm_summary(self) -> Dict[str, Any]:
        """The evaluation before training, the first / last loss, the tokens trained on and
        their rate."""
        rows, seconds = self.run.rows, self.run.seconds
        tokens = sum(r["num_tokens"] for r in rows)
        return {"eval_before": self.run.evals[0],
                "first_loss": rows[0]["loss"] if rows else None,
                "last_loss": rows[-1]["loss"] if rows else None,
                "tokens_per_s": tokens / max(seconds, 1e-9), "train_tokens_seen": tokens}

    def run_summary(self) -> Dict[str, Any]:
        """:meth:`lm_summary` with what a whole LM job reports besides: the last evaluation
        (a stopped run's too), the peak memory of this rank and of each, each rank's
        parameters (:meth:`local_parameters`, gathered by :meth:`gather_per_rank`), the data."""
        rows, evals = self.run.rows, self.run.evals
        peak = max((r["peak_memory_mib"] for r in rows), default=0.0)
        return {**self.lm_summary(), "eval_after": evals[-1] if len(evals) > 1 else None,
                "peak_memory_mib": peak, "peak_memory_mib_per_rank": self.gather_per_rank(peak),
                "parameters_per_rank": self.gather_per_rank(self.local_parameters()),
                "micro_batch": self.micro, "gas": self.gas, "seq_len": self.args.seq_len,
                "data": "stdlib" if not self.args.train_data else "user files",
                "data_key": self.data_key}

    def gather_per_rank(self, value: Any) -> Any:
        """``value`` of every rank, in rank order (collective)."""
        raise NotImplementedError

    def local_parameters(self) -> int:
        """The parameters this rank holds."""
        raise NotImplementedError

    def run_info(self, summary: Mapping[str, Any], layout: str, multiplier: str) -> str:
        """The summary table's line under a whole LM job's table: steps, seconds, tokens/s,
        ``layout``, the measured loss multiplier (named ``multiplier``), peak memory."""
        return (f"{summary['steps']} steps in {summary['train_seconds']:.1f} s, "
                f"{summary['tokens_per_s']:.0f} tokens/s, {layout}, {multiplier} "
                f"{summary['engine_loss_multiplier']:g}, peak memory "
                f"{summary['peak_memory_mib']:.0f} MiB/rank")
