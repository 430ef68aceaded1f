"""Run a function on N real processes (spawn, gloo, CPU) with a hard timeout.

A collective mismatch makes ranks wait forever; the timeout turns that into a failure. The
function runs as ``fn(rank, world_size, *args)`` after ``init_process_group``; what rank r returns
(picklable) comes back as ``results[r]``; an exception on any rank fails the caller with that
rank's traceback.
"""
from __future__ import annotations

import io
import os
import socket
import tempfile
import traceback
from typing import Any, Callable, List

import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import datetime

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))
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
                    timeout: float = DEFAULT_TIMEOUT_S) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes.

    ``fn`` must be importable (module level). Raises ``RuntimeError`` with the failing rank's
    traceback, or ``TimeoutError`` when the ranks do not all finish within ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=True)
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
