"""Process start-up for DeepSpeed: what every engine builder (the probe, :func:`initialize`)
and every launched job needs before DeepSpeed's comm starts, and keeping DeepSpeed's explicit
garbage collections cheap (:func:`freeze_imported_objects`). ``deepspeed`` is imported inside the
functions, so importing this module is cheap and does not need DeepSpeed installed.
"""
from __future__ import annotations

import logging
import os

import torch

from ...calibration.deepspeed_scale import skip_cpu_shm_comm_build

__all__ = ["skip_cpu_shm_comm_build", "configure_launched_process", "freeze_imported_objects"]


def configure_launched_process(log_level: int = logging.WARNING) -> None:
    """Per-process start-up of a job run by the ``deepspeed`` launcher, before
    ``deepspeed.init_distributed``.

    - DeepSpeed's logger at ``log_level`` (its INFO lines drown the job's own log).
    - On CPU, unless ``OMP_NUM_THREADS`` is set: torch threads = cores / processes on this node
      (``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``). The launcher starts one process per "GPU";
      on CPU each would otherwise use every core and they fight over them (measured: ~20x slower
      steps on 2 cores).
    - :func:`skip_cpu_shm_comm_build` (no JIT build of DeepSpeed's optional CPU all-reduce op).
    """
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(log_level)
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    skip_cpu_shm_comm_build()


def freeze_imported_objects() -> None:
    """Collect garbage once, then exempt every object alive now (the imported modules'
    functions, classes and caches, a built model) from Python's cyclic garbage collector
    (:func:`gc.freeze`). Call it after the imports, before building engines.

    Why: DeepSpeed calls ``gc.collect()`` while it builds an engine (ZeRO-3's ``defragment`` in
    ``deepspeed/runtime/zero/utils.py``, once per parameter group) and at other points; a full
    collection scans every tracked object, ~470k after importing torch, deepspeed and a
    transformers model (measured 0.3 s of CPU each on this project's 2-core CI machine). Frozen
    objects are skipped, so those collections, and the automatic ones, only scan what was created
    since. The collection first means no garbage is frozen; what is frozen stays in memory, as
    imported modules do anyway. The first call scans everything once; a later call scans only
    the objects created since the previous one. Thread-safe; no effect on correctness.
    """
    import gc

    gc.collect()
    gc.freeze()
