"""The FSDP2 job's checkpoints (``launch/train_lm_fsdp.py``): ``torch.distributed.checkpoint``
(DCP) folders of the sharded model and optimizer state (``get_state_dict`` / ``set_state_dict``
of ``torch.distributed.checkpoint.state_dict``), with the job's record and the tokenizer beside
them: :class:`FSDPCheckpoints`, the ``save`` / ``load`` the runner (:mod:`launch.jobs.runner`)
calls.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, List

import torch

from .checkpoints import LM_DATA_OPTIONS

__all__ = ["JOB_RECORD", "DCP_FOLDER", "FSDPCheckpoints"]

# The job's record in a checkpoint folder, next to DCP's files. The name ends in
# ``model_states.pt``: megaloss.integrations.deepspeed.checkpoint.resolve_checkpoint recognises a
# checkpoint folder by such a file (``--resume PATH`` of one folder), and check_checkpoint_files
# verifies every ``*.pt`` archive before a resume.
JOB_RECORD = "job_model_states.pt"
DCP_FOLDER = "dcp"


class FSDPCheckpoints:
    """The checkpoints of ``wrapper`` (the ``fully_shard``-ed model) and ``opt``, with
    ``tokenizer`` beside each; a resume refuses a checkpoint of another ``data_key``."""

    def __init__(self, wrapper: torch.nn.Module, opt: torch.optim.Optimizer, tokenizer: Any,
                 data_key: str) -> None:
        self.wrapper, self.opt, self.tokenizer, self.data_key = wrapper, opt, tokenizer, data_key

    def save(self, ckpt_dir: Path, step: int, job: dict, keep: int, saves: List[dict],
             log: Callable[[str], Any]) -> Path:
        """One DCP checkpoint (collective): ``<ckpt_dir>/step_<k>/dcp`` holds the sharded model
        and optimizer state (each rank writes its shards), rank 0 writes the job's record, the
        tokenizer and then ``<ckpt_dir>/latest`` (so ``latest`` names only complete saves), and
        prunes to the ``keep`` newest."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from megaloss.integrations.deepspeed.checkpoint import (
            checkpoint_bytes,
            prune_checkpoints,
        )

        from .text_data import atomic_write

        t0 = time.perf_counter()
        folder = ckpt_dir / f"step_{step}"
        model_sd, optim_sd = get_state_dict(self.wrapper, self.opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / DCP_FOLDER))
        if dist.get_rank() == 0:
            import io

            buf = io.BytesIO()
            torch.save({"job": job}, buf)
            atomic_write(folder / JOB_RECORD, buf.getvalue())
            atomic_write(folder / "tokenizer.json", self.tokenizer.to_str())
            atomic_write(ckpt_dir / "latest", folder.name)
            prune_checkpoints(ckpt_dir, keep)
        dist.barrier()
        seconds = time.perf_counter() - t0
        saves.append({"step": step, "seconds": seconds,
                      "mib": checkpoint_bytes(folder) / 2**20, "path": str(folder)})
        log(f"saved {folder} ({saves[-1]['mib']:.1f} MiB) in {seconds:.2f} s")
        return folder

    def load(self, resume_from: str, job_state: dict, log: Callable[[str], Any]) -> str:
        """Load the checkpoint ``resume_from`` (a checkpoints folder: its ``latest``; or one
        checkpoint folder) into the sharded model and optimizer, and the job's record into
        ``job_state``. Collective.

        Raises:
            SystemExit: a damaged checkpoint file; a checkpoint of other data or tokenizer.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from megaloss.integrations.deepspeed.checkpoint import (
            check_checkpoint_files,
            resolve_checkpoint,
        )

        from .agreement import agreed

        load_dir, tag = resolve_checkpoint(resume_from)
        folder = load_dir / tag

        def check():
            try:
                check_checkpoint_files(folder)
            except ValueError as e:
                raise SystemExit(f"--resume {resume_from}: {e}") from None
            if not (folder / DCP_FOLDER / ".metadata").is_file():
                raise SystemExit(f"--resume {resume_from}: {folder} holds no DCP checkpoint "
                                 f"({folder / DCP_FOLDER / '.metadata'} is missing): not a "
                                 "checkpoint of train_lm_fsdp")

        agreed(check, what=f"--resume {resume_from}")
        t0 = time.perf_counter()
        saved = torch.load(folder / JOB_RECORD, weights_only=False)["job"]
        if saved.get("data_key") != self.data_key:
            raise SystemExit(f"checkpoint {folder} was trained on other data or another "
                             f"tokenizer (data_key {saved.get('data_key')}; these options give "
                             f"{self.data_key}): pass the same {LM_DATA_OPTIONS}")
        model_sd, optim_sd = get_state_dict(self.wrapper, self.opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(folder / DCP_FOLDER))
        set_state_dict(self.wrapper, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        job_state.update({k: saved[k] for k in job_state if k in saved})
        log(f"resumed from {folder} at step {job_state['steps_done']} in "
            f"{time.perf_counter() - t0:.2f} s")
        return str(folder)
