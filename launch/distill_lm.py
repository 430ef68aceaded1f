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

Each phase is a run of the job runner (:func:`launch.jobs.runner.train_run`, :class:`Phase`): its
own folder, engine, checkpoints and outputs, under the job's one stop request;
:class:`Distillation` holds what the phases share and the table comparing them.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from launch.jobs.agreement import agreed, rank0_decides
from launch.jobs.arguments import (
    add_job_arguments,
    add_llama_arguments,
    add_lm_data_arguments,
    add_run_arguments,
    check_input_files,
    check_run_arguments,
    job_parser,
)
from launch.jobs.checkpoints import (
    CHECKPOINTS,
    LM_DATA_OPTIONS,
    RUN_OUTPUTS,
    DeepSpeedCheckpoints,
    checkpoint_stats,
)
from launch.jobs.lm_data import eval_batches, load_blocks
from launch.jobs.lm_job import LMJob
from launch.jobs.models import LLAMA_SIZES, build_llama
from launch.jobs.processes import start_process
from launch.jobs.reporting import Curve, plot_loss_curve, rank0_logger, write_summary_json
from launch.jobs.runner import (
    Run,
    StopRequest,
    Table,
    print_summary,
    run_job,
    train_run,
)

REPO = Path(__file__).resolve().parent.parent
PHASES = ("teacher", "ce", "distilled")
KINDS = ("forward_kl", "reverse_kl", "jsd")
# The distillation options without a ds_config "distillation" section or a flag.
KD_DEFAULTS = {"kind": "forward_kl", "temperature": 1.0, "alpha": 0.5, "beta": 0.5}
# The teacher trained here: the main job's model for 400 steps (the main job trains it for 150),
# so that it is ahead of the student (at 150 steps the smaller student, which learns faster per
# step, is ahead of it), with the whole default run within ~5 minutes on 2 CPU cores.
TEACHER_STEPS = 400


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


class Phase(LMJob):
    """One phase, a run of the runner (:func:`launch.jobs.runner.train_run`): ``module``
    trained for ``steps`` calibrated steps in a fresh engine (monitors, outputs and checkpoints
    in ``<output_dir>/<phase>``), held-out CE before, every ``--eval_every`` steps and after;
    checkpoints every ``--save_every`` steps, and of the last step with ``save`` (the teacher,
    a main-job checkpoint: the record ``launch/train_lm.py`` keeps) or ``--save_every`` /
    ``--resume``. With ``--resume`` it continues from the phase's latest checkpoint when it has
    one. ``job``: the :class:`Distillation` it is a phase of (data, layout, logger)."""

    tag = "distill"

    def __init__(self, job: "Distillation", phase: str, module: Any, steps: int, describe: str,
                 save: bool) -> None:
        super().__init__(job.args)
        self.phase, self.module, self.describe, self.save = phase, module, describe, save
        self.phase_steps, self.topo = steps, job.topo
        self.tok, self.train_blocks, self.held, self.data_key = (job.tok, job.train_blocks,
                                                                 job.held, job.data_key)
        self.dp, self.dp_rank = job.topo.dp_size, job.topo.dp_rank

    @property
    def out_dir(self) -> Path:
        return Path(self.args.output_dir) / self.phase

    @property
    def steps(self) -> int:
        return self.phase_steps

    @property
    def save_every(self) -> int:
        return self.args.save_every or (self.phase_steps if self.save else 0)

    @property
    def folder_args(self) -> argparse.Namespace:
        # the LM job's rules for the phase's folder: with --resume its latest checkpoint (none
        # yet: a fresh phase), what a run that crashed before its first checkpoint left cleared
        return argparse.Namespace(resume="latest" if self.args.resume is not None else None,
                                  eval_only=False, overwrite=False)

    def configure(self) -> dict:
        from megaloss.integrations.deepspeed import load_ds_config

        self.ds_config, _ = load_ds_config(self.args.deepspeed_config,
                                           output_dir=str(self.out_dir))
        self.micro = self.ds_config.get("train_micro_batch_size_per_gpu", 1)
        self.gas = self.ds_config.get("gradient_accumulation_steps", 1)
        return self.ds_config

    def build(self) -> None:
        from megaloss.integrations.deepspeed import initialize

        self.me = initialize(self.module, self.ds_config, topology=self.topo,
                             output_dir=str(self.out_dir))
        self.engine, self.device = self.me.engine, self.me.engine.device
        self.checkpoints = DeepSpeedCheckpoints(self.me, self.tok, {"data_key": self.data_key},
                                                LM_DATA_OPTIONS)

    def step(self, step: int) -> Dict[str, Any]:
        from megaloss.integrations.deepspeed import train_step

        return train_step(self.me, next(self.batches)).as_dict()

    def evaluate(self) -> Dict[str, Any]:
        from megaloss.integrations.deepspeed import evaluate

        return vars(evaluate(self.me, self.held, log=True))

    def on_eval(self, when: str, entry: Dict[str, Any]) -> None:
        if when == "before":
            self.run.log(f"{self.phase}: {self.describe}; held-out perplexity before "
                         f"{entry['perplexity']:.1f}")
        else:
            self.run.log(f"{self.phase}: held-out perplexity after {self.run.last} steps "
                         f"{entry['perplexity']:.1f} ({self.run.seconds:.1f} s)")

    def progress(self, row: Dict[str, Any]) -> Dict[str, str]:
        return {"loss": f"{row['loss']:.3f}",
                "ppl_eval": f"{self.run.evals[-1]['perplexity']:.0f}"}

    def summary(self) -> Dict[str, Any]:
        run = self.run
        return {**self.lm_summary(), "eval_after": None if run.stopped else run.evals[-1],
                "evals": run.evals, "micro_batch": self.micro, "gas": self.gas,
                "zero_stage": self.engine.zero_optimization_stage(),
                "engine_loss_multiplier": self.me.engine_scale.loss_multiplier,
                "checkpoints": checkpoint_stats(run.saves)}

    def plot_title(self, summary: Dict[str, Any]) -> str:
        return f"megaloss distillation: {self.phase}"


class Distillation:
    """The job: its data and layout, its phases (:class:`Phase`, a run of the runner each, or
    what an earlier run or the teacher cache left), the table comparing the models."""

    def __init__(self, args: argparse.Namespace) -> None:
        from megaloss import Topology
        from megaloss.integrations.deepspeed import load_ds_config

        t_start = time.perf_counter()
        rank, _ = start_process(args.local_rank, args.output_dir)
        self.run = Run(rank, rank0_logger("distill", rank, t_start), t_start)
        self.args, self.out_dir = args, Path(args.output_dir)
        self.ds_config, self.ml = load_ds_config(args.deepspeed_config,
                                                 output_dir=str(self.out_dir))
        if self.ml.sequence_parallel_size != 1:
            raise SystemExit("the distillation job runs without sequence parallelism "
                             "(megaloss.sequence_parallel_size must be 1)")
        if self.ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
            raise SystemExit("the distillation job runs with ZeRO-0/1/2: it reads its teacher "
                             "back from a checkpoint's model files, which ZeRO-3 leaves empty")
        agreed(lambda: open_distill_run(args, self.out_dir), what=f"--output_dir {self.out_dir}")
        self.topo = Topology.build(self.ml.tensor_parallel_size)
        self.tok, self.train_blocks, held_blocks, self.info, self.data_key = load_blocks(
            args, self.run.log)
        self.vocab = self.tok.get_vocab_size()
        micro = self.ds_config.get("train_micro_batch_size_per_gpu", 1)
        self.held = eval_batches(held_blocks, micro, self.topo.dp_size, self.topo.dp_rank)
        self.options = self.ml.ce.options()
        self.phases: Dict[str, Any] = {}
        self.stop: Optional[StopRequest] = None  # installed by main before the first phase

    def train(self, name: str, build: Callable[[], Any], steps: int, describe: str,
              save: bool = False) -> bool:
        """Phase ``name`` (its module from ``build()``) into ``phases``, or the summary of an
        earlier run that finished it (``--resume``); whether it was stopped."""
        done = self.finished(name)
        if done is not None and done["steps"] >= steps:
            self.run.log(f"{name}: finished by an earlier run ({done['steps']} steps), kept")
            self.phases[name] = done
        else:
            phase = Phase(self, name, build(), steps, describe, save)
            self.phases[name] = train_run(phase, self.run, self.stop)
        return self.phases[name].get("stopped") is not None

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

        return rank0_decides(read, what=f"--resume {self.out_dir / name}")

    def teacher(self) -> bool:
        """Phase 1: the main job's model, trained here (and saved, and cached) or copied from
        the cache, or loaded from ``--teacher``; the distilled phase reads it back from the
        checkpoint either way. Whether it was stopped."""
        from launch.jobs.teacher import build_teacher, evaluate_teacher, teacher_cache_folder
        from megaloss import CausalLMWithLoss

        args, log, vocab = self.args, self.run.log, self.vocab
        self.t_args = t_args = model_args(args, args.teacher_model_size, overrides=False)
        teacher_from, self.cache = args.teacher, None
        if teacher_from is None:
            if not args.no_teacher_cache:
                import torch.distributed as dist

                self.cache = teacher_cache_folder(args, json.loads(Path(
                    args.deepspeed_config).read_text(encoding="utf-8")), dist.get_world_size(),
                    self.data_key)
            cached = self.cached_teacher(self.cache)
            if cached is not None:
                log(f"teacher: {args.teacher_model_size} Llama, {cached['steps']} steps, copied "
                    f"from the cache {self.cache} (--no_teacher_cache trains it again); "
                    f"held-out perplexity {cached['eval_after']['perplexity']:.1f}")
                self.phases["teacher"] = cached
            else:
                model, t_cfg = build_llama(t_args, vocab)
                if self.train("teacher", lambda: CausalLMWithLoss(
                        model, options=self.options, tp_group=self.topo.tp_group),
                        args.teacher_steps, f"{args.teacher_model_size} Llama, "
                        f"{n_parameters(model, vocab, t_cfg.hidden_size) / 1e6:.2f} M "
                        "parameters", save=True):
                    return True
                if self.cache is not None:
                    agreed(self.store_teacher, what=f"teacher cache {self.cache}")
            teacher_from = self.phases["teacher"]["checkpoints"]["last"]
        self.teacher_model, self.t_cfg, t_info = build_teacher(teacher_from, t_args, vocab,
                                                               data_key=self.data_key)
        if args.teacher is None:
            self.teacher_eval = self.phases["teacher"]["eval_after"]
        else:
            self.teacher_eval = evaluate_teacher(self.teacher_model, self.held, self.topo,
                                                 _device(), self.options)
            log(f"teacher: {t_info['checkpoint']} (step {t_info['steps']}), held-out perplexity "
                f"{self.teacher_eval['perplexity']:.1f}")
        self.teacher_steps, self.teacher_from = t_info["steps"], t_info["checkpoint"]
        return False

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

        return rank0_decides(restore, what=f"teacher cache {cache}")

    def store_teacher(self) -> None:
        """Cache the finished teacher phase (:func:`store_cached_teacher`; rank 0): a cache
        that cannot be written is reported and the run goes on."""
        from launch.jobs.teacher import store_cached_teacher

        try:
            if store_cached_teacher(self.out_dir / "teacher", self.cache) is not None:
                self.run.log(f"teacher: cached in {self.cache} (a later run of these settings "
                             "copies it back instead of training it)")
        except OSError as e:
            self.run.log(f"teacher: not cached in {self.cache}: {e}")

    def students(self) -> Optional[str]:
        """Phases 2 and 3: the student on CE alone, then distilled, from the same initial
        weights and batches. The phase that was stopped, or None."""
        from megaloss import CausalLMWithDistillation, CausalLMWithLoss

        args, vocab, topo = self.args, self.vocab, self.topo
        self.s_args = s_args = model_args(args, args.model_size, overrides=True)
        student, self.s_cfg = build_llama(s_args, vocab)
        self.s_params = n_parameters(student, vocab, self.s_cfg.hidden_size)
        describe = f"{args.model_size} Llama, {self.s_params / 1e6:.2f} M parameters"
        if self.train("ce", lambda: CausalLMWithLoss(student, options=self.options,
                                                     tp_group=topo.tp_group),
                      args.steps, describe + ", cross-entropy"):
            return "ce"
        self.kd = kd = distillation_options(args, self.ml)

        def distilled():
            student, _ = build_llama(s_args, vocab)  # the same initial weights (build_llama seeds)
            return CausalLMWithDistillation(student, self.teacher_model.to(_device()), options=kd,
                                            tp_group=topo.tp_group)

        if self.train("distilled", distilled, args.steps,
                      describe + f", {kd.kind} T={kd.temperature:g} alpha={kd.alpha:g}"):
            return "distilled"
        return None

    def finish(self) -> Dict[str, Any]:
        """The table of the three models' held-out perplexity, ``summary.json`` and the
        students' held-out CE curves (rank 0). Collective."""
        args, topo, phases, kd, run = self.args, self.topo, self.phases, self.kd, self.run
        t_params = n_parameters(self.teacher_model, self.vocab, self.t_cfg.hidden_size)

        def size(cfg):
            return f"Llama {cfg.num_hidden_layers}L x {cfg.hidden_size}"

        table = [
            {"model": "teacher", "size": size(self.t_cfg), "parameters": int(t_params),
             "steps": self.teacher_steps, **_eval(self.teacher_eval)},
            {"model": "student, CE only", "size": size(self.s_cfg),
             "parameters": int(self.s_params), "steps": args.steps,
             **_eval(phases["ce"]["eval_after"])},
            {"model": "student, distilled", "size": size(self.s_cfg),
             "parameters": int(self.s_params), "steps": args.steps,
             **_eval(phases["distilled"]["eval_after"])},
        ]
        ce_ppl, kd_ppl = table[1]["perplexity"], table[2]["perplexity"]
        summary = {
            "table": table, "distillation_beats_ce": kd_ppl < ce_ppl,
            "perplexity_ce_minus_distilled": ce_ppl - kd_ppl,
            "distillation": {k: (str(v) if k == "accum_dtype" else v)
                             for k, v in kd.as_dict().items()},
            "teacher": {"checkpoint": self.teacher_from, "trained_here": args.teacher is None,
                        "steps": self.teacher_steps, "model_size": args.teacher_model_size,
                        "cached_from": phases.get("teacher", {}).get("cached_from"),
                        "cache": self.cache and str(self.cache)},
            "phases": phases, "steps": args.steps, "seed": args.seed, "stopped": None,
            "resumed": args.resume is not None,
            "dp": topo.dp_size, "tp": topo.tp_size,
            "zero_stage": phases["distilled"]["zero_stage"],
            "seq_len": args.seq_len, "vocab_size": self.vocab, "ce": self.ml.ce.model_dump(),
            "data": "stdlib" if not args.train_data else "user files", "data_key": self.data_key,
            "total_seconds": time.perf_counter() - run.t_start, **self.info,
        }
        if run.rank == 0:
            out_dir = self.out_dir
            write_summary_json(out_dir / "summary.json", summary)
            curves = [Curve(f"held-out CE, {p}", [e["step"] for e in phases[p]["evals"]],
                            [e["loss"] for e in phases[p]["evals"]], "o-")
                      for p in ("ce", "distilled")]
            plot_loss_curve(out_dir / "loss_curve.png", curves,
                            title="student: CE alone vs distilled",
                            ylabel="cross-entropy (nats / token)", grid=True)
            # two students side by side, not one model's before -> after
            verdict = (f"the distilled student ({kd_ppl:.1f}) "
                       + ("beats" if summary["distillation_beats_ce"] else "does NOT beat")
                       + f" the student trained on CE alone ({ce_ppl:.1f})")
            print_summary(Table(
                "megaloss distillation job: held-out perplexity", table_rows(table),
                f"{verdict}; {kd.kind}, T={kd.temperature:g}, alpha={kd.alpha:g}; "
                f"DP={topo.dp_size} x TP={topo.tp_size}, {summary['total_seconds']:.0f} s in all",
                ("model", "size", "params", "steps", "perplexity", "CE (nats/token)")), summary)
            run.log(f"wrote {out_dir / 'summary.json'}, {out_dir / 'loss_curve.png'} and "
                    f"{', '.join(str(out_dir / p) for p in phases)}/")
        return self.end(summary)

    def stopped(self, name: str) -> Dict[str, Any]:
        """The end of a run stopped in phase ``name`` (saved there, its outputs written):
        ``summary.json`` with ``"stopped": {"signal", "step", "phase"}`` and the phases so far,
        on rank 0. Collective."""
        args, phases = self.args, self.phases
        summary = {"stopped": {**phases[name]["stopped"], "phase": name}, "phases": phases,
                   "steps": args.steps, "teacher_steps": args.teacher_steps, "seed": args.seed}
        if self.run.rank == 0:
            write_summary_json(self.out_dir / "summary.json", summary)
            self.run.log(f"stopped in phase {name} after its step "
                         f"{phases[name]['stopped']['step']}: wrote "
                         f"{self.out_dir / 'summary.json'} and {self.out_dir / name}/; continue "
                         "with --resume")
        return self.end(summary)

    def end(self, summary: Dict[str, Any]) -> Dict[str, Any]:
        import torch.distributed as dist

        dist.barrier()
        self.stop.restore()
        return summary


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


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    add_job_arguments(p, steps=150, output_dir=os.path.join("runs", "distill"),
                      config="zero2.json", config_help="ds_config JSON of all three phases; its "
                      "'megaloss' section sets the TP size and CE options")
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


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    job = Distillation(parse_args(argv))
    job.stop = StopRequest().install()
    if job.teacher():
        return job.stopped("teacher")
    stopped = job.students()
    return job.finish() if stopped is None else job.stopped(stopped)


def _eval(e: Dict[str, float]) -> Dict[str, float]:
    return {"perplexity": e["perplexity"], "loss": e["loss"]}


def _device() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().current_device_name()


if __name__ == "__main__":
    run_job(main)
