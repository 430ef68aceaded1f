"""The spec both runs of ``megaloss-check-layout`` share (:mod:`megaloss.cli.check_layout`): the
tolerances per training dtype (:data:`TOLERANCES`), the layout's and the one-device reference's
ds_configs (:func:`layout_config`, :func:`reference_config`) and the run spec built from the
command line (:func:`make_specs`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from megaloss.cli.check_layout_pipeline import pipeline_config_notes

__all__ = ["TOLERANCES", "MONITOR_SECTIONS", "TINY_LLAMA", "TINY_BERT", "training_dtype",
           "DEFAULT_OPTIMIZER", "layout_config", "reference_config", "layout_tp_size",
           "read_user_config", "make_specs", "make_spec"]


# Tolerances per training dtype: relative differences of the step's global loss, of the gradient
# norm, and of the parameter update (module docstring). fp32: the layout and one device sum the
# same numbers in another order (TP splits the vocabulary, DP the batch): ~1e-7 per operation,
# amplified a little by Adam over a few steps. bf16/fp16: parameters and activations carry
# 8 / 11 bits of mantissa, so both runs round differently from the first matmul on.
# Adam's first steps move every weight by about +-lr whatever the size of its gradient, so a
# weight whose gradient is within rounding of 0 moves either way: in bf16 that is a few percent
# of the weights (measured on the tiny Llama, DP 1 x TP 2, ZeRO-2 vs one device: update
# difference 0.29-0.37, loss 3e-4, gradient norm 1e-2), hence the loose parameter bound; the loss
# and the gradient norm are the sharp tests there.
TOLERANCES: Dict[str, Dict[str, float]] = {
    "fp32": {"loss": 1e-5, "grad_norm": 1e-4, "params": 1e-3},
    "bf16": {"loss": 2e-2, "grad_norm": 5e-2, "params": 0.6},
    "fp16": {"loss": 5e-3, "grad_norm": 2e-2, "params": 0.6},
}
MONITOR_SECTIONS = ("csv_monitor", "tensorboard", "wandb", "comet")
TINY_LLAMA = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False)
TINY_BERT = dict(vocab_size=512, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=128, max_position_embeddings=256, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0)


# ------------------------------------------------------------------------------------------------
# the spec both runs share
# ------------------------------------------------------------------------------------------------
def training_dtype(ds_config: Dict[str, Any]) -> str:
    for key, name in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        section = ds_config.get(key)
        if isinstance(section, dict) and section.get("enabled"):
            return name
    return "fp32"


def _quiet_monitors(cfg: Dict[str, Any]) -> None:
    for key in MONITOR_SECTIONS:  # the check writes no monitor files and calls no service
        if isinstance(cfg.get(key), dict):
            cfg[key]["enabled"] = False


DEFAULT_OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}


def layout_config(user: Dict[str, Any], job: str, num_procs: Optional[int] = None
                  ) -> Dict[str, Any]:
    """The user's config for the layout run: monitors off, the embedding job at TP 1 (without
    AutoTP's ``tensor_parallel`` section), the three
    batch keys reduced to micro-batch and accumulation steps (``train_batch_size`` alone is
    divided by ``GAS x DP``), and an optimizer when the config has none (both runs get it)."""
    cfg = json.loads(json.dumps(user))
    section = cfg.setdefault("megaloss", {})
    if job == "embed":  # the embedding job is data parallel only (as launch/train_embed.py)
        section["tensor_parallel_size"] = 1
    gas = int(cfg.setdefault("gradient_accumulation_steps", 1))
    total = cfg.pop("train_batch_size", None)  # DeepSpeed derives it from micro x GAS x DP
    if job == "embed":  # AutoTP shards a causal LM's linears; the bi-encoder is DP only
        cfg.pop("tensor_parallel", None)
    if "train_micro_batch_size_per_gpu" not in cfg:
        dp = (num_procs or 1) // layout_tp_size(cfg)
        cfg["train_micro_batch_size_per_gpu"] = max(1, int(total or 1) // (gas * max(dp, 1)))
    cfg.setdefault("steps_per_print", 10 ** 9)
    cfg.setdefault("optimizer", DEFAULT_OPTIMIZER)
    _quiet_monitors(cfg)
    return cfg


def reference_config(layout: Dict[str, Any], dp: int) -> Dict[str, Any]:
    """One process, no parallelism: TP 1 (megaloss's and AutoTP's), ZeRO stage 0 (no
    partitioning, no offload), the
    micro-batch of all DP ranks together, everything else (optimizer, scheduler, clipping,
    precision, accumulation steps, loss options) as the layout."""
    cfg = json.loads(json.dumps(layout))
    cfg["train_micro_batch_size_per_gpu"] = int(layout["train_micro_batch_size_per_gpu"]) * dp
    cfg["zero_optimization"] = {"stage": 0}
    cfg["megaloss"]["tensor_parallel_size"] = 1
    cfg["megaloss"].pop("pipeline_parallel_size", None)
    cfg.pop("tensor_parallel", None)  # DeepSpeed AutoTP's section: no sharding on one device
    return cfg


def layout_tp_size(cfg: Dict[str, Any]) -> int:
    """The TP size of a layout config: DeepSpeed AutoTP's ``tensor_parallel.autotp_size`` when
    above 1 (:func:`megaloss.integrations.config.ds_config_autotp_size`), else
    ``megaloss.tensor_parallel_size``."""
    from megaloss.integrations.config import ds_config_autotp_size

    autotp = ds_config_autotp_size(cfg)
    return autotp if autotp > 1 else int(cfg.get("megaloss", {}).get("tensor_parallel_size", 1)
                                         or 1)


def read_user_config(path: Optional[str]) -> Dict[str, Any]:
    """The ds_config to check: ``path`` (relative to the current directory), or the shipped
    ``zero2.json`` when ``None``. Exits with a message naming the file when it cannot be read."""
    if path is None:
        from megaloss.configs import config_path
        path = str(config_path("zero2"))
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as err:
        raise SystemExit(f"--deepspeed_config {path}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise SystemExit(f"--deepspeed_config {path}: not valid JSON ({err})") from None


def make_specs(args: argparse.Namespace, out_dir: Path) -> List[Dict[str, Any]]:
    """One spec per ``--deepspeed_config`` (the shipped zero2.json when none is given). Exits
    with a message when ``--config_override`` is given neither once nor once per config, or
    ``--_inject_wrong_scale`` names a number that is no layout's."""
    n = len(args.deepspeed_config or [None])
    overrides = args.config_override or [None]
    if len(overrides) not in (1, n):
        raise SystemExit(f"--config_override: give it once (for every config) or once per "
                         f"--deepspeed_config ({n}), got {len(overrides)}")
    for k in args._inject_wrong_scale or []:
        if not 1 <= k <= n:
            raise SystemExit(f"--_inject_wrong_scale {k}: a layout number 1..{n}")
    return [make_spec(args, out_dir, i) for i in range(n)]


def make_spec(args: argparse.Namespace, out_dir: Path, index: int = 0) -> Dict[str, Any]:
    """The spec of the ``index``-th ``--deepspeed_config`` (both runs read it)."""
    path = (args.deepspeed_config or [None])[index]
    overrides = args.config_override or [None]
    override_json = overrides[index if len(overrides) > 1 else 0]
    user = read_user_config(path)
    layout = layout_config(user, args.job, args.num_procs)
    from megaloss.integrations.config import ds_config_autotp_size

    autotp = ds_config_autotp_size(layout) > 1
    tp = layout_tp_size(layout)
    pp = int(layout["megaloss"].get("pipeline_parallel_size", 1))
    name = path or "zero2.json (shipped)"
    if autotp:  # what megaloss refuses under AutoTP (ZeRO-3, both TP schemes, ...): said here
        from megaloss.integrations.config import load_megaloss_config
        try:
            load_megaloss_config(layout)
        except (TypeError, ValueError) as err:
            raise SystemExit(f"--deepspeed_config {name}: {err}") from None
        if pp > 1:
            raise SystemExit(f"--deepspeed_config {name}: tensor_parallel.autotp_size={tp} with "
                             f"megaloss.pipeline_parallel_size={pp}: AutoTP is not composed "
                             "with megaloss's pipeline engine")
    if args.num_procs < 1 or args.num_procs % (tp * pp):
        what = (f"tensor_parallel.autotp_size={tp}" if autotp
                else f"megaloss.tensor_parallel_size={tp}")
        raise SystemExit(f"--num_procs {args.num_procs} must be a positive multiple of {what}"
                         + (f" x pipeline_parallel_size={pp}" if pp > 1 else ""))
    dp = args.num_procs // (tp * pp)
    override = json.loads(override_json) if override_json else {}
    notes = pipeline_config_notes(layout, args.job) if pp > 1 else []
    if "optimizer" not in user:
        notes.append(f"the config has no optimizer: both runs use {DEFAULT_OPTIMIZER}")
    if args.job == "embed" and int(user.get("megaloss", {}).get("tensor_parallel_size", 1)) > 1:
        notes.append("the embedding job is data parallel only: tensor_parallel_size set to 1")
    if args.job == "embed" and ds_config_autotp_size(user) > 1:
        notes.append("the embedding job is data parallel only: AutoTP's tensor_parallel "
                     "section left out")
    if autotp:
        notes.append(f"DeepSpeed AutoTP (tensor_parallel.autotp_size {tp}) shards the model; "
                     "megaloss's loss runs on its lm_head shard")
    return {
        "notes": notes, "index": index, "config_name": name, "autotp": autotp,
        "job": args.job, "model": args.model, "config_override": override,
        "num_procs": args.num_procs, "tp": tp, "dp": dp, "pp": pp, "steps": args.steps,
        "seed": args.seed,
        "seq_len": args.seq_len, "layout_config": layout,
        "reference_config": reference_config(layout, dp), "dtype": training_dtype(layout),
        "micro": int(layout["train_micro_batch_size_per_gpu"]),
        "gas": int(layout["gradient_accumulation_steps"]),
        "inject_wrong_scale": index + 1 in (args._inject_wrong_scale or []),
        "result": str(out_dir / f"layout-{index + 1}.pt"),
    }
