#!/usr/bin/env python3
"""Does my layout train like one device? Run your ds_config both ways and compare.

    megaloss-check-layout                                   # the shipped zero2.json, 2 processes
    megaloss-check-layout --deepspeed_config my_ds.json --num_procs 4 --steps 5
    megaloss-check-layout --deepspeed_config my_ds.json --num_procs 4 --job embed
    megaloss-check-layout --deepspeed_config my_ds.json --model path/to/config.json \
        --config_override '{"num_hidden_layers": 2}'
    megaloss-check-layout --deepspeed_config zero2.json zero3.json --num_procs 4  # both at once

What it does:

(``python -m megaloss.cli.check_layout`` is the same.) It runs from any directory: paths are
read relative to the current one, and nothing of a megaloss checkout is needed.

1. **Your layout**: ``deepspeed --num_gpus N --module megaloss.cli.check_layout ...`` (the
``deepspeed``
   launcher, as a training job runs) builds the model on every rank from one seed, makes the
   process groups from the config's ``megaloss.tensor_parallel_size`` (``DP = N / TP``), and
   trains K optimizer steps through the path megaloss users train with:
   ``megaloss.integrations.deepspeed.initialize`` (the engine, the measured engine scale, the
   calibrator) and ``train_step`` for the LM job; for the embedding job the loop of
   ``launch/train_embed.py`` (``step_loss_weights``, ``engine.backward``, ``engine.step``).
2. **One device**: the same global batches (micro-batch ``m x DP``, the same accumulation
   steps) on ONE process with no parallelism (TP 1, DP 1, ZeRO stage 0), the same optimizer,
   scheduler, clipping and precision, through the same ``initialize`` + ``train_step``. It runs
   in this process while the layout's processes run.
3. **Compare**, step by step: the global loss, the gradient norm before clipping, and the
   parameters after the step (the layout's TP shards and ZeRO-3 partitions gathered), as the
   relative difference of the update ``|(p_layout - p0) - (p_ref - p0)| / |p_ref - p0|`` over
   all parameters. PASS when every figure is within the tolerance of the training dtype
   (:data:`TOLERANCES`, printed with the verdict); otherwise FAIL, with the likely cause.

It also prints the groups it found (TP, DP, the group DeepSpeed reduces gradients over) and the
engine scale megaloss measured on the real engine (``EngineScale``: gradient factor, loss
multiplier, group ranks), next to what ``GAS x DP`` predicts.

Models: ``--model tiny`` (default; a 2-layer Llama / 1-layer BERT from ``transformers``
configs, random init, no download) or a path to a ``transformers`` config (``config.json`` or
its folder), built with random weights; ``--config_override`` shrinks it, or ties the
embeddings (``'{"tie_word_embeddings": true}'``; a tied config, e.g. Qwen2.5's, is checked tied,
also under TP: the input embedding then uses the lm_head's vocab shard; under PP the first and
the last stage hold the tied weight, DeepSpeed's ``TiedLayerSpec``). Data: random token
ids with a different number of ignored labels per row (LM) or of padded positions (embedding),
so that a calibration counting tokens per rank, or per micro-batch, shows.

Several layouts at once: ``--deepspeed_config a.json b.json ...`` (and ``--config_override``
once for all of them, or once per config) checks every config on the same ``--num_procs``
processes in ONE launch (the ranks run the layouts one after the other), with one one-device
run per distinct reference (configs that differ only in their layout share it); a report per
layout, then a summary line.

Exit status: 0 PASS (every layout), 1 FAIL (any layout), 2 error (the layout run did not run;
its log is printed).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from megaloss.cli.check_layout_pipeline import pipeline_config_notes, run_pipeline_training

warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*", category=FutureWarning)

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
    """The user's config for the layout run: monitors off, the embedding job at TP 1, the three
    batch keys reduced to micro-batch and accumulation steps (``train_batch_size`` alone is
    divided by ``GAS x DP``), and an optimizer when the config has none (both runs get it)."""
    cfg = json.loads(json.dumps(user))
    section = cfg.setdefault("megaloss", {})
    if job == "embed":  # the embedding job is data parallel only (as launch/train_embed.py)
        section["tensor_parallel_size"] = 1
    gas = int(cfg.setdefault("gradient_accumulation_steps", 1))
    total = cfg.pop("train_batch_size", None)  # DeepSpeed derives it from micro x GAS x DP
    if "train_micro_batch_size_per_gpu" not in cfg:
        dp = (num_procs or 1) // int(section.get("tensor_parallel_size", 1) or 1)
        cfg["train_micro_batch_size_per_gpu"] = max(1, int(total or 1) // (gas * max(dp, 1)))
    cfg.setdefault("steps_per_print", 10 ** 9)
    cfg.setdefault("optimizer", DEFAULT_OPTIMIZER)
    _quiet_monitors(cfg)
    return cfg


def reference_config(layout: Dict[str, Any], dp: int) -> Dict[str, Any]:
    """One process, no parallelism: TP 1, ZeRO stage 0 (no partitioning, no offload), the
    micro-batch of all DP ranks together, everything else (optimizer, scheduler, clipping,
    precision, accumulation steps, loss options) as the layout."""
    cfg = json.loads(json.dumps(layout))
    cfg["train_micro_batch_size_per_gpu"] = int(layout["train_micro_batch_size_per_gpu"]) * dp
    cfg["zero_optimization"] = {"stage": 0}
    cfg["megaloss"]["tensor_parallel_size"] = 1
    cfg["megaloss"].pop("pipeline_parallel_size", None)
    return cfg


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
    ``--_inject_wrong_scale`` names no layout."""
    n = len(args.deepspeed_config or [None])
    overrides = args.config_override or [None]
    if len(overrides) not in (1, n):
        raise SystemExit(f"--config_override: give it once (for every config) or once per "
                         f"--deepspeed_config ({n}), got {len(overrides)}")
    if args._inject_wrong_scale is not None and not 1 <= args._inject_wrong_scale <= n:
        raise SystemExit(f"--_inject_wrong_scale {args._inject_wrong_scale}: a layout number "
                         f"1..{n}")
    return [make_spec(args, out_dir, i) for i in range(n)]


def make_spec(args: argparse.Namespace, out_dir: Path, index: int = 0) -> Dict[str, Any]:
    """The spec of the ``index``-th ``--deepspeed_config`` (both runs read it)."""
    path = (args.deepspeed_config or [None])[index]
    overrides = args.config_override or [None]
    override_json = overrides[index if len(overrides) > 1 else 0]
    user = read_user_config(path)
    layout = layout_config(user, args.job, args.num_procs)
    tp = int(layout["megaloss"].get("tensor_parallel_size", 1))
    pp = int(layout["megaloss"].get("pipeline_parallel_size", 1))
    if args.num_procs < 1 or args.num_procs % (tp * pp):
        raise SystemExit(f"--num_procs {args.num_procs} must be a positive multiple of "
                         f"megaloss.tensor_parallel_size={tp}"
                         + (f" x pipeline_parallel_size={pp}" if pp > 1 else ""))
    dp = args.num_procs // (tp * pp)
    override = json.loads(override_json) if override_json else {}
    notes = pipeline_config_notes(layout, args.job) if pp > 1 else []
    if "optimizer" not in user:
        notes.append(f"the config has no optimizer: both runs use {DEFAULT_OPTIMIZER}")
    if args.job == "embed" and int(user.get("megaloss", {}).get("tensor_parallel_size", 1)) > 1:
        notes.append("the embedding job is data parallel only: tensor_parallel_size set to 1")
    return {
        "notes": notes, "index": index, "config_name": path or "zero2.json (shipped)",
        "job": args.job, "model": args.model, "config_override": override,
        "num_procs": args.num_procs, "tp": tp, "dp": dp, "pp": pp, "steps": args.steps,
        "seed": args.seed,
        "seq_len": args.seq_len, "layout_config": layout,
        "reference_config": reference_config(layout, dp), "dtype": training_dtype(layout),
        "micro": int(layout["train_micro_batch_size_per_gpu"]),
        "gas": int(layout["gradient_accumulation_steps"]),
        "inject_wrong_scale": args._inject_wrong_scale == index + 1,
        "result": str(out_dir / f"layout-{index + 1}.pt"),
    }


# ------------------------------------------------------------------------------------------------
# model and data (identical in every process: one seed)
# ------------------------------------------------------------------------------------------------
def model_config(spec: Dict[str, Any]):
    import transformers
    if spec["model"] == "tiny":
        cls = transformers.LlamaConfig if spec["job"] == "lm" else transformers.BertConfig
        cfg = cls(**(TINY_LLAMA if spec["job"] == "lm" else TINY_BERT))
    else:
        cfg = transformers.AutoConfig.from_pretrained(spec["model"])
    for key, value in spec["config_override"].items():
        setattr(cfg, key, value)
    return cfg


def build_model(spec: Dict[str, Any], tp_group, dp_group, ml):
    import torch
    import transformers

    from megaloss import CausalLMWithLoss
    from megaloss.integrations.hf import EmbeddingModelWithMNR
    cfg = model_config(spec)
    torch.manual_seed(spec["seed"])  # every rank and the reference start from the same weights
    if spec["job"] == "lm":
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        return CausalLMWithLoss(model, options=ml.ce.options(), tp_group=tp_group)
    encoder = transformers.AutoModel.from_config(cfg, add_pooling_layer=False) if \
        cfg.model_type == "bert" else transformers.AutoModel.from_config(cfg)
    return EmbeddingModelWithMNR(encoder, options=ml.mnr.options(), group=dp_group)


def global_batches(spec: Dict[str, Any], vocab_size: int) -> List[List[Dict[str, Any]]]:
    """``steps`` lists of ``gas`` global micro-batches (``micro x dp`` rows each)."""
    import torch
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    rows, t = spec["micro"] * spec["dp"], spec["seq_len"]
    steps = []
    for _ in range(spec["steps"]):
        mbs = []
        for _ in range(spec["gas"]):
            if spec["job"] == "lm":
                ids = torch.randint(0, vocab_size, (rows, t), generator=g)
                labels = ids.clone()
                # a different share of ignored labels per row (0 to 70 %): token counts differ
                # across ranks and micro-batches
                share = torch.rand(rows, 1, generator=g) * 0.7
                labels[torch.rand(rows, t, generator=g) < share] = -100
                mbs.append({"input_ids": ids, "labels": labels})
            else:
                mb = {}
                for side in ("query", "document"):
                    ids = torch.randint(1, vocab_size, (rows, t), generator=g)
                    lengths = torch.randint(2, t + 1, (rows, 1), generator=g)
                    mb[f"{side}_input_ids"] = ids
                    mb[f"{side}_attention_mask"] = (torch.arange(t) < lengths).long()
                mbs.append(mb)
        steps.append(mbs)
    return steps


def _rows(mb: Dict[str, Any], lo: int, hi: int) -> Dict[str, Any]:
    return {k: v[lo:hi] for k, v in mb.items()}


# ------------------------------------------------------------------------------------------------
# one run (the layout on every rank, or the reference on one process)
# ------------------------------------------------------------------------------------------------
def _embed_step(me, mbs, dp_group, dp_size: int, multiplier: float):
    """One optimizer step of the embedding job, as ``launch/train_embed.py`` runs it; returns
    (global loss, gradient norm before clipping)."""
    import torch

    from megaloss.integrations.hf import step_loss_weights
    engine = me.engine
    weights = step_loss_weights([len(b["query_input_ids"]) for b in mbs], dp_group,
                                loss_multiplier=multiplier, device=engine.device)
    loss = torch.zeros((), dtype=torch.float64)
    own_norm = None
    for i, (b, w) in enumerate(zip(mbs, weights)):
        out = engine(**{k: v.to(engine.device) for k, v in b.items()}, loss_weight=w)
        engine.backward(out.loss)
        if i == len(mbs) - 1 and engine.zero_optimization_stage() == 0:
            sq = sum(float(p.grad.detach().double().pow(2).sum())
                     for p in engine.module.parameters() if p.grad is not None)
            own_norm = math.sqrt(sq)
        engine.step()
        loss += float(w) * (dp_size / multiplier) * float(out.value)
    norm = engine.get_global_grad_norm()
    return float(loss), float(norm if norm is not None else own_norm)


def full_parameters(me, topology) -> Dict[str, Any]:
    """Every parameter of the model as one device holds it (float32, CPU): TP vocab shards
    gathered and trimmed to the vocabulary, ZeRO-3 partitions gathered. Collective."""
    import deepspeed

    from megaloss.parallel import all_gather_dim0, is_tensor_parallel
    module = me.engine.module
    named = list(module.named_parameters())
    gather = (deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None)
              if me.engine.zero_optimization_stage() == 3 else contextlib.nullcontext())
    out = {}
    with gather:
        for name, p in named:
            t = p.detach().float().clone()
            if topology.tp_size > 1 and is_tensor_parallel(p):
                t = all_gather_dim0(t.contiguous(), topology.tp_group)[:module.vocab_size]
            out[name] = t.cpu()
    return out


def run_training(spec: Dict[str, Any], role: str) -> Dict[str, Any]:
    """Build, train ``steps`` steps, record. ``role``: ``"layout"`` (every launched rank) or
    ``"reference"`` (one process). torch.distributed must be initialised."""
    import torch
    import torch.distributed as dist

    from megaloss import Topology
    from megaloss.integrations.deepspeed import (
        freeze_imported_objects,
        initialize,
        load_ds_config,
        train_step,
    )
    from megaloss.integrations.deepspeed.probe import engine_reduce_group
    from megaloss.parallel import group_ranks

    if role == "layout" and spec.get("pp", 1) > 1:
        return run_pipeline_training(spec, model_config, global_batches, _rows)
    ds_config, ml = load_ds_config(spec[f"{role}_config"])
    topo = Topology.build(ml.tensor_parallel_size)
    # the imports (and an earlier layout's) out of the engine set-up's gc.collect(); before the
    # model, which is garbage once this layout is done
    freeze_imported_objects()
    model = build_model(spec, topo.tp_group, topo.dp_group, ml)
    vocab = model_config(spec).vocab_size
    me = initialize(model, ds_config, topology=topo)
    measured = me.engine_scale
    if role == "layout" and spec["inject_wrong_scale"]:
        # Deliberately wrong calibration (for the tool's own tests): the engine scale off by the
        # world size, as if the gradient averaging had been undone twice.
        world = dist.get_world_size()
        me.calibrator.engine_scale = dataclasses.replace(
            measured, gradient_factor=measured.gradient_factor / world,
            loss_multiplier=measured.loss_multiplier * world)
    used = me.calibrator.engine_scale
    rank = dist.get_rank()
    micro = int(ds_config["train_micro_batch_size_per_gpu"])
    lo = topo.dp_rank * micro if role == "layout" else 0

    record: Dict[str, Any] = {"loss": [], "grad_norm": [], "params": [],
                              "params0": full_parameters(me, topo)}
    for mbs in global_batches(spec, vocab):
        mine = [_rows(mb, lo, lo + micro) for mb in mbs]
        if spec["job"] == "lm":
            m = train_step(me, mine, log=False)
            loss, norm = m.loss, m.grad_norm
        else:
            loss, norm = _embed_step(me, mine, topo.dp_group, topo.dp_size,
                                     used.loss_multiplier)
        record["loss"].append(float(loss))
        record["grad_norm"].append(float("nan") if norm is None else float(norm))
        record["params"].append(full_parameters(me, topo))

    engine = me.engine
    groups = {"rank": rank, "tp": group_ranks(topo.tp_group), "dp": group_ranks(topo.dp_group),
              "dp_sp": group_ranks(topo.dp_sp_group),
              "engine_reduce": group_ranks(engine_reduce_group(engine) or dist.group.WORLD)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, groups)
    record.update(
        groups=everyone, zero_stage=int(engine.zero_optimization_stage()),
        world=dist.get_world_size(), dp=topo.dp_size, tp=topo.tp_size,
        gas=int(engine.gradient_accumulation_steps()), micro=micro,
        measured_scale=dataclasses.asdict(measured), used_scale=dataclasses.asdict(used),
        torch=torch.__version__)
    engine.destroy()  # the next layout (or reference) builds its own engine in this process
    return record


def reference_key(spec: Dict[str, Any]) -> str:
    """What the one-device run of ``spec`` depends on: layouts with the same key share it."""
    return json.dumps({k: spec[k] for k in ("reference_config", "job", "model",
                                            "config_override", "steps", "seed", "seq_len",
                                            "micro", "dp", "gas")}, sort_keys=True)


def _init_single_process() -> None:
    import deepspeed

    from megaloss.integrations.deepspeed import configure_launched_process
    from megaloss.testing import free_port
    configure_launched_process(logging.ERROR)  # this process prints the report
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed.init_distributed()


def layout_worker(spec_path: str) -> None:
    """Entry point of every launched rank: the layouts of the spec file one after the other."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from megaloss.integrations.deepspeed import configure_launched_process
    configure_launched_process()
    deepspeed.init_distributed()
    for spec in json.loads(Path(spec_path).read_text()):
        record = run_training(spec, "layout")
        if dist.get_rank() == 0:
            torch.save(record, spec["result"])
        dist.barrier()
    # torch's docs ask for it; left alive, gloo's threads can end a finished rank in std::terminate
    # ("terminate called without an active exception") at interpreter exit
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# comparison and report
# ------------------------------------------------------------------------------------------------
def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def _update_diff(lay: Dict[str, Any], ref: Dict[str, Any], p0: Dict[str, Any]):
    """(relative difference of the update over all parameters, worst parameter name, its
    relative difference, max abs difference of the parameters, norm of the reference update)."""
    import torch
    num = den = 0.0
    worst, worst_rel, max_abs = "", 0.0, 0.0
    for name, r in ref.items():
        if name not in lay or lay[name].shape != r.shape:
            return math.inf, name, math.inf, math.inf, math.nan
        dr = r.double() - p0[name].double()
        dl = lay[name].double() - p0[name].double()
        n, d = float(torch.linalg.vector_norm(dl - dr)), float(torch.linalg.vector_norm(dr))
        num, den = num + n * n, den + d * d
        rel = n / max(d, 1e-30) if n else 0.0
        if rel > worst_rel:
            worst, worst_rel = name, rel
        max_abs = max(max_abs, float((lay[name].double() - r.double()).abs().max()))
    rel = math.sqrt(num) / max(math.sqrt(den), 1e-30) if num else 0.0
    return rel, worst, worst_rel, max_abs, math.sqrt(den)


def _as_factor(ratio: float) -> str:
    """``"4"``, ``"1/4"`` or ``"1.37"``."""
    if ratio >= 1:
        k = round(ratio)
        return str(k) if abs(ratio - k) < 1e-3 * ratio else f"{ratio:.4g}"
    k = round(1 / ratio) if ratio > 0 else 0
    return f"1/{k}" if k and abs(1 / ratio - k) < 1e-3 / ratio else f"{ratio:.4g}"


def compare(lay: Dict[str, Any], ref: Dict[str, Any], dtype: str) -> Dict[str, Any]:
    tol = TOLERANCES[dtype]
    rows, failures = [], []
    for i, (l_lay, l_ref) in enumerate(zip(lay["loss"], ref["loss"])):
        g_lay, g_ref = lay["grad_norm"][i], ref["grad_norm"][i]
        upd, worst, worst_rel, max_abs, upd_norm = _update_diff(lay["params"][i], ref["params"][i],
                                                      ref["params0"])
        row = {"step": i + 1, "loss_layout": l_lay, "loss_ref": l_ref,
               "loss_rel": _rel(l_lay, l_ref), "gn_layout": g_lay, "gn_ref": g_ref,
               "gn_rel": _rel(g_lay, g_ref), "update_rel": upd, "worst_param": worst,
               "worst_param_rel": worst_rel, "param_max_abs": max_abs, "update_norm": upd_norm}
        for key, col in (("loss", "loss_rel"), ("grad_norm", "gn_rel"), ("params", "update_rel")):
            if not row[col] <= tol[key]:
                failures.append((i + 1, key, row[col]))
        rows.append(row)
    p0_rel = _update_diff(lay["params0"], ref["params0"], {k: v * 0 for k, v in
                                                            ref["params0"].items()})[0]
    if not p0_rel <= tol["params"]:
        failures.insert(0, (0, "params", p0_rel))
    return {"rows": rows, "failures": failures, "tolerance": tol, "dtype": dtype,
            "initial_param_rel": p0_rel, "diagnosis": diagnose(rows, failures, lay, ref, p0_rel,
                                                              tol)}


def diagnose(rows, failures, lay, ref, p0_rel, tol) -> List[str]:
    """Where the first difference is, and what usually causes it."""
    if not failures:
        return []
    used, measured = lay["used_scale"], lay["measured_scale"]
    expected = lay["gas"] * lay["dp"]
    out = []
    if p0_rel > tol["params"]:
        return ["the layout's initial parameters differ from one device's (before any step): "
                "ranks did not start from the same weights (seed every rank the same before "
                "building the model; TP shards must be rows of one full lm_head)"]
    first = rows[0]
    if first["loss_rel"] > tol["loss"]:
        out.append(
            f"the loss differs at step 1, before any update ({first['loss_layout']:.8g} vs "
            f"{first['loss_ref']:.8g} on one device): the forward or the loss weighting differs "
            "-- the calibration's global token/sample count (all-reduced over the dp x sp group "
            f"{lay['groups'][0]['dp_sp']} on rank 0), the data each DP rank gets (TP ranks of "
            "one DP rank must get the same batch), or the TP vocabulary split")
    elif first["gn_rel"] > tol["grad_norm"]:
        ratio = first["gn_layout"] / first["gn_ref"] if first["gn_ref"] else math.inf
        out.append(
            f"the loss matches at step 1 but the gradient is {_as_factor(ratio)} x one device's "
            f"(gradient norm {first['gn_layout']:.6g} vs {first['gn_ref']:.6g}): the engine's "
            "gradient scaling is not undone right. The loss multiplier in use is "
            f"{used['loss_multiplier']:g} (engine scale gradient_factor "
            f"{used['gradient_factor']:.6g}); the probe measured {measured['loss_multiplier']:g} "
            f"on this engine ({measured['engine']}, group {list(measured['group_ranks'])}), and "
            f"DeepSpeed's engine.backward with GAS {lay['gas']} x DP {lay['dp']} predicts "
            f"{expected}.")
        if abs(used["loss_multiplier"] - measured["loss_multiplier"]) > 1e-9:
            out.append("the calibrator does not use the measured engine scale: pass the "
                       "EngineScale that megaloss's probe measured (initialize does)")
    else:
        bad = next(f for f in failures)
        if bad[1] == "params":
            out.append(
                f"loss and gradient norm match at step {bad[0]} but the parameters after it "
                f"differ (update off by {bad[2]:.3g}, worst: {rows[bad[0] - 1]['worst_param']}): "
                "the optimizer step differs -- optimizer states partitioned over another group, "
                "gradient clipping counting TP shards twice or not at all, or a parameter "
                "missing from the optimizer")
        else:
            out.append(
                f"step 1 matches; the first difference is the {bad[1]} at step {bad[0]} "
                f"({bad[2]:.3g}): the update of an earlier step differed (see the parameter "
                "column), e.g. the learning-rate schedule or clipping")
    groups = lay["groups"]
    mismatched = [g["rank"] for g in groups if g["engine_reduce"] != g["dp_sp"]]
    if mismatched:
        out.append(f"on ranks {mismatched} DeepSpeed reduces gradients over another group than "
                   "the one megaloss calibrates over (dp x sp): build the engine with megaloss's "
                   "mpu (initialize does)")
    return out


def _fmt_groups(groups: List[Dict[str, Any]], key: str) -> str:
    seen = []
    for g in groups:
        if g[key] not in seen:
            seen.append(g[key])
    return " ".join(str(s) for s in seen)


def _tied_note(spec: Dict[str, Any]) -> str:
    tied = spec["job"] == "lm" and getattr(model_config(spec), "tie_word_embeddings", False)
    return " (tied embeddings)" if tied else ""


def report(spec: Dict[str, Any], lay: Dict[str, Any], ref: Dict[str, Any],
           result: Dict[str, Any], seconds: float) -> str:
    m, r = lay["measured_scale"], ref["measured_scale"]
    u = lay["used_scale"]
    tol = result["tolerance"]
    lines = [
        f"layout: {lay['world']} processes = DP {lay['dp']} x TP {lay['tp']}"
        + (f" x PP {lay['pp']}" if lay.get("pp", 1) > 1 else "") + ", "
        f"ZeRO-{lay['zero_stage']}, micro-batch {lay['micro']} x GAS {lay['gas']}, "
        f"{result['dtype']}; job {spec['job']}, model {spec['model']}{_tied_note(spec)}, "
        f"{spec['steps']} steps "
        f"({seconds:.0f} s)",
        f"one device: 1 process, ZeRO-0, micro-batch {ref['micro']} x GAS {ref['gas']}, "
        "the same global batches",
        "groups found (global ranks):",
        f"  tensor parallel:             {_fmt_groups(lay['groups'], 'tp')}",
        f"  data parallel:               {_fmt_groups(lay['groups'], 'dp')}",
        f"  calibration (dp x sp):       {_fmt_groups(lay['groups'], 'dp_sp')}",
        f"  DeepSpeed reduces grads over: {_fmt_groups(lay['groups'], 'engine_reduce')}",
        f"engine scale (measured on the engine, rank 0): {m['engine']}: gradient_factor "
        f"{_as_factor(m['gradient_factor'])} (raw {m['measured']:.6g}), loss_multiplier "
        f"{m['loss_multiplier']:g}, group ranks {list(m['group_ranks'])}; GAS x DP = "
        f"{lay['gas'] * lay['dp']}",
        f"one device's engine scale: {r['engine']}: gradient_factor "
        f"{_as_factor(r['gradient_factor'])}, loss_multiplier {r['loss_multiplier']:g}",
    ]
    if u != m:
        lines.append(f"!! the layout run used loss_multiplier {u['loss_multiplier']:g} "
                     "(--_inject_wrong_scale)")
    head = (f"{'step':>4}  {'loss layout':>13}  {'loss 1-dev':>13}  {'rel diff':>8}  "
            f"{'gnorm layout':>12}  {'gnorm 1-dev':>12}  {'rel diff':>8}  {'|dp| 1-dev':>10}  "
            f"{'update diff':>11}")
    lines += ["", head, "-" * len(head)]
    for row in result["rows"]:
        lines.append(
            f"{row['step']:>4}  {row['loss_layout']:>13.8f}  {row['loss_ref']:>13.8f}  "
            f"{row['loss_rel']:>8.1e}  {row['gn_layout']:>12.6g}  {row['gn_ref']:>12.6g}  "
            f"{row['gn_rel']:>8.1e}  {row['update_norm']:>10.3g}  {row['update_rel']:>11.1e}")
    lines.append(f"(gnorm: gradient norm before clipping; dp: parameters after the step minus the "
                 f"initial ones, all parameters; update diff = |dp_layout - dp_1dev| / |dp_1dev|"
                 f"; initial parameters differ by {result['initial_param_rel']:.1e})")
    if any(row["update_norm"] == 0 for row in result["rows"]):
        lines.append("(|dp| = 0: no update yet, e.g. a learning-rate warm-up from 0; the "
                     "parameters are then compared only after later steps)")
    verdict = "PASS" if not result["failures"] else "FAIL"
    lines += ["", f"tolerance ({result['dtype']}): loss {tol['loss']:g}, gradient norm "
              f"{tol['grad_norm']:g}, parameter update {tol['params']:g} (relative)"]
    if verdict == "PASS":
        pp = f" x PP {lay['pp']}" if lay.get("pp", 1) > 1 else ""
        lines.append(f"PASS: DP {lay['dp']} x TP {lay['tp']}{pp} ZeRO-{lay['zero_stage']} trains "
                     f"like one device over {spec['steps']} steps")
    else:
        worst = ", ".join(f"{k} at step {s}: {v:.2e}" for s, k, v in result["failures"][:4])
        lines.append(f"FAIL: {worst}")
        lines += [f"  cause: {d}" for d in result["diagnosis"]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
HELP_DESCRIPTION = """\
It trains a few steps of a small model twice: with your ds_config's layout on --num_procs
processes through the deepspeed launcher (DP = num_procs / megaloss.tensor_parallel_size),
and on one process with no parallelism on the same global batches. Then it compares the
loss, the gradient norm and the parameter update step by step, and prints PASS, or FAIL with
the likely cause (a gradient scaled by the DP size, the wrong reduce group, ...)."""

HELP_EPILOG = """\
examples:
  megaloss-check-layout                                    # the shipped zero2.json, 2 processes
  megaloss-check-layout --deepspeed_config my_ds.json --num_procs 4
  megaloss-check-layout --deepspeed_config my_ds.json --job embed --num_procs 2
  megaloss-check-layout --deepspeed_config zero2.json zero3.json --num_procs 4  # both, one launch

exit status: 0 PASS, 1 FAIL, 2 the layout did not run (its log is printed)."""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="megaloss-check-layout", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0] + "\n\n" + HELP_DESCRIPTION, epilog=HELP_EPILOG)
    p.add_argument("--deepspeed_config", nargs="+", default=None, metavar="JSON",
                   help="your ds_config JSON (default: megaloss's shipped zero2.json, "
                        "DP x TP 2 under ZeRO-2); several: every layout checked in one launch "
                        "on the same --num_procs, a report each")
    p.add_argument("--num_procs", type=int, default=2,
                   help="processes of the layout (GPUs; CPU processes without GPUs); DP = "
                        "num_procs / megaloss.tensor_parallel_size (default 2)")
    p.add_argument("--job", choices=("lm", "embed"), default="lm",
                   help="lm: causal LM with the (vocab-parallel) chunked CE and token "
                        "calibration; embed: bi-encoder with the gathered MNR loss (TP 1)")
    p.add_argument("--model", default="tiny",
                   help="'tiny' (built-in) or a transformers config.json / folder")
    p.add_argument("--config_override", nargs="+", default=None, metavar="JSON",
                   help="JSON of model config fields to override, e.g. "
                        "'{\"num_hidden_layers\": 2}'; once for every config, or once per "
                        "--deepspeed_config (in their order; '{}' for none)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps K (default 4)")
    p.add_argument("--seq_len", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the layout run")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="write the layout's log and results to DIR (default: a temp dir)")
    p.add_argument("--verbose", action="store_true", help="print the launcher's output")
    # the tool's own tests: the N-th layout (1 when no N) gets a wrong engine scale
    p.add_argument("--_inject_wrong_scale", type=int, nargs="?", const=1, default=None,
                   metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--_worker", metavar="SPEC", default=None, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.seq_len < 2:
        p.error("--steps must be >= 1 and --seq_len >= 2")
    return args


def _launch_layout(spec_path: Path, spec: Dict[str, Any], log_path: Path, verbose: bool):
    from megaloss.testing import free_port
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}
    cpus = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // (spec["num_procs"] + 1))))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus",
           str(spec["num_procs"]), "--master_port", str(free_port()),
           "--module", "megaloss.cli.check_layout",
           "--_worker", str(spec_path)]
    out = None if verbose else open(log_path, "w")
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True), cmd


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args._worker:
        layout_worker(args._worker)
        return 0
    import torch

    t0 = time.perf_counter()
    tmp = None
    if args.keep:
        out_dir = Path(args.keep)
        out_dir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="check_layout-")
        out_dir = Path(tmp.name)
    try:
        specs = make_specs(args, out_dir)
        spec_path = out_dir / "spec.json"
        spec_path.write_text(json.dumps(specs, indent=1))
        log_path = out_dir / "layout.log"
        for spec in specs:
            pp = f" x PP {spec['pp']}" if spec.get("pp", 1) > 1 else ""
            name = f"layout {spec['index'] + 1} ({spec['config_name']}): " if len(specs) > 1 \
                else ""
            print(f"check_layout: {name}DP {spec['dp']} x TP {spec['tp']}{pp} on "
                  f"{spec['num_procs']} processes through the deepspeed launcher, and one device "
                  f"in this process ({spec['steps']} steps, {spec['dtype']})", flush=True)
            for note in spec["notes"]:
                print(f"note: {note}", flush=True)
        proc, cmd = _launch_layout(spec_path, specs[0], log_path, args.verbose)
        try:
            threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or max(
                1, (os.cpu_count() or 1) // (specs[0]["num_procs"] + 1))
            if not torch.cuda.is_available():
                torch.set_num_threads(threads)
            _init_single_process()
            refs: Dict[str, Dict[str, Any]] = {}
            for spec in specs:  # one one-device run per distinct reference
                key = reference_key(spec)
                if key not in refs:
                    refs[key] = run_training(spec, "reference")
            rc = proc.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - t0)))
            torch.distributed.destroy_process_group()  # the reference's (as layout_worker's)
        except BaseException:
            if proc.poll() is None:
                import signal
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
        if rc != 0 or not all(Path(s["result"]).exists() for s in specs):
            log = "" if args.verbose else log_path.read_text(errors="replace")
            print(log[-6000:], file=sys.stderr)
            print(f"ERROR: the layout run failed (exit status {rc}): {' '.join(cmd)}",
                  file=sys.stderr)
            return 2
        failed = []
        for spec in specs:
            lay = torch.load(spec["result"], weights_only=False)
            ref = refs[reference_key(spec)]
            result = compare(lay, ref, spec["dtype"])
            if len(specs) > 1:
                print(f"\n=== layout {spec['index'] + 1} of {len(specs)}: "
                      f"{spec['config_name']} ===", flush=True)
            print(report(spec, lay, ref, result, time.perf_counter() - t0), flush=True)
            if result["failures"]:
                failed.append(f"layout {spec['index'] + 1} ({spec['config_name']})")
        if len(specs) > 1:
            print(f"\nsummary: {len(specs) - len(failed)} of {len(specs)} layouts PASS"
                  + (f"; FAIL: {', '.join(failed)}" if failed else ""), flush=True)
        return 0 if not failed else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
