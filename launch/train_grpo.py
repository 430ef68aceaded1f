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
from typing import Any, Dict, List, Optional, Sequence

import torch

from launch.jobs.arguments import (
    add_job_arguments,
    add_llama_arguments,
    add_run_arguments,
    add_text_arguments,
    check_job_arguments,
    job_parser,
    policy_llama_default,
    require_at_least,
)
from launch.jobs.grpo_task import TASKS, ListTask, build_task
from launch.jobs.layouts import rank_share
from launch.jobs.reporting import Curve
from launch.jobs.rollout import completion_log_probs, generate_completions, make_rollout
from launch.jobs.runner import StopRequest, Table, run, run_job
from launch.jobs.sft_phases import SFTThen


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


def _draw(task: ListTask, n: int, seed: int, *, held_out: bool) -> torch.Tensor:
    """``n`` lists, the same on every rank (each takes its share)."""
    return task.draw(n, torch.Generator().manual_seed(seed), held_out=held_out)


def _task_key(task: ListTask) -> Dict[str, Any]:
    """What a checkpoint's task must match on resume (the prompts, answers and positions)."""
    return {"kind": task.kind, "items": list(task.items), "length": task.length,
            "held_out_lists": task.eval_fraction}


# the job ----------------------------------------------------------------------------------------
class GRPO(SFTThen):
    """The job for the runner (:mod:`launch.jobs.runner`): SFT steps, then GRPO steps
    (:mod:`launch.jobs.sft_phases`), the held-out greedy reward at initialisation, after SFT,
    every ``--eval_every`` GRPO steps and after."""

    tag, title, second, second_title = "grpo", "megaloss GRPO job", "grpo", "GRPO"
    columns = ("phase", "step", "optimizer_step", "loss", "reward", "num_tokens", "lr", "kl",
               "entropy", "clip_ratio", "eval_reward")
    figure = ("held-out reward", "reward")
    task_key, task_flags = "task", "--task / --num_items / --list_length / --held_out_lists"
    whole_model = ("the GRPO job generates with the whole lm_head on every rank",
                   "that generate() needs whole")
    before_after, train_figure = ("reward",), ("train_reward", "reward")

    def task(self) -> Dict[str, Any]:
        return _task_key(self.list_task)

    def configure(self) -> dict:
        ds_config = super().configure()
        rows = ds_config.get("train_micro_batch_size_per_gpu", 1) * \
            ds_config.get("gradient_accumulation_steps", 1)
        if rows % self.args.num_generations:
            raise SystemExit(f"train_micro_batch_size_per_gpu x gradient_accumulation_steps = "
                             f"{rows} completions per rank and step is not a multiple of "
                             f"--num_generations {self.args.num_generations}")
        return ds_config

    def set_loss(self) -> None:
        self.prompts_per_rank = self.micro * self.gas // self.args.num_generations
        self.opts = self.ml.policy.options()
        self.needs_reference = self.opts.beta > 0

    def prepare_data(self, train_stream: torch.Tensor, eval_stream: torch.Tensor) -> int:
        """The task's items from the text, an example list (logged), the held-out lists; the
        model's positions: a prompt and its answer."""
        args, tok = self.args, self.tok
        self.list_task = task = build_task(tok, train_stream, kind=args.task,
                                           num_items=args.num_items, length=args.list_length,
                                           eval_fraction=args.held_out_lists)
        example = task.draw(1, torch.Generator().manual_seed(args.seed), held_out=False)
        self.run.log(f"task: {tok.decode(task.prompts(example)[0].tolist())!r} -> "
                     f"{tok.decode(task.answers(example)[0].tolist())!r} ({len(task.items)} "
                     f"items, {task.length} per list)")
        self.held = rank_share(_draw(task, args.eval_prompts // self.dp * self.dp,
                                     args.seed + 1, held_out=True), self.dp, self.dp_rank)
        return task.sequence_length

    def describe_loss(self) -> str:
        return f"policy {self.opts}"

    def lists(self, n: int, seed: int) -> torch.Tensor:
        """This rank's share of ``n`` training lists drawn from ``seed``."""
        return rank_share(_draw(self.list_task, n, seed, held_out=False), self.dp,
                          self.dp_rank)

    def evaluate(self) -> Dict[str, Any]:
        return _evaluate(self.model, self.list_task, self.held, self.topo.dp_group)

    def eval_rows(self, result: Dict[str, Any]) -> List[tuple]:
        return [("held-out reward (greedy)", f"{result['reward']:.3f}"),
                ("held-out exact answers", f"{result['exact']:.3f}")]

    def sft_batches(self, s: int) -> List[Dict[str, Any]]:
        task, p_len = self.list_task, self.list_task.prompt_length
        lists = self.lists(self.micro * self.gas * self.dp, self.args.seed * 1_000_003 + s)
        ids = torch.cat([task.prompts(lists), task.answers(lists)], dim=1)
        labels = torch.full_like(ids, -100)
        labels[:, p_len - 1:-1] = ids[:, p_len:]
        return [{"input_ids": i, "shift_labels": y}
                for i, y in zip(ids.chunk(self.gas), labels.chunk(self.gas))]

    def begin_second(self) -> None:
        """The reference policy (the SFT model, frozen) when the KL ``beta`` > 0, and the
        sampling temperature."""
        if self.needs_reference:
            self.ref = self.reference_module(temperature=self.args.temperature)
        # the policy loss scores completions under the distribution they were sampled from
        self.engine.module.temperature = self.args.temperature

    def second_step(self, s: int) -> Dict[str, Any]:
        from megaloss.integrations.deepspeed import policy_train_step

        args, task, engine, micro = self.args, self.list_task, self.engine, self.micro
        lists = self.lists(self.prompts_per_rank * self.dp,
                           args.seed * 1_000_003 + 500_000 + s)
        torch.manual_seed(args.seed * 1_000_003 + 7919 * s + self.dp_rank)  # this rank's samples
        completions = generate_completions(self.model, task.prompts(lists), task.length,
                                           num_generations=args.num_generations,
                                           temperature=args.temperature)
        rewards = task.reward(completions,
                              task.answers(lists).repeat_interleave(args.num_generations, 0))
        rollout = make_rollout(task.prompts(lists), completions, rewards, args.num_generations,
                               scale_rewards=not args.no_scale_rewards)
        if self.ref is not None:
            rollout.ref_log_probs = completion_log_probs(self.ref, rollout, micro, engine.device)
        if args.num_iterations > 1:
            rollout.old_log_probs = completion_log_probs(engine, rollout, micro, engine.device)
        for _ in range(args.num_iterations):
            m = policy_train_step(self.me, rollout.micro_batches(self.gas),
                                  options=self.opts).as_dict()
        reward = _global_mean(rewards, self.topo.dp_group, engine.device)
        eval_reward = ""
        if args.eval_every and s % args.eval_every == 0 and s != args.steps:
            eval_reward = self.evaluate_at(phase="grpo", step=s)["reward"]
        if s % max(1, args.steps // 10) == 0 or s == args.steps:
            self.run.log(f"GRPO step {s}/{args.steps}: train reward {reward:.3f}, loss "
                         f"{m['loss']:.4f}"
                         + (f", held-out reward {eval_reward:.3f}" if eval_reward != "" else ""))
        return self.row("grpo", s, m, reward=reward, kl=m.get("kl", ""),
                        entropy=m.get("entropy", ""),
                        clip_ratio=m.get("clip_ratio/region_mean", ""), eval_reward=eval_reward)

    def summary(self) -> Dict[str, Any]:
        args, task, tok = self.args, self.list_task, self.tok
        return {
            **self.phase_summary(),
            "task": {"kind": task.kind, "items": [tok.decode([i]) for i in task.items],
                     "list_length": task.length, "held_out_lists": task.eval_fraction,
                     "eval_prompts": int(self.held.shape[0] * self.dp)},
            "num_generations": args.num_generations,
            "prompts_per_step": self.prompts_per_rank * self.dp,
            "num_iterations": args.num_iterations, "temperature": args.temperature,
            "scale_rewards": not args.no_scale_rewards, "policy": vars(self.opts)}

    def plot(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        grpo_rows = self.second_rows()
        grpo_evals = [e for e in self.run.evals if e["phase"] != "init"]
        task = self.list_task
        return {"curves": [
            Curve("train reward (sampled)", [r["step"] for r in grpo_rows],
                  [r["reward"] for r in grpo_rows]),
            Curve("held-out reward (greedy)", [e["step"] for e in grpo_evals],
                  [e["reward"] for e in grpo_evals], "o-")],
            "title": f"megaloss GRPO: {summary['model']}, {task.kind} of {task.length} words",
            "ylabel": "reward", "xlabel": "GRPO step (0: after SFT)", "grid": True}

    def table(self, summary: Dict[str, Any]) -> Table:
        rows = [("held-out reward (greedy)", *self.cells(summary, "reward")),
                ("held-out exact answers", *self.cells(summary, "exact"))]
        if summary["train_reward_first"] is not None:
            rows.append(("train reward (sampled; first / last GRPO step)", "-",
                         f"{summary['train_reward_first']:.3f}",
                         f"{summary['train_reward_last']:.3f}"))
        return Table("megaloss GRPO job", rows, (
            f"{summary['sft_steps']} SFT + {summary['steps']} GRPO steps in "
            f"{summary['train_seconds']:.1f} s, DP={summary['dp']}, "
            f"ZeRO-{summary['zero_stage']}, {summary['prompts_per_step']} prompts x "
            f"{summary['num_generations']} completions per step, loss_type "
            f"{summary['policy']['loss_type']}, beta {summary['policy']['beta']:g}, "
            f"{summary['model']}"), ("metric", "init", "after SFT", "after GRPO"))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    add_job_arguments(p, steps=40, output_dir=os.path.join("runs", "grpo"), config="grpo.json",
                      config_help="ds_config JSON; its 'megaloss.policy' section sets the GRPO "
                      "loss (loss_type, clipping, beta); tensor_parallel_size 1, ZeRO 0-2")
    add_text_arguments(p, "data (the items of the task's lists)",
                       "the LM jobs' held-out text (only its tokenizer cache key depends on it)")
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
    add_llama_arguments(p, default_size=None)  # None: 2 layers x 64 (policy_llama_default)
    add_run_arguments(p)  # --save_every, --resume, --eval_only, --overwrite, --keep_checkpoints
    args = p.parse_args(argv)
    require_at_least(p, args, ("steps", "num_items", "list_length", "eval_prompts",
                               "num_iterations"))
    require_at_least(p, args, ("num_generations", ), 2)
    require_at_least(p, args, ("sft_steps", "eval_every"), 0)
    if not args.temperature > 0:
        p.error("--temperature must be > 0")
    if not 0 < args.held_out_lists < 1:
        p.error("--held_out_lists must be in (0, 1)")
    policy_llama_default(args)
    return check_job_arguments(p, args)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run(GRPO(parse_args(argv)), StopRequest)


if __name__ == "__main__":
    run_job(main)
