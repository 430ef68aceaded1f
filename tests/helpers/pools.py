"""The test suite's shared ranks: a :class:`ProcessGroupPool` per ``(world size, threads)``
runs case after case on ranks spawned and joined to one gloo world once, and
:func:`shared_process_groups` sends ``megaloss.testing.run_distributed`` calls there. This saves
each call's spawn + ``import torch`` + rendezvous (seconds of CPU): it is how the full suite
stays within its time. The pattern of torch's ``MultiProcContinuousTest``
(torch/testing/_internal/common_distributed.py).

tests/conftest.py opens a :func:`shared_process_groups` block around every test but those
marked ``deepspeed`` (fresh ranks, or tests/integrations' DeepSpeed-only pools) or
``fresh_processes``. Inside it, ``run_distributed`` is the pooled runner wherever a module holds
it: ``megaloss.testing.run_distributed`` and every loaded module's ``run_distributed`` name bound
to the runner the block replaces (a test module's ``from megaloss.testing import
run_distributed``); the block puts them back when it ends. A test thus calls
``run_distributed`` as a user does, and the suite decides where it runs.

What keeps the cases independent: each case is reseeded to the same fixed value first
(:data:`CASE_SEED`: its outcome does not depend on what ran before) with the default dtype,
thread count and grad mode put back; the process groups it created are destroyed after it
(:func:`destroy_subgroups`: a live gloo group keeps a thread polling every few milliseconds);
and a case that fails or times out takes its pool down, so the next case gets fresh processes.
A pooled case must leave the default process group alone (no ``destroy_process_group``).
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.multiprocessing as mp

from megaloss import testing
from megaloss.testing import (
    DEFAULT_TIMEOUT_S,
    _freeze_survivors,
    _init_rank,
    _next_reply,
    _serialise,
    free_port,
)

# Before every pooled case, torch's, Python's and NumPy's generators are reseeded to this value,
# so a case's outcome does not depend on the cases that ran before it on the same ranks.
CASE_SEED = 0

Pools = Dict[Tuple[int, int], "ProcessGroupPool"]


def _reseed():
    import random
    random.seed(CASE_SEED)
    torch.manual_seed(CASE_SEED)
    try:
        import numpy
        numpy.random.seed(CASE_SEED)
    except ImportError:
        pass


def destroy_subgroups() -> int:
    """Destroy every ``torch.distributed`` process group except the default one, and collect
    the garbage that still referenced them; returns how many were destroyed (0 without an
    initialised default group).

    For processes that run case after case (or job after job) in one default group: every
    gloo group keeps its own communication threads, one of which wakes every few milliseconds
    for as long as the group object lives (measured on 2 CPU cores: 20 idle groups cost 2.7 %
    of a core, 0.2 % once destroyed). Cases build groups of their own (``new_group``,
    DeviceMeshes, DeepSpeed's and megaloss' parallel groups), so without this the shared ranks
    spend a share of the machine that grows with every case, busy or idle. Local (no
    collective): call it on every rank once that rank is done with the groups.

    Reads ``torch.distributed.distributed_c10d._world.pg_map`` (torch has no public list of the
    live groups).
    """
    import gc

    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    from torch.distributed import distributed_c10d
    default = distributed_c10d._get_default_group()
    subgroups = [pg for pg in list(distributed_c10d._world.pg_map) if pg is not default]
    count = len(subgroups)
    while subgroups:  # no reference left here: a destroyed group's threads end with its object
        dist.destroy_process_group(subgroups.pop())
    gc.collect()  # engines and meshes hold their groups in reference cycles
    return count


def _fresh_process_state(environment):
    """Before a pooled case: the environment the rank joined the world with (a case may set
    or remove variables, e.g. ``LOCAL_RANK`` or accelerate's), and accelerate's process-wide
    singletons (``PartialState`` / ``AcceleratorState``) unset, so a Trainer built now reads
    the world as on a fresh rank, not as an earlier case's Trainer saw it."""
    os.environ.clear()
    os.environ.update(environment)
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


def _pool_worker(rank, world_size, port, tasks, results, threads, collective_timeout):
    """One pooled rank: join the world once, then run cases until told to stop (``None``)."""
    import torch.distributed as dist
    try:
        _init_rank(rank, world_size, port, threads, collective_timeout)
    except BaseException:  # noqa: BLE001
        results.put((-1, rank, "error", traceback.format_exc()))
        return
    default_dtype = torch.get_default_dtype()
    environment = dict(os.environ)
    while True:
        task = tasks.get()
        if task is None:
            break
        case, sys_path, payload = task
        try:
            # Test folders pytest put on sys.path after this process started: before unpickling,
            # which imports ``fn``'s module by name.
            sys.path.extend(p for p in sys_path if p not in sys.path)
            fn, args = pickle.loads(payload)
            _fresh_process_state(environment)
            _freeze_survivors()
            _reseed()
            torch.set_default_dtype(default_dtype)
            torch.set_num_threads(threads)
            torch.set_grad_enabled(True)
            results.put((case, rank, "ok", _serialise(fn(rank, world_size, *args))))
        except BaseException:  # noqa: BLE001 - report every failure to the parent
            results.put((case, rank, "error", traceback.format_exc()))
        # after the reply (the parent goes on meanwhile); should this fail, the rank exits
        # and the next case gets fresh ranks
        destroy_subgroups()
    dist.destroy_process_group()


class ProcessGroupPool:
    """``world_size`` spawned gloo ranks that run case after case (see the module docstring).

    The ranks start on the first :meth:`run` (and again on the next one after a failure or a
    timeout, which kills them). Cases must leave the default process group as they found it
    (no ``destroy_process_group``); subgroups and DeviceMeshes of any shape may be created: they
    are destroyed after the case (:func:`destroy_subgroups`).
    """

    def __init__(self, world_size: int, threads_per_rank: int = 1,
                 collective_timeout: float = DEFAULT_TIMEOUT_S):
        self.world_size, self.threads_per_rank = world_size, threads_per_rank
        self.collective_timeout = collective_timeout
        self._procs: List[Any] = []
        self._tasks: List[Any] = []
        self._results: Optional[Any] = None
        self._case = 0
        self.starts = 0  # how many times ranks were spawned (a restart after a failure counts)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _start(self):
        ctx = mp.get_context("spawn")
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_pool_worker,
                                   args=(r, self.world_size, port, self._tasks[r], self._results,
                                         self.threads_per_rank, self.collective_timeout),
                                   daemon=True)
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        self.starts += 1

    def run(self, fn: Callable[..., Any], *args: Any,
            timeout: float = DEFAULT_TIMEOUT_S) -> List[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; same contract as
        :func:`run_distributed` (``timeout`` counts from here, and includes the first start)."""
        if not self.alive:
            self.close()
            self._start()
        self._case += 1
        case = self._case
        out: List[Any] = [None] * self.world_size
        deadline = time.monotonic() + timeout
        done = 0
        try:
            task = (case, list(sys.path), pickle.dumps((fn, args)))
            for q in self._tasks:
                q.put(task)
            while done < self.world_size:
                got_case, rank, status, payload = _next_reply(self._results, self._procs,
                                                              deadline, fn, timeout)
                if got_case not in (case, -1):
                    continue  # cannot happen after a clean case; ignore stale replies
                if status == "error":
                    raise RuntimeError(f"rank {rank} of {self.world_size} failed:\n{payload}")
                out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                done += 1
        except BaseException:
            self.close(kill=True)  # one bad case must not poison the next one
            raise
        return out

    def close(self, kill: bool = False):
        """Stop the ranks (``kill``: at once, without letting them finish their case)."""
        if not kill:
            for q in self._tasks:
                with contextlib.suppress(Exception):
                    q.put(None)
        for p in self._procs:
            if not kill:
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs, self._tasks, self._results = [], [], None


# The modules that hold a ``run_distributed`` (imported by name, or megaloss.testing's own), and
# the names of every module already looked at: each rebind looks only at the modules imported
# since the last one (a set difference in C). Scanning all of sys.modules (~4k modules once
# torch, transformers and DeepSpeed are loaded) on entering and leaving every test's block cost
# the fast tier ~7 s. A module imported again under a name already seen is not rebound: its
# calls spawn fresh ranks, as outside a block.
_HOLDERS: Dict[str, Any] = {}
_SEEN: set = set()


def _rebind(old: Callable[..., Any], new: Callable[..., Any]) -> None:
    """Every loaded module's ``run_distributed`` that is ``old`` becomes ``new`` (the
    modules that imported the runner by name, and ``megaloss.testing`` itself)."""
    for name in sys.modules.keys() - _SEEN:
        _SEEN.add(name)
        names = getattr(sys.modules.get(name), "__dict__", None)
        if isinstance(names, dict) and "run_distributed" in names:
            _HOLDERS[name] = names
    for names in _HOLDERS.values():
        if names.get("run_distributed") is old:
            names["run_distributed"] = new


@contextlib.contextmanager
def shared_process_groups(pools: Optional[Pools] = None) -> Iterator[Pools]:
    """Within this block, ``run_distributed`` (``megaloss.testing``'s, wherever a module holds
    it) runs on a :class:`ProcessGroupPool` per ``(world_size, threads_per_rank)``, kept in
    ``pools`` (pass the same dict to a later block to reuse its ranks; the caller closes them).
    Blocks nest: the inner one's pools serve its calls, the outer one's again after it. Yields
    ``pools``."""
    pools = {} if pools is None else pools

    def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                        timeout: float = DEFAULT_TIMEOUT_S, threads_per_rank: int = 1) -> List[Any]:
        key = (world_size, threads_per_rank)
        if key not in pools:
            pools[key] = ProcessGroupPool(world_size, threads_per_rank)
        return pools[key].run(fn, *args, timeout=timeout)

    run_distributed.__doc__ = testing.run_distributed.__doc__
    replaced = testing.run_distributed  # the plain runner, or an enclosing block's
    _rebind(replaced, run_distributed)
    try:
        yield pools
    finally:
        # also the modules imported inside the block, which bound the pooled runner
        _rebind(run_distributed, replaced)
