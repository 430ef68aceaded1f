"""``python -m launch.jobs.check_args JOB ARGS...``: a job's command line checked once, before the
``deepspeed`` launcher starts any rank (``launch/multinode.sh`` runs it). ``JOB`` is the job's
script (``launch/train_lm.py``) or name (``train_lm``); its ``parse_args`` runs on ``ARGS``: a bad
option (``--steps -5``), a missing data source or an unreadable ``--deepspeed_config`` is then
reported once, with exit status 2, instead of by every rank after the launch. ``--help`` prints
the job's help (status 0)."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Optional, Sequence

JOBS = ("train_lm", "train_embed", "train_lm_hf", "train_embed_hf", "distill_lm", "train_grpo")


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or Path(argv[0]).stem not in JOBS:
        raise SystemExit(f"usage: python -m launch.jobs.check_args {{{','.join(JOBS)}}} ARGS...")
    job = importlib.import_module(f"launch.{Path(argv[0]).stem}")
    job.parse_args(argv[1:])  # argparse's p.error: usage and message, exit status 2


if __name__ == "__main__":
    main()
