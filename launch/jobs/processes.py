"""A launched job's process, start to end: :func:`start_process` / :func:`start_trainer_process`
(quiet DeepSpeed, threads, DeepSpeed's comm, the rank's device), :func:`start_torchrun_process`
(a job without DeepSpeed, under ``torchrun``), :func:`run_job` (a job's
``__main__``: exit status, its error reported once and blamed on the rank that found it,
:func:`report_error`) and :func:`end_process` (process groups destroyed) on every exit path.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import torch

from .agreement import AgreedExit
from .peers import leave, left_on_error, mark_left, peer_failure, record_peers
from .quiet_logs import quiet_accelerate_logger

__all__ = ["start_process", "start_trainer_process", "start_torchrun_process", "run_job",
           "end_process", "report_error", "keep_tracebacks_in", "is_input_check"]

_RUN_DIR: List[Path] = []  # where a failing rank keeps its traceback (keep_tracebacks_in)


def keep_tracebacks_in(output_dir: Optional[os.PathLike]) -> None:
    """Where :func:`run_job` writes a failing rank's traceback: ``<output_dir>/error_rank<r>.log``
    (None: ``$TMPDIR``). Set by :func:`start_process`, as soon as a job knows its folder."""
    _RUN_DIR[:] = [] if output_dir is None else [Path(output_dir)]


def start_process(local_rank: int, output_dir: Optional[os.PathLike] = None) -> Tuple[int, int]:
    """Process start-up of a job under the ``deepspeed`` launcher (or plain ``python``: then one
    process): quiet DeepSpeed, threads per process on CPU, no JIT build
    (``configure_launched_process``), DeepSpeed's comm, and this rank's device before the first
    object collective (NCCL needs it; a no-op on CPU). ``output_dir``: the job's run folder,
    where a failing rank leaves its traceback (:func:`keep_tracebacks_in`).

    Returns:
        ``(rank, world_size)``.
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from megaloss.integrations.deepspeed.compat import (
        configure_launched_process,
        freeze_imported_objects,
    )
    from megaloss.testing import free_port

    keep_tracebacks_in(output_dir)
    configure_launched_process()
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        # plain `python -m launch.<job>`: one process (DeepSpeed would look for MPI)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    deepspeed.init_distributed()
    get_accelerator().set_device(local_rank)
    if dist.get_world_size() > 1:
        record_peers(dist)  # which peer died, should a collective fail (run_job)
    freeze_imported_objects()  # the job's module-level imports are done (cheaper gc.collect)
    return dist.get_rank(), dist.get_world_size()


def start_trainer_process(local_rank: int, report_to: str, out_dir: Path) -> Tuple[int, int]:
    """:func:`start_process` for a job that hands its loop to a Hugging Face trainer: also keeps
    the thread count from accelerate (which resets torch's threads when ``OMP_NUM_THREADS`` is
    unset) and points W&B at ``<out_dir>/wandb`` when ``report_to`` is not ``"none"``. DeepSpeed's
    comm starts before any model is built (under ZeRO-3 the trainers load models through
    ``zero.Init``).

    Returns:
        ``(rank, world_size)``.
    """
    rank, world = start_process(local_rank, out_dir)
    quiet_accelerate_logger()
    if not torch.cuda.is_available():
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    if report_to != "none":
        os.environ.setdefault("WANDB_DIR", str(out_dir.resolve()))  # <output_dir>/wandb
        os.environ.setdefault("WANDB_PROJECT", "megaloss")
        from megaloss.integrations.deepspeed.engine import keep_wandb_cache_in_run_dir

        keep_wandb_cache_in_run_dir()  # wandb-core's debug log too
    return rank, world


def start_torchrun_process(output_dir: Optional[os.PathLike] = None
                           ) -> Tuple[int, int, torch.device]:
    """torch.distributed from torchrun's environment (gloo on CPU, NCCL on CUDA; one process
    without it), the rank's device, threads per process on CPU. ``output_dir``: as
    :func:`start_process`'s. Returns ``(rank, world, device)``."""
    import torch.distributed as dist

    from megaloss.testing import free_port

    keep_tracebacks_in(output_dir)
    if "RANK" not in os.environ:  # plain `python -m launch.<job>`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        if "OMP_NUM_THREADS" not in os.environ:
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ["WORLD_SIZE"])
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    dist.init_process_group(backend)
    if dist.get_world_size() > 1:
        record_peers(dist)  # which peer died, should a collective fail (run_job)
    return dist.get_rank(), dist.get_world_size(), device


def end_process() -> bool:
    """The last thing a launched job does, on every exit path (:func:`run_job`): flush the
    output and destroy ``torch.distributed``'s process groups. Left alive, their communication
    threads are torn down with the interpreter, in no set order; a C++ thread still joinable then
    ends the process in ``std::terminate`` ("terminate called without an active exception",
    SIGABRT: the rank exits -6 and the launcher 250) even after a finished run or a clean
    refusal. Returns whether there were process groups."""
    import torch.distributed as dist

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer already gone: the process is ending anyway
            pass
        return True
    return False


def report_error(message: str, show: Optional[bool] = None) -> None:
    """Leave a rank's error in ``$MEGALOSS_ERROR_FILE.rank<r>`` (set by ``launch/multinode.sh``,
    which prints the lowest rank's as its last line, after the launcher's closing lines) and
    print it on its own line when ``show`` (default: only when no script will print it, i.e.
    ``MEGALOSS_ERROR_FILE`` is unset: a plain ``deepspeed`` or ``python`` launch)."""
    base = os.environ.get("MEGALOSS_ERROR_FILE")
    if show if show is not None else not base:
        print(message, file=sys.stderr, flush=True)
    if base:
        try:
            Path(f"{base}.rank{int(os.environ.get('RANK', 0)):05d}").write_text(
                message + "\n", encoding="utf-8")
        except OSError:
            pass


def _sources() -> Tuple[Path, ...]:
    import megaloss

    return (Path(megaloss.__file__).resolve().parent, Path(__file__).resolve().parents[1])


def is_input_check(e: BaseException) -> bool:
    """Whether ``e`` is one of megaloss's or the jobs' own checks of their input (a bad value, a
    ds_config section, a layout that does not fit the world size): a ``ValueError`` /
    ``TypeError`` raised by a ``raise`` statement in the ``megaloss`` package or in ``launch/``.
    Its message is the whole story; anything else (raised inside torch, DeepSpeed, or by Python
    itself in megaloss's code, such as ``len(None)``) is a bug, whose traceback is the story."""
    import linecache
    import traceback

    if not isinstance(e, (ValueError, TypeError)) or e.__traceback__ is None:
        return False
    last = traceback.extract_tb(e.__traceback__)[-1]
    path = Path(last.filename).resolve()
    if not any(root in path.parents for root in _sources()):
        return False
    return linecache.getline(last.filename, last.lineno or 0).lstrip().startswith("raise")


def _keep_traceback(e: BaseException, rank: int) -> Optional[Path]:
    """Write ``e``'s traceback, with the time and the command line, to
    ``<output_dir>/error_rank<r>.log`` (else a file in ``$TMPDIR``). Returns its path, None
    when neither can be written."""
    import tempfile
    import time
    import traceback

    text = (f"{time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank} (pid {os.getpid()}): "
            f"{' '.join(sys.argv)}\n" + "".join(traceback.format_exception(e)))
    places = [d / f"error_rank{rank}.log" for d in _RUN_DIR]
    places.append(Path(tempfile.gettempdir()) / f"megaloss-error-rank{rank}-{os.getpid()}.log")
    for path in places:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            return path
        except OSError:
            continue
    return None


def _report_exception(e: BaseException, rank: int) -> None:
    """What a rank that raised ``e`` says (:func:`run_job`), by cause:

    - one of megaloss's or the jobs' own input checks (:func:`is_input_check`): its message, one
      line, the traceback only in the log file it names; the peers are not looked at (the rank
      left on its own error, whatever they did meanwhile);
    - a peer is gone without having said so (killed, crashed: :func:`peer_failure`, the peers
      that marked leaving on an error excluded): a line naming it, this rank's traceback (the
      failed collective's) only in the log file. Looked for first: every surviving rank of a
      failed collective marks itself as leaving (:func:`run_job`), so with three ranks or more
      the survivors of a killed peer find each other's marks;
    - else a peer left first on an error of its own (:func:`launch.jobs.peers.left_on_error`:
      this rank's collective failed because of it): nothing, that peer's message is the cause;
    - else a bug: the traceback on the terminal and in the log file.
    """
    import traceback

    log = _keep_traceback(e, rank)
    where = f" (traceback in {log})" if log else ""
    if is_input_check(e):
        if log is None:
            traceback.print_exc()
        report_error(f"{type(e).__name__}: {e}{where}")
        return
    left = left_on_error(rank)
    gone = peer_failure(rank, exclude=left)
    if gone:  # the collective failed because a peer died: that is the cause
        if log is None:
            traceback.print_exc()
        first = (str(e).splitlines() or [""])[0]
        report_error(f"{gone}; this rank stopped with {type(e).__name__}: {first}{where}")
        return
    if left:
        return
    traceback.print_exc()
    report_error(f"{type(e).__name__}: {e}{where}", show=False)  # the traceback's last line


def run_job(main: Callable[[], Any]) -> None:
    """A job's ``if __name__ == "__main__":``: ``main()``, then :func:`end_process` whatever
    happened, and the exit status:

    - 0 after a finished run (also one stopped by a signal, which saved);
    - 1 after a job's own error: a ``SystemExit`` message, or a ``ValueError`` / ``TypeError``
      of megaloss's or the jobs' own input checks (:func:`is_input_check`; its traceback goes to
      ``<output_dir>/error_rank<r>.log``, which the message names). One line, reported by the
      rank that found it (:func:`report_error`: under ``launch/train_*.sh`` the script prints
      the lowest rank's as its last line, the ranks print nothing; the ranks told of it by
      :func:`agreed` exit 1 silently);
    - 1 after another exception (:func:`_report_exception`): silently when a peer left first on
      an error of its own (every rank leaving with an error marks it first,
      :func:`launch.jobs.peers.mark_left`, before its process groups close, so its peers'
      failed collectives never take it for dead); when a peer rank is gone without that mark,
      a line naming it, the cause of a failed collective: a rank on this node whose process is
      gone, found at once from its pid; in a world over several nodes, else, a rank whose
      heartbeat in the rendezvous store stopped, with its node and host, or global rank 0
      when that store, which lives in its process, does not answer (:mod:`launch.jobs.peers`);
      else its traceback (a bug). Finding a peer on another node costs at most
      ``peers.SILENCE_SECONDS`` (3 s) before the exit (about one ``peers.HEARTBEAT_SECONDS``
      when every peer is alive), and global rank 0 keeps the store up at most 5 s more (on
      every exit), until the other ranks have left;
    - 130 after an abort (``KeyboardInterrupt``: SIGINT while the stop's checkpoint was saved).
    """
    code: Any = 0
    rank = int(os.environ.get("RANK", 0))
    try:
        main()
    except AgreedExit:
        mark_left(rank)
        code = 1
    except SystemExit as e:
        code = e.code
        if code:
            mark_left(rank)
        if code is not None and not isinstance(code, int):
            report_error(str(code))
            code = 1
    except KeyboardInterrupt:
        mark_left(rank)
        print("[megaloss] aborted (SIGINT)", file=sys.stderr, flush=True)
        code = 130
    except BaseException as e:  # noqa: BLE001 - reported, then the status says it failed
        mark_left(rank)  # first: a peer whose collective fails now must not call this rank dead
        _report_exception(e, rank)
        code = 1
    finally:
        # whatever the exit: the other nodes must not name this rank dead once it has left, and
        # global rank 0 keeps the rendezvous store up until they have marked it
        leave(rank)
        distributed = end_process()
    if code and distributed:
        # A failed rank's peers may already have closed their side: a communication thread of
        # this process can then still be joinable at interpreter teardown and end it in
        # std::terminate (-6) instead of its status (seen about once in three full-suite runs
        # of the bad-JSONL test). Everything is flushed: leave without the teardown.
        import logging

        logging.shutdown()
        os._exit(code if isinstance(code, int) else 1)
    sys.exit(code or 0)
