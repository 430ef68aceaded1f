"""A launched job's process, start to end: :func:`start_process` / :func:`start_trainer_process`
(quiet DeepSpeed, threads, DeepSpeed's comm, the rank's device), :func:`run_job` (a job's
``__main__``: exit status, its error printed once, :func:`report_error`) and
:func:`end_process` (process groups destroyed) on every exit path.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Tuple

import torch

from .agreement import AgreedExit
from .peers import leave, peer_failure, record_peers
from .quiet_logs import quiet_accelerate_logger

__all__ = ["start_process", "start_trainer_process", "run_job", "end_process",
           "report_error"]

def start_process(local_rank: int) -> Tuple[int, int]:
    """Process start-up of a job under the ``deepspeed`` launcher (or plain ``python``: then one
    process): quiet DeepSpeed, threads per process on CPU, no JIT build
    (``configure_launched_process``), DeepSpeed's comm, and this rank's device before the first
    object collective (NCCL needs it; a no-op on CPU).

    Returns:
        ``(rank, world_size)``.
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    from megaloss.integrations.deepspeed import configure_launched_process, freeze_imported_objects
    from megaloss.testing import free_port

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
    rank, world = start_process(local_rank)
    quiet_accelerate_logger()
    if not torch.cuda.is_available():
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    if report_to != "none":
        os.environ.setdefault("WANDB_DIR", str(out_dir.resolve()))  # <output_dir>/wandb
        os.environ.setdefault("WANDB_PROJECT", "megaloss")
        from megaloss.integrations.deepspeed import keep_wandb_cache_in_run_dir

        keep_wandb_cache_in_run_dir()  # wandb-core's debug log too
    return rank, world


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


def report_error(message: str, show: bool = True) -> None:
    """Print a rank's error on its own line (``show``) and leave it in
    ``$MEGALOSS_ERROR_FILE.rank<r>`` (set by ``launch/multinode.sh``, which shows it again after
    the launcher's closing lines)."""
    if show:
        print(message, file=sys.stderr, flush=True)
    base = os.environ.get("MEGALOSS_ERROR_FILE")
    if base:
        try:
            Path(f"{base}.rank{int(os.environ.get('RANK', 0)):05d}").write_text(
                message + "\n", encoding="utf-8")
        except OSError:
            pass


def run_job(main: Callable[[], Any]) -> None:
    """A job's ``if __name__ == "__main__":``: ``main()``, then :func:`end_process` whatever
    happened, and the exit status:

    - 0 after a finished run (also one stopped by a signal, which saved);
    - 1 after a job's own error (a ``SystemExit`` message, printed once, on its own line, by the
      rank that found it; the ranks told of it by :func:`agreed` exit 1 silently);
    - 1 after an exception (its traceback, printed by the rank that raised it; when a peer rank
      is gone, a last line naming it, the cause of a failed collective: a rank on this node whose
      process is gone, found at once from its pid; in a world over several nodes, else, a rank
      whose heartbeat in the rendezvous store stopped, with its node and host, or global rank 0
      when that store, which lives in its process, does not answer; :mod:`launch.jobs.peers`).
      Finding a peer on another node costs at most ``peers.SILENCE_SECONDS`` (3 s) before the
      exit (about one ``peers.HEARTBEAT_SECONDS`` when every peer is alive), and global rank 0
      keeps the store up at most 5 s more (on every exit), until the other ranks have left;
    - 130 after an abort (``KeyboardInterrupt``: SIGINT while the stop's checkpoint was saved).
    """
    import traceback

    code: Any = 0
    try:
        main()
    except AgreedExit:
        code = 1
    except SystemExit as e:
        code = e.code
        if code is not None and not isinstance(code, int):
            report_error(str(code))
            code = 1
    except KeyboardInterrupt:
        print("[megaloss] aborted (SIGINT)", file=sys.stderr, flush=True)
        code = 130
    except BaseException as e:  # noqa: BLE001 - reported, then the status says it failed
        traceback.print_exc()  # its last line is the cause, unless a peer died
        rank = int(os.environ.get("RANK", 0))
        gone = peer_failure(rank)
        if gone:  # the collective failed because a peer died: that is the cause
            first = (str(e).splitlines() or [""])[0]
            report_error(f"{gone}; this rank stopped with {type(e).__name__}: {first}")
        else:
            report_error(f"{type(e).__name__}: {e}", show=False)
        code = 1
    finally:
        # whatever the exit: the other nodes must not name this rank dead once it has left, and
        # global rank 0 keeps the rendezvous store up until they have marked it
        leave(int(os.environ.get("RANK", 0)))
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
