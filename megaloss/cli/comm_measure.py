"""The collectives of megaloss's losses counted on real gloo processes and compared to the model
(:mod:`megaloss.cli.comm_costs`): :class:`CollectiveCounter` (a ``TorchDispatchMode`` that sees
every c10d operator), the measured cases (:data:`CE_CASES`, :data:`MNR_CASES`, every layout of
world 1-4), :func:`predict`, :func:`measure` and :func:`check`.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, Iterable, List, Sequence, Tuple

from .comm_costs import (
    DTYPE_BYTES,
    Traffic,
    calibration_step,
    mnr_call,
    mnr_step,
    vocab_parallel_ce,
)

__all__ = ["CollectiveCounter", "layouts", "CE_CASES", "MNR_CASES", "STEP_GAS", "CALIB_SHAPE",
           "predict", "gradcache_mnr_step", "measure", "check"]


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

    from megaloss import LossCalibrator, VocabParallelOptions, linear_cross_entropy, mnr_loss
    from megaloss.calibration import EngineScale
    from megaloss.integrations.hf.embedding import step_loss_weights
    from megaloss.losses.vocab_parallel import vocab_shard_range
    from megaloss.ops.cross_entropy_options import CrossEntropyOptions
    from megaloss.parallel.groups import group_ranks
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
