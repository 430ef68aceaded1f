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
   as the main job trains its model (``--teacher_model_size``, default ``small``, the same
   seed, data order, calibrated CE step and ds_config) but longer (``--teacher_steps``,
   default 400, against the main job's 150: a teacher ahead of the student), and saved to
   ``<output_dir>/teacher/checkpoints`` for later ``--teacher`` runs. The finished teacher
   phase is cached in ``--cache_dir``, keyed by its settings
   (:func:`launch.jobs.teacher.teacher_cache_folder`): a later run of the same settings copies
   it back instead of training it (``--no_teacher_cache``: train it anyway);
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
``--resume`` or ``--overwrite``, which keeps a ``--teacher`` that lies inside it).

Checkpoints, resume and preemption are the LM job's (``launch/train_lm.py``,
:mod:`launch.jobs.checkpoints`), phase by phase: ``--save_every N`` checkpoints each phase every N
of its steps (and after its last) into ``<output_dir>/<phase>/checkpoints``; SIGTERM / SIGINT /
SIGUSR1 stop the phase in progress at its next step boundary, save it, write its outputs and a
``summary.json`` naming the phase and step (``"stopped"``), and end the job. ``--resume`` (the
run in ``--output_dir``; no PATH) skips the phases that finished, continues the one that was
stopped from its latest checkpoint (engine state, RNG states, data position, metrics so far) and
runs the rest: the same losses, bitwise, as a run never stopped.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from launch.jobs.agreement import distributed_or_none
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
    add_run_arguments,
    agreed,
    check_run_arguments,
    checkpoint_stats,
    open_run,
    quiet_job_environment,
    resume_job_state,
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
# The teacher trained here: the main job's model for 400 steps (the main job trains it for 150),
# so that it is ahead of the student (at 150 steps the smaller student, which learns faster per
# step, is ahead of it), with the whole default run within ~5 minutes on 2 CPU cores.
TEACHER_STEPS = 400


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
    g.add_argument("--teacher_steps", type=int, default=TEACHER_STEPS,
                   help="optimizer steps of the teacher trained here (the main job trains "
                        "150: longer here, for a teacher ahead of the student)")
    g.add_argument("--no_teacher_cache", action="store_true",
                   help="train the teacher even when --cache_dir holds one of the same "
                        "settings, and do not cache it (default: a finished teacher phase is "
                        "cached there, keyed by its settings, and later runs copy it back)")
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
    add_run_arguments(p)  # --save_every, --resume, --overwrite, --keep_checkpoints, --eval_only
    for action in p._actions:
        if action.dest == "overwrite":
            action.help += "; a --teacher inside it is kept"
        elif action.dest == "resume":
            action.help = ("continue the run in --output_dir: its finished phases are kept, the "
                           "one that was stopped continues from its latest checkpoint (and "
                           "starts fresh when it has none yet); --steps / --teacher_steps are "
                           "the totals to reach")
    args = p.parse_args(argv)
    if args.resume not in (None, "latest"):
        p.error(f"--resume {args.resume}: the distillation job continues the run in "
                "--output_dir (each phase from its own checkpoints); pass --resume alone")
    if args.eval_only:
        p.error("--eval_only: the distillation job has no checkpoint evaluation of its own; it "
                "evaluates every model it trains (the table in summary.json)")
    check_run_arguments(p, args)
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


def run_folder_refusal(args: argparse.Namespace, out_dir: Path) -> Optional[str]:
    """Why this job may not start in ``out_dir`` (None: it may), without touching it: the folder
    holds a run's outputs or phase folders and neither ``--resume`` nor ``--overwrite`` is given
    (also the pre-flight check's rule for this job, ``launch/jobs/preflight.py``). The message
    offers ``--resume`` when a phase holds a checkpoint."""
    existing = [n for n in RUN_OUTPUTS + PHASES if (out_dir / n).exists()]
    if not existing or args.overwrite or getattr(args, "resume", None) is not None:
        return None
    saved = [n for n in PHASES if (out_dir / n / CHECKPOINTS / "latest").is_file()]
    resume = (f"pass --resume to continue it (checkpoints of {', '.join(saved)}), "
              if saved else "pass ")
    return (f"{out_dir} already holds a run ({', '.join(existing)}); {resume}--overwrite to "
            "replace it (a --teacher inside it is kept), or another --output_dir")


def open_distill_run(args: argparse.Namespace, out_dir: Path) -> None:
    """One run per folder (call on one rank): refuse an ``out_dir`` holding a run's outputs or
    phase folders unless ``--overwrite`` (:func:`run_folder_refusal`), which removes them,
    except the teacher folder that ``--teacher`` reads from."""
    refusal = run_folder_refusal(args, out_dir)
    if refusal is not None:
        raise SystemExit(refusal)
    if args.resume is not None:  # each phase decides what to continue (Phase.train)
        out_dir.mkdir(parents=True, exist_ok=True)
        return
    existing = [n for n in RUN_OUTPUTS + PHASES if (out_dir / n).exists()]
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
    """What one phase shares with the others: data, layout, options, the run's logger and its
    stop request."""

    def __init__(self, args: argparse.Namespace, out_dir: Path, topo: Any, tok: Any,
                 train_blocks: Dict[str, Any], held: List[Dict[str, Any]], data_key: str,
                 log: Callable[[str], None], stop: StopRequest) -> None:
        self.args, self.out_dir, self.topo, self.tok = args, out_dir, topo, tok
        self.train_blocks, self.held, self.data_key, self.log = train_blocks, held, data_key, log
        self.stop = stop

    def finished(self, name: str) -> Optional[Dict[str, Any]]:
        """With ``--resume``: the summary of phase ``name`` when an earlier run finished it (its
        ``summary.json`` says it was not stopped), else None; read on rank 0 and shared.
        Collective."""
        def read():
            path = self.out_dir / name / "summary.json"
            if self.args.resume is None or not path.is_file():
                return None
            summary = json.loads(path.read_text(encoding="utf-8"))
            return summary if summary.get("stopped") is None else None

        out = [agreed(read, what=f"--resume {self.out_dir / name}")]
        dist = distributed_or_none()
        if dist is not None:
            dist.broadcast_object_list(out, src=0)
        return out[0]

    def cached_teacher(self, cache: Optional[Path]) -> Optional[Dict[str, Any]]:
        """The teacher phase copied from ``cache`` into ``<output_dir>/teacher`` when that
        folder does not exist yet (a fresh run, or ``--resume`` before the teacher phase
        started) and ``cache`` holds a finished one (:func:`restore_cached_teacher`); its
        summary, or None (no ``cache``: ``--no_teacher_cache``). Collective."""
        from launch.jobs.teacher import restore_cached_teacher

        def restore():
            phase_dir = self.out_dir / "teacher"
            if cache is None or phase_dir.exists():
                return None
            return restore_cached_teacher(cache, phase_dir)

        out = [agreed(restore, what=f"teacher cache {cache}")]
        dist = distributed_or_none()
        if dist is not None:
            dist.broadcast_object_list(out, src=0)
        return out[0]

    def store_teacher(self, cache: Path) -> None:
        """Cache the finished teacher phase (:func:`store_cached_teacher`; rank 0): a cache
        that cannot be written is reported and the run goes on."""
        from launch.jobs.teacher import store_cached_teacher

        try:
            if store_cached_teacher(self.out_dir / "teacher", cache) is not None:
                self.log(f"teacher: cached in {cache} (a later run of these settings copies it "
                         "back instead of training it)")
        except OSError as e:
            self.log(f"teacher: not cached in {cache}: {e}")

    def train(self, name: str, module: Any, steps: int, describe: str,
              save: bool = False) -> Dict[str, Any]:
        """Train ``module`` for ``steps`` calibrated steps in a fresh engine (monitors, outputs
        and checkpoints in ``<output_dir>/<name>``), held-out CE before, every ``--eval_every``
        steps and after; checkpoints every ``--save_every`` steps, and of the last step with
        ``save`` (the teacher, a main-job checkpoint) or ``--save_every`` / ``--resume``. With
        ``--resume`` it continues from the phase's latest checkpoint when it has one. A stop
        request ends it at the next step boundary (saved; ``"stopped"`` in the summary).
        Collective.

        Returns:
            the phase's summary, ``"engine"`` (its :class:`MegalossEngine`) included.
        """
        from megaloss.integrations.deepspeed import evaluate, initialize, load_ds_config, train_step
        from megaloss.integrations.deepspeed.monitor import close_monitors

        args, topo, log = self.args, self.topo, self.log
        phase_dir = self.out_dir / name
        ds_config, _ = load_ds_config(args.deepspeed_config, output_dir=str(phase_dir))
        micro = ds_config.get("train_micro_batch_size_per_gpu", 1)
        gas = ds_config.get("gradient_accumulation_steps", 1)
        # the LM job's rules for the phase's folder: with --resume its latest checkpoint (none
        # yet: a fresh phase), what a run that crashed before its first checkpoint left cleared
        folder_args = argparse.Namespace(resume="latest" if args.resume is not None else None,
                                         eval_only=False, overwrite=False)
        resume_from = open_run(folder_args, phase_dir, ds_config)
        me = initialize(module, ds_config, topology=topo, output_dir=str(phase_dir))
        engine = me.engine
        job_state: Dict[str, Any] = {"rows": [], "evals": [], "train_seconds": 0.0, "saves": []}
        if resume_from is not None:
            resume_from = resume_job_state(
                me, resume_from, job_state, {"data_key": self.data_key},
                "--train_data / --eval_data / --eval_fraction / --max_train_bytes / "
                "--vocab_size", log)
        start = int(engine.global_steps)
        rows: List[Dict[str, Any]] = job_state["rows"]
        evals: List[Dict[str, Any]] = job_state["evals"]
        saves: List[Dict[str, Any]] = job_state["saves"]
        if not evals:
            evals.append({"step": 0, **vars(evaluate(me, self.held, log=True))})
            log(f"{name}: {describe}; held-out perplexity before {evals[0]['perplexity']:.1f}")

        def save_fn(step: int) -> None:  # the record train_lm.py keeps: a main-job checkpoint
            job = {"name": "lm", "data_key": self.data_key, "seed": args.seed,
                   "seq_len": args.seq_len, "steps_done": step, "rows": rows, "evals": evals,
                   "saves": saves, "train_seconds": loop.seconds}
            save_run(me, phase_dir / CHECKPOINTS, step, job, self.tok, args.keep_checkpoints,
                     saves, log)

        loop_args = argparse.Namespace(steps=steps, no_progress=args.no_progress,
                                       save_every=args.save_every or (steps if save else 0),
                                       resume=args.resume)
        batches = StepBatches(self.train_blocks, micro=micro, gas=gas, dp_size=topo.dp_size,
                              dp_rank=topo.dp_rank, seed=args.seed).iter_from(start)
        loop = TrainLoop(loop_args, start, job_state["train_seconds"], self.stop, engine.device,
                         save_fn, log)
        for step in loop:
            m = train_step(me, next(batches))
            rows.append(m.as_dict())
            if args.eval_every and step % args.eval_every == 0 and step != steps:
                evals.append({"step": m.step, **vars(evaluate(me, self.held, log=True))})
            loop.show(loss=f"{m.loss:.3f}", ppl_eval=f"{evals[-1]['perplexity']:.0f}")
        stopped = loop.stopped
        last = rows[-1]["step"] if rows else start
        if stopped is None and evals[-1]["step"] != last:
            evals.append({"step": last, **vars(evaluate(me, self.held, log=True))})
            log(f"{name}: held-out perplexity after {last} steps {evals[-1]['perplexity']:.1f} "
                f"({loop.seconds:.1f} s)")
        tokens = sum(r["num_tokens"] for r in rows)
        summary = {"steps": last, "steps_requested": steps, "stopped": stopped,
                   "resumed_from": resume_from and str(resume_from), "resumed_at_step": start,
                   "eval_before": evals[0], "eval_after": None if stopped else evals[-1],
                   "evals": evals, "first_loss": rows[0]["loss"] if rows else None,
                   "last_loss": rows[-1]["loss"] if rows else None,
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
    from launch.jobs.teacher import build_teacher, evaluate_teacher, teacher_cache_folder
    from megaloss import CausalLMWithDistillation, CausalLMWithLoss, Topology
    from megaloss.integrations.deepspeed import load_ds_config

    rank, _ = start_process(args.local_rank, args.output_dir)
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
    stop = StopRequest().install()
    phase = Phase(args, out_dir, topo, tok, train_blocks, held, data_key, log, stop)
    options = ml.ce.options()
    phases: Dict[str, Any] = {}

    def run_phase(name: str, build: Callable[[], Any], steps: int, describe: str,
                  save: bool = False) -> bool:
        """Phase ``name`` (its module from ``build()``) into ``phases``, or the summary of an
        earlier run that finished it (``--resume``); whether it was stopped."""
        done = phase.finished(name)
        if done is not None and done["steps"] >= steps:
            log(f"{name}: finished by an earlier run ({done['steps']} steps), kept")
            phases[name] = done
        else:
            phases[name] = phase.train(name, build(), steps, describe, save=save)
            phases[name].pop("engine")
        return phases[name].get("stopped") is not None

    # 1. the teacher: the main job's model, trained here (and saved) or loaded from its
    # checkpoint; the distilled phase reads it back from the checkpoint either way
    t_args = model_args(args, args.teacher_model_size, overrides=False)
    teacher_from, cache = args.teacher, None
    if teacher_from is None:
        if not args.no_teacher_cache:
            import torch.distributed as dist

            cache = teacher_cache_folder(args, json.loads(Path(args.deepspeed_config).read_text(
                encoding="utf-8")), dist.get_world_size(), data_key)
        cached = phase.cached_teacher(cache)
        if cached is not None:
            log(f"teacher: {args.teacher_model_size} Llama, {cached['steps']} steps, copied from "
                f"the cache {cache} (--no_teacher_cache trains it again); held-out perplexity "
                f"{cached['eval_after']['perplexity']:.1f}")
            phases["teacher"] = cached
        else:
            model, t_cfg = build_llama(t_args, vocab)
            if run_phase("teacher", lambda: CausalLMWithLoss(model, options=options,
                                                             tp_group=topo.tp_group),
                         args.teacher_steps, f"{args.teacher_model_size} Llama, "
                         f"{n_parameters(model, vocab, t_cfg.hidden_size) / 1e6:.2f} M "
                         "parameters", save=True):
                return stopped_run(args, out_dir, rank, "teacher", phases, stop, log)
            if cache is not None:
                agreed(lambda: phase.store_teacher(cache), what=f"teacher cache {cache}")
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
    if run_phase("ce", lambda: CausalLMWithLoss(student, options=options,
                                                tp_group=topo.tp_group),
                 args.steps, describe + ", cross-entropy"):
        return stopped_run(args, out_dir, rank, "ce", phases, stop, log)
    kd = distillation_options(args, ml)

    def distilled():
        student, _ = build_llama(s_args, vocab)  # the same initial weights (build_llama seeds)
        return CausalLMWithDistillation(student, teacher.to(_device()), options=kd,
                                        tp_group=topo.tp_group)

    if run_phase("distilled", distilled, args.steps,
                 describe + f", {kd.kind} T={kd.temperature:g} alpha={kd.alpha:g}"):
        return stopped_run(args, out_dir, rank, "distilled", phases, stop, log)

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
                    "steps": teacher_steps, "model_size": args.teacher_model_size,
                    "cached_from": phases.get("teacher", {}).get("cached_from"),
                    "cache": cache and str(cache)},
        "phases": phases, "steps": args.steps, "seed": args.seed, "stopped": None,
        "resumed": args.resume is not None,
        "dp": topo.dp_size, "tp": topo.tp_size, "zero_stage": phases["distilled"]["zero_stage"],
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
        # two students side by side, not one model's before -> after
        verdict = (f"the distilled student ({kd_ppl:.1f}) "
                   + ("beats" if summary["distillation_beats_ce"] else "does NOT beat")
                   + f" the student trained on CE alone ({ce_ppl:.1f})")
        print_summary_table(
            "megaloss distillation job: held-out perplexity", table_rows(table),
            f"{verdict}; {kd.kind}, T={kd.temperature:g}, "
            f"alpha={kd.alpha:g}; DP={topo.dp_size} x TP={topo.tp_size}, "
            f"{summary['total_seconds']:.0f} s in all",
            columns=("model", "size", "params", "steps", "perplexity", "CE (nats/token)"))
        log(f"wrote {out_dir / 'summary.json'}, {out_dir / 'loss_curve.png'} and "
            f"{', '.join(str(out_dir / p) for p in phases)}/")
    import torch.distributed as dist

    dist.barrier()
    stop.restore()
    return summary


def stopped_run(args: argparse.Namespace, out_dir: Path, rank: int, name: str,
                phases: Dict[str, Any], stop: StopRequest,
                log: Callable[[str], None]) -> Dict[str, Any]:
    """The end of a run stopped in phase ``name`` (saved there, its outputs written):
    ``summary.json`` with ``"stopped": {"signal", "step", "phase"}`` and the phases so far, on
    rank 0, then a barrier. Collective."""
    import torch.distributed as dist

    summary = {"stopped": {**phases[name]["stopped"], "phase": name}, "phases": phases,
               "steps": args.steps, "teacher_steps": args.teacher_steps, "seed": args.seed}
    if rank == 0:
        write_summary_json(out_dir / "summary.json", summary)
        log(f"stopped in phase {name} after its step {phases[name]['stopped']['step']}: wrote "
            f"{out_dir / 'summary.json'} and {out_dir / name}/; continue with --resume")
    dist.barrier()
    stop.restore()
    return summary


def _eval(e: Dict[str, float]) -> Dict[str, float]:
    return {"perplexity": e["perplexity"], "loss": e["loss"]}


def _device() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


if __name__ == "__main__":
    run_job(main)
