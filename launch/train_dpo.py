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
from launch.jobs.lm_data import load_data
from launch.jobs.models import build_llama
from launch.jobs.policy_model import CausalLMLogProbs
from launch.jobs.preference_data import REJECTED_KINDS, Pairs, draw_pairs, sft_batch
from launch.jobs.preference_step import (
    LOSSES,
    evaluate_pairs,
    preference_loss,
    preference_step,
)
from launch.jobs.reporting import (
    Curve,
    plot_loss_curve,
    print_summary_table,
    rank0_logger,
    write_metrics_csv,
    write_summary_json,
)
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
NAMES = {"dpo": "DPO", "simpo": "SimPO", "orpo": "ORPO", "cpo": "CPO", "kto": "KTO"}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    p.add_argument("--deepspeed_config", type=str, default=str(REPO / "configs" / "dpo.json"),
                   help="ds_config JSON; its 'megaloss.dpo' section sets DPO's loss_type and "
                        "beta; tensor_parallel_size 1, ZeRO 0-2")
    add_job_arguments(p, steps=40, output_dir=os.path.join("runs", "dpo"))
    g = p.add_argument_group("data (the text the pairs are cut from)")
    g.add_argument("--train_data", nargs="*", default=None,
                   help="text files or directories (.py/.txt/.md/.rst); default: the stdlib")
    g.add_argument("--eval_data", nargs="*", default=None,
                   help="held-out text (the held-out pairs' prompts and continuations)")
    g.add_argument("--eval_fraction", type=float, default=0.05,
                   help="share of --train_data files held out when --eval_data is not given")
    g.add_argument("--max_train_bytes", type=int, default=2_500_000,
                   help="keep a strided subset of training files under this size (0: all)")
    g.add_argument("--vocab_size", type=int, default=2048, help="BPE vocabulary size")
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
    g.add_argument("--beta", type=float, default=None,
                   help="the loss's beta (default: the ds_config's megaloss.<loss>.beta; "
                        "without that section dpo 0.1, simpo 2.0, orpo / cpo / kto 0.1)")
    g.add_argument("--preference_lr", type=float, default=None,
                   help="the optimizer's learning rate from the first preference step on "
                        "(default: the ds_config's, as in SFT)")
    g.add_argument("--simpo_gamma", type=float, default=None,
                   help="SimPO's target margin (default: the ds_config's megaloss.simpo "
                        "section's, else 0.5)")
    g.add_argument("--cpo_alpha", type=float, default=None,
                   help="CPO's NLL weight (default: the ds_config's megaloss.cpo section's, "
                        "else 1.0)")
    g.add_argument("--eval_every", type=int, default=10,
                   help="preference steps between held-out evaluations (0: only before and "
                        "after)")
    add_llama_arguments(p)
    add_run_arguments(p)  # --save_every, --resume, --eval_only, --overwrite, --keep_checkpoints
    p.set_defaults(model_size=None)  # None: 2 layers x 64 (the GRPO job's)
    args = p.parse_args(argv)
    if args.model_size is None:
        args.model_size = "small"  # its head layout; the width and depth below
        args.hidden_size = args.hidden_size or 64
        args.num_layers = args.num_layers or 2
    require_at_least(p, args, ("steps", "prompt_length", "completion_length", "eval_pairs"))
    require_at_least(p, args, ("sft_steps", "eval_every"), 0)
    for key in ("beta", "preference_lr"):
        value = getattr(args, key)
        if value is not None and not value > 0:
            p.error(f"--{key} must be > 0")
    if args.completion_length < 2 and args.rejected == "shuffle":
        p.error("--rejected shuffle needs --completion_length >= 2 (one token has one order)")
    check_run_arguments(p, args)
    check_input_files(p, args)
    return args


def _check_layout(ds_config: Dict[str, Any], ml, args) -> None:
    """Refuse what this job cannot honour (the same verdict on every rank)."""
    if ml.tensor_parallel_size != 1 or ml.sequence_parallel_size != 1:
        raise SystemExit(f"{args.deepspeed_config}: the preference job's reference model and "
                         "evaluation hold the whole lm_head on every rank; set "
                         "megaloss.tensor_parallel_size and sequence_parallel_size to 1")
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    if stage == 3:
        raise SystemExit(f"{args.deepspeed_config}: ZeRO-3 partitions the weights the held-out "
                         "evaluation and the reference snapshot read whole; use ZeRO stage 0, 1 "
                         "or 2")


def _preference_spec(args, ml):
    """``--loss`` (default: the ds_config's preference section other than ``dpo``, else
    ``dpo``; set on ``args``) with the options of its ds_config section when given, the flags
    overriding them."""
    if args.loss is None:
        args.loss = ml.preference_section()
    section = ml.preference_options() if args.loss == ml.preference_section() else None
    return preference_loss(args.loss, section, beta=args.beta, simpo_gamma=args.simpo_gamma,
                           cpo_alpha=args.cpo_alpha)


def _rank_share(pairs: Pairs, dp: int, rank: int) -> Pairs:
    n = len(pairs) // dp
    return pairs.rows(rank * n, (rank + 1) * n)


def _pairs_key(args) -> Dict[str, Any]:
    """What a checkpoint's pairs and loss must match on resume."""
    return {"prompt_length": args.prompt_length, "completion_length": args.completion_length,
            "rejected": args.rejected, "loss": args.loss}


def print_summary(summary: Dict[str, Any]) -> None:
    evals = [summary["eval_init"], summary["eval_before"], summary["eval_after"]]
    name = NAMES[summary["loss"]["loss"]]

    def cell(e, key):
        return "-" if e is None else f"{e[key]:.3f}"

    rows = [("held-out preference accuracy (length-normalised log-prob)",
             *(cell(e, "accuracy") for e in evals)),
            (f"held-out {name} reward accuracy", *(cell(e, "reward_accuracy") for e in evals)),
            (f"held-out {name} rewards margin", *(cell(e, "reward_margin") for e in evals)),
            (f"held-out {name} loss", *(cell(e, "loss") for e in evals)),
            ("held-out log-prob per token, chosen", *(cell(e, "logps_chosen") for e in evals)),
            ("held-out log-prob per token, rejected",
             *(cell(e, "logps_rejected") for e in evals))]
    stopped = summary.get("stopped")
    info = (f"{summary['sft_steps']} SFT + {summary['steps']} {name} steps in "
            f"{summary['train_seconds']:.1f} s, DP={summary['dp']}, ZeRO-{summary['zero_stage']}, "
            f"{summary['pairs_per_step']} pairs per step ({summary['pairs']['rejected']} "
            f"rejected), beta {summary['loss']['beta']:g}, {summary['eval_pairs']} held-out "
            f"pairs, {summary['model']}"
            + (f"; stopped by {stopped['signal']} at step {stopped['step']} (resume with "
               "--resume)" if stopped else ""))
    print_summary_table(f"megaloss {name} job", rows, info,
                        columns=("metric", "init", "after SFT", f"after {name}"))


# main -------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    from megaloss import Topology
    from megaloss.integrations.deepspeed import initialize, load_ds_config

    rank, _ = start_process(args.local_rank, args.output_dir)
    out_dir = Path(args.output_dir)
    ckpt_dir = out_dir / CHECKPOINTS
    log = rank0_logger("dpo", rank, t_start)

    ds_config, ml = load_ds_config(args.deepspeed_config, output_dir=str(out_dir))
    _check_layout(ds_config, ml, args)
    resume_from = open_run(args, out_dir, ds_config)
    topo = Topology.build(1)
    dp, dp_rank = topo.dp_size, topo.dp_rank
    micro = ds_config.get("train_micro_batch_size_per_gpu", 1)
    gas = ds_config.get("gradient_accumulation_steps", 1)
    spec = _preference_spec(args, ml)
    name = NAMES[spec.name]

    tok, train_stream, eval_stream, info, data_key = load_data(args)
    p_len, c_len = args.prompt_length, args.completion_length

    def draw(stream, n, seed):
        return draw_pairs(stream, n, p_len, c_len, args.rejected,
                          torch.Generator().manual_seed(seed))

    try:
        example = draw(train_stream, 1, args.seed)
        held_all = draw(eval_stream, args.eval_pairs // dp * dp, args.seed + 1)
    except ValueError as e:
        raise SystemExit(f"{e}: give more text, or a smaller --prompt_length / "
                         "--completion_length") from None
    log(f"pairs: {tok.decode(example.prompts[0].tolist())!r} -> chosen "
        f"{tok.decode(example.chosen[0].tolist())!r}, rejected "
        f"{tok.decode(example.rejected[0].tolist())!r}")
    held = _rank_share(held_all, dp, dp_rank)
    args.seq_len = p_len + c_len  # the model's positions
    model, cfg = build_llama(args, tok.get_vocab_size())
    n_params = sum(p.numel() for p in model.parameters())
    policy = CausalLMLogProbs(model, return_entropy=False)
    me = initialize(policy, ds_config, topology=topo, output_dir=str(out_dir))
    engine = me.engine
    log(f"engine ready: DP={dp}, ZeRO-{engine.zero_optimization_stage()}, {n_params / 1e6:.2f} M "
        f"params, measured engine loss multiplier {me.engine_scale.loss_multiplier:g}, {name} "
        f"{spec.describe()}")

    job_state: Dict[str, Any] = {"rows": [], "evals": [], "train_seconds": 0.0, "saves": [],
                                 "steps_done": 0, "sft_steps": args.sft_steps,
                                 "pairs": _pairs_key(args), "reference": None}
    if resume_from is not None:
        resume_from = resume_job_state(
            me, resume_from, job_state, {"data_key": data_key},
            "--train_data / --eval_data / --eval_fraction / --max_train_bytes / --vocab_size",
            log)
        for key, flags in (("sft_steps", "--sft_steps"),
                           ("pairs", "--prompt_length / --completion_length / --rejected / "
                                     "--loss")):
            if job_state[key] != {"sft_steps": args.sft_steps, "pairs": _pairs_key(args)}[key]:
                raise SystemExit(f"checkpoint {resume_from} was trained with another {key} "
                                 f"({job_state[key]}): pass the same {flags}")
    start = int(job_state["steps_done"])
    saves_before = len(job_state["saves"])
    pref: Dict[str, Any] = {"ref": None, "started": False}

    def reference_module():
        if not spec.needs_reference or job_state["reference"] is None:
            return None
        ref_model, _ = build_llama(args, tok.get_vocab_size())
        ref_model.load_state_dict(job_state["reference"])
        ref_model.to(engine.device)
        return CausalLMLogProbs(ref_model.requires_grad_(False).eval(), return_entropy=False)

    def evaluate() -> Dict[str, float]:
        return evaluate_pairs(policy, pref["ref"], held, micro, spec, len(held_all),
                              topo.dp_group, engine.device)

    if args.eval_only:
        log(f"evaluating checkpoint {resume_from} (step {start})")
        if start > args.sft_steps:
            pref["ref"] = reference_module()
        result = evaluate()
        return report_checkpoint_eval(out_dir, rank, f"megaloss {name} job", resume_from, start,
                                      result, [
                                          ("held-out preference accuracy",
                                           f"{result['accuracy']:.3f}"),
                                          (f"held-out {name} reward accuracy",
                                           f"{result['reward_accuracy']:.3f}"),
                                          (f"held-out {name} rewards margin",
                                           f"{result['reward_margin']:.4f}")])

    rows: List[Dict[str, Any]] = job_state["rows"]
    evals: List[Dict[str, Any]] = job_state["evals"]
    saves: List[Dict[str, Any]] = job_state["saves"]
    if not evals:
        evals.append({"phase": "init", "step": 0, **evaluate()})
        log(f"at initialisation: held-out preference accuracy {evals[0]['accuracy']:.3f}")

    def start_preference() -> None:
        """After SFT: the held-out figures and the reference model (the SFT model, frozen; read
        back from the checkpoint when resuming past this point)."""
        if not any(e["phase"] == "sft" for e in evals):
            evals.append({"phase": "sft", "step": 0, **evaluate()})
            log(f"after SFT: held-out preference accuracy {evals[-1]['accuracy']:.3f}")
        if spec.needs_reference and job_state["reference"] is None:
            job_state["reference"] = {k: v.detach().cpu().clone()
                                      for k, v in model.state_dict().items()}
        pref["ref"] = reference_module()
        if args.preference_lr is not None:  # the job's configs have no lr scheduler
            for group in engine.optimizer.param_groups:
                group["lr"] = args.preference_lr
        pref["started"] = True

    def train_pairs(s: int) -> Pairs:
        return _rank_share(draw(train_stream, micro * gas * dp, args.seed * 1_000_003 + s),
                           dp, dp_rank)

    def sft(s: int) -> Dict[str, Any]:
        pairs = train_pairs(s)
        m = sft_step(me, [sft_batch(pairs.rows(i * micro, (i + 1) * micro))
                          for i in range(gas)])
        if s % max(1, args.sft_steps // 5) == 0:
            log(f"SFT step {s}/{args.sft_steps}: loss {m['loss']:.4f}")
        return {"phase": "sft", "step": s, "optimizer_step": m["step"], "loss": m["loss"],
                "num_tokens": m["num_tokens"], "lr": m["lr"], "num_pairs": "",
                "reward_accuracy": "", "reward_margin": "", "logps_chosen": "",
                "logps_rejected": "", "kl": "", "eval_accuracy": ""}

    def preference(s: int) -> Dict[str, Any]:
        pairs = train_pairs(500_000 + s)
        m = preference_step(me, [pairs.rows(i * micro, (i + 1) * micro) for i in range(gas)],
                            spec, pref["ref"])
        eval_accuracy = ""
        if args.eval_every and s % args.eval_every == 0 and s != args.steps:
            evals.append({"phase": spec.name, "step": s, **evaluate()})
            eval_accuracy = evals[-1]["accuracy"]
        acc = m.get("rewards/accuracies", "")
        if s % max(1, args.steps // 10) == 0 or s == args.steps:
            log(f"{name} step {s}/{args.steps}: loss {m['loss']:.4f}, rewards margin "
                f"{m['rewards/margins']:.4f}"
                + (f", reward accuracy {acc:.3f}" if acc != "" else "")
                + (f", held-out accuracy {eval_accuracy:.3f}" if eval_accuracy != "" else ""))
        return {"phase": spec.name, "step": s, "optimizer_step": m["step"], "loss": m["loss"],
                "num_tokens": m["num_tokens"], "lr": m["lr"], "num_pairs": m["num_pairs"],
                "reward_accuracy": acc, "reward_margin": m["rewards/margins"],
                "logps_chosen": m["logps/chosen"], "logps_rejected": m["logps/rejected"],
                "kl": m.get("kl", ""), "eval_accuracy": eval_accuracy}

    def save(step: int) -> None:
        job = {"name": "dpo", "data_key": data_key, "seed": args.seed,
               "sft_steps": args.sft_steps, "pairs": _pairs_key(args), "steps_done": step,
               "rows": rows, "evals": evals, "saves": saves, "train_seconds": loop.seconds,
               "reference": job_state["reference"]}
        save_run(me, ckpt_dir, step, job, tok, args.keep_checkpoints, saves, log,
                 tag=f"step_{step}")

    total = args.sft_steps + args.steps
    loop_args = argparse.Namespace(steps=total, no_progress=args.no_progress,
                                   save_every=args.save_every, resume=args.resume)
    stop = StopRequest().install()
    loop = TrainLoop(loop_args, start, job_state["train_seconds"], stop, engine.device, save, log)
    for step in loop:
        if step <= args.sft_steps:
            rows.append(sft(step))
        else:
            if not pref["started"]:
                start_preference()
            rows.append(preference(step - args.sft_steps))
        last = rows[-1]
        loop.show(phase=last["phase"], loss=f"{last['loss']:.3f}")
    stopped, train_seconds = loop.stopped, loop.seconds
    pref_rows = [r for r in rows if r["phase"] != "sft"]
    sft_rows = [r for r in rows if r["phase"] == "sft"]
    done = pref_rows[-1]["step"] if pref_rows else 0
    if stopped is None and not (evals[-1]["phase"] == spec.name and evals[-1]["step"] == done):
        evals.append({"phase": spec.name, "step": done, **evaluate()})
        log(f"after {name}: held-out preference accuracy {evals[-1]['accuracy']:.3f} (after "
            f"SFT {evals[1]['accuracy']:.3f})")

    after_sft = next((e for e in evals if e["phase"] == "sft"), None)
    after = evals[-1] if stopped is None and evals[-1]["phase"] == spec.name else None
    summary = {
        "eval_init": evals[0], "eval_before": after_sft, "eval_after": after,
        "accuracy_before": after_sft and after_sft["accuracy"],
        "accuracy_after": after and after["accuracy"],
        "reward_accuracy_before": after_sft and after_sft["reward_accuracy"],
        "reward_accuracy_after": after and after["reward_accuracy"],
        "reward_margin_before": after_sft and after_sft["reward_margin"],
        "reward_margin_after": after and after["reward_margin"],
        "evals": evals, "sft_steps": len(sft_rows), "steps": len(pref_rows),
        "sft_steps_requested": args.sft_steps, "steps_requested": args.steps,
        "stopped": stopped, "resumed_from": resume_from and str(resume_from),
        "resumed_at_step": start,
        "sft_first_loss": sft_rows[0]["loss"] if sft_rows else None,
        "sft_last_loss": sft_rows[-1]["loss"] if sft_rows else None,
        "train_loss_first": pref_rows[0]["loss"] if pref_rows else None,
        "train_loss_last": pref_rows[-1]["loss"] if pref_rows else None,
        "train_seconds": train_seconds, "total_seconds": time.perf_counter() - t_start,
        "loss": spec.describe(), "reference_model": spec.needs_reference,
        "pairs": {**_pairs_key(args), "example": {
            "prompt": tok.decode(example.prompts[0].tolist()),
            "chosen": tok.decode(example.chosen[0].tolist()),
            "rejected": tok.decode(example.rejected[0].tolist())}},
        "eval_pairs": len(held_all), "pairs_per_step": micro * gas * dp,
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
        pref_evals = [e for e in evals if e["phase"] != "init"]
        plot_loss_curve(
            out_dir / "loss_curve.png",
            [Curve(f"train {name} reward accuracy", [r["step"] for r in pref_rows],
                   [r["reward_accuracy"] if r["reward_accuracy"] != "" else float("nan")
                    for r in pref_rows]),
             Curve("held-out preference accuracy", [e["step"] for e in pref_evals],
                   [e["accuracy"] for e in pref_evals], "o-")],
            title=f"megaloss {name}: {summary['model']}, {args.rejected} rejected",
            ylabel="accuracy", xlabel=f"{name} step (0: after SFT)", grid=True)

    finish_run(out_dir, rank, write_outputs, lambda: print_summary(summary), log,
               engine=engine, stop=stop)
    return summary


if __name__ == "__main__":
    run_job(main)
