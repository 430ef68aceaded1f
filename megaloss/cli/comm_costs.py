"""The communication model of megaloss's losses (``megaloss-comm-model``,
:mod:`megaloss.cli.comm_model`): per rank, every collective a loss issues (:class:`Traffic`: kind,
group size, calls, payload bytes, and the ring algorithms' bytes on the wire), per loss:
:func:`vocab_parallel_ce`, :func:`calibration_step`, :func:`mnr_call`, :func:`mnr_step`,
:func:`lm_step`, :func:`gradient_allreduce`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

__all__ = ["KINDS", "DTYPE_BYTES", "Traffic", "vocab_parallel_ce", "calibration_step",
           "train_step_logging", "mnr_call", "mnr_step", "lm_step", "gradient_allreduce"]


KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier")
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8}


# ------------------------------------------------------------------------------------------------
# traffic: calls and payload bytes per (kind, group size)
# ------------------------------------------------------------------------------------------------
@dataclass
class Traffic:
    """Collectives of one rank: ``counts[(kind, group_size)] = [calls, payload bytes]``."""

    counts: Dict[Tuple[str, int], List[int]] = field(default_factory=dict)

    def add(self, kind: str, group_size: int, payload: int, calls: int = 1) -> "Traffic":
        if group_size <= 1 or calls == 0:  # a trivial group issues nothing (megaloss skips it)
            return self
        c = self.counts.setdefault((kind, int(group_size)), [0, 0])
        c[0] += int(calls)
        c[1] += int(payload)
        return self

    def __add__(self, other: "Traffic") -> "Traffic":
        out = Traffic({k: list(v) for k, v in self.counts.items()})
        for (kind, size), (calls, payload) in other.counts.items():
            out.add(kind, size, payload, calls)
        return out

    def times(self, n: int) -> "Traffic":
        return Traffic({k: [v[0] * n, v[1] * n] for k, v in self.counts.items()})

    @property
    def calls(self) -> int:
        return sum(v[0] for v in self.counts.values())

    @property
    def payload(self) -> int:
        return sum(v[1] for v in self.counts.values())

    def wire_bytes(self) -> float:
        """Bytes this rank sends with ring algorithms (module docstring)."""
        total = 0.0
        for (kind, p), (_, x) in self.counts.items():
            if kind == "all_reduce":
                total += 2.0 * (p - 1) / p * x
            elif kind == "all_gather":
                total += (p - 1) * x
            elif kind == "reduce_scatter":
                total += (p - 1) / p * x
            elif kind in ("broadcast", "all_to_all"):
                total += (p - 1) / p * x
        return total

    def as_dict(self) -> Dict[str, List[int]]:
        return {f"{k}@{p}": list(v) for (k, p), v in sorted(self.counts.items())}

    @staticmethod
    def from_dict(d: Dict[str, Sequence[int]]) -> "Traffic":
        out = Traffic()
        for key, (calls, payload) in d.items():
            kind, p = key.split("@")
            out.counts[(kind, int(p))] = [int(calls), int(payload)]
        return out


# ------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------
def vocab_parallel_ce(tokens: int, hidden: int, tp: int, *, chunk_size: int = 1024,
                      hidden_bytes: int = 4, label_smoothing: bool = False,
                      sequence_parallel: bool = False, loss_weights: bool = True,
                      weight_bytes: int = 4) -> Dict[str, Traffic]:
    """``linear_cross_entropy(..., vocab_parallel_options=...)`` on one micro-batch, per rank,
    over the TP group.

    Args:
        tokens: this rank's tokens (``[..., H]`` hidden states it hands in; with Megatron
            ``sequence_parallel`` its shard of the TP group's tokens).
        hidden: ``H``; ``hidden_bytes``: bytes per element of the hidden states (and of their
            gradient); ``weight_bytes``: of the loss weights (the calibration's: fp32).

    Forward: one all-gather of 8 int64 (the cross-rank check: failed flag, shapes, bad label,
    the shard's range);
    per chunk of ``chunk_size`` tokens a MAX all-reduce of ``[c]`` fp32 and one SUM all-reduce of
    the stacked ``[2, c]`` fp32 (``[3, c]`` with label smoothing): 12 (16) bytes per token
    whatever ``V``.
    Backward: the SUM all-reduce of the replicated hidden states' gradient ``[tokens, H]``
    (Megatron's output layer pays the same). With Megatron sequence parallelism the hidden
    states are all-gathered forward (plus their sizes, labels and weights) and their gradient
    reduce-scattered backward; the statistics then cover the TP group's ``tp x tokens``.
    """
    fwd, bwd = Traffic(), Traffic()
    fwd.add("all_gather", tp, 8 * 8)
    n = tokens
    if sequence_parallel and tp > 1:
        fwd.add("all_gather", tp, 8)                          # the shards' sizes
        fwd.add("all_gather", tp, tokens * hidden * hidden_bytes)
        fwd.add("all_gather", tp, tokens * 8)                 # int64 labels
        if loss_weights:
            fwd.add("all_gather", tp, tokens * weight_bytes)
        n = tokens * tp
        bwd.add("reduce_scatter", tp, n * hidden * hidden_bytes)
    else:
        bwd.add("all_reduce", tp, tokens * hidden * hidden_bytes)
    chunks = math.ceil(n / chunk_size) if n else 0
    rows = 3 if label_smoothing else 2
    fwd.add("all_reduce", tp, 4 * n, calls=chunks)            # MAX of the chunk's row maxima
    fwd.add("all_reduce", tp, 4 * rows * n, calls=chunks)     # SUM of [sum-exp, target, (sum)]
    return {"fwd": fwd, "bwd": bwd}


def calibration_step(dp: int, sp: int = 1) -> Traffic:
    """``LossCalibrator`` per optimizer step, over the ``dp x sp`` group: ``begin_step``'s
    all-reduce of float64 ``[sum of weights, tokens, samples]`` and ``global_loss``'s float64
    scalar; whatever the number of tokens or micro-batches."""
    return Traffic().add("all_reduce", dp * sp, 24).add("all_reduce", dp * sp, 8)


def train_step_logging(dp: int, sp: int = 1) -> Traffic:
    """What ``train_step`` adds for its metrics: the global z-loss (float64 scalar)."""
    return Traffic().add("all_reduce", dp * sp, 8)


def mnr_call(batch_sizes: Sequence[int], dim: int, *, negatives: int = 0,
             symmetric: bool = False, local_loss: bool = True, metrics: bool = True,
             duplicate_ids: bool = False, embedding_bytes: int = 4,
             similarity: str = "cosine") -> Dict[str, Traffic]:
    """One ``mnr_loss`` call over a DP group whose ranks hold
    ``batch_sizes`` pairs (``len`` = DP), per rank.

    Forward: an all-gather of 11 int64 of metadata; the autograd all-gather of every rank's
    ``[positives; negatives; (queries)]`` rows, padded to the largest rank's count (queries are
    gathered for ``symmetric`` or ``local_loss=False``); the ids' all-gather with
    ``duplicate_ids``; with ``local_loss`` the loss share's all-reduce and, with metrics, that of
    two float64 metric sums. Backward: the loss share's all-reduce (``local_loss``) and the
    reduce-scatter of the gathered rows' gradient. Cosine similarity gathers the normalised
    embeddings in fp32 at least.
    """
    fwd, bwd = Traffic(), Traffic()
    p = len(batch_sizes)
    fwd.add("all_gather", p, 11 * 8)
    if p <= 1 or sum(batch_sizes) == 0:
        return {"fwd": fwd, "bwd": bwd}
    e = max(embedding_bytes, 4) if similarity == "cosine" else embedding_bytes
    extra = 1 if (symmetric or not local_loss) else 0
    width = max(b * (1 + negatives + extra) for b in batch_sizes)
    fwd.add("all_gather", p, width * dim * e)
    bwd.add("reduce_scatter", p, p * width * dim * e)
    if duplicate_ids:
        fwd.add("all_gather", p, max(batch_sizes) * 8)
    if local_loss:
        acc = max(embedding_bytes, 4)
        fwd.add("all_reduce", p, acc)
        bwd.add("all_reduce", p, acc)
        if metrics:
            fwd.add("all_reduce", p, 2 * 8)
    return {"fwd": fwd, "bwd": bwd}


def mnr_step(batch_sizes: Sequence[int], dim: int, gas: int, *, cached: bool = False,
             **options: Any) -> Traffic:
    """One optimizer step of the embedding job (``G = gas`` micro-batches of ``batch_sizes``
    pairs per rank): ``step_loss_weights``' all-reduce of ``[G]`` fp32, then ``G`` loss calls
    (``launch/train_embed.py``); ``cached``: GradCache, one loss call over ``G x`` the pairs."""
    if cached:
        call = mnr_call([b * gas for b in batch_sizes], dim, **options)
        return call["fwd"] + call["bwd"]
    call = mnr_call(batch_sizes, dim, **options)
    return Traffic().add("all_reduce", len(batch_sizes), 4 * gas) + (
        call["fwd"] + call["bwd"]).times(gas)


def lm_step(tokens_per_micro: int, hidden: int, gas: int, *, tp: int, dp: int, sp: int = 1,
            logging: bool = True, **ce_options: Any) -> Dict[str, Traffic]:
    """One calibrated optimizer step of the LM job per rank: ``gas`` micro-batches of
    ``tokens_per_micro`` tokens per DP rank (each SP rank holds ``1/sp`` of them) through the
    vocab-parallel CE, plus the calibration (and ``train_step``'s z-loss log)."""
    ce = vocab_parallel_ce(tokens_per_micro // sp, hidden, tp, **ce_options)
    calib = calibration_step(dp, sp) + (train_step_logging(dp, sp) if logging else Traffic())
    return {"ce_fwd": ce["fwd"].times(gas), "ce_bwd": ce["bwd"].times(gas), "calibration": calib}


def gradient_allreduce(params: float, *, tp: int, dp: int, grad_bytes: int = 2) -> float:
    """Wire bytes per rank per step of the model's data-parallel gradient reduction (DDP's
    all-reduce, or ZeRO-1/2's reduce-scatter + parameter all-gather: the same ring volume): each
    rank holds ``params / tp`` gradients. Model only (not megaloss's traffic)."""
    return 0.0 if dp <= 1 else 2.0 * (dp - 1) / dp * params / tp * grad_bytes
