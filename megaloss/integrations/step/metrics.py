"""What the calibrated steps return: :class:`StepOutcome` (what every step measures, the result
of a family without its own), :class:`StepMetrics` (cross-entropy and distillation),
:class:`PolicyStepMetrics` (policy-gradient and preference losses), :class:`EvalResult`
(held-out cross-entropy), and :func:`peak_memory_mib`."""
from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch

__all__ = ["StepOutcome", "StepMetrics", "PolicyStepMetrics", "EvalResult", "peak_memory_mib"]


def peak_memory_mib(device: Optional[torch.device] = None) -> float:
    """Peak memory of this process in MiB: the CUDA caching allocator's peak on a CUDA device,
    else the peak resident set size (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


@dataclass
class StepMetrics:
    """Metrics of one optimizer step (identical on all ranks except ``peak_memory_mib``).

    ``loss``: global calibrated loss (z-loss included); ``z_loss``: its z-loss part;
    ``num_tokens``: global valid tokens; ``lr``; ``grad_norm`` (None when the engine does not
    compute it); ``tokens_per_s``: global valid tokens / step wall time; ``peak_memory_mib``:
    this process's peak (CUDA allocator, or max RSS on CPU); ``step``: optimizer steps done;
    ``samples``: the engine's global sample count after the step (the monitors' x value).
    With a distillation module (its forward returns a :class:`megaloss.DistillationOutput`):
    ``divergence`` and ``ce_loss``, the global calibrated divergence and hard-label CE (the
    loss's two parts before their factors), and ``top1_agreement``, the fraction of valid
    tokens whose student and teacher top-1 tokens agree; ``None`` otherwise. With router
    losses (a mixture-of-experts module): ``router_aux_loss``, ``router_seq_aux_loss``,
    ``router_z_loss``, each term of the step before its coefficient (its part of ``loss`` is
    the coefficient times it), and ``expert_load_max``, the most loaded expert's top-k
    selections over the mean expert's in the worst layer (1: perfect balance); ``None``
    otherwise (:func:`megaloss.integrations.step.router.router_metrics`). With multi-token
    prediction (:mod:`megaloss.integrations.step.mtp`): ``mtp_losses``, each depth's global
    cross-entropy (before the scaling factor), written to the monitors as ``mtp_loss_1`` ...
    """

    step: int
    loss: float
    z_loss: float
    num_tokens: float
    lr: float
    grad_norm: Optional[float]
    tokens_per_s: float
    peak_memory_mib: float
    step_time_s: float
    samples: int = 0
    divergence: Optional[float] = None
    ce_loss: Optional[float] = None
    top1_agreement: Optional[float] = None
    router_aux_loss: Optional[float] = None
    router_seq_aux_loss: Optional[float] = None
    router_z_loss: Optional[float] = None
    expert_load_max: Optional[float] = None
    mtp_losses: Optional[List[float]] = None

    def as_dict(self) -> Dict[str, Any]:
        """Flat ``{name: value}`` (``mtp_losses`` as ``mtp_loss_1``, ...)."""
        d = asdict(self)
        for k, value in enumerate(d.pop("mtp_losses") or [], start=1):
            d[f"mtp_loss_{k}"] = value
        return d


@dataclass
class StepOutcome:
    """One optimizer step's figures (identical on all ranks except ``peak_memory_mib``).

    ``loss``: the global loss (what one device computes on the whole global batch);
    ``num_tokens`` / ``num_sequences``: the calibration's global valid tokens and sequences
    (pairs, examples or queries, as the family counts them); ``metrics``: the family's, global
    over the step (:meth:`megaloss.integrations.step.StepLoss.metrics`).
    """

    step: int
    loss: float
    num_tokens: float
    num_sequences: float
    lr: float
    grad_norm: Optional[float]
    peak_memory_mib: float
    step_time_s: float
    samples: int = 0
    metrics: Dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / max(self.step_time_s, 1e-9)

    def as_dict(self) -> Dict[str, Any]:
        """Flat ``{name: value}``: the fields, then the metrics by their names."""
        d = asdict(self)
        d.update(d.pop("metrics"))
        return d


@dataclass
class PolicyStepMetrics(StepOutcome):
    """Metrics of one policy / preference optimizer step (a :class:`StepOutcome`):
    ``num_tokens``: global completion tokens; ``num_sequences``: global sequences (policy) or
    pairs (DPO) with at least one completion token (every row, for a policy loss with
    ``count_empty_rows=True``); ``metrics``: TRL's names
    (:func:`megaloss.policy_metrics` / :func:`megaloss.dpo_metrics`), global over the step.
    """


@dataclass
class EvalResult:
    """Held-out token-mean cross-entropy (nats, z-loss excluded), its perplexity, and the
    global number of valid tokens it covers."""

    loss: float
    perplexity: float
    num_tokens: float
