"""What the jobs silence: :func:`quiet_job_environment` (no tokenizers threads, no Hub access
or download bars, no per-call FutureWarning) and the DeepSpeed / accelerate warnings that
say nothing about a run (:data:`DEEPSPEED_NOISE`, :data:`ACCELERATE_NOISE`, dropped by
:class:`DropMessages`).
"""
from __future__ import annotations

import os
from typing import Any, Sequence

__all__ = ["quiet_job_environment", "DEEPSPEED_NOISE", "ACCELERATE_NOISE", "DropMessages",
           "quiet_deepspeed_logger", "quiet_accelerate_logger"]

def quiet_job_environment() -> None:
    """What every job sets before its libraries start: no tokenizers thread pool (the jobs are
    launched as several processes), no Hub access or download bars (the models are built here),
    and no per-call FutureWarning of torch 2.13's deprecated ``all_gather_into_tensor`` (DeepSpeed's
    ZeRO and megaloss's gathers call it every step). Settings already in the environment win."""
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*",
                            category=FutureWarning)
    quiet_deepspeed_logger()


# DeepSpeed warnings that every run of these jobs prints and that say nothing about it: the CPU
# accelerator chosen when there is no GPU (the jobs run there by design); ZeRO around torch's
# AdamW, which the configs allow on purpose ("zero_allow_untested_optimizer"); the LR of a
# warm-up schedule read before its first step (the engine's start-up, not the job).
DEEPSPEED_NOISE = ("Setting accelerator to CPU",
                   "You are using ZeRO with an untested optimizer",
                   "get learning rate from scheduler before it has started")


class DropMessages:
    """A ``logging`` filter dropping the records whose message contains one of ``parts``."""

    def __init__(self, parts: Sequence[str]) -> None:
        self.parts = tuple(parts)

    def filter(self, record: Any) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


def quiet_deepspeed_logger() -> None:
    """Drop :data:`DEEPSPEED_NOISE` from DeepSpeed's logger ("DeepSpeed"). Set before DeepSpeed is
    imported (the accelerator warning comes with the import): DeepSpeed's logger is then this
    one, filter included. Idempotent."""
    import logging

    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, DropMessages) for f in logger.filters):
        logger.addFilter(DropMessages(DEEPSPEED_NOISE))


# accelerate's "Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1,
# DeepSpeed config has N. Using DeepSpeed's value." in every Trainer job with GAS > 1: the
# Trainer sets accelerate's own accumulation to 1 on purpose (transformers' trainer.py
# create_accelerator_and_postprocess: it accumulates itself) and DeepSpeed's engine takes the
# ds_config's value, which is what the jobs ask for (the MegalossTrainer measures the engine's
# scaling at its first micro-batch).
ACCELERATE_NOISE = ("Gradient accumulation steps mismatch: GradientAccumulationPlugin has 1,",)


def quiet_accelerate_logger() -> None:
    """Drop :data:`ACCELERATE_NOISE` from accelerate's logger. Idempotent."""
    import logging

    logger = logging.getLogger("accelerate.accelerator")
    if not any(isinstance(f, DropMessages) for f in logger.filters):
        logger.addFilter(DropMessages(ACCELERATE_NOISE))
