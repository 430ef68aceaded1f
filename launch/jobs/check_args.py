"""``python -m launch.jobs.check_args JOB ARGS...``: a job's command line and inputs checked once,
before the ``deepspeed`` launcher starts any rank (``launch/multinode.sh`` runs it). ``JOB`` is the
job's script (``launch/train_lm.py``) or name (``train_lm``); its ``parse_args`` runs on ``ARGS``
(an option that does not parse: the usage and the message; a bad value such as ``--steps 0``: the
message alone), then :func:`launch.jobs.preflight.preflight` checks the data, the ds_config against
the world size and ``--output_dir``. Each problem is one line, ``<job>: error: ...``, under the
name in ``MEGALOSS_PROG`` (the shell script's, e.g. ``train_lm.sh``), with exit status 2.
``MEGALOSS_WORLD_SIZE`` is the number of processes the launcher will start (unset: not checked).
``--help`` prints the job's help (status 0)."""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from .preflight import EMBEDDING_JOBS, LM_JOBS, Refusal, preflight

JOBS = LM_JOBS + EMBEDDING_JOBS  # the data checks of each kind are the pre-flight's


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or Path(argv[0]).stem not in JOBS:
        raise SystemExit(f"usage: python -m launch.jobs.check_args {{{','.join(JOBS)}}} ARGS...")
    name = Path(argv[0]).stem
    job = importlib.import_module(f"launch.{name}")
    args = job.parse_args(argv[1:])  # exit status 2 on a bad option (launch.jobs.arguments)
    world = os.environ.get("MEGALOSS_WORLD_SIZE")
    try:
        preflight(name, args, int(world) if world else None,
                  run_folder_refusal=getattr(job, "run_folder_refusal", None))
    except Refusal as e:
        prog = os.environ.get("MEGALOSS_PROG") or f"{name}.py"
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
