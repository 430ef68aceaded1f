"""The LM job under DeepSpeed's pipeline engine (``--pipeline_parallel_size`` /
``megaloss.pipeline_parallel_size`` > 1): the layout, the Llama's stages and the engine, and the
step / eval functions the job loop calls instead of the ``engine.forward`` ones.

The stages start from the weights every other layout trains: :func:`build_llama` of the job's
seed, its state dict sliced into the stages (:func:`llama_stage_layers`), so one seed gives one
initial model whatever the layout.

The pipeline engine takes ZeRO stages 0 and 1 only (DeepSpeed 0.19.8,
``runtime/pipe/engine.py``): a ds_config asking for ZeRO-2 or 3 (the job's default is ZeRO-2)
runs at ZeRO-1, and the job says so.

Checkpoints (``--save_every``, ``--resume``, ``--eval_only``, the save at the step boundary after
SIGTERM / SIGINT) take the path of every other layout (:func:`launch.jobs.checkpoints.save_run`,
:func:`launch.jobs.checkpoints.resume_job_state`): the pipeline engine's own
``save_checkpoint`` / ``load_checkpoint`` (``DeepSpeedEngine``'s, DeepSpeed 0.19.8
``runtime/engine.py``) write and read the stages' weights one file per pipeline layer and
tensor-parallel rank (``PipelineModule.save_state_dict`` / ``load_state_dir``,
``runtime/pipe/module.py``; the tied embedding is in the last stage's file, broadcast to the
first stage on load: ``initialize_pipeline`` in ``megaloss/integrations/deepspeed/pipeline.py``),
beside the ZeRO-1 optimizer shards, the LR scheduler, the step counters and the job's client
state; the engine is built from the seed's weights first, then loaded. A resumed run continues
bitwise (tests/launch/test_train_lm_pipeline.py).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .models import build_llama

__all__ = ["PipelineJob", "pipeline_parallel_size", "llama_stage_layers", "build_pipeline_job",
           "gather_per_rank"]


def pipeline_parallel_size(args: argparse.Namespace, ml: Any, ds_config: Dict[str, Any]) -> int:
    """The run's stage count: ``--pipeline_parallel_size`` when given (written into the
    ds_config's section), else ``megaloss.pipeline_parallel_size``."""
    if args.pipeline_parallel_size is not None:
        ml.pipeline_parallel_size = args.pipeline_parallel_size
        ds_config.setdefault("megaloss", {})["pipeline_parallel_size"] = args.pipeline_parallel_size
    return ml.pipeline_parallel_size


@dataclass
class PipelineJob:
    """What the LM job needs from the pipeline set-up."""

    me: Any  # MegalossPipelineEngine
    config: Any  # the LlamaConfig
    parameters: int  # the whole model's (decoder + full lm_head; tied: counted once)
    train_step: Callable[[List[Mapping[str, Any]]], Any]
    evaluate: Callable[..., Any]  # (batches, log=True): log writes to the engine's monitors


def _check_job_arguments(ml: Any) -> None:
    if ml.sequence_parallel_size != 1:
        raise ValueError("sequence parallelism and pipeline parallelism do not combine in this "
                         "job (DeepSpeed's pipeline engine takes dp x pp x tp)")


def llama_stage_layers(args: argparse.Namespace, vocab: int, *, options: Any = None,
                       tp_group: Any = None) -> Tuple[List[Any], Any, int, Dict[str, Any]]:
    """The Llama the other layouts train, as pipeline layers: :func:`build_llama` of ``args``
    (same seed, config and tied embedding), its ``LlamaForCausalLM`` state dict handed to
    :func:`megaloss.integrations.deepspeed.pipeline_llama.llama_pipeline_layers`, which loads
    each stage's keys (a tied weight: ``model.embed_tokens.weight`` on the first and the last
    stage; under TP each rank keeps its vocab rows of the lm_head, as ``CausalLMWithLoss``
    does).

    Every rank builds the whole model once, as the other layouts do; the stages copy their
    weights out of the returned ``state`` when ``PipelineModule`` builds them, after which the
    caller empties it (the ``LayerSpec`` s, kept by the module, hold it).

    Args:
        args: the job's arguments (:func:`launch.jobs.arguments.add_llama_arguments`,
            ``--seed``, ``--seq_len``).
        vocab: the tokenizer's vocabulary size.
        options: the head's ``CrossEntropyOptions`` (None: megaloss's defaults, sum).
        tp_group: the tensor-parallel group (None: no tensor parallelism).

    Returns:
        ``(layers, config, parameters, state)``: the ``LayerSpec`` layers, the ``LlamaConfig``,
        the whole model's parameter count (decoder + full lm_head; tied: counted once) and the
        state dict the layers load.
    """
    from megaloss.integrations.deepspeed.pipeline_llama import llama_pipeline_layers
    from megaloss.parallel.groups import SINGLE_RANK

    model, cfg = build_llama(args, vocab)
    n_params = sum(p.numel() for p in model.base_model.parameters()) + (
        0 if cfg.tie_word_embeddings else vocab * cfg.hidden_size)
    state = dict(model.state_dict())
    del model
    layers = llama_pipeline_layers(cfg, options=options,
                                   tp_group=SINGLE_RANK if tp_group is None else tp_group,
                                   state_dict=state)
    return layers, cfg, n_params, state


def build_pipeline_job(args: argparse.Namespace, ds_config: Dict[str, Any], ml: Any, vocab: int,
                       out_dir: str, log: Callable[[str], Any]) -> PipelineJob:
    """The pipeline layout, the Llama of ``args`` in stages and the calibrated pipeline engine
    (collective). A ZeRO stage > 1 in ``ds_config`` is lowered to 1 (logged)."""
    from megaloss.integrations.deepspeed.pipeline import (
        PIPELINE_ZERO_STAGES,
        build_pipeline_layout,
        initialize_pipeline,
        pipeline_evaluate,
        pipeline_train_step,
    )

    _check_job_arguments(ml)
    zero = ds_config.setdefault("zero_optimization", {})
    asked = int(zero.get("stage", 0))
    if asked not in PIPELINE_ZERO_STAGES:
        zero["stage"] = max(PIPELINE_ZERO_STAGES)
        log(f"pipeline parallelism: DeepSpeed's pipeline engine supports ZeRO stages "
            f"{PIPELINE_ZERO_STAGES} only; the ds_config asks for ZeRO-{asked}, running at "
            f"ZeRO-{zero['stage']}")
    layout = build_pipeline_layout(ml.pipeline_parallel_size, ml.tensor_parallel_size)
    layers, cfg, n_params, state = llama_stage_layers(args, vocab, options=ml.ce.options(),
                                                      tp_group=layout.topology.tp_group)
    me = initialize_pipeline(layers, ds_config, layout=layout, output_dir=out_dir,
                             activation_checkpoint_interval=int(
                                 getattr(args, "activation_checkpointing", False)))
    # the stages copied their weights: free the other stages' ones on this rank
    state.clear()
    micro = int(me.engine.train_micro_batch_size_per_gpu())

    def evaluate(batches, log: bool = True):
        # eval_batch() keeps the stage buffers' shapes: full micro-batches only
        return pipeline_evaluate(me, [b for b in batches if b["input_ids"].shape[0] == micro],
                                 log=log)

    return PipelineJob(me, cfg, n_params, lambda mbs: pipeline_train_step(me, mbs), evaluate)


def gather_per_rank(value: float) -> Optional[List[float]]:
    """``value`` of every rank, in rank order (collective; None without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, float(value))
    return out
