#!/usr/bin/env python3
"""Train the LM job's small Llama with megaloss's chunked cross-entropy under PyTorch FSDP2
(``torch.distributed.fsdp.fully_shard``) instead of DeepSpeed.

Run through ``torchrun`` with the repository root on ``PYTHONPATH``, as
``launch/train_lm_fsdp.sh`` does::

    PYTHONPATH=. torchrun --nproc_per_node 2 launch/train_lm_fsdp.py

or as one process from the repository root: ``python -m launch.train_lm_fsdp``.

The data, tokenizer, model, held-out perplexity and outputs are those of ``launch/train_lm.py``
(:mod:`launch.jobs.lm_data`, :func:`launch.jobs.models.build_llama`, ``metrics.csv`` /
``loss_curve.png`` / ``summary.json``). The model is wrapped in :class:`megaloss.CausalLMWithLoss`
(its lm_head becomes a head module whose own forward computes the chunked CE, so the weight is
used inside an FSDP-managed forward; see ``megaloss/integrations/hf/causal_lm.py``), then
``fully_shard`` is applied to every decoder layer and to the wrapper as root (torchtitan's layout,
the head in the root unit) on a 1-D mesh over all processes. Every optimizer step is calibrated
globally (megaloss's one calibrated step on its FSDP2 adapter,
:class:`megaloss.integrations.fsdp.FSDPStepEngine`): :class:`megaloss.LossCalibrator`
(``--loss_reduction``, token mean by default) with the
gradient factor of FSDP2 measured at start-up by :func:`megaloss.calibration.probe_fsdp`;
gradient accumulation keeps the gradients local on non-final micro-batches
(``set_requires_gradient_sync(False)``); AdamW with a linear warm-up and gradient clipping.

``--tensor_parallel_size N`` (FSDP2 x tensor parallelism on a ``(dp, tp)`` mesh): the lm_head is
split over the vocabulary across the ``tp`` ranks (``ColwiseParallel``: a ``Shard(0)`` DTensor),
and :class:`VocabParallelCausalLM` computes megaloss's vocab-parallel CE on this rank's rows
(:meth:`megaloss.VocabParallelOptions.from_dtensor`) inside the FSDP-managed forward; the decoder
is replicated over ``tp`` and everything is ``fully_shard``-ed over ``dp``.

Checkpoints (``--save_every N``, ``--resume [latest|PATH]``, ``--eval_only``) are
``torch.distributed.checkpoint`` (DCP) folders of the sharded model and optimizer state
(``get_state_dict`` / ``set_state_dict`` of ``torch.distributed.checkpoint.state_dict``) with the
job's record beside them; SIGTERM / SIGINT / SIGUSR1 save at the next step boundary. The data
position follows from the step, so a resumed run sees the batches an uninterrupted one would.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List, Optional, Sequence

import torch

from launch.jobs.arguments import (
    add_lm_job_arguments,
    check_job_arguments,
    job_parser,
    require_at_least,
)
from launch.jobs.fsdp_checkpoints import FSDPCheckpoints
from launch.jobs.lm_data import eval_batches, load_blocks
from launch.jobs.lm_job import LMJob
from launch.jobs.models import build_llama
from launch.jobs.processes import start_torchrun_process
from launch.jobs.runner import StopRequest, Table, run, run_job
from megaloss.integrations.fsdp import FSDPStepEngine
from megaloss.integrations.step import run_step
from megaloss.integrations.step.lm import LanguageModelLoss, evaluate_lm


def gather_per_rank(value: float) -> List[float]:
    """``value`` of every rank, in rank order (collective)."""
    import torch.distributed as dist

    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# model ------------------------------------------------------------------------------------------
class VocabParallelCausalLM(torch.nn.Module):
    """A ``transformers`` ``*ForCausalLM`` whose lm_head weight is a ``Shard(0)`` DTensor over the
    TP mesh dimension (``parallelize_module(lm_head, tp_mesh, ColwiseParallel())``), with the
    loss in its forward: decoder (replicated over TP), then :func:`megaloss.linear_cross_entropy`
    on this rank's vocabulary rows (:meth:`megaloss.VocabParallelOptions.from_dtensor`, read
    inside the forward, where FSDP2 has unsharded the weight over the data-parallel dimension).
    The lm_head module's own forward (and ColwiseParallel's hooks) never runs: no logits."""

    def __init__(self, model: torch.nn.Module, options) -> None:
        super().__init__()
        self.model = model
        self.options = options

    def forward(self, input_ids: torch.Tensor, *, shift_labels: torch.Tensor,
                loss_weights: Optional[torch.Tensor] = None):
        from megaloss import VocabParallelOptions, linear_cross_entropy

        hidden = self.model.model(input_ids=input_ids, use_cache=False).last_hidden_state
        weight, vp = VocabParallelOptions.from_dtensor(self.model.lm_head.weight)
        return linear_cross_entropy(hidden, weight, shift_labels, loss_weights=loss_weights,
                                    options=self.options, vocab_parallel_options=vp,
                                    return_stats=True)


def build_wrapper(model: torch.nn.Module, options, mesh, tp: int, device: torch.device):
    """The model with the loss in its forward: :class:`megaloss.CausalLMWithLoss` (TP 1), or
    the lm_head made a ``Shard(0)`` DTensor over ``mesh["tp"]`` by ``ColwiseParallel`` inside
    :class:`VocabParallelCausalLM` (TP > 1)."""
    from megaloss import CausalLMWithLoss

    if tp == 1:
        return CausalLMWithLoss(model, options=options).to(device)
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = model.to(device)
    parallelize_module(model.lm_head, mesh["tp"], ColwiseParallel())
    return VocabParallelCausalLM(model, options)


def shard_model(wrapper: torch.nn.Module, model: torch.nn.Module, mesh, reshard: bool) -> None:
    """``fully_shard`` every decoder layer, then the wrapper as root (embedding, final norm and
    the loss head in the root unit: a tied embedding stays in one group with the head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(wrapper, mesh=mesh, reshard_after_forward=reshard)


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """The lr of optimizer step ``step`` (1-based): linear warm-up, then constant."""
    if args.warmup_steps <= 0:
        return args.lr
    return args.lr * min(1.0, step / args.warmup_steps)


# the metrics.csv columns of a step (megaloss's StepMetrics but the distillation fields), then
# the job's sample count
ROW_KEYS = ("step", "loss", "z_loss", "num_tokens", "lr", "grad_norm", "tokens_per_s",
            "peak_memory_mib", "step_time_s")


# the job ----------------------------------------------------------------------------------------
class FSDPLM(LMJob):
    """The job for the runner (:mod:`launch.jobs.runner`): the Llama of ``args`` ``fully_shard``
    -ed over the processes (x TP), :func:`train_step` and :func:`evaluate` above, DCP
    checkpoints (:class:`launch.jobs.fsdp_checkpoints.FSDPCheckpoints`)."""

    tag, title, name = "lm-fsdp", "megaloss LM job (FSDP2)", "lm_fsdp"

    def start_process(self) -> int:
        rank, self.world, self.device = start_torchrun_process(self.args.output_dir)
        return rank

    def build(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from megaloss import CrossEntropyOptions, LossCalibrator, Topology
        from megaloss.calibration import probe_fsdp

        args, world, device, log = self.args, self.world, self.device, self.run.log
        self.micro, self.gas = micro, gas = args.micro_batch_size, args.gradient_accumulation_steps
        tp = args.tensor_parallel_size
        if world % tp:  # what parse_args checks too, when the world size is known to it
            raise SystemExit(f"--tensor_parallel_size {tp} does not divide the {world} processes")
        self.dp = dp = world // tp
        self.tok, self.train_blocks, held_blocks, self.info, self.data_key = load_blocks(args, log)
        self.vocab = vocab = self.tok.get_vocab_size()
        model, self.cfg = build_llama(args, vocab)
        self.n_params = sum(p.numel() for p in model.base_model.parameters()) + (
            0 if self.cfg.tie_word_embeddings else vocab * self.cfg.hidden_size)
        options = CrossEntropyOptions(reduction="sum", chunk_size=args.chunk_size,
                                      z_loss=args.z_loss)
        if tp == 1:
            mesh = init_device_mesh(device.type, (world,))
            dp_mesh, topo = mesh, Topology.default()
        else:
            mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
            dp_mesh, topo = mesh["dp"], Topology.from_device_mesh(mesh)
        self.wrapper = wrapper = build_wrapper(model, options, mesh, tp, device)
        shard_model(wrapper, model, dp_mesh, reshard=not args.no_reshard_after_forward)
        self.scale = scale = probe_fsdp(wrapper, gas=gas, accumulation="no_sync")
        self.calib = LossCalibrator(topo, loss_reduction=args.loss_reduction, engine_scale=scale)
        self.dp_rank = topo.dp_rank
        decay = [p for p in wrapper.parameters() if p.ndim >= 2]
        no_decay = [p for p in wrapper.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
        log(f"FSDP2 ready: {world} processes ({device.type}), DP={dp} x TP={tp}, micro-batch "
            f"{micro} x GAS {gas} x DP {dp} = {micro * gas * dp} x {args.seq_len} tokens/step, "
            f"{self.n_params / 1e6:.2f} M params, measured loss multiplier "
            f"{scale.loss_multiplier:g} ({scale.engine}), loss_reduction {args.loss_reduction}")
        self.held = eval_batches(held_blocks, micro, dp, topo.dp_rank)
        self.checkpoints = FSDPCheckpoints(wrapper, self.opt, self.tok, self.data_key)
        # megaloss's FSDP2 adapter to its one calibrated step: gradients reduce-scattered at
        # the step's last micro-batch, the warm-up lr, clipping, AdamW
        self.step_engine = FSDPStepEngine(
            wrapper, self.opt, self.calib, max_grad_norm=args.grad_clip,
            lr_schedule=lambda k: learning_rate(args, k), gradient_accumulation_steps=gas,
            tensor_parallel_size=tp)

    def begin(self, start: int) -> None:
        super().begin(start)
        self.wrapper.train()
        self.step_engine.steps_done = start

    def step(self, step: int) -> Dict[str, Any]:
        m = run_step(self.step_engine, LanguageModelLoss(), next(self.batches), log=False)
        row = {k: v for k, v in m.as_dict().items() if k in ROW_KEYS}
        row["samples"] = step * self.micro * self.gas * self.dp
        return row

    def evaluate(self) -> Dict[str, Any]:
        was_training = self.wrapper.training
        self.wrapper.eval()
        result = evaluate_lm(self.wrapper, self.held, self.calib.topology,
                             ignore_index=self.calib.ignore_index, device=self.device)
        self.wrapper.train(was_training)
        return vars(result)

    def summary(self) -> Dict[str, Any]:
        args, scale = self.args, self.scale
        return {
            **self.run_summary(), "engine": "fsdp2", "dp": self.dp, "sp": 1,
            "tp": args.tensor_parallel_size, "pp": 1,
            "reshard_after_forward": not args.no_reshard_after_forward,
            "loss_reduction": args.loss_reduction, "vocab_size": self.vocab,
            "parameters": int(self.n_params), "engine_loss_multiplier": scale.loss_multiplier,
            "engine_scale": scale.engine,
            "ce": {"chunk_size": args.chunk_size, "z_loss": args.z_loss,
                   "loss_reduction": args.loss_reduction},
            "optimizer": {"type": "AdamW", "lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                          "weight_decay": args.weight_decay, "warmup_steps": args.warmup_steps,
                          "grad_clip": args.grad_clip},
            "model": f"Llama {self.cfg.num_hidden_layers}L x {self.cfg.hidden_size}", **self.info,
        }

    def gather_per_rank(self, value: Any) -> Any:
        return gather_per_rank(value)

    def local_parameters(self) -> int:
        return sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                   for p in self.wrapper.parameters())

    def plot_title(self, summary: Dict[str, Any]) -> str:
        return f"megaloss LM (FSDP2): {summary['model']} on {summary['data']}"

    def table(self, summary: Dict[str, Any]) -> Table:
        """The before/after table of held-out perplexity and losses, with the run's figures."""
        return self.lm_table(summary, "megaloss LM job (FSDP2)", self.run_info(
            summary, f"FSDP2 DP={summary['dp']} x TP={summary['tp']}",
            "measured loss multiplier"))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    g = p.add_argument_group("FSDP2 training (defaults: configs/zero2.json's)")
    g.add_argument("--micro_batch_size", type=int, default=8,
                   help="blocks per process per micro-batch")
    g.add_argument("--gradient_accumulation_steps", type=int, default=2,
                   help="micro-batches per optimizer step (gradients kept local until the last)")
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate")
    g.add_argument("--warmup_steps", type=int, default=10,
                   help="linear warm-up: step k uses lr x min(1, k / warmup_steps)")
    g.add_argument("--weight_decay", type=float, default=0.01)
    g.add_argument("--grad_clip", type=float, default=1.0,
                   help="clip the global gradient norm to this (0: no clipping)")
    g.add_argument("--chunk_size", type=int, default=1024,
                   help="tokens per chunk of megaloss's chunked CE")
    g.add_argument("--z_loss", type=float, default=1e-4, help="z-loss coefficient")
    g.add_argument("--loss_reduction", choices=("token", "sample", "square"), default="token",
                   help="global loss calibration (megaloss.LossCalibrator): token mean, mean of "
                        "per-sample means, or 1/sqrt(n) sample weights")
    g.add_argument("--no_reshard_after_forward", action="store_true",
                   help="keep the unsharded parameters from forward to backward (fewer "
                        "all-gathers, more memory)")
    g.add_argument("--tensor_parallel_size", type=int, default=1,
                   help="FSDP2 x tensor parallelism: the lm_head split over the vocabulary "
                        "(ColwiseParallel, a Shard(0) DTensor) across this many ranks, "
                        "megaloss's vocab-parallel CE on its shard, the decoder replicated over "
                        "them; NUM_PROCS must be a multiple of it")
    add_lm_job_arguments(p, steps=150, output_dir=os.path.join("runs", "lm_fsdp"))
    args = p.parse_args(argv)
    require_at_least(p, args, ("steps", "micro_batch_size", "gradient_accumulation_steps",
                               "tensor_parallel_size", "chunk_size"))
    if args.warmup_steps < 0:
        p.error("--warmup_steps must be >= 0")
    if args.tensor_parallel_size > 1 and args.tie_word_embeddings:
        p.error(f"--tie_word_embeddings with --tensor_parallel_size {args.tensor_parallel_size}: "
                "this job splits only the lm_head over the TP ranks, and a tied input "
                "embedding would have to be split with it; untie it, or use "
                "launch/train_lm.sh (DeepSpeed, VocabParallelEmbedding)")
    world = os.environ.get("MEGALOSS_WORLD_SIZE") or os.environ.get("WORLD_SIZE")
    if world and int(world) % args.tensor_parallel_size:
        p.error(f"--tensor_parallel_size {args.tensor_parallel_size} does not divide the "
                f"{world} processes; set NUM_PROCS to a multiple of it")
    return check_job_arguments(p, args)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run(FSDPLM(parse_args(argv)), StopRequest)


if __name__ == "__main__":
    run_job(main)
