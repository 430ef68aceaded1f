#!/usr/bin/env python3
"""What megaloss's losses send as the world grows: a model of their collectives, checked against
counts measured on real gloo processes, and the scaling table and plot of the README.

    megaloss-comm-model                      # the scaling tables (model)
    megaloss-comm-model --measure            # measure at world 1-4, compare to the model
    megaloss-comm-model --measure --json docs/comm_measured.json --plot docs/comm_scaling.png
    megaloss-comm-model --markdown           # the README section's tables

(``python -m megaloss.cli.comm_model`` is the same.)

**The model** (:func:`vocab_parallel_ce`, :func:`calibration_step`, :func:`mnr_call`,
:func:`mnr_step`, :func:`lm_step`) gives, per rank, every collective a loss issues: its kind
(all-reduce, all-gather, reduce-scatter), the size of the group it runs over, the number of calls
and the *payload* (the bytes this rank hands to the collective: the all-reduce buffer, the
all-gather input, the reduce-scatter input), as ``tools/bench_vocab_parallel.py`` counts them.
It is exact, not asymptotic: the shape checks, the metadata exchanges, the padding of uneven
batches and the chunking are in it. Parameters: TP, DP, SP (DeepSpeed-Ulysses, the Topology's
``sp``: a rank holds ``1/SP`` of each sample's tokens), tokens or pairs per rank, hidden /
embedding size, chunk size, dtypes, options.

**Bytes on the wire** (:meth:`Traffic.wire_bytes`) are derived from the payloads with the ring
algorithms' costs (Thakur, Rabenseifner & Gropp 2005; NCCL's ring all-reduce): per rank, an
all-reduce of ``x`` bytes over ``p`` ranks sends ``2 (p-1)/p x``, an all-gather of an ``x``-byte
input ``(p-1) x``, a reduce-scatter of an ``x``-byte input ``(p-1)/p x``. That part is an
assumption about the backend (tree and hierarchical algorithms differ by constant factors), not
a measurement.

**The measurement** (:func:`measure`): ``world`` spawned gloo processes (``megaloss.testing``)
run every layout ``TP x DP x SP = world`` on small sizes, each loss through its public entry
point, counting with :class:`CollectiveCounter`, a ``TorchDispatchMode`` that sees every c10d
operator: the ``torch.distributed`` calls (``c10d::allreduce_``, ``c10d::_allgather_base_``) and
the functional collectives of the autograd gathers (``_c10d_functional::all_gather_into_tensor``
and, in backward, ``reduce_scatter_tensor``) -- the latter never pass through the
``torch.distributed`` functions that ``bench_vocab_parallel.py``'s counter wraps. The test
(``tests/tools/test_comm_model.py``) requires every count to equal the model's, per rank.

**GradCache** (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup"; sentence-transformers' ``CachedMultipleNegativesRankingLoss``): embed the step's
``G`` chunks without gradients, run the loss ONCE on all of them, then re-encode each chunk with
gradients and back-propagate the cached embedding gradients. :func:`gradcache_mnr_step` does it
on megaloss's ``mnr_loss`` (measured like the rest); its communication is one loss call over
``G x B`` pairs per step instead of ``G`` calls over ``B``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

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

    Forward: one all-gather of 6 int64 (the cross-rank check: failed flag, shapes, bad label);
    per chunk of ``chunk_size`` tokens a MAX all-reduce of ``[c]`` fp32 and one SUM all-reduce of
    the stacked ``[2, c]`` fp32 (``[3, c]`` with label smoothing): 12 (16) bytes per token
    whatever ``V``.
    Backward: the SUM all-reduce of the replicated hidden states' gradient ``[tokens, H]``
    (Megatron's output layer pays the same). With Megatron sequence parallelism the hidden
    states are all-gathered forward (plus their sizes, labels and weights) and their gradient
    reduce-scattered backward; the statistics then cover the TP group's ``tp x tokens``.
    """
    fwd, bwd = Traffic(), Traffic()
    fwd.add("all_gather", tp, 6 * 8)
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


# ------------------------------------------------------------------------------------------------
# counting (real processes)
# ------------------------------------------------------------------------------------------------
_OPS = {
    "c10d::allreduce_": "all_reduce", "c10d::allreduce_coalesced_": "all_reduce",
    "_c10d_functional::all_reduce": "all_reduce", "_c10d_functional::all_reduce_": "all_reduce",
    "c10d::_allgather_base_": "all_gather", "c10d::allgather_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::all_gather_into_tensor_out": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter", "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
    "c10d::broadcast_": "broadcast", "_c10d_functional::broadcast": "broadcast",
    "c10d::alltoall_base_": "all_to_all", "_c10d_functional::all_to_all_single": "all_to_all",
    "c10d::barrier": "barrier",
}
# the argument holding what this rank hands in (bench_vocab_parallel.py's definition of payload)
_INPUT_ARG = {"c10d::_allgather_base_": 1, "c10d::allgather_": 1,
              "c10d::allgather_into_tensor_coalesced_": 1, "c10d::_reduce_scatter_base_": 1,
              "c10d::reduce_scatter_": 1, "c10d::reduce_scatter_tensor_coalesced_": 1,
              "c10d::alltoall_base_": 1, "_c10d_functional::all_gather_into_tensor_out": 0}


def _nbytes(x) -> int:
    import torch
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _group_size(name: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist
    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return dist.ProcessGroup.unbox(a).size()
    if name.startswith("_c10d_functional::"):
        group_name = [a for a in args if isinstance(a, str)][-1]
        return dist.distributed_c10d._resolve_process_group(group_name).size()
    return -1


class CollectiveCounter:
    """Counts this process's collectives per phase, kind and group size (calls, payload bytes).

    A ``TorchDispatchMode`` (entered with ``with counter.phase("fwd"):``) sees every c10d operator
    dispatched while it is active, including those issued by autograd in backward and the
    functional collectives of autograd gathers; it records and runs them unchanged."""

    def __init__(self) -> None:
        self.records: Dict[str, Traffic] = defaultdict(Traffic)

    def phase(self, name: str):
        from torch.utils._python_dispatch import TorchDispatchMode
        records = self.records

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                op = func._schema.name
                kind = _OPS.get(op)
                if kind is not None:
                    payload = 0 if kind == "barrier" else _nbytes(args[_INPUT_ARG.get(op, 0)])
                    size = _group_size(op, args, kwargs)
                    c = records[name].counts.setdefault((kind, size), [0, 0])
                    c[0] += 1
                    c[1] += payload
                return func(*args, **kwargs)

        return _Mode()


# ------------------------------------------------------------------------------------------------
# the measured cases (small sizes, every layout of world 1-4)
# ------------------------------------------------------------------------------------------------
def layouts(world: int) -> List[Tuple[int, int, int]]:
    """``(tp, dp, sp)`` with ``tp x dp x sp = world`` measured at that world size."""
    out = []
    for tp in range(1, world + 1):
        for sp in (1, 2):
            if world % (tp * sp) == 0:
                out.append((tp, world // (tp * sp), sp))
    return out


CE_CASES = [  # (name, options): tokens per rank, hidden, chunk, dtype, label smoothing, Megatron SP
    ("ce-fp32-3chunks", dict(tokens=300, hidden=48, vocab=1000, chunk_size=128,
                             dtype="float32", label_smoothing=False, sequence_parallel=False)),
    ("ce-bf16-ls", dict(tokens=64, hidden=32, vocab=777, chunk_size=1024, dtype="bfloat16",
                        label_smoothing=True, sequence_parallel=False)),
    ("ce-megatron-sp", dict(tokens=40, hidden=16, vocab=500, chunk_size=32, dtype="float32",
                            label_smoothing=False, sequence_parallel=True)),
]
MNR_CASES = [  # (name, options); batch: pairs per rank (a list: per DP rank, cycled)
    ("mnr-even", dict(batch=[4], dim=16, negatives=0, symmetric=False, local_loss=True,
                      duplicate_ids=False, dtype="float32", similarity="cosine")),
    ("mnr-uneven-neg-sym-ids", dict(batch=[3, 0, 5, 1], dim=12, negatives=2, symmetric=True,
                                    local_loss=True, duplicate_ids=True, dtype="float32",
                                    similarity="cosine")),
    ("mnr-bf16-dot-global", dict(batch=[2, 6], dim=8, negatives=1, symmetric=False,
                                 local_loss=False, duplicate_ids=False, dtype="bfloat16",
                                 similarity="dot")),
]
STEP_GAS = 3
CALIB_SHAPE = (2, 16)  # [B, T] labels per micro-batch (full sequences; SP ranks hold 16/sp)


def _mnr_sizes(batch: Sequence[int], dp: int) -> List[int]:
    return [batch[r % len(batch)] for r in range(dp)]


def predict(case: str, opts: Dict[str, Any], tp: int, dp: int, sp: int) -> Dict[str, Traffic]:
    """The model's prediction for one measured case (phases as :func:`_measure_world` names)."""
    if case.startswith("ce-"):
        return vocab_parallel_ce(opts["tokens"], opts["hidden"], tp, chunk_size=opts["chunk_size"],
                                 hidden_bytes=DTYPE_BYTES[opts["dtype"]],
                                 label_smoothing=opts["label_smoothing"],
                                 sequence_parallel=opts["sequence_parallel"])
    if case == "calibration":
        return {"step": calibration_step(dp, sp)}
    sizes = _mnr_sizes(opts["batch"], dp)
    keys = ("negatives", "symmetric", "local_loss", "duplicate_ids", "similarity")
    kw = {k: opts[k] for k in keys}
    kw["embedding_bytes"] = DTYPE_BYTES[opts["dtype"]]
    if case.startswith("mnr-step"):
        return {"step": mnr_step(sizes, opts["dim"], STEP_GAS, cached=opts["cached"], **kw)}
    return mnr_call(sizes, opts["dim"], **kw)


def _layout_topology(tp: int, dp: int, sp: int):
    from megaloss import Topology
    return Topology.build(tp, sequence_parallel_size=sp)


def gradcache_mnr_step(encoder, query_chunks, document_chunks, **loss_options):
    """One GradCache step of the gathered MNR loss (module docstring): embed every chunk without
    gradients, ``mnr_loss(..., return_stats=True)`` once over all of them, then re-encode chunk
    by chunk and back-propagate the cached embedding gradients into ``encoder``. Returns the
    loss."""
    import torch

    from megaloss import mnr_loss
    with torch.no_grad():
        q = torch.cat([encoder(x) for x in query_chunks])
        d = torch.cat([encoder(x) for x in document_chunks])
    q.requires_grad_(True)
    d.requires_grad_(True)
    out = mnr_loss(q, d, return_stats=True, **loss_options)
    out.loss.backward()
    start = 0
    for xq, xd in zip(query_chunks, document_chunks):
        stop = start + len(xq)
        torch.autograd.backward([encoder(xq), encoder(xd)], [q.grad[start:stop],
                                                             d.grad[start:stop]])
        start = stop
    return out.loss.detach()


def _measure_world(rank: int, world: int) -> List[Dict[str, Any]]:
    """Every case at every layout of this world size, on this rank (run by
    :func:`megaloss.testing.run_distributed`)."""
    import torch

    from megaloss import (
        EngineScale,
        LossCalibrator,
        VocabParallelOptions,
        linear_cross_entropy,
        mnr_loss,
    )
    from megaloss.integrations.hf import step_loss_weights
    from megaloss.losses.vocab_parallel import vocab_shard_range
    from megaloss.ops.options import CrossEntropyOptions
    from megaloss.parallel import group_ranks
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    out = []
    for tp, dp, sp in layouts(world):
        topo = _layout_topology(tp, dp, sp)
        g = torch.Generator().manual_seed(topo.dp_rank * 100 + topo.sp_rank)  # same over TP
        for case, o in CE_CASES:
            counter = CollectiveCounter()
            h = torch.randn(o["tokens"], o["hidden"], generator=g).to(dtypes[o["dtype"]])
            h.requires_grad_(True)
            _, _, rows = vocab_shard_range(o["vocab"], tp, topo.tp_rank)
            w = torch.randn(rows, o["hidden"], generator=torch.Generator().manual_seed(7))
            w = (w * 0.02).to(dtypes[o["dtype"]]).requires_grad_(True)
            labels = torch.randint(0, o["vocab"], (o["tokens"],), generator=g)
            weights = torch.rand(o["tokens"], generator=g)
            if o["sequence_parallel"]:  # Megatron SP: every TP rank its own token shard
                tg = torch.Generator().manual_seed(1000 + topo.tp_rank)
                h = torch.randn(o["tokens"], o["hidden"], generator=tg).requires_grad_(True)
                labels = torch.randint(0, o["vocab"], (o["tokens"],), generator=tg)
                weights = torch.rand(o["tokens"], generator=tg)
            opts = CrossEntropyOptions(reduction="sum", chunk_size=o["chunk_size"],
                                       label_smoothing=0.1 if o["label_smoothing"] else 0.0,
                                       z_loss=1e-4)
            with counter.phase("fwd"):
                res = linear_cross_entropy(
                    h, w, labels, loss_weights=weights, options=opts, return_stats=True,
                    vocab_parallel_options=VocabParallelOptions(
                        tp_group=topo.tp_group, vocab_size=o["vocab"],
                        sequence_parallel=o["sequence_parallel"]))
            with counter.phase("bwd"):
                res.loss.backward()
            out.append(_record(case, o, tp, dp, sp, rank, counter))

        counter = CollectiveCounter()
        n = topo.dp_sp_size  # the scale a DDP-style engine has (the value does not matter here)
        calib = LossCalibrator(topo, engine_scale=EngineScale(
            "counted", 1.0 / n, float(n), STEP_GAS, n, 1.0 / n,
            tuple(group_ranks(topo.dp_sp_group))))
        labels = [torch.randint(0, 50, CALIB_SHAPE, generator=g).masked_fill_(
            torch.rand(CALIB_SHAPE, generator=g) < 0.3, -100) for _ in range(STEP_GAS)]
        with counter.phase("step"):
            step = calib.begin_step(labels)
            for i in range(STEP_GAS):
                step.loss_for_backward(torch.tensor(float(step.weights(i).sum())))
            step.global_loss()
        out.append(_record("calibration", {}, tp, dp, sp, rank, counter))

        dg = topo.dp_group
        for case, o in MNR_CASES:
            counter = CollectiveCounter()
            b = _mnr_sizes(o["batch"], dp)[topo.dp_rank]
            dt = dtypes[o["dtype"]]
            q = torch.randn(b, o["dim"], generator=g).to(dt).requires_grad_(True)
            p = torch.randn(b, o["dim"], generator=g).to(dt).requires_grad_(True)
            neg = (torch.randn(b, o["negatives"], o["dim"], generator=g).to(dt)
                   .requires_grad_(True) if o["negatives"] else None)
            ids = torch.randint(0, 3, (b,), generator=g) if o["duplicate_ids"] else None
            with counter.phase("fwd"):
                res = mnr_loss(q, p, neg, similarity=o["similarity"], return_stats=True,
                               symmetric=o["symmetric"], group=dg,
                               local_loss=o["local_loss"], duplicate_ids=ids)
            with counter.phase("bwd"):
                res.loss.backward()
            out.append(_record(case, o, tp, dp, sp, rank, counter))

        # a step of the embedding job: G loss calls, or one GradCache call
        enc = torch.nn.Linear(8, 16)
        for cached in (False, True):
            o = dict(batch=[3, 1], dim=16, negatives=0, symmetric=False, local_loss=True,
                     duplicate_ids=False, dtype="float32", similarity="cosine", cached=cached)
            b = _mnr_sizes(o["batch"], dp)[topo.dp_rank]
            xq = [torch.randn(b, 8, generator=g) for _ in range(STEP_GAS)]
            xd = [torch.randn(b, 8, generator=g) for _ in range(STEP_GAS)]
            counter = CollectiveCounter()
            with counter.phase("step"):
                if cached:
                    gradcache_mnr_step(enc, xq, xd, group=dg)
                else:
                    ws = step_loss_weights([b] * STEP_GAS, dg)
                    for i in range(STEP_GAS):
                        res = mnr_loss(enc(xq[i]), enc(xd[i]), group=dg, return_stats=True)
                        (res.loss * ws[i]).backward()
            name = "mnr-step-cached" if cached else "mnr-step"
            out.append(_record(name, o, tp, dp, sp, rank, counter))
    return out


def _record(case, opts, tp, dp, sp, rank, counter) -> Dict[str, Any]:
    return {"case": case, "options": opts, "tp": tp, "dp": dp, "sp": sp, "rank": rank,
            "measured": {ph: t.as_dict() for ph, t in counter.records.items()}}


def measure(worlds: Iterable[int] = (1, 2, 3, 4), timeout: float = 300.0) -> List[Dict[str, Any]]:
    """Measured records of every case at every layout of each world size (all ranks)."""
    from megaloss.testing import run_distributed
    records = []
    for world in worlds:
        for per_rank in run_distributed(_measure_world, world, timeout=timeout):
            records.extend(per_rank)
    return records


def check(records: Sequence[Dict[str, Any]]) -> List[str]:
    """Mismatches between measured records and the model (empty: every count is exact)."""
    problems = []
    for r in records:
        pred = predict(r["case"], r["options"], r["tp"], r["dp"], r["sp"])
        for phase in sorted(set(pred) | set(r["measured"])):
            want = pred.get(phase, Traffic()).as_dict()
            got = r["measured"].get(phase, {})
            got = {k: list(v) for k, v in got.items()}
            if want != got:
                problems.append(f"{r['case']} tp={r['tp']} dp={r['dp']} sp={r['sp']} rank "
                                f"{r['rank']} {phase}: model {want} measured {got}")
    return problems


# ------------------------------------------------------------------------------------------------
# at scale: tables, crossing points, plot
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """The stated sizes of the scaling tables (README, "Communication at scale")."""

    params: float = 7e9              # model parameters (Llama-2-7B class)
    grad_bytes: int = 2              # bf16 gradients
    hidden: int = 4096               # LM hidden size H (the CE's traffic does not depend on V)
    hidden_bytes: int = 2            # bf16 hidden states
    tokens_per_micro: int = 8192     # tokens per DP rank per micro-batch (2 x 4096)
    gas: int = 4                     # micro-batches per step: 32768 tokens per DP rank per step
    chunk_size: int = 1024
    mnr_batch: int = 64              # pairs per rank per micro-batch (embedding job)
    mnr_dim: int = 4096              # embedding size D (e.g. a 7B decoder as embedder)
    mnr_negatives: int = 1           # hard negatives per pair
    small_params: float = 335e6      # a BERT-large class embedder ...
    small_dim: int = 1024            # ... and its embedding size


TABLE_TP = (1, 2, 4, 8)
TABLE_DP = (1, 2, 8, 64, 512)
MEASURED_WORLDS = (1, 2, 3, 4)


def lm_row(s: Scenario, tp: int, dp: int) -> Dict[str, Any]:
    step = lm_step(s.tokens_per_micro, s.hidden, s.gas, tp=tp, dp=dp, chunk_size=s.chunk_size,
                   hidden_bytes=s.hidden_bytes)
    grad = gradient_allreduce(s.params, tp=tp, dp=dp, grad_bytes=s.grad_bytes)
    loss = sum(t.wire_bytes() for t in step.values())
    return {"tp": tp, "dp": dp, "ce_fwd": step["ce_fwd"].wire_bytes(),
            "ce_bwd": step["ce_bwd"].wire_bytes(), "calibration": step["calibration"].wire_bytes(),
            "loss": loss, "calls": sum(t.calls for t in step.values()), "gradient": grad,
            "ratio": loss / grad if grad else math.inf,
            "measured": tp * dp in MEASURED_WORLDS}


def mnr_row(s: Scenario, dp: int) -> Dict[str, Any]:
    kw = dict(negatives=s.mnr_negatives, embedding_bytes=2)
    plain = mnr_step([s.mnr_batch] * dp, s.mnr_dim, s.gas, **kw)
    cached = mnr_step([s.mnr_batch] * dp, s.mnr_dim, s.gas, cached=True, **kw)
    small = mnr_step([s.mnr_batch] * dp, s.small_dim, s.gas, **kw)
    return {"dp": dp, "mnr": plain.wire_bytes(), "mnr_calls": plain.calls,
            "cached": cached.wire_bytes(), "cached_calls": cached.calls,
            "gradient": gradient_allreduce(s.params, tp=1, dp=dp, grad_bytes=s.grad_bytes),
            "small": small.wire_bytes(),
            "small_gradient": gradient_allreduce(s.small_params, tp=1, dp=dp,
                                                 grad_bytes=s.grad_bytes),
            "measured": dp in MEASURED_WORLDS}


def ce_crossing_tokens(s: Scenario, tp: int, dp: int) -> float:
    """Tokens per DP rank per step at which the vocab-parallel CE's wire bytes equal the
    gradient reduction's (``dp``; the large-``dp`` limit for ``dp = inf``)."""
    if tp <= 1:
        return math.inf
    per_token = vocab_parallel_ce(s.chunk_size, s.hidden, tp, chunk_size=s.chunk_size,
                                  hidden_bytes=s.hidden_bytes)
    per_token = (per_token["fwd"] + per_token["bwd"]).wire_bytes() / s.chunk_size
    grad = (2.0 * s.params / tp * s.grad_bytes if math.isinf(dp)
            else gradient_allreduce(s.params, tp=tp, dp=dp, grad_bytes=s.grad_bytes))
    return grad / per_token


def mnr_crossing_dp(s: Scenario, params: float, dim: int, limit: int = 1 << 20) -> int:
    """Smallest DP at which a step of the gathered MNR sends as much as the gradient reduction
    of a ``params`` model (bisection; MNR grows ~linearly in DP, the gradient's saturates)."""
    def excess(dp):
        m = mnr_step([s.mnr_batch] * dp, dim, s.gas, negatives=s.mnr_negatives,
                     embedding_bytes=2).wire_bytes()
        return m - gradient_allreduce(params, tp=1, dp=dp, grad_bytes=s.grad_bytes)
    lo, hi = 2, limit
    if excess(hi) < 0:
        return -1
    while lo < hi:
        mid = (lo + hi) // 2
        if excess(mid) >= 0:
            hi = mid
        else:
            lo = mid + 1
    return lo


def human(n: float) -> str:
    if n == 0:
        return "0"
    if math.isinf(n):
        return "-"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.0f} B"


def _percent(x: float) -> str:
    return f"{x:.2%}" if x >= 1e-4 else f"{x * 100:.1g} %"


def lm_table(s: Scenario = Scenario()) -> str:
    lines = ["| TP | DP | CE forward (statistics) | CE backward (d_hidden) | calibration + log | "
             "loss total (collectives) | gradient all-reduce | loss / gradient | measured |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for tp in TABLE_TP:
        for dp in TABLE_DP:
            r = lm_row(s, tp, dp)
            ratio = "-" if math.isinf(r["ratio"]) else _percent(r["ratio"])
            lines.append(f"| {tp} | {dp} | {human(r['ce_fwd'])} | {human(r['ce_bwd'])} | "
                         f"{human(r['calibration'])} | {human(r['loss'])} ({r['calls']}) | "
                         f"{human(r['gradient'])} | {ratio} | "
                         f"{'yes' if r['measured'] else ''} |")
    return "\n".join(lines)


def mnr_table(s: Scenario = Scenario()) -> str:
    lines = [f"| DP | gathered MNR (collectives) | GradCache MNR (collectives) | gradient "
             f"all-reduce {s.params / 1e9:g}B | MNR / gradient | D={s.small_dim}: MNR | "
             f"gradient {s.small_params / 1e6:g}M | measured |",
             "|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for dp in TABLE_DP:
        r = mnr_row(s, dp)
        ratio = "-" if not r["gradient"] else _percent(r["mnr"] / r["gradient"])
        lines.append(f"| {dp} | {human(r['mnr'])} ({r['mnr_calls']}) | {human(r['cached'])} "
                     f"({r['cached_calls']}) | {human(r['gradient'])} | {ratio} | "
                     f"{human(r['small'])} | {human(r['small_gradient'])} | "
                     f"{'yes' if r['measured'] else ''} |")
    return "\n".join(lines)


def crossings(s: Scenario = Scenario()) -> Dict[str, Any]:
    return {"ce_tokens": {tp: ce_crossing_tokens(s, tp, math.inf) for tp in TABLE_TP[1:]},
            "mnr_dp": mnr_crossing_dp(s, s.params, s.mnr_dim),
            "mnr_dp_small": mnr_crossing_dp(s, s.small_params, s.small_dim)}


def plot(path: str, records: Optional[Sequence[Dict[str, Any]]] = None,
         s: Scenario = Scenario()) -> None:
    """Left: bytes per rank per step against DP at the stated sizes (model), the measured layouts
    marked. Right: the counts measured at world 2-4 (circles) on the model (lines)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dps = [1, 2, 3, 4, 6, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.6),
                                 gridspec_kw={"width_ratios": [1.4, 1]})
    colors = {1: "tab:gray", 2: "tab:blue", 4: "tab:green", 8: "tab:red"}
    for tp in TABLE_TP:
        ax.plot(dps[1:], [lm_row(s, tp, d)["gradient"] for d in dps[1:]], "-", color=colors[tp],
                lw=3, alpha=0.3, label=f"gradient all-reduce, {s.params / 1e9:g}B bf16, TP {tp}")
    for tp in TABLE_TP[1:]:
        ax.plot(dps, [lm_row(s, tp, d)["loss"] for d in dps], "--", color=colors[tp],
                label=f"vocab-parallel CE + calibration, TP {tp}")
    ax.plot(dps[1:], [lm_row(s, 1, d)["loss"] for d in dps[1:]], ":", color="k",
            label="calibration + log only (TP 1)")
    ax.plot(dps[1:], [mnr_row(s, d)["mnr"] for d in dps[1:]], "-", color="tab:purple",
            label=f"gathered MNR, B {s.mnr_batch}, D {s.mnr_dim}, G {s.gas} "
                  "(GradCache: same bytes)")
    meas = [d for d in dps if d in MEASURED_WORLDS]
    ax.plot(meas[1:], [mnr_row(s, d)["mnr"] for d in meas[1:]], "o", color="tab:purple",
            mfc="none", ms=9)
    for tp in TABLE_TP[1:]:
        pts = [d for d in meas if tp * d in MEASURED_WORLDS]
        ax.plot(pts, [lm_row(s, tp, d)["loss"] for d in pts], "o", color=colors[tp], mfc="none",
                ms=9)
    ax.plot([1, 2, 3, 4], [lm_row(s, 1, d)["loss"] or math.nan for d in (1, 2, 3, 4)], "o",
            color="k", mfc="none", ms=9, label="layout measured (world <= 4, small sizes)")
    cross = mnr_crossing_dp(s, s.params, s.mnr_dim)
    if cross > 0:
        y = mnr_row(s, cross)["mnr"]
        ax.plot([cross], [y], "*", color="tab:purple", ms=14)
        ax.annotate(f"MNR = {s.params / 1e9:g}B gradient\nat DP {cross}", (cross, y),
                    textcoords="offset points", xytext=(-150, -6), fontsize=8)
    ax.axvspan(1, 4, color="k", alpha=0.06)
    ax.axvline(512, color="k", lw=0.8, alpha=0.4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("data-parallel size DP (table: up to 512)")
    ax.set_ylabel("bytes sent per rank per optimizer step (ring algorithms)")
    ax.set_title(f"model at scale: {s.tokens_per_micro * s.gas} tokens per DP rank per step, "
                 f"H {s.hidden}, bf16")
    ax.legend(fontsize=7, loc="center right", framealpha=0.9)
    ax.grid(True, which="both", alpha=0.3)

    if records:
        series = defaultdict(dict)  # case -> world -> (model, measured) total payload
        for r in records:
            if r["rank"] != 0 or r["sp"] != 1:
                continue
            case = r["case"]
            axis_tp = case.startswith("ce-")
            if (axis_tp and r["dp"] != 1) or (not axis_tp and r["tp"] != 1):
                continue
            world = r["tp"] * r["dp"]
            pred = predict(case, r["options"], r["tp"], r["dp"], r["sp"])
            model = sum(t.payload for t in pred.values())
            got = sum(Traffic.from_dict(m).payload for m in r["measured"].values())
            series[case][world] = (model, got)
        markers = "osD^vP*Xh"
        for i, (case, pts) in enumerate(sorted(series.items())):
            xs = [w for w in sorted(pts) if w > 1]
            line, = bx.plot(xs, [pts[w][0] for w in xs], "-", lw=1.2,
                            label=f"{case} ({'TP' if case.startswith('ce-') else 'DP'})")
            bx.plot(xs, [pts[w][1] for w in xs], markers[i % len(markers)],
                    color=line.get_color(), mfc="none", ms=8)
        bx.set_yscale("log")
        bx.set_ylim(1, 3e5)
        bx.set_xticks([2, 3, 4])
        bx.set_xlabel("TP (ce-* cases) or DP (the others): world size")
        bx.set_ylabel("payload bytes per rank, forward + backward / per step")
        bx.set_title("model (lines) vs counted on gloo (markers); world 1: none")
        bx.legend(fontsize=7, loc="lower right", ncol=2)
        bx.grid(True, which="both", alpha=0.3)
    else:
        bx.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _count(n: float) -> str:
    return f"{n / 1e6:.3g} M" if n >= 1e6 else f"{n / 1e3:.3g} k" if n >= 1e3 else f"{n:.0f}"


def markdown(s: Scenario = Scenario()) -> str:
    """The tables of the README's "Communication at scale" section."""
    c = crossings(s)
    ce = ", ".join(f"TP {tp}: {_count(n)} tokens" for tp, n in c["ce_tokens"].items())
    return "\n".join([
        lm_table(s), "",
        f"CE traffic equals the {s.params / 1e9:g}B model's gradient all-reduce (large DP) at "
        f"{ce} per DP rank per step.", "",
        mnr_table(s), "",
        f"The gathered MNR (B {s.mnr_batch}, K {s.mnr_negatives}, G {s.gas}, bf16 embeddings) "
        f"rivals the gradient all-reduce at DP {c['mnr_dp']} for {s.params / 1e9:g}B / D "
        f"{s.mnr_dim}, and at DP {c['mnr_dp_small']} for {s.small_params / 1e6:g}M / D "
        f"{s.small_dim}.",
    ])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="megaloss-comm-model",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measure", action="store_true",
                   help="count the collectives on 1-4 gloo processes and compare to the model")
    p.add_argument("--worlds", type=int, nargs="+", default=list(MEASURED_WORLDS))
    p.add_argument("--json", metavar="PATH", help="write the measured records (with --measure)")
    p.add_argument("--records", metavar="PATH", help="read measured records (instead of "
                   "--measure) for the plot")
    p.add_argument("--plot", metavar="PATH", help="write the scaling plot (PNG)")
    p.add_argument("--markdown", action="store_true", help="print the README tables")
    args = p.parse_args(argv)

    records = None
    status = 0
    if args.measure:
        records = measure(args.worlds)
        problems = check(records)
        n = len(records)
        print(f"measured {n} (case, layout, rank) records at world {args.worlds}: "
              f"{'all equal to the model' if not problems else f'{len(problems)} differ'}")
        for line in problems[:20]:
            print("  " + line)
        status = 1 if problems else 0
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=0)
    elif args.records:
        with open(args.records) as f:
            records = json.load(f)
    if args.plot:
        plot(args.plot, records)
        print(f"wrote {args.plot}")
    if args.markdown or not (args.measure or args.plot):
        print(markdown())
    return status


if __name__ == "__main__":
    sys.exit(main())
