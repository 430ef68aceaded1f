"""One training run of ``megaloss-check-layout`` (:mod:`megaloss.cli.check_layout`): the model and
the global batches (identical in every process: one seed), the layout on every rank
(:func:`layout_worker`) or the one-device reference in one process (:func:`run_training`), and
the full parameters gathered after each step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Dict, List

from megaloss.cli.check_layout_pipeline import run_pipeline_training

from .check_layout_spec import TINY_BERT, TINY_LLAMA

__all__ = ["model_config", "build_model", "global_batches", "full_parameters", "run_training",
           "reference_key", "init_single_process", "layout_worker"]


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


def build_model(spec: Dict[str, Any], tp_group, dp_group, ml, *, autotp: bool = False):
    """The model of ``spec`` from its seed. ``autotp``: the plain ``*ForCausalLM``, which
    :func:`megaloss.integrations.deepspeed.initialize` wraps in ``AutoTPCausalLMWithLoss`` and
    DeepSpeed AutoTP shards."""
    import torch
    import transformers

    from megaloss import CausalLMWithLoss
    from megaloss.integrations.hf import EmbeddingModelWithMNR
    cfg = model_config(spec)
    torch.manual_seed(spec["seed"])  # every rank and the reference start from the same weights
    if spec["job"] == "lm":
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        if autotp:
            return model
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

    from megaloss.integrations.hf.embedding import step_loss_weights
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


def _autotp_full_parameters(module) -> Dict[str, Any]:
    """:func:`full_parameters` of a DeepSpeed AutoTP module (``AutoTPCausalLMWithLoss``): every
    AutoTP layer's shards gathered by the layer's own ``gather_params`` (deepspeed 0.19.8
    ``deepspeed/module_inject/layers.py``: column-parallel ``LinearLayer`` / the vocab-parallel
    lm_head on dim 0, row-parallel ``LinearAllreduce`` on dim 1, uneven splits included) on
    copies, so the engine's parameters (views of ZeRO's flat buffers) are left as they are. Named
    as in ``CausalLMWithLoss``, which holds the ``*ForCausalLM`` as its child ``model``, so the
    names are the one-device run's. Collective over the TP group."""
    import torch
    from deepspeed.module_inject.layers import TensorParallel_Layer

    out = {}
    for mod_name, mod in module.named_modules():
        own = list(mod.named_parameters(recurse=False))
        if not own:
            continue
        copies = {n: torch.nn.Parameter(p.detach().float().clone(), requires_grad=False)
                  for n, p in own}
        if isinstance(mod, TensorParallel_Layer):
            mod.gather_params([copies.get("weight"), copies.get("bias")])
        for n, t in copies.items():
            out[f"model.{mod_name}.{n}" if mod_name else f"model.{n}"] = t.data.cpu()
    return out


def full_parameters(me, topology) -> Dict[str, Any]:
    """Every parameter of the model as one device holds it (float32, CPU): TP vocab shards
    gathered and trimmed to the vocabulary, ZeRO-3 partitions gathered, DeepSpeed AutoTP's
    shards gathered (:func:`_autotp_full_parameters`). Collective."""
    import deepspeed

    from megaloss.integrations.config import ds_config_autotp_size
    from megaloss.parallel.comm import all_gather_dim0
    from megaloss.parallel.param_tags import is_tensor_parallel
    module = me.engine.module
    if ds_config_autotp_size(me.ds_config) > 1:  # ZeRO-3 is refused with AutoTP
        return _autotp_full_parameters(module)
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
    from megaloss.calibration.deepspeed_scale import engine_reduce_group
    from megaloss.integrations.deepspeed import initialize, load_ds_config, train_step
    from megaloss.integrations.deepspeed.compat import freeze_imported_objects
    from megaloss.parallel.groups import group_ranks

    if role == "layout" and spec.get("pp", 1) > 1:
        return run_pipeline_training(spec, model_config, global_batches, _rows)
    ds_config, ml = load_ds_config(spec[f"{role}_config"])
    autotp = role == "layout" and spec.get("autotp", False)
    # under DeepSpeed AutoTP the groups are AutoTP's, made inside deepspeed.initialize
    topo = None if autotp else Topology.build(ml.tensor_parallel_size)
    # the imports (and an earlier layout's) out of the engine set-up's gc.collect(); before the
    # model, which is garbage once this layout is done
    freeze_imported_objects()
    model = build_model(spec, None if autotp else topo.tp_group,
                        None if autotp else topo.dp_group, ml, autotp=autotp)
    vocab = model_config(spec).vocab_size
    me = initialize(model, ds_config, topology=topo)
    topo = me.topology
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
        world=dist.get_world_size(), dp=topo.dp_size, tp=topo.tp_size, autotp=autotp,
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


def init_single_process() -> None:
    import deepspeed

    from megaloss.integrations.deepspeed.compat import configure_launched_process
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

    from megaloss.integrations.deepspeed.compat import configure_launched_process
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
