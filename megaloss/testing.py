"""Run a function on N real processes (spawn start method, gloo, CPU) with a hard timeout: the
harness megaloss's tests, benchmarks and checkers use to exercise collectives for real.

Writing a case:

```python
def _rank(rank, world_size, n):  # module level: the ranks import it by name
    ...                          # init_process_group has run; create subgroups freely
    return loss.item()           # picklable; comes back as results[rank]

results = run_distributed(_rank, 2, 13, timeout=120)
```

The function runs as ``fn(rank, world_size, *args)`` after ``init_process_group`` (gloo, with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` set); it and its
arguments are pickled, so ``fn`` must be importable from its module (not a lambda or a nested
function). An exception on any rank fails the caller with that rank's traceback. A collective
mismatch makes ranks wait forever; the timeout (:data:`DEFAULT_TIMEOUT_S` unless given) turns
that into a ``TimeoutError``, and a rank that dies without replying fails the call at once.
"spawn", not "fork": forking after torch has run ops can hang in OpenMP.

Two ways to get the ranks:

- :func:`run_distributed` on its own spawns ``world_size`` fresh processes per call and ends
  them after it (what the tools and launch checks use).
- Inside a :func:`shared_process_groups` block, :func:`run_distributed` sends the call to a
  :class:`ProcessGroupPool` of that world size (and thread count) instead: ranks spawned and
  joined to one gloo world once, then reused case after case, which saves the spawn +
  ``import torch`` + rendezvous (seconds of CPU) of every call. The test suite opens such a
  block around every test (tests/conftest.py) but those marked ``deepspeed`` (fresh ranks, or
  tests/integrations' DeepSpeed-only pools) or ``fresh_processes``. This is the pattern of
  torch's ``MultiProcContinuousTest`` (torch/testing/_internal/common_distributed.py). What
  keeps the cases independent: each case is reseeded to the same fixed value first
  (:data:`CASE_SEED`: its outcome does not depend on what ran before) with the default dtype,
  thread count and grad mode put back; the process groups it created are destroyed after it
  (:func:`destroy_subgroups`: a live gloo group keeps a thread polling every few
  milliseconds); and a case that fails or times out takes its pool down, so the next case gets
  fresh processes. A pooled case must leave the default process group alone (no
  ``destroy_process_group``).
"""
from __future__ import annotations

import contextlib
import datetime
import io
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 180.0
# Before every pooled case, torch's, Python's and NumPy's generators are reseeded to this value,
# so a case's outcome does not depend on the cases that ran before it on the same ranks.
CASE_SEED = 0


__all__ = ["run_distributed", "free_port", "DEFAULT_TIMEOUT_S", "ProcessGroupPool",
           "shared_process_groups", "destroy_subgroups"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_rank(rank, world_size, port, threads, collective_timeout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS=str(threads))
    import torch.distributed as dist
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout))


def _serialise(result) -> bytes:
    # Tensors put on a torch Queue live in shared memory that vanishes when this process exits:
    # send serialised bytes instead.
    buf = io.BytesIO()
    torch.save(result, buf)
    return buf.getvalue()


def _worker(rank, world_size, port, fn, args, queue, threads, collective_timeout):
    import torch.distributed as dist
    try:
        _init_rank(rank, world_size, port, threads, collective_timeout)
        _freeze_survivors()
        queue.put((rank, "ok", _serialise(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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


def _freeze_survivors():
    """Before a case: garbage (a previous case's) collected, the survivors (imports, caches)
    frozen out of later collections: DeepSpeed's engine set-up calls ``gc.collect()`` (see
    :func:`megaloss.integrations.deepspeed.freeze_imported_objects`)."""
    from megaloss.integrations.deepspeed.compat import freeze_imported_objects
    freeze_imported_objects()


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


def _next_reply(replies, procs, deadline, fn, timeout):
    """The next rank's reply; fails at the deadline, or as soon as a rank died without one (a
    crash in C code, a kill): then waiting longer cannot help."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {len(procs)} ranks did not "
                               f"finish in {timeout:.0f} s (collective mismatch or deadlock?)")
        try:
            return replies.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                rank, code = dead[0]
                raise RuntimeError(f"rank {rank} of {len(procs)} exited with code {code} "
                                   f"before replying") from None


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


_ACTIVE: Optional[Dict[Tuple[int, int], ProcessGroupPool]] = None


@contextlib.contextmanager
def shared_process_groups(pools: Optional[Dict[Tuple[int, int], ProcessGroupPool]] = None
                          ) -> Iterator[Dict[Tuple[int, int], ProcessGroupPool]]:
    """Within this block, :func:`run_distributed` runs on a :class:`ProcessGroupPool` per
    ``(world_size, threads_per_rank)``, kept in ``pools`` (pass the same dict to a later block
    to reuse its ranks; the caller closes them). Yields ``pools``."""
    global _ACTIVE
    pools = {} if pools is None else pools
    previous, _ACTIVE = _ACTIVE, pools
    try:
        yield pools
    finally:
        _ACTIVE = previous


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = DEFAULT_TIMEOUT_S, threads_per_rank: int = 1) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes.

    Fresh processes per call, or a shared pool's ranks inside :func:`shared_process_groups`.

    Args:
        fn: importable (module level) function; its return value must be picklable.
        world_size: number of processes (each with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``).
        args: extra picklable arguments.
        timeout: seconds for all ranks to finish.
        threads_per_rank: torch threads of each process.

    Returns:
        The ranks' return values, in rank order.

    Raises:
        RuntimeError: a rank failed (with its traceback).
        TimeoutError: the ranks did not all finish within ``timeout`` seconds.
    """
    if _ACTIVE is not None:
        key = (world_size, threads_per_rank)
        if key not in _ACTIVE:
            _ACTIVE[key] = ProcessGroupPool(world_size, threads_per_rank)
        return _ACTIVE[key].run(fn, *args, timeout=timeout)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    # a rank waiting in a collective fails after at most the caller's timeout (2 min at least)
    collective_timeout = max(120.0, float(timeout))
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue,
                                               threads_per_rank, collective_timeout), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: List[Any] = [None] * world_size
    deadline = time.monotonic() + timeout
    failed = True
    try:
        for _ in range(world_size):
            rank, status, payload = _next_reply(queue, procs, deadline, fn, timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        failed = False
    finally:
        for p in procs:
            # after a failure or a timeout the other ranks may wait in a collective for ever:
            # killed at once (only ranks that all replied get time to leave the group cleanly)
            if not failed:
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return results
