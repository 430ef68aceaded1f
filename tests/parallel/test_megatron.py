"""``Topology.from_megatron`` / ``megaloss.parallel.megatron``.

Slow tier: the real Megatron-core ``parallel_state`` (megatron-core 0.16.1 of the ``test`` extra;
skipped where it is not installed) initialised on 2 spawned gloo CPU processes, one spawn looping
over TP 2, CP 2 (megaloss's ``sp``), PP 2 and DP 2: the Topology's groups are Megatron's, and a
calibrated vocab-parallel CE (``loss_reduction="sample"``) over those groups equals the float64
single-process loss of the whole batch to 1e-12.

Fast tier: NVIDIA apex's ``apex.transformer.parallel_state`` is not on PyPI (the PyPI ``apex``
is another package), so a stand-in module with apex's function names (no context parallelism)
is put in ``sys.modules``; the errors.
"""
import importlib.util
import sys
import types

import pytest
import torch

from megaloss import Topology
from megaloss.parallel import SINGLE_RANK, megatron
from megaloss.testing import run_distributed
from tests.helpers.ce_reference import reference_linear_ce

S, T, H, V = 4, 6, 5, 11
CONFIGS = [(2, 1, 1), (1, 1, 2), (1, 2, 1), (1, 1, 1)]  # (tp, pp, cp) on 2 ranks; dp = the rest


def _apex_stand_in(initialised=True):
    calls = []

    def group(name):
        def fn(*args, **kwargs):
            calls.append((name, args, kwargs))
            return None  # None: torch's default group, a single rank without torch.distributed
        return fn

    ps = types.ModuleType("apex.transformer.parallel_state")
    for name in ("get_data_parallel_group", "get_tensor_model_parallel_group",
                 "get_pipeline_model_parallel_group"):
        setattr(ps, name, group(name))
    ps.model_parallel_is_initialized = lambda: initialised
    return ps, calls


def test_apex_parallel_state_is_taken_when_megatron_core_is_absent(monkeypatch):
    ps, calls = _apex_stand_in()
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", None)  # import fails
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    monkeypatch.setitem(sys.modules, "apex.transformer", types.ModuleType("apex.transformer"))
    monkeypatch.setitem(sys.modules, "apex.transformer.parallel_state", ps)
    assert megatron.import_parallel_state() is ps
    topo = Topology.from_megatron()
    assert (topo.dp_size, topo.sp_size, topo.tp_size, topo.dp_sp_size) == (1, 1, 1, 1)
    groups = megatron.megatron_groups(ps)
    assert groups["sp"] is SINGLE_RANK and groups["dp_sp"] is groups["dp"]
    # apex has no context parallelism: no with_context_parallel= keyword is passed to it
    assert all(not kwargs for _, _, kwargs in calls)
    assert {name for name, _, _ in calls} == {
        "get_data_parallel_group", "get_tensor_model_parallel_group",
        "get_pipeline_model_parallel_group"}


def test_errors_name_the_problem(monkeypatch):
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        Topology.from_megatron(_apex_stand_in(initialised=False)[0])
    with pytest.raises(TypeError, match="get_tensor_model_parallel_group"):
        megatron.megatron_groups(types.SimpleNamespace(get_data_parallel_group=lambda: None))
    monkeypatch.setattr(megatron, "PARALLEL_STATE_MODULES", ("megaloss_no_such.parallel_state",))
    with pytest.raises(ImportError, match="megaloss_no_such"):
        Topology.from_megatron()


def _data():
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(S, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (S, T), generator=g)
    labels[0, 1:] = -100  # uneven valid tokens per sample
    labels[2] = -100  # a sample without any
    return hidden, weight, labels


def _calibrated_loss(topo):
    """This layout's global loss: DP splits the samples, SP (Megatron's CP) the tokens, TP the
    vocabulary; the calibration's weights over the Topology's groups."""
    import torch.distributed as dist

    import megaloss
    from megaloss.calibration.weights import compute_loss_weights, split_for_sequence_parallel
    from megaloss.losses.vocab_parallel import vocab_shard_range
    hidden, weight, labels = _data()
    rows = S // topo.dp_size
    lo = topo.dp_rank * rows
    full = labels[lo: lo + rows]
    lw = compute_loss_weights([full], "sample", group=topo.dp_sp_group, sp_group=topo.sp_group,
                              dtype=torch.float64)
    h = split_for_sequence_parallel(hidden[lo: lo + rows], topo.sp_rank, topo.sp_size, dim=1)
    y = split_for_sequence_parallel(full, topo.sp_rank, topo.sp_size, -100)
    start, stop, n = vocab_shard_range(V, topo.tp_size, topo.tp_rank)
    shard = torch.zeros(n, H, dtype=torch.float64)
    shard[: stop - start] = weight[start:stop]
    loss = megaloss.linear_cross_entropy(
        h, shard, y, loss_weights=lw.weights[0], reduction="sum", chunk_size=4,
        vocab_parallel_options=megaloss.VocabParallelOptions(topo.tp_group, V))
    total = loss.detach().clone()
    if topo.dp_sp_size > 1:
        dist.all_reduce(total, group=topo.dp_sp_group)
    return float(total)


def _megatron_worker(rank, world):
    import warnings
    warnings.filterwarnings("ignore")  # megatron-core warns that apex / TE are absent
    from megatron.core import parallel_state as ps

    from megaloss.parallel.groups import group_ranks
    out = {}
    for tp, pp, cp in CONFIGS:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                     pipeline_model_parallel_size=pp, context_parallel_size=cp)
        topo = Topology.from_megatron()
        groups = megatron.megatron_groups(ps)
        mine = {n: group_ranks(getattr(topo, f"{n}_group")) for n in ("dp", "sp", "tp", "dp_sp")}
        mine["pp"] = group_ranks(groups["pp"])
        theirs = {"dp": ps.get_data_parallel_group(), "sp": ps.get_context_parallel_group(),
                  "tp": ps.get_tensor_model_parallel_group(),
                  "dp_sp": ps.get_data_parallel_group(with_context_parallel=True),
                  "pp": ps.get_pipeline_model_parallel_group()}
        out[tp, pp, cp] = (mine, {n: group_ranks(g) for n, g in theirs.items()},
                           _calibrated_loss(topo))
        ps.destroy_model_parallel()
    return out


def _reference_loss():
    hidden, weight, labels = _data()
    means = [reference_linear_ce(hidden[s], weight, labels[s]) for s in range(S)
             if (labels[s] != -100).any()]
    return float(sum(means) / len(means))


@pytest.mark.distributed
@pytest.mark.fresh_processes  # megatron-core's import and globals stay out of the shared pool
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core is not installed (the test extra has it)")
def test_megatron_core_groups_drive_the_losses_and_the_calibrator():
    results = run_distributed(_megatron_worker, 2, timeout=280)
    ref = _reference_loss()
    for tp, pp, cp in CONFIGS:
        dp = 2 // (tp * pp * cp)
        for rank, per_rank in enumerate(results):
            mine, theirs, loss = per_rank[tp, pp, cp]
            assert mine == theirs, (tp, pp, cp, rank)
            sizes = {n: len(r) for n, r in mine.items()}
            assert sizes == {"dp": dp, "sp": cp, "tp": tp, "dp_sp": dp * cp, "pp": pp}
            assert loss == pytest.approx(ref, rel=1e-12, abs=0), (tp, pp, cp, rank)
