"""Shared pieces of the benchmark tools: honest peak-memory probes, timing, tables and CSV.

How memory is measured (docs/benchmarks.md states the same):

* CPU: every case runs in a *fresh* process, so no earlier case's high-water mark or allocator
  cache can hide or inflate its figure. After the inputs, the weight and everything the run keeps
  alive are allocated, the process's peak resident set is reset to its current RSS
  (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0) and that RSS is the baseline; the loss then
  runs forward+backward ONCE and the figure is ``peak RSS - baseline`` (peak = ``VmHWM`` of
  ``/proc/self/status``, the same kernel counter ``getrusage(RUSAGE_SELF).ru_maxrss`` reads;
  ``ru_maxrss`` is the fallback where ``/proc`` is missing). ``ru_maxrss`` alone is not used on
  Linux because it also carries the high-water mark of the image the process was exec'd from
  (for spawned ranks: the parent, torch already imported) and it cannot be reset.
* The tools preallocate (and touch) the ``.grad`` buffers of the inputs and the weight before the
  baseline, so autograd accumulates into them and the figure is the memory *beyond* inputs,
  weight and their gradients (a gradient computed into a temporary and then added counts).
* glibc malloc: worker processes start with ``MALLOC_MMAP_THRESHOLD_=65536`` (every block of
  64 KiB or more is its own ``mmap``, returned to the kernel on free; a fixed threshold also turns
  off glibc's dynamic threshold, which otherwise grows after frees and keeps freed chunks of up to
  32 MiB in the heap, inflating later RSS) and ``MALLOC_ARENA_MAX=1`` (no per-thread arenas holding
  freed memory). RSS then tracks live tensors; untouched pages of ``torch.empty`` are not counted.
* CUDA: ``torch.cuda.max_memory_allocated() - memory_allocated()`` at the baseline, after
  ``reset_peak_memory_stats()`` (the caching allocator's reserve is not counted).
"""
from __future__ import annotations

import csv
import ctypes
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

__all__ = ["MALLOC_ENV", "MemoryProbe", "trim_memory", "median", "budget_spent", "run_worker",
           "format_table", "write_csv", "mib", "worker_env", "require_positive", "vocab_shard",
           "peak_rss_bytes", "finish", "add_process_arguments", "answer_worker",
           "run_in_this_process"]

# Fixed glibc malloc behaviour in every worker process (see the module docstring).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}

_MIB = 1024.0 * 1024.0


def trim_memory() -> None:
    """Collect garbage and hand freed heap memory back to the OS (glibc ``malloc_trim``), so the
    next baseline RSS holds only live data."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def mib(n_bytes: float) -> float:
    return n_bytes / _MIB


def worker_env(threads: int) -> Dict[str, str]:
    """Environment for a worker process: fixed malloc settings and thread count."""
    env = dict(os.environ)
    env.update(MALLOC_ENV)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    return env


def _read_status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _ru_maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _current_rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes() -> float:
    """The process's peak resident set since it started (or since a :class:`MemoryProbe` reset
    it): ``VmHWM``, else ``ru_maxrss``."""
    kib = _read_status_kib("VmHWM")
    return kib * 1024.0 if kib is not None else float(_ru_maxrss_bytes())


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryProbe:
    """Peak memory of one region above the memory live when :meth:`start` is called.

    ``device`` is a ``torch.device`` (``cuda``: allocator statistics) or anything else (process
    RSS). Use it once per process for CPU figures: see the module docstring.
    """

    def __init__(self, device: Any = "cpu"):
        self.cuda = getattr(device, "type", str(device)).startswith("cuda")
        self.method = ""
        self._base = 0
        self.baseline_slack = 0  # how much of a peak the baseline could hide (0 when reset)

    def start(self) -> None:
        if self.cuda:
            import torch
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            self.method = "cuda.max_memory_allocated"
            return
        current = _current_rss_bytes()
        if current is not None and _reset_peak_rss() and _read_status_kib("VmHWM") is not None:
            self.method = "VmHWM (reset via clear_refs)"
            self._base = _current_rss_bytes()
            self.baseline_slack = max(0, _read_status_kib("VmHWM") * 1024 - self._base)
        else:
            # High-water mark cannot be reset: the baseline is the peak so far, and a run whose
            # peak stays under it reads as 0 (reported as slack).
            self.method = "ru_maxrss"
            peak = _ru_maxrss_bytes()
            self._base = current if current is not None else peak
            self.baseline_slack = max(0, peak - self._base)

    def peak_above_baseline(self) -> int:
        """Bytes: peak during the region minus the baseline."""
        if self.cuda:
            import torch
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self._base
        if self.method.startswith("VmHWM"):
            return _read_status_kib("VmHWM") * 1024 - self._base
        return _ru_maxrss_bytes() - self._base


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def budget_spent(spent: float, budget: float) -> bool:
    """Whether timing rounds stop: ``spent >= budget`` seconds, on the slowest rank when this
    process is a rank of a ``torch.distributed`` world of several (one MAX all-reduce: every rank
    must take the same decision, else one waits for ever in the next round's first collective
    for a rank that stopped)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        import torch
        total = torch.tensor([float(spent)], dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        spent = float(total)
    return spent >= budget


def run_worker(script: str, spec: Dict[str, Any], threads: int, timeout: float) -> Dict[str, Any]:
    """Run ``python script --worker JSON`` in a fresh process and return the JSON dict it prints
    as its last stdout line; on failure (crash, OOM kill, timeout) ``{"error": ...}``."""
    cmd = [sys.executable, script, "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, env=worker_env(threads), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or "").strip().splitlines()[-5:]
        return {"error": f"exit code {proc.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


def add_process_arguments(parser: Any, timeout_help: str = "seconds per case") -> None:
    """The arguments of a tool whose cases run each in a fresh process (:func:`run_worker`):
    ``--timeout``, ``--same-process`` (:func:`run_in_this_process`) and the hidden
    ``--worker SPEC`` the tool re-invokes itself with (:func:`answer_worker`)."""
    import argparse

    parser.add_argument("--timeout", type=float, default=1800.0, help=timeout_help)
    parser.add_argument("--same-process", action="store_true",
                        help="run every case in this process, not a fresh process each (a "
                             "smoke run, for tests: the memory figures then include what "
                             "earlier cases left allocated, and the allocator settings of the "
                             "workers do not apply)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)


def answer_worker(args: Any, worker: Callable[[Dict[str, Any]], Dict[str, Any]]) -> bool:
    """In a ``--worker SPEC`` process (:func:`add_process_arguments`): ``worker(SPEC)``'s result
    printed as the JSON line :func:`run_worker` reads; returns whether this was one."""
    if not args.worker:
        return False
    print(json.dumps(worker(json.loads(args.worker))))
    return True


def run_in_this_process(worker: Callable[[Dict[str, Any]], Dict[str, Any]],
                        spec: Dict[str, Any]) -> Dict[str, Any]:
    """``worker(spec)`` in this process (a tool's ``--same-process``, for tests: no interpreter
    start-up), its result as :func:`run_worker` would give it (through JSON), an exception as
    ``{"error": ...}``, torch's thread count put back after it."""
    import torch

    threads = torch.get_num_threads()
    try:
        return json.loads(json.dumps(worker(spec)))
    except Exception as e:  # noqa: BLE001 - reported in the row, as run_worker does
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        torch.set_num_threads(threads)


def require_positive(parser: Any, args: Any, names: Sequence[str]) -> None:
    """``parser.error`` for the first of the integer options ``names`` (attribute names of
    ``args``, e.g. ``"chunk_size"`` for ``--chunk-size``) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")


def vocab_shard(full: Any, tp: int, rank: int) -> Any:
    """Rank ``rank``'s ``[ceil(V / tp), H]`` rows of the lm_head ``full [V, H]`` split over ``tp``
    ranks as megaloss's vocab-parallel losses take it: rows ``[rank * Vp, (rank + 1) * Vp)``,
    ``Vp = ceil(V / tp)``, zero past ``V`` (a new tensor, no grad)."""
    import torch
    vocab, rows = full.shape[0], math.ceil(full.shape[0] / tp)
    start = min(rank * rows, vocab)
    stop = min(start + rows, vocab)
    out = torch.zeros(rows, full.shape[1], dtype=full.dtype)
    out[:stop - start] = full[start:stop]
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def format_table(rows: Iterable[Dict[str, Any]], columns: Sequence[str]) -> str:
    """Fixed-width text table of ``rows`` (dicts) restricted to ``columns``."""
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def finish(errors: Sequence[str], csv_path: Optional[str], rows: Sequence[Dict[str, Any]],
           columns: Sequence[str]) -> int:
    """A tool's end: each of ``errors`` on stderr, the CSV of ``rows`` when ``csv_path`` is
    given; the exit status (1 when a row failed)."""
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    if csv_path:
        write_csv(csv_path, rows, columns)
    return 0 if not errors else 1


def write_csv(path: str, rows: Iterable[Dict[str, Any]], columns: Sequence[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow(r)
