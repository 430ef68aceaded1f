"""Run a function on N real processes (spawn start method, gloo, CPU) with a hard timeout: the
harness megaloss's tests, benchmarks and checkers use to exercise collectives for real.

A collective mismatch makes ranks wait forever; the timeout turns that into a failure. The
function runs as ``fn(rank, world_size, *args)`` after ``init_process_group``; what rank r returns
(picklable) comes back as ``results[r]``; an exception on any rank fails the caller with that
rank's traceback. "spawn", not "fork": forking after torch has run ops can hang in OpenMP.
"""
from __future__ import annotations

import io
import os
import socket
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


def _worker(rank, world_size, port, fn, args, queue, threads, collective_timeout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS=str(threads))
    import datetime

    import torch
    import torch.distributed as dist
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        result = fn(rank, world_size, *args)
        # Tensors put on a torch Queue live in shared memory that vanishes when this process
        # exits: send serialised bytes instead.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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
        RuntimeError: a rank failed (with its traceback).
        TimeoutError: the ranks did not all finish within ``timeout`` seconds.
    """
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
    import queue as queue_mod
    import time
    deadline = time.monotonic() + timeout
    try:
        for _ in range(world_size):
            remaining = deadline - time.monotonic()
            try:
                rank, status, payload = queue.get(timeout=max(remaining, 0.1))
            except queue_mod.Empty:
                raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in "
                                   f"{timeout:.0f} s (collective mismatch or deadlock?)") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return results
