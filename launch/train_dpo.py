#!/usr/bin/env python3
"""Train a tiny Llama with a few SFT steps, then preference training (DPO, SimPO, ORPO, CPO or
KTO) on pairs built from the built-in text, under DeepSpeed.

Run through the launcher with the repository root on ``PYTHONPATH``, as ``launch/train_dpo.sh``
does::

    PYTHONPATH=. deepspeed --num_gpus 2 launch/train_dpo.py --deepspeed_config configs/dpo.json

or as one process from the repository root: ``python -m launch.train_dpo``.

Data (:mod:`launch.jobs.preference_data`): the LM jobs' built-in text (this interpreter's standard
library, BPE tokenizer cached, :mod:`launch.jobs.lm_data`). A pair is a prompt of
``--prompt_length`` tokens of the text, *chosen* its real continuation (the next
``--completion_length`` tokens) and *rejected* another one (``--rejected other``, the default:
the continuation at another place of the text, so a model must read the prompt to tell them
apart; ``swap``: the real one with two neighbouring tokens exchanged; ``shuffle``: its tokens in
a random order).
Training pairs are drawn from the training files at offsets given by ``(--seed, step)``,
held-out pairs from the held-out files (never trained on).

Phases, on one DeepSpeed engine (ZeRO-2, data parallel) whose module returns per-token
log-probs (:class:`megaloss.CausalLMWithLogProbs`, no ``[tokens, vocab]`` logits,
:mod:`launch.jobs.policy_model`):

1. SFT (``--sft_steps``): the next-token NLL of the prompts with their real continuations,
   calibrated over DP x GAS (:mod:`launch.jobs.sft_step`);
2. preference training (``--steps``) with ``--loss``: ``dpo`` (:func:`megaloss.losses.dpo_loss`,
   the ds_config's ``megaloss.dpo`` section: ``loss_type``, ``beta``; a frozen reference, the
   SFT model), ``simpo`` (:func:`megaloss.losses.simpo_loss`, reference-free,
   length-normalised, margin ``--simpo_gamma``), ``orpo`` (:func:`megaloss.losses.orpo_loss`,
   odds ratio plus the chosen NLL, reference-free), ``cpo`` (:func:`megaloss.losses.cpo_loss`,
   sigmoid plus ``--cpo_alpha`` x NLL) or ``kto`` (:func:`megaloss.losses.kto_loss`, chosen rows
   desirable, rejected rows undesirable, the step's KL baseline; a frozen reference), every
   weight global over the step's pairs, each step megaloss's
   :func:`megaloss.integrations.deepspeed.preference_train_step`
   (:mod:`launch.jobs.preference_step` builds its micro-batches). The loss's options come from
   the ds_config's section of that name when it has one (``"megaloss": {"orpo": {"beta":
   0.2}}``; ``--loss`` defaults to that section's loss), ``--beta``, ``--simpo_gamma``,
   ``--cpo_alpha`` overriding them.

Reports the held-out preference accuracy (the share of held-out pairs whose length-normalised
log-prob under the policy prefers chosen), the loss's implicit-reward accuracy and the rewards
margin at initialisation, after SFT (``accuracy_before``) and after preference training
(``accuracy_after``); writes ``metrics.csv`` (one row per step of either phase),
``loss_curve.png`` and ``summary.json`` to ``--output_dir`` (default ``runs/dpo``; a folder that
holds a run is refused unless ``--resume`` or ``--overwrite``).

Checkpoints, resume and preemption are the LM job's (``launch/train_lm.py``,
:mod:`launch.jobs.checkpoints`), as the GRPO job has them: ``--save_every N``, ``--resume
[latest|PATH]``, ``--eval_only``, ``--keep_checkpoints``; SIGTERM / SIGINT / SIGUSR1 save at the
next step boundary. The job's steps are its SFT steps then its preference steps (the checkpoints
``step_<k>`` counted over both); a checkpoint holds DeepSpeed's engine state, every rank's RNG
states, the metrics and evaluations so far and, from the first preference step, the reference
model's weights (DPO, KTO).
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
from launch.jobs.layouts import rank_share
from launch.jobs.preference_data import REJECTED_KINDS, Pairs, draw_pairs, sft_batch
from launch.jobs.preference_step import (
    LOSSES,
    evaluate_pairs,
    preference_loss,
    preference_step,
)
from launch.jobs.reporting import Curve
from launch.jobs.runner import StopRequest, Table, run, run_job
from launch.jobs.sft_phases import SFTThen

NAMES = {"dpo": "DPO", "simpo": "SimPO", "orpo": "ORPO", "cpo": "CPO", "kto": "KTO"}


def _preference_spec(args, ml):
    """``--loss`` (default: the ds_config's preference section other than ``dpo``, else
    ``dpo``; set on ``args``) with the options of its ds_config section when given, the flags
    overriding them."""
    if args.loss is None:
        args.loss = ml.preference_section()
    section = ml.preference_options() if args.loss == ml.preference_section() else None
    return preference_loss(args.loss, section, beta=args.beta, simpo_gamma=args.simpo_gamma,
                           cpo_alpha=args.cpo_alpha)


def _pairs_key(args) -> Dict[str, Any]:
    """What a checkpoint's pairs and loss must match on resume."""
    return {"prompt_length": args.prompt_length, "completion_length": args.completion_length,
            "rejected": args.rejected, "loss": args.loss}


# the job ----------------------------------------------------------------------------------------
class Preference(SFTThen):
    """The job for the runner (:mod:`launch.jobs.runner`): SFT steps, then preference steps
    (:mod:`launch.jobs.sft_phases`), held-out pairs evaluated at initialisation, after SFT,
    every ``--eval_every`` preference steps and after."""

    tag = "dpo"
    columns = ("phase", "step", "optimizer_step", "loss", "num_tokens", "lr", "num_pairs",
               "reward_accuracy", "reward_margin", "logps_chosen", "logps_rejected", "kl",
               "eval_accuracy")
    figure = ("held-out preference accuracy", "accuracy")
    task_key = "pairs"
    task_flags = "--prompt_length / --completion_length / --rejected / --loss"
    whole_model = ("the preference job's reference model and evaluation hold the whole lm_head "
                   "on every rank", "the held-out evaluation and the reference snapshot read "
                   "whole")
    policy_options = {"return_entropy": False}
    before_after = ("accuracy", "reward_accuracy", "reward_margin")

    def task(self) -> Dict[str, Any]:
        return _pairs_key(self.args)

    def set_loss(self) -> None:
        self.spec = spec = _preference_spec(self.args, self.ml)
        self.second, self.second_title = spec.name, NAMES[spec.name]
        self.title = f"megaloss {self.second_title} job"
        self.needs_reference = spec.needs_reference

    def prepare_data(self, train_stream: torch.Tensor, eval_stream: torch.Tensor) -> int:
        """The example pair (logged), the held-out pairs; the model's positions: a prompt and
        a continuation."""
        args, tok, dp = self.args, self.tok, self.dp
        self.train_stream = train_stream
        try:
            self.example = example = self.draw(train_stream, 1, args.seed)
            self.held_all = self.draw(eval_stream, args.eval_pairs // dp * dp, args.seed + 1)
        except ValueError as e:
            raise SystemExit(f"{e}: give more text, or a smaller --prompt_length / "
                             "--completion_length") from None
        self.run.log(f"pairs: {tok.decode(example.prompts[0].tolist())!r} -> chosen "
                     f"{tok.decode(example.chosen[0].tolist())!r}, rejected "
                     f"{tok.decode(example.rejected[0].tolist())!r}")
        self.held = rank_share(self.held_all, dp, self.dp_rank)
        return args.prompt_length + args.completion_length

    def describe_loss(self) -> str:
        return f"{self.second_title} {self.spec.describe()}"

    def draw(self, stream: torch.Tensor, n: int, seed: int) -> Pairs:
        return draw_pairs(stream, n, self.args.prompt_length, self.args.completion_length,
                          self.args.rejected, torch.Generator().manual_seed(seed))

    def train_pairs(self, s: int) -> Pairs:
        n = self.micro * self.gas * self.dp
        return rank_share(self.draw(self.train_stream, n, self.args.seed * 1_000_003 + s),
                          self.dp, self.dp_rank)

    def begin(self, start: int) -> None:
        # --eval_only past SFT evaluates against the checkpoint's reference
        if (self.args.eval_only and start > self.args.sft_steps and self.needs_reference
                and self.run.state["reference"] is not None):
            self.ref = self.reference_module()

    def evaluate(self) -> Dict[str, Any]:
        return evaluate_pairs(self.policy, self.ref, self.held, self.micro, self.spec,
                              len(self.held_all), self.topo.dp_group, self.engine.device)

    def eval_rows(self, result: Dict[str, Any]) -> List[tuple]:
        name = self.second_title
        return [("held-out preference accuracy", f"{result['accuracy']:.3f}"),
                (f"held-out {name} reward accuracy", f"{result['reward_accuracy']:.3f}"),
                (f"held-out {name} rewards margin", f"{result['reward_margin']:.4f}")]

    def sft_batches(self, s: int) -> List[Dict[str, Any]]:
        pairs, micro = self.train_pairs(s), self.micro
        return [sft_batch(pairs.rows(i * micro, (i + 1) * micro)) for i in range(self.gas)]

    def begin_second(self) -> None:
        """The reference model (the SFT model, frozen) and the preference learning rate."""
        self.ref = self.reference_module() if self.needs_reference else None
        if self.args.preference_lr is not None:  # the job's configs have no lr scheduler
            for group in self.engine.optimizer.param_groups:
                group["lr"] = self.args.preference_lr

    def second_step(self, s: int) -> Dict[str, Any]:
        args, micro, name = self.args, self.micro, self.second_title
        pairs = self.train_pairs(500_000 + s)
        m = preference_step(self.me, [pairs.rows(i * micro, (i + 1) * micro)
                                      for i in range(self.gas)], self.spec, self.ref)
        eval_accuracy = ""
        if args.eval_every and s % args.eval_every == 0 and s != args.steps:
            eval_accuracy = self.evaluate_at(phase=self.second, step=s)["accuracy"]
        acc = m.get("rewards/accuracies", "")
        if s % max(1, args.steps // 10) == 0 or s == args.steps:
            self.run.log(f"{name} step {s}/{args.steps}: loss {m['loss']:.4f}, rewards margin "
                         f"{m['rewards/margins']:.4f}"
                         + (f", reward accuracy {acc:.3f}" if acc != "" else "")
                         + (f", held-out accuracy {eval_accuracy:.3f}"
                            if eval_accuracy != "" else ""))
        return self.row(self.second, s, m, num_pairs=m["num_pairs"], reward_accuracy=acc,
                        reward_margin=m["rewards/margins"], logps_chosen=m["logps/chosen"],
                        logps_rejected=m["logps/rejected"], kl=m.get("kl", ""),
                        eval_accuracy=eval_accuracy)

    def summary(self) -> Dict[str, Any]:
        args, tok, example = self.args, self.tok, self.example
        return {
            **self.phase_summary(),
            "loss": self.spec.describe(), "reference_model": self.needs_reference,
            "pairs": {**_pairs_key(args), "example": {
                "prompt": tok.decode(example.prompts[0].tolist()),
                "chosen": tok.decode(example.chosen[0].tolist()),
                "rejected": tok.decode(example.rejected[0].tolist())}},
            "eval_pairs": len(self.held_all), "pairs_per_step": self.micro * self.gas * self.dp}

    def plot(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        name, pref_rows = self.second_title, self.second_rows()
        pref_evals = [e for e in self.run.evals if e["phase"] != "init"]
        return {"curves": [
            Curve(f"train {name} reward accuracy", [r["step"] for r in pref_rows],
                  [r["reward_accuracy"] if r["reward_accuracy"] != "" else float("nan")
                   for r in pref_rows]),
            Curve("held-out preference accuracy", [e["step"] for e in pref_evals],
                  [e["accuracy"] for e in pref_evals], "o-")],
            "title": f"megaloss {name}: {summary['model']}, {self.args.rejected} rejected",
            "ylabel": "accuracy", "xlabel": f"{name} step (0: after SFT)", "grid": True}

    def table(self, summary: Dict[str, Any]) -> Table:
        name, cells = self.second_title, self.cells
        rows = [("held-out preference accuracy (length-normalised log-prob)",
                 *cells(summary, "accuracy")),
                (f"held-out {name} reward accuracy", *cells(summary, "reward_accuracy")),
                (f"held-out {name} rewards margin", *cells(summary, "reward_margin")),
                (f"held-out {name} loss", *cells(summary, "loss")),
                ("held-out log-prob per token, chosen", *cells(summary, "logps_chosen")),
                ("held-out log-prob per token, rejected", *cells(summary, "logps_rejected"))]
        return Table(f"megaloss {name} job", rows, (
            f"{summary['sft_steps']} SFT + {summary['steps']} {name} steps in "
            f"{summary['train_seconds']:.1f} s, DP={summary['dp']}, "
            f"ZeRO-{summary['zero_stage']}, {summary['pairs_per_step']} pairs per step "
            f"({summary['pairs']['rejected']} rejected), beta {summary['loss']['beta']:g}, "
            f"{summary['eval_pairs']} held-out pairs, {summary['model']}"),
            ("metric", "init", "after SFT", f"after {name}"))


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    add_job_arguments(p, steps=40, output_dir=os.path.join("runs", "dpo"), config="dpo.json",
                      config_help="ds_config JSON; its 'megaloss.dpo' section sets DPO's "
                                  "loss_type and beta; tensor_parallel_size 1, ZeRO 0-2")
    add_text_arguments(p, "data (the text the pairs are cut from)",
                       "held-out text (the held-out pairs' prompts and continuations)")
    g = p.add_argument_group("pairs")
    g.add_argument("--prompt_length", type=int, default=24, help="prompt tokens")
    g.add_argument("--completion_length", type=int, default=8,
                   help="tokens of the chosen and of the rejected continuation")
    g.add_argument("--rejected", choices=REJECTED_KINDS, default="other",
                   help="the rejected continuation: the one at another place of the text "
                        "(other), the real one with two neighbouring tokens exchanged (swap), "
                        "or its tokens shuffled (shuffle)")
    g.add_argument("--eval_pairs", type=int, default=512, help="held-out pairs evaluated")
    g = p.add_argument_group("SFT and preference training")
    g.add_argument("--sft_steps", type=int, default=60,
                   help="supervised steps before preference training (micro-batch x GAS x DP "
                        "prompts with their real continuations each)")
    g.add_argument("--loss", choices=LOSSES, default=None,
                   help="the preference loss (default: that of the ds_config's megaloss "
                        "preference section other than dpo, if any, else dpo)")
    for name, text in (
            ("beta", "the loss's beta (default: the ds_config's megaloss.<loss>.beta; without "
                     "that section dpo 0.1, simpo 2.0, orpo / cpo / kto 0.1)"),
            ("preference_lr", "the optimizer's learning rate from the first preference step "
                              "on (default: the ds_config's, as in SFT)"),
            ("simpo_gamma", "SimPO's target margin (default: the ds_config's megaloss.simpo "
                            "section's, else 0.5)"),
            ("cpo_alpha", "CPO's NLL weight (default: the ds_config's megaloss.cpo section's, "
                          "else 1.0)")):
        g.add_argument(f"--{name}", type=float, default=None, help=text)
    g.add_argument("--eval_every", type=int, default=10,
                   help="preference steps between held-out evaluations (0: only before and "
                        "after)")
    add_llama_arguments(p, default_size=None)  # None: 2 layers x 64 (policy_llama_default)
    add_run_arguments(p)  # --save_every, --resume, --eval_only, --overwrite, --keep_checkpoints
    args = p.parse_args(argv)
    policy_llama_default(args)
    require_at_least(p, args, ("steps", "prompt_length", "completion_length", "eval_pairs"))
    require_at_least(p, args, ("sft_steps", "eval_every"), 0)
    for key in ("beta", "preference_lr"):
        value = getattr(args, key)
        if value is not None and not value > 0:
            p.error(f"--{key} must be > 0")
    if args.completion_length < 2 and args.rejected == "shuffle":
        p.error("--rejected shuffle needs --completion_length >= 2 (one token has one order)")
    return check_job_arguments(p, args)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run(Preference(parse_args(argv)), StopRequest)


if __name__ == "__main__":
    run_job(main)
