"""Shared by the end-to-end launcher tests (``tests/launch/test_train_*.py``): run a script under
``deepspeed --num_gpus N`` on CPU and read what DeepSpeed's ``csv_monitor`` wrote.

Not a test module (no ``test_`` prefix); ``tests/helpers`` is on ``sys.path`` (conftest.py).
"""
import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

from megaloss.testing import free_port

REPO = Path(__file__).resolve().parents[2]


def run_deepspeed_launcher(script: Path, args: Sequence[str], *, timeout: float,
                           num_gpus: int = 2, tail: int = 4000) -> subprocess.CompletedProcess:
    """Run ``deepspeed --num_gpus {num_gpus} script *args`` from the repo root, one thread per
    process, and assert it exits with status 0 (the message shows the last ``tail`` characters
    of stdout and stderr).

    Returns:
        the completed process (``stdout``/``stderr`` as text).
    """
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_gpus),
           "--master_port", str(free_port()), str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-tail:] + proc.stderr[-tail:]
    return proc


def monitor_column(path: Path) -> List[float]:
    """The values of a ``csv_monitor`` file (``<output_path>/<job>/<tag, / -> _>.csv``: a header,
    then ``step,value`` rows)."""
    with open(path) as f:
        return [float(r[1]) for r in list(csv.reader(f))[1:]]
