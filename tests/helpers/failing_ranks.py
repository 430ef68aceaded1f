"""A launched job that fails on purpose, the script ``deepspeed --num_gpus N`` runs in
``tests/launch/test_run_errors.py``: :func:`launch.jobs.processes.run_job` as its ``__main__``,
``MEGALOSS_FAILURE`` saying how. No model, no data: only the start-up and the failure.

- ``layout``: every rank builds a TP=2 topology on a world size 2 does not divide (megaloss's own
  check, ``Topology.build``'s ``ValueError``). Rank 0 builds it only once every other rank's
  process is gone (it ignores the launcher's SIGTERM meanwhile): the order in which it used to
  call them dead.
- ``peer_check``: rank 1 fails a check of megaloss (a misspelled key of the ds_config's
  ``"megaloss"`` section) while rank 0 waits for it in a barrier (ignoring the launcher's
  SIGTERM, so it reaches its report).

Not a test module (no ``test_`` prefix). Options: ``--output_dir`` (where a failing rank keeps its
traceback) and the launcher's ``--local_rank``.
"""
import argparse
import os
import signal
import time

from launch.jobs.processes import run_job, start_process


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--output_dir", required=True)
    args = p.parse_args()
    rank, world = start_process(args.local_rank, args.output_dir)
    how = os.environ["MEGALOSS_FAILURE"]
    if rank == 0:  # the launcher's SIGTERM, once a peer exited: rank 0 must reach its report
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if how == "layout":
        from launch.jobs.peers import dead_peers
        from megaloss import Topology

        deadline = time.monotonic() + 60
        while rank == 0 and len(dead_peers()) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        Topology.build(2)
    elif how == "peer_check":
        import torch.distributed as dist

        from megaloss.integrations.deepspeed import load_megaloss_config

        if rank == 1:
            load_megaloss_config({"megaloss": {"tensor_paralel_size": 2}})
        dist.barrier()
    else:
        raise SystemExit(f"MEGALOSS_FAILURE={how}: not a failure this script knows")


if __name__ == "__main__":
    run_job(main)
