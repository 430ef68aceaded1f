"""Run a function on N real processes (spawn start method, gloo, CPU) with a hard timeout: the
harness megaloss's tests, benchmarks, examples and checkers use to exercise collectives for real.

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

Each call spawns ``world_size`` fresh processes and ends them after it. (megaloss's own test
suite reuses ranks across cases instead: ``tests/helpers/pools.py`` in the repository.)
"""
from __future__ import annotations

import datetime
import io
import os
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, List

import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 180.0

__all__ = ["run_distributed", "free_port", "DEFAULT_TIMEOUT_S"]


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


def _freeze_survivors():
    """Before a case: garbage (a previous case's) collected, the survivors (imports, caches)
    frozen out of later collections: DeepSpeed's engine set-up calls ``gc.collect()`` (see
    :func:`megaloss.integrations.deepspeed.freeze_imported_objects`)."""
    from megaloss.integrations.deepspeed.compat import freeze_imported_objects
    freeze_imported_objects()


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


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float = DEFAULT_TIMEOUT_S, threads_per_rank: int = 1) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes.

    Args:
        fn: importable (module level) function; its return value must be picklable.
        world_size: number of processes (each with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``).
        args: extra picklable arguments.
        timeout: seconds for all ranks to finish.
        threads_per_rank: torch threads of each process.

    Returns:
        The ranks' return values, in rank order.

    Raises:
        RuntimeError: a rank failed (with its traceback); the rendezvous port was taken by
            another process on every one of a few fresh ports.
        TimeoutError: the ranks did not all finish within ``timeout`` seconds.
    """
    for _ in range(_PORT_ATTEMPTS - 1):
        try:
            return _spawn(fn, world_size, args, timeout, threads_per_rank)
        except _PortTaken:
            continue
    return _spawn(fn, world_size, args, timeout, threads_per_rank)


# free_port's port may be taken by another process before rank 0 listens on it (many suites and
# launches start ranks on one machine): the rendezvous then fails at once with EADDRINUSE, and a
# fresh port is tried
_PORT_ATTEMPTS = 3


class _PortTaken(RuntimeError):
    """Rank 0 could not listen on the rendezvous port (taken since :func:`free_port`)."""


def _spawn(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float,
           threads_per_rank: int) -> List[Any]:
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
                message = f"rank {rank} of {world_size} failed:\n{payload}"
                if "EADDRINUSE" in payload and "_init_rank" in payload:
                    raise _PortTaken(message)
                raise RuntimeError(message)
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

