"""Checkpoints through DeepSpeed's own ``engine.save_checkpoint`` / ``engine.load_checkpoint``,
with what a *bitwise* continuation needs beyond the engine's own state.

DeepSpeed saves the module, the (ZeRO-partitioned) optimizer, the LR scheduler, its step and
sample counters and a ``client_state`` dict (written by the ranks that write model files). On
top of that, :func:`save_checkpoint`:

- writes every rank's RNG states (Python, NumPy, torch CPU and CUDA) to
  ``<tag>/rng_state_rank<NNNNN>.pt``: dropout draws differ per rank, and the ``client_state``
  DeepSpeed keeps comes from one rank per model-parallel shard;
- records the layout (world size, DP, TP, ZeRO stage) in the client state, so a load on another
  layout is reported instead of silently restoring the wrong RNG streams;
- writes the ``latest`` pointer itself, atomically and only after every rank has written its
  files, so a save cut short (preemption) is never the one ``latest`` names;
- records DeepSpeed's ``universal_checkpoint_info`` (which parameters are replicated over the
  tensor-parallel group, the others being split on dim 0 like the vocab-parallel head), so
  ``python -m deepspeed.checkpoint.ds_to_universal`` can turn the checkpoint into a universal
  one that loads on another DP (and TP) size with ``"checkpoint": {"load_universal": true}``.

:func:`load_checkpoint` loads a ``checkpoints/`` folder's ``latest`` or a given tag folder,
restores this rank's RNG states and lets the monitors continue the run's files
(:func:`~.monitor.continue_monitors`). ``deepspeed`` is imported by the engine, not here.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch

from ...parallel.param_tags import is_tensor_parallel
from .monitor import continue_monitors

__all__ = ["CLIENT_KEY", "universal_checkpoint_info", "save_checkpoint", "load_checkpoint",
           "resolve_checkpoint", "check_checkpoint_files",
           "latest_tag", "rng_state", "set_rng_state", "prune_checkpoints", "checkpoint_bytes"]

CLIENT_KEY = "megaloss"  # the part of DeepSpeed's client_state megaloss writes
_RNG_FILE = "rng_state_rank{:05d}.pt"
PathLike = Union[str, os.PathLike]


def _dist():
    import torch.distributed as dist

    return dist if dist.is_initialized() else None


def _rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def _barrier() -> None:
    d = _dist()
    if d:
        d.barrier()


def rng_state() -> Dict[str, Any]:
    """This process's RNG states: ``random``, NumPy's global generator (when installed), torch's
    CPU generator and every CUDA device's."""
    state: Dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def latest_tag(save_dir: PathLike) -> Optional[str]:
    """The tag ``<save_dir>/latest`` names, or None when there is no such file."""
    path = Path(save_dir) / "latest"
    return path.read_text(encoding="utf-8").strip() if path.is_file() else None


def resolve_checkpoint(path: PathLike) -> Tuple[Path, str]:
    """``(load_dir, tag)`` of a checkpoint given as a folder of checkpoints (its ``latest`` is
    used) or as one tag folder (``.../checkpoints/step_50``).

    Raises:
        FileNotFoundError: neither, with what was looked for.
    """
    path = Path(path)
    tag = latest_tag(path)
    if tag is not None:
        if not (path / tag).is_dir():
            raise FileNotFoundError(f"{path / 'latest'} names {tag!r}, but {path / tag} does "
                                    "not exist")
        return path, tag
    if path.is_dir() and any(p.name.endswith("model_states.pt") for p in path.iterdir()):
        return path.parent, path.name
    # a folder inside a checkpoint (the FSDP job's step_<k>/dcp): name the checkpoint
    hint = (f" (did you mean {path.parent}, the checkpoint that holds it?)"
            if any(path.parent.glob("*model_states.pt")) else "")
    raise FileNotFoundError(f"no checkpoint at {path}: expected a folder of checkpoints with a "
                            "'latest' file (.../checkpoints), or one checkpoint folder "
                            "(.../checkpoints/step_<k>, holding *model_states.pt files)"
                            f"{hint}")


def check_checkpoint_files(path: PathLike) -> Path:
    """Refuse a checkpoint with a file that is cut short or damaged, naming the file, before
    DeepSpeed reads it (``torch.load`` would fail inside DeepSpeed with only
    ``PytorchStreamReader failed reading zip archive``). Every ``*.pt`` file of the checkpoint
    must be a complete ``torch.save`` archive (a zip whose directory, at the end of the file, is
    intact) whose entries match their CRC-32 checksums. Reads every file once.

    Args:
        path: a folder of checkpoints (its ``latest``) or one checkpoint folder.

    Returns:
        the checkpoint folder.

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (:func:`resolve_checkpoint`).
        ValueError: ``checkpoint file <path> is truncated or corrupted (...)``.
    """
    import zipfile

    load_dir, tag = resolve_checkpoint(path)
    folder = load_dir / tag
    for f in sorted(folder.rglob("*.pt")):
        try:
            with zipfile.ZipFile(f) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise ValueError(f"checkpoint file {f} is truncated or corrupted ({e}); resume "
                             "from another checkpoint") from None
        if bad is not None:
            raise ValueError(f"checkpoint file {f} is truncated or corrupted (entry {bad} fails "
                             "its CRC-32 check); resume from another checkpoint")
    return folder


def _engine(me: Any) -> Any:
    return getattr(me, "engine", me)


def _layout(me: Any) -> Dict[str, int]:
    engine = _engine(me)
    d = _dist()
    topo = getattr(me, "topology", None)
    return {"world_size": d.get_world_size() if d else 1,
            "dp": getattr(topo, "dp_size", 1) if topo is not None else 1,
            "tp": getattr(topo, "tp_size", 1) if topo is not None else 1,
            "zero_stage": int(engine.zero_optimization_stage())}


def universal_checkpoint_info(module: torch.nn.Module) -> Dict[str, Any]:
    """DeepSpeed's ``universal_checkpoint_info`` for a megaloss model: the trained parameters not
    tagged tensor-parallel are replicated over the TP group (``ds_to_universal`` keeps one copy);
    the TP-sharded ones (the vocab-parallel lm_head) are split on dim 0, its default."""
    from deepspeed.checkpoint.constants import (
        TP_REPLICATED_PARAMETER_PATTERNS,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    replicated = [re.escape(name) + "$" for name, p in module.named_parameters()
                  if p.requires_grad and not is_tensor_parallel(p)]
    return {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            TP_REPLICATED_PARAMETER_PATTERNS: replicated}


def save_checkpoint(me: Any, save_dir: PathLike, tag: Optional[str] = None,
                    client_state: Optional[Dict[str, Any]] = None) -> Path:
    """Save a checkpoint with DeepSpeed's ``engine.save_checkpoint`` plus every rank's RNG states,
    then point ``<save_dir>/latest`` at it. Collective: every rank calls it.

    Args:
        me: a :class:`~.engine.MegalossEngine` (or a bare DeepSpeed engine).
        save_dir: the folder of checkpoints (``<output_dir>/checkpoints`` in the launch jobs).
        tag: the checkpoint's folder name; default ``step_<global_steps>``.
        client_state: the caller's state (data position, metrics so far, ...), stored by
            DeepSpeed next to the model; must be the same on every rank where it matters (each
            model-parallel shard's writer keeps its own rank's copy).

    Returns:
        the checkpoint's folder ``<save_dir>/<tag>``.
    """
    engine = _engine(me)
    tag = tag or f"step_{int(engine.global_steps)}"
    state = dict(client_state or {})
    state[CLIENT_KEY] = {"layout": _layout(me), "global_steps": int(engine.global_steps),
                         "global_samples": int(getattr(engine, "global_samples", 0))}
    state.setdefault("universal_checkpoint_info", universal_checkpoint_info(engine.module))
    engine.save_checkpoint(str(save_dir), tag=tag, client_state=state, save_latest=False)
    folder = Path(save_dir) / tag
    torch.save(rng_state(), folder / _RNG_FILE.format(_rank()))
    _barrier()  # every rank's files are on disk before latest names them
    if _rank() == 0:
        _atomic_text(Path(save_dir) / "latest", tag)
    _barrier()
    return folder


def load_checkpoint(me: Any, path: PathLike, *, load_optimizer_states: bool = True,
                    restore_rng: bool = True, continue_monitor_files: bool = True
                    ) -> Tuple[Path, Dict[str, Any]]:
    """Load a checkpoint written by :func:`save_checkpoint` (or by DeepSpeed alone) into the
    engine with ``engine.load_checkpoint``. Collective.

    Args:
        me: a :class:`~.engine.MegalossEngine` (or a bare DeepSpeed engine), freshly built
            (under ZeRO-3 DeepSpeed loads into a pristine engine only).
        path: a folder of checkpoints (its ``latest``) or one checkpoint folder.
        load_optimizer_states: also the optimizer and LR scheduler (False: weights only).
        restore_rng: restore this rank's RNG states (skipped with a warning when the checkpoint
            was written by another layout or has no file for this rank).
        continue_monitor_files: :func:`~.monitor.continue_monitors` at the restored sample
            count, so the monitors' files continue the checkpointed run's.

    Returns:
        ``(checkpoint folder, client_state)``: the caller's state as saved (the
        ``"megaloss"`` entry holds the layout and counters).

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (see :func:`resolve_checkpoint`), or
            DeepSpeed could not load it.
    """
    engine = _engine(me)
    load_dir, tag = resolve_checkpoint(path)
    load_path, client_state = engine.load_checkpoint(
        str(load_dir), tag=tag, load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=load_optimizer_states)
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed could not load the checkpoint {load_dir / tag}")
    client_state = dict(client_state or {})
    saved = client_state.get(CLIENT_KEY, {})
    if restore_rng:
        rng_file = load_dir / tag / _RNG_FILE.format(_rank())
        same = saved.get("layout") in (None, _layout(me))
        if same and rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            warnings.warn(f"checkpoint {load_dir / tag} was written with layout "
                          f"{saved.get('layout')} (now {_layout(me)}): RNG states not restored, "
                          "so dropout draws differ from an uninterrupted run", UserWarning,
                          stacklevel=2)
    if continue_monitor_files:
        continue_monitors(engine)
    return load_dir / tag, client_state


def prune_checkpoints(save_dir: PathLike, keep: int) -> None:
    """Remove all but the ``keep`` newest checkpoint folders of ``save_dir`` (by the step in
    ``step_<n>``; the one ``latest`` names is always kept). Call on one rank, after a save."""
    if keep <= 0:
        return
    root = Path(save_dir)
    latest = latest_tag(root)
    tags = sorted((p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                  key=lambda p: int(p.name[5:]))
    for p in tags[:-keep]:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)


def checkpoint_bytes(folder: PathLike) -> int:
    """Total size of the files under a checkpoint folder."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
