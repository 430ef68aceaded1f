"""The pipeline-parallel layout run of ``megaloss-check-layout``
(:mod:`megaloss.cli.check_layout`): ``megaloss.pipeline_parallel_size`` > 1 in the ds_config.

Every rank builds the whole (small) model from the check's seed, as the one-device run does,
and keeps its stage's layers
(:func:`~megaloss.integrations.deepspeed.pipeline_llama.llama_pipeline_layers` loading the full
state dict), then trains through
:func:`~megaloss.integrations.deepspeed.pipeline.initialize_pipeline` and
:func:`~megaloss.integrations.deepspeed.pipeline.pipeline_train_step`. The record has the keys
of the check's other layout runs; parameters carry the one-device run's names
(``CausalLMWithLoss``: ``model.`` + the ``LlamaForCausalLM`` name). Llama-family configs only
(the stage split is the Llama's).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

__all__ = ["pipeline_config_notes", "run_pipeline_training"]


def pipeline_config_notes(layout: Dict[str, Any], job: str) -> List[str]:
    """Adapt the layout's ds_config to the pipeline engine in place (ZeRO > 1 lowered to 1, as
    the LM job does); the notes to print. Raises SystemExit for the embedding job."""
    from megaloss.integrations.deepspeed.pipeline_layout import PIPELINE_ZERO_STAGES

    if job != "lm":
        raise SystemExit("megaloss.pipeline_parallel_size > 1 is checked for --job lm only")
    notes = []
    zero = layout.setdefault("zero_optimization", {})
    asked = int(zero.get("stage", 0))
    if asked not in PIPELINE_ZERO_STAGES:
        zero["stage"] = max(PIPELINE_ZERO_STAGES)
        notes.append(f"DeepSpeed's pipeline engine supports ZeRO stages {PIPELINE_ZERO_STAGES}: "
                     f"the config's ZeRO-{asked} runs at ZeRO-{zero['stage']}")
    return notes


def _full_parameters(me: Any, num_layers: int, vocab: int) -> Dict[str, Any]:
    """Every parameter of the model on every rank (float32, CPU, one-device names): TP shards
    gathered within the stage, then the stages' dicts all-gathered. Collective."""
    import torch.distributed as dist

    from megaloss.integrations.deepspeed.pipeline_llama import hf_parameter_name
    from megaloss.parallel.comm import all_gather_dim0
    from megaloss.parallel.param_tags import is_tensor_parallel

    topo = me.topology
    mine = {}
    for name, p in me.engine.module.named_parameters():
        t = p.detach().float().clone()
        if topo.tp_size > 1 and is_tensor_parallel(p):
            t = all_gather_dim0(t.contiguous(), topo.tp_group)[:vocab]
        mine["model." + hf_parameter_name(name, num_layers)] = t.cpu()
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: Dict[str, Any] = {}
    for d in everyone:
        out.update(d)
    return out


def run_pipeline_training(spec: Dict[str, Any], model_config, global_batches, rows
                          ) -> Dict[str, Any]:
    """The layout run under the pipeline engine (every launched rank); ``model_config``,
    ``global_batches`` and ``rows`` are the check's own builders (the same model and data as the
    one-device run)."""
    import torch
    import torch.distributed as dist
    import transformers

    from megaloss.integrations.deepspeed import load_ds_config
    from megaloss.integrations.deepspeed.pipeline import (
        build_pipeline_layout,
        initialize_pipeline,
        pipeline_train_step,
    )
    from megaloss.integrations.deepspeed.pipeline_llama import llama_pipeline_layers
    from megaloss.parallel.groups import group_ranks

    ds_config, ml = load_ds_config(spec["layout_config"])
    cfg = model_config(spec)
    if cfg.model_type != "llama":
        raise ValueError(f"pipeline parallelism is checked for Llama models only, got "
                         f"model_type {cfg.model_type!r}")
    layout = build_pipeline_layout(ml.pipeline_parallel_size, ml.tensor_parallel_size)
    topo = layout.topology
    torch.manual_seed(spec["seed"])  # the one-device run's weights (check_layout.build_model)
    state = transformers.AutoModelForCausalLM.from_config(cfg).state_dict()
    layers = llama_pipeline_layers(cfg, options=ml.ce.options(), tp_group=topo.tp_group,
                                   state_dict=state)
    del state
    me = initialize_pipeline(layers, ds_config, layout=layout)
    measured = used = me.engine_scale
    if spec["inject_wrong_scale"]:
        world = dist.get_world_size()
        used = dataclasses.replace(measured, gradient_factor=measured.gradient_factor / world,
                                   loss_multiplier=measured.loss_multiplier * world)
        me.calibrator.engine_scale = used
        if me.loss is not None:
            me.loss.gradient_multiplier = used.loss_multiplier
    micro = int(ds_config["train_micro_batch_size_per_gpu"])
    lo = topo.dp_rank * micro
    n, vocab = cfg.num_hidden_layers, cfg.vocab_size
    record: Dict[str, Any] = {"loss": [], "grad_norm": [], "params": [],
                              "params0": _full_parameters(me, n, vocab)}
    for mbs in global_batches(spec, vocab):
        m = pipeline_train_step(me, [rows(mb, lo, lo + micro) for mb in mbs], log=False)
        record["loss"].append(float(m.loss))
        record["grad_norm"].append(float("nan") if m.grad_norm is None else float(m.grad_norm))
        record["params"].append(_full_parameters(me, n, vocab))
    engine = me.engine
    groups = {"rank": dist.get_rank(), "tp": group_ranks(topo.tp_group),
              "dp": group_ranks(topo.dp_group), "dp_sp": group_ranks(topo.dp_sp_group),
              "engine_reduce": list(engine.grid.get_data_parallel_group_ranks())}
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, groups)
    record.update(
        groups=everyone, zero_stage=int(engine.zero_optimization_stage()),
        world=dist.get_world_size(), dp=topo.dp_size, tp=topo.tp_size, pp=topo.pp_size,
        gas=int(engine.gradient_accumulation_steps()), micro=micro,
        measured_scale=dataclasses.asdict(measured), used_scale=dataclasses.asdict(used),
        torch=torch.__version__)
    engine.destroy()  # the check's next layout builds its own engine in this process
    return record
