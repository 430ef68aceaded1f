"""A distillation teacher from a checkpoint of the main LM job (``launch/train_lm.py
--save_every N``, or the teacher phase of ``launch/distill_lm.py``): the decoder and the full
lm_head read back from DeepSpeed's per-TP-rank model files into a frozen ``LlamaForCausalLM``
with the whole ``[V, H]`` head, which :class:`megaloss.CausalLMWithDistillation` splits over the
vocabulary for *this* run's TP group exactly like the student's (the same rows,
:func:`megaloss.vocab_shard_range`).

DeepSpeed writes one ``mp_rank_<tp rank>_model_states.pt`` per TP rank (ZeRO-0/1/2: the whole
module of that rank; ``deepspeed/runtime/engine.py``, ``_save_checkpoint``): the decoder is
replicated, the vocab-parallel lm_head holds ``ceil(V / tp)`` rows per rank (the last padded with
zeros). The full ``[V, H]`` head is their concatenation cut to ``V`` rows, so a teacher trained
with one TP size loads under any other. ZeRO-3 checkpoints keep the weights in the optimizer
partitions instead and are refused with the way out.

The teacher the job trains itself is cached in ``--cache_dir`` as the token streams are
(:mod:`launch.jobs.lm_data`): :func:`teacher_cache_folder` keys a copy of its finished phase
folder (outputs and last checkpoint) by everything its training and evaluation read, and a later
run of the same settings copies it back instead of training it again
(:func:`store_cached_teacher`, :func:`restore_cached_teacher`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from .models import build_llama

__all__ = ["load_teacher_state", "build_teacher", "evaluate_teacher", "teacher_cache_folder",
           "store_cached_teacher", "restore_cached_teacher"]

_HEAD = "model.lm_head.weight"
# bump when the teacher phase trains or records differently for the same settings
TEACHER_CACHE_VERSION = 1
# ds_config sections that change what is logged, not the weights or the evaluations
_UNKEYED = ("csv_monitor", "wandb", "tensorboard", "comet", "steps_per_print",
            "wall_clock_breakdown")


def load_teacher_state(path: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any], Path]:
    """The full state dict of a main-job checkpoint and its job record.

    Args:
        path: a folder of checkpoints (its ``latest``) or one checkpoint folder
            (``.../checkpoints/step_150``).

    Returns:
        ``(state dict of the wrapped *ForCausalLM`` (``model.*`` keys, ``lm_head.weight`` the
        full ``[V, H]`` float32 head), ``the job's client state ("job": data_key, seed, steps)``,
        ``checkpoint folder)``.

    Raises:
        SystemExit: no checkpoint at ``path``; a file cut short or damaged; no model files; a
            ZeRO-3 checkpoint; model files of different TP layouts.
    """
    from megaloss.integrations.deepspeed.checkpoint import (
        check_checkpoint_files,
        resolve_checkpoint,
    )

    try:
        load_dir, tag = resolve_checkpoint(path)
        folder = check_checkpoint_files(load_dir / tag)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"--teacher {path}: {e}") from None
    files = sorted(folder.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise SystemExit(f"--teacher {path}: {folder} holds no mp_rank_*_model_states.pt file")
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    layout = states[0].get("megaloss", {}).get("layout", {})
    if layout.get("zero_stage") == 3 or states[0].get("module") is None:
        raise SystemExit(f"--teacher {path}: a ZeRO-3 checkpoint keeps its weights in the "
                         "optimizer partitions; train the teacher with ZeRO-0/1/2 (the default "
                         "configs/zero2.json), or convert it with DeepSpeed's zero_to_fp32.py")
    if len(files) != states[0].get("mp_world_size", len(files)):
        raise SystemExit(f"--teacher {path}: {len(files)} model files in {folder} but the "
                         f"checkpoint was written by TP={states[0].get('mp_world_size')}")
    full = dict(states[0]["module"])
    if _HEAD in full:  # vocab-parallel head: one shard per TP rank
        full[_HEAD] = torch.cat([s["module"][_HEAD] for s in states])
    return full, dict(states[0].get("job") or {}), folder


def build_teacher(path: str, model_args: argparse.Namespace, vocab_size: int, *,
                  data_key: str):
    """The frozen teacher ``LlamaForCausalLM`` of the checkpoint at ``path`` (full lm_head), in
    eval mode.

    Args:
        path: see :func:`load_teacher_state`.
        model_args: the teacher's size (``model_size``, ``hidden_size``, ``num_layers``,
            ``num_heads``, ``seq_len``, ``seed``), as :func:`launch.jobs.models.build_llama`
            reads them: the checkpoint's shapes must match.
        vocab_size: this run's vocabulary ``V``.
        data_key: this run's data / tokenizer cache key: the teacher must have been trained on
            the same tokens (its job record holds its key).

    Returns:
        ``(teacher, its LlamaConfig, {"checkpoint", "steps", "seed"})``.

    Raises:
        SystemExit: see :func:`load_teacher_state`; the teacher was trained on other data or
            another tokenizer; its weights do not fit ``model_args`` (names the first tensor).
    """
    state, job, folder = load_teacher_state(path)
    if job.get("data_key") not in (None, data_key):
        raise SystemExit(f"--teacher {path}: trained on other data or another tokenizer (data "
                         f"key {job.get('data_key')}, these options give {data_key}); pass the "
                         "teacher's --train_data / --eval_data / --eval_fraction / "
                         "--max_train_bytes / --vocab_size")
    head = state.get(_HEAD)
    if head is None or head.shape[0] < vocab_size:
        raise SystemExit(f"--teacher {path}: no lm_head of {vocab_size} rows in {folder}")
    state[_HEAD] = head[:vocab_size]  # drop the last shard's padding rows
    model, cfg = build_llama(model_args, vocab_size)
    prefix = "model."  # CausalLMWithLoss's own attribute in front of the *ForCausalLM's names
    own = model.state_dict()
    weights = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    for name, tensor in own.items():
        if name not in weights or tuple(weights[name].shape) != tuple(tensor.shape):
            got = tuple(weights[name].shape) if name in weights else "missing"
            raise SystemExit(f"--teacher {path}: its weights do not fit --teacher_model_size "
                             f"{model_args.model_size} ({name}: checkpoint {got}, model "
                             f"{tuple(tensor.shape)}); pass the teacher's size")
    model.load_state_dict({k: weights[k] for k in own}, strict=True)
    model.requires_grad_(False)
    model.eval()
    return model, cfg, {"checkpoint": str(folder), "steps": job.get("steps_done"),
                        "seed": job.get("seed")}


@torch.no_grad()
def evaluate_teacher(teacher: torch.nn.Module, batches, topology: Any, device: Any,
                     options: Any) -> Dict[str, float]:
    """Held-out token-mean CE (nats, z-loss excluded) and perplexity of a teacher that has no
    engine, global over ``dp x sp`` as :func:`megaloss.integrations.deepspeed.evaluate`
    computes them (the same batches, one all-reduce; a copy of the teacher in a
    :class:`megaloss.CausalLMWithLoss` of ``options``, vocab-parallel over this run's TP
    group). Collective.

    Returns:
        ``{"loss", "perplexity", "num_tokens"}``.
    """
    import copy
    import math

    from megaloss import CausalLMWithLoss
    from megaloss.parallel.comm import all_reduce_sum_

    scorer = CausalLMWithLoss(copy.deepcopy(teacher), options=options,
                              tp_group=topology.tp_group).to(device).eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for mb in batches:
        out = scorer(mb["input_ids"].to(device), shift_labels=mb["shift_labels"].to(device))
        sums[0] += (out.loss - out.z_loss).to(torch.float64)
        sums[1] += out.num_valid_tokens.to(torch.float64)
    all_reduce_sum_(sums, topology.dp_sp_group)
    n = float(sums[1])
    loss = float(sums[0]) / n if n > 0 else 0.0
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "num_tokens": n}


def teacher_cache_folder(args: argparse.Namespace, ds_config: Dict[str, Any], world_size: int,
                         data_key: str) -> Path:
    """``<cache_dir>/distill-teacher-<key>``: where the teacher phase of these settings is cached.
    The key is a digest of what its weights and evaluations depend on: the data and tokenizer
    (``data_key``), ``teacher_model_size``, ``teacher_steps``, ``seed``, ``seq_len``,
    ``eval_blocks``, ``eval_every``, the number of processes and the ds_config (optimizer,
    scheduler, batch sizes, ZeRO stage, the ``megaloss`` section; its monitors left out)."""
    cfg = {k: v for k, v in ds_config.items() if k not in _UNKEYED}
    settings = {"version": TEACHER_CACHE_VERSION, "data_key": data_key,
                "model_size": args.teacher_model_size, "steps": args.teacher_steps,
                "seed": args.seed, "seq_len": args.seq_len, "eval_blocks": args.eval_blocks,
                "eval_every": args.eval_every, "world_size": world_size, "ds_config": cfg}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    return Path(args.cache_dir) / f"distill-teacher-{key.hexdigest()[:16]}"


def _latest(folder: Path) -> Optional[str]:
    from megaloss.integrations.deepspeed.checkpoint import latest_tag

    return latest_tag(folder / "checkpoints")


def store_cached_teacher(phase_dir: Path, cache: Path) -> Optional[Path]:
    """Copy a finished teacher phase folder into ``cache`` (call on one rank): its outputs and
    its last checkpoint only, written under a temporary name and renamed, so a reader sees all
    of it or nothing. Nothing is done when ``cache`` exists already or the phase has no
    checkpoint; a copy that fails (a full or read-only disk) is removed and the error raised.

    Returns:
        ``cache``, or None when nothing was written.
    """
    last = _latest(phase_dir)
    if cache.exists() or last is None:
        return None
    ckpts = phase_dir / "checkpoints"

    def skip(folder: str, names):
        if Path(folder) == ckpts:  # only the last checkpoint
            return [n for n in names if n.startswith("step_") and n != last]
        return []

    tmp = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(phase_dir, tmp, ignore=skip)
        os.replace(tmp, cache)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cache


def restore_cached_teacher(cache: Path, phase_dir: Path) -> Optional[Dict[str, Any]]:
    """The cached teacher phase at ``cache`` copied to ``phase_dir`` (which must not exist; call
    on one rank), its ``summary.json`` naming its new checkpoint folder (``checkpoints.last``)
    and where it came from (``cached_from``).

    Returns:
        the phase's summary, or None when ``cache`` holds no finished teacher phase.
    """
    path = cache / "summary.json"
    if not path.is_file() or _latest(cache) is None:
        return None
    summary = json.loads(path.read_text(encoding="utf-8"))
    if summary.get("stopped") is not None or summary.get("eval_after") is None:
        return None
    shutil.copytree(cache, phase_dir)
    summary["checkpoints"] = {**(summary.get("checkpoints") or {}),
                              "last": str(phase_dir / "checkpoints" / _latest(cache))}
    summary["cached_from"] = str(cache)
    from .reporting import write_summary_json

    write_summary_json(phase_dir / "summary.json", summary)
    return summary
