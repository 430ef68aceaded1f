#!/usr/bin/env python3
"""Distil the main LM job's small Llama into a smaller one under DeepSpeed, and compare with the
same student trained on cross-entropy alone.

Run through the launcher (it passes ``--local_rank``) with the repository root on
``PYTHONPATH``, as ``launch/distill_lm.sh`` does::

    PYTHONPATH=. deepspeed --num_gpus 2 launch/distill_lm.py --deepspeed_config configs/zero2.json

or as one process from the repository root: ``python -m launch.distill_lm``.

Three phases in one launch, on the main job's built-in data (the standard library's sources,
the same tokenizer and cache, :mod:`launch.jobs.lm_data`) and layout (the ds_config's
``megaloss.tensor_parallel_size``: TP=2 with the default ``configs/zero2.json``):

1. **teacher**: with ``--teacher PATH`` (a checkpoint of ``launch/train_lm.py --save_every N``,
   or of an earlier run of this job) it is loaded, frozen, its lm_head split over the TP ranks
   like the student's (:mod:`launch.jobs.teacher`). Without it the teacher is trained first
   exactly as the main job trains its model (``--teacher_model_size``, default ``small``,
   ``--teacher_steps``, default 150, the same seed, data order, calibrated CE step and
   ds_config) and saved to ``<output_dir>/teacher/checkpoints`` for later ``--teacher`` runs;
2. **ce**: the student (``--model_size``, default ``mini``: 2 layers x 64) trained with the
   calibrated cross-entropy for ``--steps``;
3. **distilled**: the same student, from the same initial weights, seed and batches, trained
   for the same steps with :func:`megaloss.linear_distillation_loss` against the teacher
   (:class:`megaloss.CausalLMWithDistillation`: the teacher's decoder without gradients, both
   lm_heads split over the TP group the same way, no logits of either model): ``--kind``,
   ``--temperature``, ``--alpha`` (weight of the hard-label CE), ``--beta`` (JSD); without
   them the ds_config's ``megaloss.distillation`` section, else :data:`KD_DEFAULTS`.

Held-out perplexity of the teacher and of both students goes into a table printed on rank 0 and
``summary.json`` (``"table"``); each phase writes ``metrics.csv``, ``summary.json`` and
``loss_curve.png`` into its folder (``<output_dir>/{teacher,ce,distilled}``, default
``runs/distill`` under the current directory; a folder that holds a run is refused unless
``--overwrite``, which keeps a ``--teacher`` that lies inside it).
"""
from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from launch.jobs.arguments import (
    add_job_arguments,
    add_llama_arguments,
    add_lm_data_arguments,
    check_input_files,
    job_parser,
)
from launch.jobs.lm_data import eval_batches, load_blocks
from launch.jobs.models import LLAMA_SIZES, build_llama
from launch.jobs.reporting import (
    Curve,
    plot_loss_curve,
    print_summary_table,
    rank0_logger,
    write_summary_json,
)
from launch.jobs.runs import (
    CHECKPOINTS,
    RUN_OUTPUTS,
    StopRequest,
    TrainLoop,
    agreed,
    checkpoint_stats,
    quiet_job_environment,
    run_job,
    save_run,
    start_process,
)
from launch.jobs.summaries import write_lm_outputs
from launch.jobs.text_data import StepBatches

quiet_job_environment()

REPO = Path(__file__).resolve().parent.parent
PHASES = ("teacher", "ce", "distilled")
KINDS = ("forward_kl", "reverse_kl", "jsd")
# The distillation options without a ds_config "distillation" section or a flag.
KD_DEFAULTS = {"kind": "forward_kl", "temperature": 1.0, "alpha": 0.5, "beta": 0.5}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    p.add_argument("--deepspeed_config", type=str, default=str(REPO / "configs" / "zero2.json"),
                   help="ds_config JSON of all three phases; its 'megaloss' section sets the TP "
                        "size and CE options")
    add_job_arguments(p, steps=150, output_dir=os.path.join("runs", "distill"))
    add_lm_data_arguments(p)
    add_llama_arguments(p, default_size="mini")  # the student
    g = p.add_argument_group("teacher")
    g.add_argument("--teacher", type=str, default=None, metavar="PATH",
                   help="a checkpoint of the main job (launch/train_lm.py --save_every N: its "
                        "checkpoints folder or one step_<k> folder) trained on the same data; "
                        "default: train one first (saved to <output_dir>/teacher/checkpoints)")
    g.add_argument("--teacher_model_size", choices=sorted(LLAMA_SIZES), default="small",
                   help="the teacher's size (the main job's default)")
    g.add_argument("--teacher_steps", type=int, default=150,
                   help="optimizer steps of the teacher trained here (the main job's default)")
    g = p.add_argument_group("distillation")
    g.add_argument("--kind", choices=KINDS, default=None,
                   help=f"divergence (default {KD_DEFAULTS['kind']})")
    g.add_argument("--temperature", type=float, default=None,
                   help=f"default {KD_DEFAULTS['temperature']}")
    g.add_argument("--alpha", type=float, default=None,
                   help="weight of the hard-label cross-entropy (0: distillation only; default "
                        f"{KD_DEFAULTS['alpha']})")
    g.add_argument("--beta", type=float, default=None,
                   help=f"JSD's beta (--kind jsd; default {KD_DEFAULTS['beta']})")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --output_dir (a --teacher inside it is kept)")
    args = p.parse_args(argv)
    for name in ("steps", "teacher_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    for name in ("alpha", "beta"):
        value = getattr(args, name)
        if value is not None and not 0.0 <= value <= 1.0:
            p.error(f"--{name} must be in [0, 1], got {value}")
    if args.temperature is not None and not args.temperature > 0:
        p.error(f"--temperature must be > 0, got {args.temperature}")
    if args.teacher is not None and not Path(args.teacher).exists():
        p.error(f"--teacher {args.teacher}: no such file or directory")
    check_input_files(p, args)
    return args


def _inside(path: Optional[str], folder: Path) -> bool:
    if path is None:
        return False
    p, f = Path(path).resolve(), folder.resolve()
    return p == f or f in p.parents


def open_distill_run(args: argparse.Namespace, out_dir: Path) -> None:
    """One run per folder (call on one rank): refuse an ``out_dir`` holding a run's outputs or
    phase folders unless ``--overwrite``, which removes them, except the teacher folder that
    ``--teacher`` reads from."""
    existing = [n for n in RUN_OUTPUTS + PHASES if (out_dir / n).exists()]
    if existing and not args.overwrite:
        raise SystemExit(f"{out_dir} already holds a run ({', '.join(existing)}); pass "
                         "--overwrite to replace it (a --teacher inside it is kept), or another "
                         "--output_dir")
    for name in existing:
        path = out_dir / name
        if _inside(args.teacher, path):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


class Phase:
    """What one phase shares with the others: data, layout, options and the run's logger."""

    def __init__(self, args: argparse.Namespace, out_dir: Path, topo: Any, tok: Any,
                 train_blocks: Dict[str, Any], held: List[Dict[str, Any]], data_key: str,
                 log: Callable[[str], None]) -> None:
        self.args, self.out_dir, self.topo, self.tok = args, out_dir, topo, tok
        self.train_blocks, self.held, self.data_key, self.log = train_blocks, held, data_key, log

    def train(self, name: str, module: Any, steps: int, describe: str,
              save: bool = False) -> Dict[str, Any]:
        """Train ``module`` for ``steps`` calibrated steps in a fresh engine (monitors and
        outputs in ``<output_dir>/<name>``), held-out CE before, every ``--eval_every`` steps and
        after; with ``save`` a main-job checkpoint of the last step. Collective.

        Returns:
            the phase's summary, ``"engine"`` (its :class:`MegalossEngine`) included.
        """
        from megaloss.integrations.deepspeed import (
            close_monitors,
            evaluate,
            initialize,
            load_ds_config,
            train_step,
        )

        args, topo, log = self.args, self.topo, self.log
        phase_dir = self.out_dir / name
        ds_config, _ = load_ds_config(args.deepspeed_config, output_dir=str(phase_dir))
        micro = ds_config.get("train_micro_batch_size_per_gpu", 1)
        gas = ds_config.get("gradient_accumulation_steps", 1)
        me = initialize(module, ds_config, topology=topo, output_dir=str(phase_dir))
        engine = me.engine
        evals = [{"step": 0, **vars(evaluate(me, self.held, log=True))}]
        log(f"{name}: {describe}; held-out perplexity before {evals[0]['perplexity']:.1f}")
        rows: List[Dict[str, Any]] = []
        saves: List[Dict[str, Any]] = []

        def save_fn(step: int) -> None:  # the record train_lm.py keeps: a main-job checkpoint
            job = {"name": "lm", "data_key": self.data_key, "seed": args.seed,
                   "seq_len": args.seq_len, "steps_done": step, "rows": rows, "evals": evals,
                   "saves": saves, "train_seconds": loop.seconds}
            save_run(me, phase_dir / CHECKPOINTS, step, job, self.tok, 0, saves, log)

        loop_args = argparse.Namespace(steps=steps, no_progress=args.no_progress,
                                       save_every=steps if save else 0, resume=None)
        batches = StepBatches(self.train_blocks, micro=micro, gas=gas, dp_size=topo.dp_size,
                              dp_rank=topo.dp_rank, seed=args.seed).iter_from(0)
        loop = TrainLoop(loop_args, 0, 0.0, StopRequest(), engine.device, save_fn, log)
        for step in loop:
            m = train_step(me, next(batches))
            rows.append(m.as_dict())
            if args.eval_every and step % args.eval_every == 0 and step != steps:
                evals.append({"step": m.step, **vars(evaluate(me, self.held, log=True))})
            loop.show(loss=f"{m.loss:.3f}", ppl_eval=f"{evals[-1]['perplexity']:.0f}")
        evals.append({"step": steps, **vars(evaluate(me, self.held, log=True))})
        log(f"{name}: held-out perplexity after {steps} steps {evals[-1]['perplexity']:.1f} "
            f"({loop.seconds:.1f} s)")
        tokens = sum(r["num_tokens"] for r in rows)
        summary = {"steps": steps, "eval_before": evals[0], "eval_after": evals[-1],
                   "evals": evals, "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
                   "train_seconds": loop.seconds,
                   "tokens_per_s": tokens / max(loop.seconds, 1e-9), "train_tokens_seen": tokens,
                   "micro_batch": micro, "gas": gas,
                   "zero_stage": engine.zero_optimization_stage(),
                   "engine_loss_multiplier": me.engine_scale.loss_multiplier,
                   "checkpoints": checkpoint_stats(saves)}
        close_monitors(engine)
        if topo_rank0():
            write_lm_outputs(phase_dir, rows, evals, summary, f"megaloss distillation: {name}")
        return {**summary, "engine": me}


def topo_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def model_args(args: argparse.Namespace, size: str, overrides: bool) -> argparse.Namespace:
    """What :func:`build_llama` reads for ``size`` (with the student's ``--hidden_size`` /
    ``--num_layers`` / ``--num_heads`` / ``--tie_word_embeddings`` when ``overrides``; the
    teacher is the main job's untied model)."""
    pick = (lambda k: getattr(args, k)) if overrides else (lambda k: None)
    return argparse.Namespace(model_size=size, hidden_size=pick("hidden_size"),
                              num_layers=pick("num_layers"), num_heads=pick("num_heads"),
                              tie_word_embeddings=bool(pick("tie_word_embeddings")),
                              seq_len=args.seq_len, seed=args.seed)


def n_parameters(model: Any, vocab: int, hidden: int) -> int:
    """Decoder + the full (unsharded) lm_head, whatever the TP size."""
    return sum(p.numel() for p in model.base_model.parameters()) + vocab * hidden


def distillation_options(args: argparse.Namespace, ml: Any) -> Any:
    """:class:`megaloss.DistillationOptions` of the distilled phase: the ds_config's
    ``megaloss.distillation`` section when it has one, else :data:`KD_DEFAULTS` with the CE
    section's chunk size and soft-capping; ``--kind`` / ``--temperature`` / ``--alpha`` /
    ``--beta`` override either. ``reduction="sum"`` (the calibrated step weights tokens)."""
    from megaloss import DistillationOptions

    section = getattr(ml, "distillation", None)
    if section is not None:
        base = section.options()
    else:
        base = DistillationOptions(reduction="sum", chunk_size=ml.ce.chunk_size,
                                   logit_softcapping=ml.ce.logit_softcapping,
                                   teacher_logit_softcapping=ml.ce.logit_softcapping,
                                   **KD_DEFAULTS)
    given = {k: getattr(args, k) for k in KD_DEFAULTS if getattr(args, k) is not None}
    return base.replace(**given)


def table_rows(table: List[Dict[str, Any]]) -> List[tuple]:
    return [(r["model"], r["size"], f"{r['parameters'] / 1e6:.2f} M", str(r["steps"]),
             f"{r['perplexity']:.1f}", f"{r['loss']:.4f}") for r in table]


# main -------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    from launch.jobs.teacher import build_teacher, evaluate_teacher
    from megaloss import CausalLMWithDistillation, CausalLMWithLoss, Topology
    from megaloss.integrations.deepspeed import load_ds_config

    rank, _ = start_process(args.local_rank)
    out_dir = Path(args.output_dir)
    log = rank0_logger("distill", rank, t_start)

    ds_config, ml = load_ds_config(args.deepspeed_config, output_dir=str(out_dir))
    if ml.sequence_parallel_size != 1:
        raise SystemExit("the distillation job runs without sequence parallelism "
                         "(megaloss.sequence_parallel_size must be 1)")
    if ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        raise SystemExit("the distillation job runs with ZeRO-0/1/2: it reads its teacher back "
                         "from a checkpoint's model files, which ZeRO-3 leaves empty")
    agreed(lambda: open_distill_run(args, out_dir), what=f"--output_dir {out_dir}")
    topo = Topology.build(ml.tensor_parallel_size)
    tok, train_blocks, held_blocks, info, data_key = load_blocks(args, log)
    vocab = tok.get_vocab_size()
    micro = ds_config.get("train_micro_batch_size_per_gpu", 1)
    held = eval_batches(held_blocks, micro, topo.dp_size, topo.dp_rank)
    phase = Phase(args, out_dir, topo, tok, train_blocks, held, data_key, log)
    options = ml.ce.options()
    phases: Dict[str, Any] = {}

    # 1. the teacher: the main job's model, trained here (and saved) or loaded from its
    # checkpoint; the distilled phase reads it back from the checkpoint either way
    t_args = model_args(args, args.teacher_model_size, overrides=False)
    teacher_from = args.teacher
    if teacher_from is None:
        model, t_cfg = build_llama(t_args, vocab)
        wrapper = CausalLMWithLoss(model, options=options, tp_group=topo.tp_group)
        phases["teacher"] = phase.train(
            "teacher", wrapper, args.teacher_steps, f"{args.teacher_model_size} Llama, "
            f"{n_parameters(model, vocab, t_cfg.hidden_size) / 1e6:.2f} M parameters", save=True)
        phases["teacher"].pop("engine")
        teacher_from = phases["teacher"]["checkpoints"]["last"]
    teacher, t_cfg, t_info = build_teacher(teacher_from, t_args, vocab, data_key=data_key)
    t_params = n_parameters(teacher, vocab, t_cfg.hidden_size)
    if args.teacher is None:
        teacher_eval = phases["teacher"]["eval_after"]
    else:
        teacher_eval = evaluate_teacher(teacher, held, topo, _device(), options)
        log(f"teacher: {t_info['checkpoint']} (step {t_info['steps']}), held-out perplexity "
            f"{teacher_eval['perplexity']:.1f}")
    teacher_steps, teacher_from = t_info["steps"], t_info["checkpoint"]

    # 2. / 3. the student: CE alone, then distilled, from the same initial weights and batches
    s_args = model_args(args, args.model_size, overrides=True)
    student, s_cfg = build_llama(s_args, vocab)
    s_params = n_parameters(student, vocab, s_cfg.hidden_size)
    describe = f"{args.model_size} Llama, {s_params / 1e6:.2f} M parameters"
    phases["ce"] = phase.train("ce", CausalLMWithLoss(student, options=options,
                                                      tp_group=topo.tp_group),
                               args.steps, describe + ", cross-entropy")
    phases["ce"].pop("engine")
    kd = distillation_options(args, ml)
    student, _ = build_llama(s_args, vocab)  # the same initial weights (build_llama seeds)
    module = CausalLMWithDistillation(student, teacher.to(_device()), options=kd,
                                      tp_group=topo.tp_group)
    phases["distilled"] = phase.train("distilled", module, args.steps,
                                      describe + f", {kd.kind} T={kd.temperature:g} "
                                      f"alpha={kd.alpha:g}")
    me = phases["distilled"].pop("engine")

    def size(cfg):
        return f"Llama {cfg.num_hidden_layers}L x {cfg.hidden_size}"

    table = [
        {"model": "teacher", "size": size(t_cfg), "parameters": int(t_params),
         "steps": teacher_steps, **_eval(teacher_eval)},
        {"model": "student, CE only", "size": size(s_cfg), "parameters": int(s_params),
         "steps": args.steps, **_eval(phases["ce"]["eval_after"])},
        {"model": "student, distilled", "size": size(s_cfg), "parameters": int(s_params),
         "steps": args.steps, **_eval(phases["distilled"]["eval_after"])},
    ]
    ce_ppl, kd_ppl = table[1]["perplexity"], table[2]["perplexity"]
    summary = {
        "table": table, "distillation_beats_ce": kd_ppl < ce_ppl,
        "perplexity_ce_minus_distilled": ce_ppl - kd_ppl,
        "distillation": {k: (str(v) if k == "accum_dtype" else v)
                         for k, v in kd.as_dict().items()},
        "teacher": {"checkpoint": teacher_from, "trained_here": args.teacher is None,
                    "steps": teacher_steps, "model_size": args.teacher_model_size},
        "phases": phases, "steps": args.steps, "seed": args.seed,
        "dp": topo.dp_size, "tp": topo.tp_size, "zero_stage": me.engine.zero_optimization_stage(),
        "seq_len": args.seq_len, "vocab_size": vocab, "ce": ml.ce.model_dump(),
        "data": "stdlib" if not args.train_data else "user files", "data_key": data_key,
        "total_seconds": time.perf_counter() - t_start, **info,
    }
    if rank == 0:
        write_summary_json(out_dir / "summary.json", summary)
        curves = [Curve(f"held-out CE, {p}", [e["step"] for e in phases[p]["evals"]],
                        [e["loss"] for e in phases[p]["evals"]], "o-") for p in ("ce", "distilled")]
        plot_loss_curve(out_dir / "loss_curve.png", curves, title="student: CE alone vs distilled",
                        ylabel="cross-entropy (nats / token)", grid=True)
        verdict = ("distillation beats CE alone" if summary["distillation_beats_ce"] else
                   "distillation does NOT beat CE alone")
        print_summary_table(
            "megaloss distillation job: held-out perplexity", table_rows(table),
            f"{verdict} ({ce_ppl:.1f} -> {kd_ppl:.1f}); {kd.kind}, T={kd.temperature:g}, "
            f"alpha={kd.alpha:g}; DP={topo.dp_size} x TP={topo.tp_size}, "
            f"{summary['total_seconds']:.0f} s in all",
            columns=("model", "size", "params", "steps", "perplexity", "CE (nats/token)"))
        log(f"wrote {out_dir / 'summary.json'}, {out_dir / 'loss_curve.png'} and "
            f"{', '.join(str(out_dir / p) for p in phases)}/")
    import torch.distributed as dist

    dist.barrier()
    return summary


def _eval(e: Dict[str, float]) -> Dict[str, float]:
    return {"perplexity": e["perplexity"], "loss": e["loss"]}


def _device() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


if __name__ == "__main__":
    run_job(main)
