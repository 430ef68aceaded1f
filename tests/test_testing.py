"""megaloss.testing: fresh spawned ranks per call; and the suite's shared pool
(tests/helpers/pools.py: reused ranks, reseeded cases, fresh ranks after a failure or a
timeout, ``run_distributed`` rerouted inside a block and put back after it)."""
import contextlib
import os
import sys

import pytest
import torch

import megaloss.testing
from megaloss.testing import run_distributed
from tests.helpers.pools import ProcessGroupPool, shared_process_groups

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _identity(rank, world):
    import torch.distributed as dist
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world, os.getpid(), float(t)


def _draw(rank, world, consume):
    torch.rand(consume)  # a case that uses the generator must not shift the next case's draws
    return torch.rand(3)


def _fail_on_rank1(rank, world):
    if rank == 1:
        raise ValueError("rank 1 refuses")
    return rank


def _rank0_waits_forever(rank, world):
    import threading

    import torch.distributed as dist
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: a collective mismatch
    # rank 1 hangs too, outside any collective (had it returned, a fresh rank 1 would exit and
    # rank 0 fail with gloo's "Connection closed by peer" before the timeout: a race)
    threading.Event().wait()
    return rank


def _rank1_dies(rank, world):
    if rank == 1:
        os._exit(3)  # no reply, no traceback: as a crash in C code
    return rank


def _subgroups(rank, world, size):
    import torch.distributed as dist
    groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
    t = torch.ones(1)
    dist.all_reduce(t, group=groups[rank // size])
    return float(t)


def _new_groups(rank, world, n):
    import torch.distributed as dist
    groups = [dist.new_group(list(range(world))) for _ in range(n)]
    for g in groups:
        dist.all_reduce(torch.ones(1), group=g)
    return len(dist.distributed_c10d._world.pg_map)


def _live_groups(rank, world):
    """(process groups torch knows, gloo loop threads of this process or None without /proc)."""
    import torch.distributed as dist
    tasks = f"/proc/{os.getpid()}/task"
    loops = None
    if os.path.isdir(tasks):
        loops = 0
        for t in os.listdir(tasks):
            with contextlib.suppress(OSError), open(f"{tasks}/{t}/comm") as f:
                loops += f.read().strip() == "gloo_tcp_loop"
    return len(dist.distributed_c10d._world.pg_map), loops


@pytest.fixture(scope="module")
def pool():
    pool = ProcessGroupPool(2)
    yield pool
    pool.close()
    assert not pool.alive


def test_pool_reuses_its_ranks_and_returns_in_rank_order(pool):
    first = pool.run(_identity, timeout=120)
    starts = pool.starts
    second = pool.run(_identity, timeout=60)
    assert [r[:2] for r in first] == [(0, 2), (1, 2)]
    assert all(r[3] == 3.0 for r in first + second)
    assert [r[2] for r in first] == [r[2] for r in second]  # the same processes
    assert len({r[2] for r in first}) == 2 and os.getpid() not in {r[2] for r in first}
    # subgroups of different shapes inside the one world, case after case
    assert pool.run(_subgroups, 1, timeout=60) == [1.0, 1.0]
    assert pool.run(_subgroups, 2, timeout=60) == [2.0, 2.0]
    assert pool.starts == starts


def test_every_pooled_case_is_reseeded(pool):
    a = pool.run(_draw, 0, timeout=120)
    b = pool.run(_draw, 5, timeout=60)
    c = pool.run(_draw, 0, timeout=60)
    torch.manual_seed(0)
    want = torch.rand(3)
    for got in a + c:
        assert torch.equal(got, want)
    assert not torch.equal(b[0], want)  # the draw did depend on the case's own consumption


def test_a_failed_case_raises_and_the_next_case_gets_fresh_ranks(pool):
    before = pool.run(_identity, timeout=120)
    starts = pool.starts
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*rank 1 refuses"):
        pool.run(_fail_on_rank1, timeout=60)
    assert not pool.alive
    after = pool.run(_identity, timeout=120)
    assert pool.starts == starts + 1
    assert {r[2] for r in before}.isdisjoint(r[2] for r in after)
    assert [r[3] for r in after] == [3.0, 3.0]


def test_a_hung_case_times_out_and_the_next_case_gets_fresh_ranks(pool):
    pool.run(_identity, timeout=120)
    starts = pool.starts
    with pytest.raises(TimeoutError, match="_rank0_waits_forever on 2 ranks"):
        pool.run(_rank0_waits_forever, timeout=3)
    assert not pool.alive
    assert [r[3] for r in pool.run(_identity, timeout=120)] == [3.0, 3.0]
    assert pool.starts == starts + 1


def test_a_dead_rank_fails_the_case_without_waiting_for_the_timeout(pool):
    with pytest.raises(RuntimeError, match="rank 1 of 2 exited with code 3"):
        pool.run(_rank1_dies, timeout=3600)  # the test's own 300 s timeout would fire first
    assert [r[3] for r in pool.run(_identity, timeout=120)] == [3.0, 3.0]


def test_a_cases_subgroups_are_destroyed_after_it(pool):
    before = pool.run(_live_groups, timeout=120)
    assert [g for g, _ in before] == [1, 1]  # the default group only
    assert pool.run(_new_groups, 3, timeout=60) == [4, 4]
    after = pool.run(_live_groups, timeout=60)
    # the groups are gone, and with them their gloo threads (each group has a polling one)
    assert after == before, (before, after)


def test_run_distributed_uses_the_active_pool(pool):
    pools = {(2, 1): pool}
    with shared_process_groups(pools):
        first = run_distributed(_identity, 2, timeout=120)
        second = run_distributed(_identity, 2, timeout=60)
    assert [r[2] for r in first] == [r[2] for r in second] == [r[2] for r in
                                                              pool.run(_identity, timeout=60)]
    assert set(pools) == {(2, 1)}


def test_a_block_reroutes_every_binding_of_the_runner_and_puts_it_back():
    """Inside a block the module attribute and this module's own binding are the pooled runner
    (blocks nest); after it, the runner the block replaced (no process is started here)."""
    this = sys.modules[__name__]
    before = megaloss.testing.run_distributed
    assert this.run_distributed is before
    with shared_process_groups() as outer:
        pooled = megaloss.testing.run_distributed
        assert pooled is not before and this.run_distributed is pooled
        with shared_process_groups() as inner:
            assert megaloss.testing.run_distributed not in (before, pooled)
            assert this.run_distributed is megaloss.testing.run_distributed
        assert megaloss.testing.run_distributed is pooled and this.run_distributed is pooled
    assert megaloss.testing.run_distributed is before and this.run_distributed is before
    assert outer == {} and inner == {}  # no call, no pool
    assert not hasattr(megaloss.testing, "ProcessGroupPool")  # the pools ship outside the wheel


@pytest.mark.fresh_processes
def test_run_distributed_spawns_fresh_ranks_outside_a_pool(pool):
    pooled = {r[2] for r in pool.run(_identity, timeout=120)}
    fresh = run_distributed(_identity, 2, timeout=120)
    assert [r[3] for r in fresh] == [3.0, 3.0]
    assert pooled.isdisjoint(r[2] for r in fresh) and pool.alive
    with pytest.raises(RuntimeError, match="rank 1 refuses"):
        run_distributed(_fail_on_rank1, 2, timeout=120)
    with pytest.raises(TimeoutError, match="_rank0_waits_forever on 2 ranks"):
        run_distributed(_rank0_waits_forever, 2, timeout=3)


@pytest.mark.fresh_processes
def test_a_taken_rendezvous_port_is_retried_on_a_fresh_one(monkeypatch):
    """``free_port``'s port taken by another process before rank 0 listens (EADDRINUSE at the
    rendezvous, as seen when suites and launches share a machine): the ranks start again on a
    fresh port instead of failing the caller."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    ports = [held.getsockname()[1]]
    real = megaloss.testing.free_port
    monkeypatch.setattr(megaloss.testing, "free_port",
                        lambda: ports.pop() if ports else real())
    try:
        assert [r[3] for r in run_distributed(_identity, 2, timeout=120)] == [3.0, 3.0]
    finally:
        held.close()
    assert not ports  # the taken port was tried first
