#!/usr/bin/env python3
"""Train a tiny Llama with a few SFT steps, then GRPO on a verifiable task, under DeepSpeed.

Run through the launcher with the repository root on ``PYTHONPATH``, as ``launch/train_grpo.sh``
does::

    PYTHONPATH=. deepspeed --num_gpus 2 launch/train_grpo.py --deepspeed_config configs/grpo.json

or as one process from the repository root: ``python -m launch.train_grpo``.

Data and task (:mod:`launch.jobs.grpo_task`): the LM jobs' built-in text (this interpreter's
standard library, BPE tokenizer cached, :mod:`launch.jobs.lm_data`) supplies the items, its most
frequent one-word tokens; a prompt is ``"reverse: <w1> ... <wL> =>"`` and the reward the share
of answer positions a completion gets right (in [0, 1]). Held-out lists are never trained on.

Phases, on one DeepSpeed engine (ZeRO-2, data parallel) whose module returns per-token
log-probs (:func:`megaloss.linear_log_probs`, no ``[tokens, vocab]`` logits,
:mod:`launch.jobs.policy_model`):

1. SFT (``--sft_steps``): the answers' negative log-likelihood, calibrated over DP x GAS
   (:mod:`launch.jobs.sft_step`);
2. GRPO (``--steps``): per step every rank samples ``--num_generations`` completions of its
   prompts with the model's own ``generate`` (:mod:`launch.jobs.rollout`), scores them,
   normalises the rewards within each group, takes the reference policy's log-probs (the SFT
   model, frozen) when the KL ``beta`` > 0 and the old policy's when ``--num_iterations`` > 1,
   and runs :func:`megaloss.integrations.deepspeed.policy_train_step` (the ds_config's
   ``megaloss.policy`` section: ``loss_type``, clipping, ``beta``; the loss normalised over the
   global batch of the step).

Reports the held-out greedy reward at initialisation, after SFT (``reward_before``) and after
GRPO (``reward_after``), writes ``metrics.csv`` (one row per step of either phase),
``loss_curve.png`` (rewards against the step) and ``summary.json`` to ``--output_dir`` (default
``runs/grpo``; a folder that holds a run is refused unless ``--resume`` or ``--overwrite``).

Checkpoints, resume and preemption are the LM job's (``launch/train_lm.py``,
:mod:`launch.jobs.checkpoints`): ``--save_every N``, ``--resume [latest|PATH]``, ``--eval_only``,
``--keep_checkpoints``; SIGTERM / SIGINT / SIGUSR1 save at the next step boundary and write what
ran. The job's steps are its SFT steps then its GRPO steps (``--sft_steps + --steps``, the
checkpoints ``step_<k>`` counted over both); a checkpoint holds, besides DeepSpeed's engine state
and every rank's RNG states, the metrics and evaluations so far and, from the first GRPO step,
the reference policy's weights (the SFT model). Each step's lists and each rank's sampling seed
are drawn from ``(--seed, step, rank)``, so a resumed run draws the same rollouts and continues
bitwise as if uninterrupted.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from launch.jobs.arguments import (
    add_job_arguments,
    add_llama_arguments,
    check_input_files,
    job_parser,
    require_at_least,
)
from launch.jobs.grpo_task import TASKS, ListTask, build_task
from launch.jobs.lm_data import load_data
from launch.jobs.models import build_llama
from launch.jobs.policy_model import CausalLMLogProbs
from launch.jobs.reporting import (
    Curve,
    plot_loss_curve,
    print_summary_table,
    rank0_logger,
    write_metrics_csv,
    write_summary_json,
)
from launch.jobs.rollout import completion_log_probs, generate_completions, make_rollout
from launch.jobs.runs import (
    CHECKPOINTS,
    StopRequest,
    TrainLoop,
    add_run_arguments,
    check_run_arguments,
    checkpoint_stats,
    finish_run,
    open_run,
    quiet_job_environment,
    report_checkpoint_eval,
    resume_job_state,
    run_job,
    save_run,
    start_process,
)
from launch.jobs.sft_step import sft_step

quiet_job_environment()

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    p.add_argument("--deepspeed_config", type=str, default=str(REPO / "configs" / "grpo.json"),
                   help="ds_config JSON; its 'megaloss.policy' section sets the GRPO loss "
                        "(loss_type, clipping, beta); tensor_parallel_size 1, ZeRO 0-2")
    add_job_arguments(p, steps=40, output_dir=os.path.join("runs", "grpo"))
    g = p.add_argument_group("data (the items of the task's lists)")
    g.add_argument("--train_data", nargs="*", default=None,
                   help="text files or directories (.py/.txt/.md/.rst); default: the stdlib")
    g.add_argument("--eval_data", nargs="*", default=None,
                   help="the LM jobs' held-out text (only its tokenizer cache key depends on it)")
    g.add_argument("--eval_fraction", type=float, default=0.05,
                   help="share of --train_data files held out when --eval_data is not given")
    g.add_argument("--max_train_bytes", type=int, default=2_500_000,
                   help="keep a strided subset of training files under this size (0: all)")
    g.add_argument("--vocab_size", type=int, default=2048, help="BPE vocabulary size")
    g = p.add_argument_group("task")
    g.add_argument("--task", choices=TASKS, default="reverse")
    g.add_argument("--num_items", type=int, default=16, help="distinct words a list draws from")
    g.add_argument("--list_length", type=int, default=5, help="words per list (answer tokens)")
    g.add_argument("--held_out_lists", type=float, default=0.1,
                   help="share of all lists held out from training (crc32 of the list)")
    g.add_argument("--eval_prompts", type=int, default=256, help="held-out lists evaluated")
    g = p.add_argument_group("SFT and GRPO")
    g.add_argument("--sft_steps", type=int, default=30,
                   help="supervised steps before GRPO (micro-batch x GAS x DP answers each)")
    g.add_argument("--num_generations", type=int, default=8,
                   help="completions per prompt (the group); micro-batch x GAS must be a "
                        "multiple of it")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    g.add_argument("--num_iterations", type=int, default=1,
                   help="optimizer steps on each rollout (> 1: the old policy's log-probs "
                        "are taken before the first, so the PPO ratio and clipping act)")
    g.add_argument("--no_scale_rewards", action="store_true",
                   help="advantages = reward - group mean, not divided by the group's std "
                        "(Dr. GRPO)")
    g.add_argument("--eval_every", type=int, default=10,
                   help="GRPO steps between held-out evaluations (0: only before and after)")
    add_llama_arguments(p)
    add_run_arguments(p)  # --save_every, --resume, --eval_only, --overwrite, --keep_checkpoints
    p.set_defaults(model_size=None)  # None: 2 layers x 64 (the named sizes learn slower on CPU)
    args = p.parse_args(argv)
    if args.model_size is None:
        args.model_size = "small"  # its head layout; the width and depth below
        args.hidden_size = args.hidden_size or 64
        args.num_layers = args.num_layers or 2
    require_at_least(p, args, ("steps", "num_items", "list_length", "eval_prompts",
                               "num_iterations"))
    require_at_least(p, args, ("num_generations", ), 2)
    require_at_least(p, args, ("sft_steps", "eval_every"), 0)
    if not args.temperature > 0:
        p.error("--temperature must be > 0")
    if not 0 < args.held_out_lists < 1:
        p.error("--held_out_lists must be in (0, 1)")
    check_run_arguments(p, args)
    check_input_files(p, args)
    return args


def _check_layout(ds_config: Dict[str, Any], ml, args) -> None:
    """Refuse what this job cannot honour (the same verdict on every rank)."""
    if ml.tensor_parallel_size != 1 or ml.sequence_parallel_size != 1:
        raise SystemExit(f"{args.deepspeed_config}: the GRPO job generates with the whole "
                         "lm_head on every rank; set megaloss.tensor_parallel_size and "
                         "sequence_parallel_size to 1")
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage == 3:
        raise SystemExit(f"{args.deepspeed_config}: ZeRO-3 partitions the weights that "
                         "generate() needs whole; use ZeRO stage 0, 1 or 2")
    rows = ds_config.get("train_micro_batch_size_per_gpu", 1) * \
        ds_config.get("gradient_accumulation_steps", 1)
    if rows % args.num_generations:
        raise SystemExit(f"train_micro_batch_size_per_gpu x gradient_accumulation_steps = {rows} "
                         f"completions per rank and step is not a multiple of "
                         f"--num_generations {args.num_generations}")


def _global_mean(values: torch.Tensor, group, device) -> float:
    """Mean of ``values`` over every rank of ``group`` (one all-reduce of sum and count, on
    ``device``: NCCL reduces only CUDA tensors)."""
    import torch.distributed as dist

    s = torch.tensor([values.double().sum().item(), float(values.numel())], dtype=torch.float64,
                     device=device)
    dist.all_reduce(s, group=group)
    return float(s[0] / s[1]) if s[1] > 0 else 0.0


def _evaluate(model, task: ListTask, held: torch.Tensor, dp_group) -> Dict[str, float]:
    """Held-out greedy reward and exact-answer rate, over this rank's share of ``held``."""
    completions = generate_completions(model, task.prompts(held), task.length, greedy=True)
    reward = task.reward(completions, task.answers(held))
    return {"reward": _global_mean(reward, dp_group, model.device),
            "exact": _global_mean((reward == 1).float(), dp_group, model.device)}


def _rank_share(rows: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    n = rows.shape[0] // dp
    return rows[rank * n:(rank + 1) * n]


def _draw(task: ListTask, n: int, seed: int, *, held_out: bool) -> torch.Tensor:
    """``n`` lists, the same on every rank (each takes its share)."""
    return task.draw(n, torch.Generator().manual_seed(seed), held_out=held_out)


def _task_key(task: ListTask) -> Dict[str, Any]:
    """What a checkpoint's task must match on resume (the prompts, answers and positions)."""
    return {"kind": task.kind, "items": list(task.items), "length": task.length,
            "held_out_lists": task.eval_fraction}


def print_summary(summary: Dict[str, Any]) -> None:
    evals = [summary["eval_init"], summary["eval_before"], summary["eval_after"]]

    def cell(e, key):
        return "-" if e is None else f"{e[key]:.3f}"

    rows = [("held-out reward (greedy)", *(cell(e, "reward") for e in evals)),
            ("held-out exact answers", *(cell(e, "exact") for e in evals))]
    if summary["train_reward_first"] is not None:
        rows.append(("train reward (sampled; first / last GRPO step)", "-",
                     f"{summary['train_reward_first']:.3f}",
                     f"{summary['train_reward_last']:.3f}"))
    stopped = summary.get("stopped")
    info = (f"{summary['sft_steps']} SFT + {summary['steps']} GRPO steps in "
            f"{summary['train_seconds']:.1f} s, DP={summary['dp']}, ZeRO-{summary['zero_stage']}, "
            f"{summary['prompts_per_step']} prompts x {summary['num_generations']} completions "
            f"per step, loss_type {summary['policy']['loss_type']}, beta "
            f"{summary['policy']['beta']:g}, {summary['model']}"
            + (f"; stopped by {stopped['signal']} at step {stopped['step']} (resume with "
               "--resume)" if stopped else ""))
    print_summary_table("megaloss GRPO job", rows, info,
                        columns=("metric", "init", "after SFT", "after GRPO"))


# main -------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    from megaloss import Topology
    from megaloss.integrations.deepspeed import initialize, load_ds_config, policy_train_step

    rank, _ = start_process(args.local_rank, args.output_dir)
    out_dir = Path(args.output_dir)
    ckpt_dir = out_dir / CHECKPOINTS
    log = rank0_logger("grpo", rank, t_start)

    ds_config, ml = load_ds_config(args.deepspeed_config, output_dir=str(out_dir))
    _check_layout(ds_config, ml, args)
    resume_from = open_run(args, out_dir, ds_config)
    topo = Topology.build(1)
    dp, dp_rank = topo.dp_size, topo.dp_rank
    micro = ds_config.get("train_micro_batch_size_per_gpu", 1)
    gas = ds_config.get("gradient_accumulation_steps", 1)
    prompts_per_rank = micro * gas // args.num_generations
    opts = ml.policy.options()

    tok, train_stream, _, info, data_key = load_data(args)
    task = build_task(tok, train_stream, kind=args.task, num_items=args.num_items,
                      length=args.list_length, eval_fraction=args.held_out_lists)
    example = task.draw(1, torch.Generator().manual_seed(args.seed), held_out=False)
    log(f"task: {tok.decode(task.prompts(example)[0].tolist())!r} -> "
        f"{tok.decode(task.answers(example)[0].tolist())!r} ({len(task.items)} items, "
        f"{task.length} per list)")
    args.seq_len = task.sequence_length  # the model's positions
    model, cfg = build_llama(args, tok.get_vocab_size())
    n_params = sum(p.numel() for p in model.parameters())
    me = initialize(CausalLMLogProbs(model), ds_config, topology=topo, output_dir=str(out_dir))
    engine = me.engine
    log(f"engine ready: DP={dp}, ZeRO-{engine.zero_optimization_stage()}, {n_params / 1e6:.2f} M "
        f"params, measured engine loss multiplier {me.engine_scale.loss_multiplier:g}, policy "
        f"{opts}")

    held = _rank_share(_draw(task, args.eval_prompts // dp * dp, args.seed + 1, held_out=True),
                       dp, dp_rank)

    # what a resumed run needs besides the engine's own state (and the RNG states beside it)
    job_state: Dict[str, Any] = {"rows": [], "evals": [], "train_seconds": 0.0, "saves": [],
                                 "steps_done": 0, "sft_steps": args.sft_steps,
                                 "task": _task_key(task), "reference": None}
    if resume_from is not None:
        resume_from = resume_job_state(
            me, resume_from, job_state, {"data_key": data_key},
            "--train_data / --eval_data / --eval_fraction / --max_train_bytes / --vocab_size",
            log)
        for key, flags in (("sft_steps", "--sft_steps"),
                           ("task", "--task / --num_items / --list_length / --held_out_lists")):
            if job_state[key] != {"sft_steps": args.sft_steps, "task": _task_key(task)}[key]:
                raise SystemExit(f"checkpoint {resume_from} was trained with another {key} "
                                 f"({job_state[key]}): pass the same {flags}")
    start = int(job_state["steps_done"])
    saves_before = len(job_state["saves"])  # the resumed run's record; summary: this run's

    if args.eval_only:
        log(f"evaluating checkpoint {resume_from} (step {start})")
        result = _evaluate(model, task, held, topo.dp_group)
        return report_checkpoint_eval(out_dir, rank, "megaloss GRPO job", resume_from, start,
                                      result, [
                                          ("held-out reward (greedy)", f"{result['reward']:.3f}"),
                                          ("held-out exact answers", f"{result['exact']:.3f}")])

    rows: List[Dict[str, Any]] = job_state["rows"]
    evals: List[Dict[str, Any]] = job_state["evals"]
    saves: List[Dict[str, Any]] = job_state["saves"]
    if not evals:
        evals.append({"phase": "init", "step": 0, **_evaluate(model, task, held, topo.dp_group)})
        log(f"at initialisation: held-out reward {evals[0]['reward']:.3f}")
    p_len = task.prompt_length
    grpo: Dict[str, Any] = {"ref": None, "started": False}  # the GRPO phase's set-up

    def start_grpo() -> None:
        """After SFT: the held-out reward, the reference policy (the SFT model, frozen; read
        back from the checkpoint when resuming past this point) and the sampling temperature."""
        if not any(e["phase"] == "sft" for e in evals):
            evals.append({"phase": "sft", "step": 0,
                          **_evaluate(model, task, held, topo.dp_group)})
            log(f"after SFT: held-out reward {evals[-1]['reward']:.3f}")
        if opts.beta > 0:
            if job_state["reference"] is None:
                job_state["reference"] = {k: v.detach().cpu().clone()
                                          for k, v in model.state_dict().items()}
            ref_model, _ = build_llama(args, tok.get_vocab_size())
            ref_model.load_state_dict(job_state["reference"])
            ref_model.to(engine.device)
            grpo["ref"] = CausalLMLogProbs(ref_model.requires_grad_(False).eval(),
                                           return_entropy=False, temperature=args.temperature)
        # the policy loss scores completions under the distribution they were sampled from
        engine.module.temperature = args.temperature
        grpo["started"] = True

    def sft(s: int) -> Dict[str, Any]:
        lists = _rank_share(_draw(task, micro * gas * dp, args.seed * 1_000_003 + s,
                                  held_out=False), dp, dp_rank)
        ids = torch.cat([task.prompts(lists), task.answers(lists)], dim=1)
        labels = torch.full_like(ids, -100)
        labels[:, p_len - 1:-1] = ids[:, p_len:]
        m = sft_step(me, [{"input_ids": i, "shift_labels": y}
                          for i, y in zip(ids.chunk(gas), labels.chunk(gas))])
        if s % max(1, args.sft_steps // 5) == 0:
            log(f"SFT step {s}/{args.sft_steps}: loss {m['loss']:.4f}")
        return {"phase": "sft", "step": s, "optimizer_step": m["step"], "loss": m["loss"],
                "reward": "", "num_tokens": m["num_tokens"], "lr": m["lr"], "kl": "",
                "entropy": "", "clip_ratio": "", "eval_reward": ""}

    def grpo_step(s: int) -> Dict[str, Any]:
        lists = _rank_share(_draw(task, prompts_per_rank * dp, args.seed * 1_000_003 + 500_000 + s,
                                  held_out=False), dp, dp_rank)
        torch.manual_seed(args.seed * 1_000_003 + 7919 * s + dp_rank)  # this rank's samples
        completions = generate_completions(model, task.prompts(lists), task.length,
                                           num_generations=args.num_generations,
                                           temperature=args.temperature)
        rewards = task.reward(completions,
                              task.answers(lists).repeat_interleave(args.num_generations, 0))
        rollout = make_rollout(task.prompts(lists), completions, rewards, args.num_generations,
                               scale_rewards=not args.no_scale_rewards)
        if grpo["ref"] is not None:
            rollout.ref_log_probs = completion_log_probs(grpo["ref"], rollout, micro,
                                                         engine.device)
        if args.num_iterations > 1:
            rollout.old_log_probs = completion_log_probs(engine, rollout, micro, engine.device)
        for _ in range(args.num_iterations):
            m = policy_train_step(me, rollout.micro_batches(gas), options=opts).as_dict()
        reward = _global_mean(rewards, topo.dp_group, engine.device)
        eval_reward = ""
        if args.eval_every and s % args.eval_every == 0 and s != args.steps:
            evals.append({"phase": "grpo", "step": s,
                          **_evaluate(model, task, held, topo.dp_group)})
            eval_reward = evals[-1]["reward"]
        if s % max(1, args.steps // 10) == 0 or s == args.steps:
            log(f"GRPO step {s}/{args.steps}: train reward {reward:.3f}, loss {m['loss']:.4f}"
                + (f", held-out reward {eval_reward:.3f}" if eval_reward != "" else ""))
        return {"phase": "grpo", "step": s, "optimizer_step": m["step"], "loss": m["loss"],
                "reward": reward, "num_tokens": m["num_tokens"], "lr": m["lr"],
                "kl": m.get("kl", ""), "entropy": m.get("entropy", ""),
                "clip_ratio": m.get("clip_ratio/region_mean", ""), "eval_reward": eval_reward}

    def save(step: int) -> None:
        job = {"name": "grpo", "data_key": data_key, "seed": args.seed,
               "sft_steps": args.sft_steps, "task": _task_key(task), "steps_done": step,
               "rows": rows, "evals": evals, "saves": saves, "train_seconds": loop.seconds,
               "reference": job_state["reference"]}
        save_run(me, ckpt_dir, step, job, tok, args.keep_checkpoints, saves, log,
                 tag=f"step_{step}")

    # one loop over the job's steps: SFT steps 1..sft_steps, then GRPO steps
    total = args.sft_steps + args.steps
    loop_args = argparse.Namespace(steps=total, no_progress=args.no_progress,
                                   save_every=args.save_every, resume=args.resume)
    stop = StopRequest().install()
    loop = TrainLoop(loop_args, start, job_state["train_seconds"], stop, engine.device, save, log)
    for step in loop:
        if step <= args.sft_steps:
            rows.append(sft(step))
        else:
            if not grpo["started"]:
                start_grpo()
            rows.append(grpo_step(step - args.sft_steps))
        last = rows[-1]
        loop.show(phase=last["phase"], loss=f"{last['loss']:.3f}")
    stopped, train_seconds = loop.stopped, loop.seconds
    done = rows[-1]["step"] if rows and rows[-1]["phase"] == "grpo" else 0
    if stopped is None and not (evals[-1]["phase"] == "grpo" and evals[-1]["step"] == done):
        evals.append({"phase": "grpo", "step": done,
                      **_evaluate(model, task, held, topo.dp_group)})
        log(f"after GRPO: held-out reward {evals[-1]['reward']:.3f} (after SFT "
            f"{evals[1]['reward']:.3f})")

    grpo_rows = [r for r in rows if r["phase"] == "grpo"]
    sft_rows = [r for r in rows if r["phase"] == "sft"]
    after_sft = next((e for e in evals if e["phase"] == "sft"), None)
    after = evals[-1] if stopped is None and evals[-1]["phase"] == "grpo" else None
    summary = {
        "eval_init": evals[0], "eval_before": after_sft, "eval_after": after,
        "reward_before": after_sft and after_sft["reward"],
        "reward_after": after and after["reward"],
        "evals": evals, "sft_steps": len(sft_rows), "steps": len(grpo_rows),
        "sft_steps_requested": args.sft_steps, "steps_requested": args.steps,
        "stopped": stopped, "resumed_from": resume_from and str(resume_from),
        "resumed_at_step": start,
        "sft_first_loss": sft_rows[0]["loss"] if sft_rows else None,
        "sft_last_loss": sft_rows[-1]["loss"] if sft_rows else None,
        "train_reward_first": grpo_rows[0]["reward"] if grpo_rows else None,
        "train_reward_last": grpo_rows[-1]["reward"] if grpo_rows else None,
        "train_seconds": train_seconds, "total_seconds": time.perf_counter() - t_start,
        "task": {"kind": task.kind, "items": [tok.decode([i]) for i in task.items],
                 "list_length": task.length, "held_out_lists": task.eval_fraction,
                 "eval_prompts": int(held.shape[0] * dp)},
        "num_generations": args.num_generations, "prompts_per_step": prompts_per_rank * dp,
        "num_iterations": args.num_iterations, "temperature": args.temperature,
        "scale_rewards": not args.no_scale_rewards, "policy": vars(opts),
        "dp": dp, "zero_stage": engine.zero_optimization_stage(), "micro_batch": micro,
        "gas": gas, "vocab_size": tok.get_vocab_size(), "parameters": int(n_params),
        "engine_loss_multiplier": me.engine_scale.loss_multiplier,
        "model": f"Llama {cfg.num_hidden_layers}L x {cfg.hidden_size}",
        "checkpoints": checkpoint_stats(saves, since=saves_before),
        "data": "stdlib" if not args.train_data else "user files", "data_key": data_key, **info,
    }

    def write_outputs() -> None:
        write_metrics_csv(out_dir / "metrics.csv", rows)
        write_summary_json(out_dir / "summary.json", summary)
        grpo_evals = [e for e in evals if e["phase"] != "init"]
        plot_loss_curve(
            out_dir / "loss_curve.png",
            [Curve("train reward (sampled)", [r["step"] for r in grpo_rows],
                   [r["reward"] for r in grpo_rows]),
             Curve("held-out reward (greedy)", [e["step"] for e in grpo_evals],
                   [e["reward"] for e in grpo_evals], "o-")],
            title=f"megaloss GRPO: {summary['model']}, {task.kind} of {task.length} words",
            ylabel="reward", xlabel="GRPO step (0: after SFT)", grid=True)

    finish_run(out_dir, rank, write_outputs, lambda: print_summary(summary), log,
               engine=engine, stop=stop)
    return summary


if __name__ == "__main__":
    run_job(main)
