#!/usr/bin/env python3
"""Train a small mixture-of-experts LM twice, with its load-balancing loss counted per
micro-batch and over the global batch, and compare perplexity, expert load and specialisation.

Run through the launcher (it passes ``--local_rank``) with the repository root on
``PYTHONPATH``, as ``launch/train_moe.sh`` does::

    PYTHONPATH=. deepspeed --num_gpus 2 launch/train_moe.py --deepspeed_config configs/moe.json

or as one process from the repository root: ``python -m launch.train_moe`` (one rank: the
``global`` scope is then the ``micro_batch`` one; the ``step`` scope still pools the
accumulated micro-batches).

The model is a random-init Qwen3-MoE (``transformers`` ``Qwen3MoeConfig``,
:func:`launch.jobs.models.build_qwen3_moe`: by default 2 layers x 64 wide, 8 experts, top-2,
``output_router_logits=False`` so the model's own router term is off) on the main LM job's
built-in data (the Python standard library's sources, its BPE tokenizer and cache,
:mod:`launch.jobs.lm_data`), wrapped in :class:`megaloss.CausalLMWithLoss` and trained by
megaloss's calibrated step under DeepSpeed (``configs/moe.json``: ZeRO-2, data parallel on every
process, micro-batch 2 x gradient accumulation 2), ``--steps`` 300. The router loss is the
ds_config's ``megaloss.router`` section (load balancing, per layer), which the step computes and
calibrates; each run sets its ``scope`` (``--scopes``), everything else equal: the same initial
weights, seed, batches and coefficient (``--aux_loss`` overrides the config's).

The coefficient is 0.1, not the 0.001-0.01 of large models: measured at this size (300 steps, 2
CPU processes), ``aux_loss`` 0.01 leaves the routers about as unbalanced as no loss would
(held-out load max / mean 1.3-1.4 in the first layer and 2.1-2.4 in the second, in every scope),
so the scopes have no constraint to differ by; at 0.1 the micro-batch-balanced router is close
to uniform (1.08 / 1.18) and the scopes can differ in how they reach balance.

Why ``micro_batch`` against ``step`` by default. The Qwen team (arXiv:2501.11873) shows that
counting the expert load ``f`` per micro-batch pushes every micro-batch, i.e. a few sequences of
one or two domains, to spread over all experts, which blocks specialisation; counting it over
the global batch lets each domain keep its experts while the batch as a whole stays balanced.
At this size a micro-batch is 2 blocks of 128 tokens, each from one file, and the ``global``
scope (one micro-step over the data-parallel ranks, the paper's all-reduce) pools only 4 of them
on 2 processes; ``step`` pools the whole optimizer step (8 blocks, the counts from a routing
pre-pass without gradients): the largest pool this layout has, the paper's "global batch"
without the approximation of its running buffer across accumulation steps. ``--scopes
micro_batch,global,step`` trains all three.

Reports (rank 0: a table; ``summary.json``; ``plot.png``; each run's ``metrics.csv``,
``summary.json`` and ``loss_curve.png`` in ``<output_dir>/<scope>``, default ``runs/moe``):

- held-out perplexity of each run (the held-out files' blocks, the LM job's evaluation);
- expert load per layer on the held-out blocks: the most used expert's top-k selections over
  the mean expert's (1 is perfect balance, ``E / top_k`` = 4 all tokens on two experts);
- expert specialisation per data domain (top-level stdlib packages, ``--domains``, on their
  held-out files): the share of a domain's top-k selections that go to its ``top_k`` most used
  experts, averaged over the layers (``top_k / E`` = 0.25: spread evenly; 1: two experts take
  the whole domain), and its lift: that share minus the whole held-out text's share on the
  same experts (an unbalanced router raises every domain's share; the lift is what a domain
  concentrates beyond that) (:mod:`launch.jobs.expert_routing`).

``--mtp D`` adds DeepSeek-V3's multi-token prediction (arXiv:2412.19437, sec. 2.2) to every run:
``D`` depths (:mod:`launch.jobs.mtp_module`, each one decoder layer of the model's class) whose
cross-entropies go through the shared lm_head, chunked, each calibrated over the global batch
with its own token count, weighted ``--mtp_scaling / D``
(:class:`megaloss.integrations.step.mtp.MultiTokenPredictionStepLoss`,
:class:`launch.jobs.mtp_lm.CausalLMWithMTP`); each depth's CE per step goes to ``metrics.csv``
(``mtp_loss_<k>``) and the last step's to the table. The held-out CE stays the main
model's.

Each run is a run of the job runner (:func:`launch.jobs.runner.train_run`, :class:`ScopeRun`).
A stop signal ends the job after the run in progress has saved and written its outputs
(``"stopped"`` in ``summary.json``); the job does not resume (rerun with ``--overwrite``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from launch.jobs.agreement import agreed
from launch.jobs.arguments import (
    add_job_arguments,
    add_lm_data_arguments,
    check_input_files,
    job_parser,
    require_at_least,
)
from launch.jobs.checkpoints import LM_DATA_OPTIONS, RUN_OUTPUTS, DeepSpeedCheckpoints
from launch.jobs.expert_routing import DOMAINS, domain_blocks, plot_routing, routing_report
from launch.jobs.lm_data import eval_batches, load_blocks, split_files
from launch.jobs.lm_job import LMJob
from launch.jobs.models import build_qwen3_moe
from launch.jobs.processes import start_process
from launch.jobs.reporting import Curve, plot_loss_curve, rank0_logger, write_summary_json
from launch.jobs.runner import Run, StopRequest, Table, print_summary, run_job, train_run

REPO = Path(__file__).resolve().parent.parent
SCOPES = ("micro_batch", "global", "step")
PLOT = "plot.png"


def run_folder_refusal(args: argparse.Namespace, out_dir: Path) -> Optional[str]:
    """Why this job may not start in ``out_dir`` (None: it may): the folder holds a run's
    outputs or run folders and ``--overwrite`` is not given (also the pre-flight check's rule
    for this job, ``launch/jobs/preflight.py``)."""
    existing = [n for n in (*RUN_OUTPUTS, PLOT, *SCOPES) if (out_dir / n).exists()]
    if not existing or args.overwrite:
        return None
    return (f"{out_dir} already holds a run ({', '.join(existing)}); pass --overwrite to "
            "replace it, or another --output_dir")


def open_moe_run(args: argparse.Namespace, out_dir: Path) -> None:
    """One run per folder (call on one rank): refuse ``out_dir`` holding a run unless
    ``--overwrite`` (:func:`run_folder_refusal`), which removes its outputs and run folders."""
    refusal = run_folder_refusal(args, out_dir)
    if refusal is not None:
        raise SystemExit(refusal)
    for name in (*RUN_OUTPUTS, PLOT, *SCOPES):
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


class ScopeRun(LMJob):
    """One run of the comparison (:func:`launch.jobs.runner.train_run`): ``module`` trained for
    ``--steps`` calibrated steps with the router losses of ``scope`` in a fresh engine (monitors,
    outputs and checkpoints of a stop in ``<output_dir>/<scope>``), held-out CE before, every
    ``--eval_every`` steps and after. ``job``: the :class:`MoEComparison` it is a run of."""

    tag = "moe"

    def __init__(self, job: "MoEComparison", scope: str, module: Any) -> None:
        super().__init__(job.args)
        self.scope, self.module, self.topo = scope, module, job.topo
        self.tok, self.train_blocks, self.held, self.data_key = (job.tok, job.train_blocks,
                                                                 job.held, job.data_key)
        self.dp, self.dp_rank = job.topo.dp_size, job.topo.dp_rank
        self.base_config = job.ds_config

    @property
    def out_dir(self) -> Path:
        return Path(self.args.output_dir) / self.scope

    @property
    def folder_args(self) -> argparse.Namespace:
        return argparse.Namespace(resume=None, eval_only=False, overwrite=False)

    def configure(self) -> dict:
        from megaloss.integrations.deepspeed import load_ds_config

        config = json.loads(json.dumps(self.base_config))  # a copy: each run sets its scope
        config["megaloss"]["router"]["scope"] = self.scope
        self.ds_config, self.ml = load_ds_config(config, output_dir=str(self.out_dir))
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

        if not self.args.mtp:
            return train_step(self.me, next(self.batches)).as_dict()
        # the multi-token prediction family of the calibrated step: every depth calibrated by
        # its own global count; its depths' global CEs as mtp_loss_1, ...
        from megaloss.integrations.step import run_step
        from megaloss.integrations.step.mtp import MultiTokenPredictionStepLoss

        family = MultiTokenPredictionStepLoss(self.args.mtp, router=self.ml.router.options())
        return run_step(self.me, family, next(self.batches)).as_dict()

    def evaluate(self) -> Dict[str, Any]:
        from megaloss.integrations.deepspeed import evaluate

        return vars(evaluate(self.me, self.held, log=True))

    def on_eval(self, when: str, entry: Dict[str, Any]) -> None:
        self.run.log(f"{self.scope}: held-out perplexity {when} training "
                     f"{entry['perplexity']:.1f}" + (f" ({self.run.seconds:.1f} s)"
                                                     if when == "after" else ""))

    def progress(self, row: Dict[str, Any]) -> Dict[str, str]:
        return {"loss": f"{row['loss']:.3f}", "aux": f"{row['router_aux_loss']:.3f}",
                "load": f"{row['expert_load_max']:.2f}",
                "ppl_eval": f"{self.run.evals[-1]['perplexity']:.0f}"}

    def summary(self) -> Dict[str, Any]:
        run = self.run
        rows = run.rows
        return {**self.lm_summary(), "eval_after": None if run.stopped else run.evals[-1],
                "evals": run.evals, "micro_batch": self.micro, "gas": self.gas,
                "zero_stage": self.engine.zero_optimization_stage(),
                "engine_loss_multiplier": self.me.engine_scale.loss_multiplier,
                "router": self.ml.router.options().as_dict(),
                "first_router_aux_loss": rows[0]["router_aux_loss"] if rows else None,
                "last_router_aux_loss": rows[-1]["router_aux_loss"] if rows else None,
                "last_expert_load_max": rows[-1]["expert_load_max"] if rows else None,
                "mtp_depths": self.args.mtp,
                "last_mtp_losses": [rows[-1][f"mtp_loss_{k}"]
                                    for k in range(1, self.args.mtp + 1)] if rows else None}

    def plot_title(self, summary: Dict[str, Any]) -> str:
        return f"megaloss MoE: router loss scope {self.scope}"


class MoEComparison:
    """The job: its data, layout and held-out domains, one :class:`ScopeRun` per scope, the
    routing figures of each trained model, the table and plot comparing them."""

    def __init__(self, args: argparse.Namespace) -> None:
        from megaloss import Topology
        from megaloss.integrations.deepspeed import load_ds_config

        t_start = time.perf_counter()
        rank, _ = start_process(args.local_rank, args.output_dir)
        self.run = Run(rank, rank0_logger("moe", rank, t_start), t_start)
        self.args, self.out_dir = args, Path(args.output_dir)
        # the monitors' paths stay empty here: each run points them at its own folder
        self.ds_config, self.ml = load_ds_config(args.deepspeed_config)
        self.router = router_options(args, self.ml)  # the comparison's coefficients
        self.ds_config.setdefault("megaloss", {})["router"] = self.router.as_dict()
        if (self.ml.tensor_parallel_size, self.ml.sequence_parallel_size,
                self.ml.pipeline_parallel_size) != (1, 1, 1):
            raise SystemExit("the MoE job runs data parallel only (megaloss.tensor_parallel_size,"
                             " sequence_parallel_size and pipeline_parallel_size must be 1): the "
                             "scopes differ by how many data-parallel ranks' tokens they pool")
        agreed(lambda: open_moe_run(args, self.out_dir), what=f"--output_dir {self.out_dir}")
        self.topo = topo = Topology.build(1)
        self.tok, self.train_blocks, held_blocks, self.info, self.data_key = load_blocks(
            args, self.run.log)
        self.vocab = self.tok.get_vocab_size()
        self.micro = self.ds_config.get("train_micro_batch_size_per_gpu", 1)
        self.held = eval_batches(held_blocks, self.micro, topo.dp_size, topo.dp_rank)
        self.domains = self.load_domains()
        self.runs: Dict[str, Dict[str, Any]] = {}
        self.stop: Optional[StopRequest] = None  # installed by main before the first run

    def load_domains(self) -> Dict[str, Any]:
        """The held-out blocks of each ``--domains`` entry (the held-out files of the split)."""
        from launch.jobs.code_search import stdlib_root

        args = self.args
        _, held_files = split_files(args)
        named = args.eval_data or args.train_data
        root = Path(named[0]) if named else stdlib_root()
        if named and not root.is_dir():
            root = root.parent
        blocks = domain_blocks(self.tok, held_files, root, args.domains, args.seq_len,
                               args.domain_blocks)
        missing = [d for d in args.domains if d not in blocks]
        self.run.log("domains (held-out blocks): " + ", ".join(
            f"{d} {b['input_ids'].shape[0]}" for d, b in blocks.items())
            + (f"; no held-out text for {', '.join(missing)}" if missing else ""))
        return blocks

    def model(self) -> Any:
        """A fresh model, the same initial weights for every run (seeded), in the wrapper."""
        from megaloss import CausalLMWithLoss

        model, self.cfg = build_qwen3_moe(self.args, self.vocab)
        self.n_params = sum(p.numel() for p in model.parameters())
        lm = CausalLMWithLoss(model, options=self.ml.ce.options(), tp_group=self.topo.tp_group)
        if not self.args.mtp:
            return lm
        from launch.jobs.mtp_lm import CausalLMWithMTP

        return CausalLMWithMTP(lm, self.args.mtp, self.args.mtp_scaling)

    def train(self, scope: str) -> bool:
        """Run ``scope``, then its routing figures; whether it was stopped. Collective."""
        module = self.model()
        job = ScopeRun(self, scope, module)
        summary = train_run(job, self.run, self.stop)
        if summary.get("stopped") is None:
            # the engine's module: under ZeRO-2 every rank holds the whole model
            summary["routing"] = routing_report(
                job.engine.module.decoder, self.cfg.num_experts_per_tok, self.held,
                self.domains, micro=self.micro, dp=self.topo.dp_size, dp_rank=self.topo.dp_rank,
                device=job.device, group=self.topo.dp_group)
            r = summary["routing"]
            self.run.log(f"{scope}: held-out expert load (max / mean) per layer "
                         f"{', '.join(f'{v:.2f}' for v in r['load_per_layer'])}; "
                         f"specialisation {r['specialisation_mean'] or 0:.3f}, lift "
                         f"{r['lift_mean'] or 0:+.3f}")
        self.runs[scope] = summary
        return summary.get("stopped") is not None

    def summary(self) -> Dict[str, Any]:
        args, cfg = self.args, self.cfg
        return {
            "runs": self.runs, "scopes": list(args.scopes), "router": self.router.as_dict(),
            "steps": args.steps, "seed": args.seed, "stopped": self.stopped_in(),
            "dp": self.topo.dp_size, "micro_batch": self.micro,
            "gas": self.ds_config.get("gradient_accumulation_steps", 1),
            "seq_len": args.seq_len, "vocab_size": self.vocab, "parameters": int(self.n_params),
            "model": (f"Qwen3-MoE {cfg.num_hidden_layers}L x {cfg.hidden_size}, "
                      f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok}"),
            "domains": list(self.domains), "data": "stdlib" if not args.train_data else
            "user files", "data_key": self.data_key,
            "total_seconds": time.perf_counter() - self.run.t_start, **self.info,
        }

    def stopped_in(self) -> Optional[Dict[str, Any]]:
        for scope, s in self.runs.items():
            if s.get("stopped") is not None:
                return {**s["stopped"], "run": scope}
        return None

    def finish(self) -> Dict[str, Any]:
        """``summary.json``, ``plot.png``, ``loss_curve.png`` and the table (rank 0)."""
        import torch.distributed as dist

        summary = self.summary()
        run, out = self.run, self.out_dir
        if run.rank == 0:
            write_summary_json(out / "summary.json", summary)
            done = {s: r for s, r in self.runs.items() if "routing" in r}
            if done:
                plot_routing(out / PLOT, {s: r["routing"] for s, r in done.items()},
                             title=f"{summary['model']}, aux_loss {self.router.aux_loss:g}, "
                                   f"{summary['steps']} steps")
            plot_loss_curve(out / "loss_curve.png",
                            [Curve(f"held-out CE, {s}", [e["step"] for e in r["evals"]],
                                   [e["loss"] for e in r["evals"]], "o-")
                             for s, r in self.runs.items()],
                            title="held-out CE per router-loss scope",
                            ylabel="cross-entropy (nats / token)", grid=True)
            print_summary(self.table(summary), summary)
            run.log(f"wrote {out / 'summary.json'}, {out / PLOT}, {out / 'loss_curve.png'} and "
                    f"{', '.join(str(out / s) for s in self.runs)}/")
        dist.barrier()
        self.stop.restore()
        return summary

    def table(self, summary: Dict[str, Any]) -> Table:
        return Table("megaloss MoE job: router load balancing per micro-batch vs global",
                     table_rows(summary), table_info(summary),
                     ("metric", *summary["runs"].keys()))


def table_rows(summary: Dict[str, Any]) -> List[tuple]:
    """``(metric, value per run...)`` rows of the summary table."""
    runs = list(summary["runs"].values())

    def row(name, get, fmt):
        cells = []
        for r in runs:
            try:
                value = get(r)
            except (KeyError, TypeError, IndexError):
                value = None
            cells.append("-" if value is None else fmt(value))
        return (name, *cells)

    rows = [row("held-out perplexity", lambda r: r["eval_after"]["perplexity"], "{:.2f}".format),
            row("held-out CE (nats/token)", lambda r: r["eval_after"]["loss"], "{:.4f}".format),
            row("train loss, first / last step", lambda r: (r["first_loss"], r["last_loss"]),
                lambda v: f"{v[0]:.3f} / {v[1]:.3f}"),
            row("router aux loss, last step", lambda r: r["last_router_aux_loss"],
                "{:.4f}".format)]
    layers = max((len(r.get("routing", {}).get("load_per_layer", [])) for r in runs), default=0)
    for i in range(layers):
        rows.append(row(f"held-out load, layer {i}",
                        lambda r, i=i: r["routing"]["load_per_layer"][i], "{:.3f}".format))
    for d in summary["domains"]:
        rows.append(row(f"specialisation: {d}", lambda r, d=d: r["routing"]["specialisation"][d],
                        "{:.3f}".format))
    rows.append(row("specialisation: mean",
                    lambda r: r["routing"]["specialisation_mean"], "{:.3f}".format))
    for k in range(1, max((r.get("mtp_depths") or 0 for r in runs), default=0) + 1):
        rows.insert(3 + k, row(f"MTP depth {k} CE, last step",
                           lambda r, k=k: r["last_mtp_losses"][k - 1], "{:.4f}".format))
    rows.append(row("lift over the corpus: mean", lambda r: r["routing"]["lift_mean"],
                    "{:+.3f}".format))
    return rows


def table_info(summary: Dict[str, Any]) -> str:
    router = summary["router"]
    uniform = next((r["routing"]["uniform_share"] for r in summary["runs"].values()
                    if "routing" in r), None)
    return (f"{summary['model']}, {summary['parameters'] / 1e6:.2f} M parameters; "
            f"{summary['steps']} steps of micro-batch {summary['micro_batch']} x GAS "
            f"{summary['gas']} x DP {summary['dp']} x {summary['seq_len']} tokens; aux_loss "
            f"{router['aux_loss']:g} ({router['layers']}), z_loss {router['z_loss']:g}; "
            "load: the most used expert's top-k selections over the mean expert's (1 = "
            "balanced); specialisation: share of a domain's top-k selections on its top-k "
            f"experts ({uniform if uniform is None else f'{uniform:.2f}'} = spread evenly); lift: "
            "that share minus the whole held-out text's share on the same experts"
            f"; {summary['total_seconds']:.0f} s in all")


def router_options(args: argparse.Namespace, ml: Any) -> Any:
    """The runs' :class:`megaloss.losses.router_options.RouterLossOptions`: the ds_config's
    ``megaloss.router`` section with ``--aux_loss`` overriding its coefficient (each run sets
    the scope).

    Raises:
        SystemExit: no load-balancing loss to compare (no section and no ``--aux_loss``, or a
            coefficient of 0).
    """
    from megaloss.losses.router_options import RouterLossOptions

    base = ml.router.options() if ml.router is not None else RouterLossOptions()
    if args.aux_loss is not None:
        base = base.replace(aux_loss=args.aux_loss)
    if not base.aux_loss > 0:
        raise SystemExit(f"--deepspeed_config {args.deepspeed_config}: the MoE job compares "
                         "load-balancing scopes and needs megaloss.router.aux_loss > 0 (or "
                         "--aux_loss)")
    return base


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_parser(__doc__)
    add_job_arguments(p, steps=300, output_dir=os.path.join("runs", "moe"), config="moe.json",
                      config_help="ds_config JSON of every run; its 'megaloss.router' section "
                                  "sets the router losses (each run sets the scope)")
    add_lm_data_arguments(p)
    g = p.add_argument_group("model")
    g.add_argument("--hidden_size", type=int, default=64, help="16-wide attention heads")
    g.add_argument("--num_layers", type=int, default=2, help="decoder layers, each an MoE one")
    g.add_argument("--num_experts", type=int, default=8)
    g.add_argument("--top_k", type=int, default=2, help="experts per token")
    g.add_argument("--moe_intermediate_size", type=int, default=128,
                   help="each expert's feed-forward width")
    g = p.add_argument_group("comparison")
    g.add_argument("--scopes", type=str, default="micro_batch,step",
                   help="comma-separated router-loss scopes to train, in order, each from the "
                        f"same initial weights and batches ({', '.join(SCOPES)})")
    g.add_argument("--aux_loss", type=float, default=None,
                   help="load-balancing coefficient of every run (default: the ds_config's "
                        "megaloss.router.aux_loss)")
    g.add_argument("--domains", type=str, default=",".join(DOMAINS),
                   help="comma-separated data domains whose held-out text measures expert "
                        "specialisation: top-level packages of the stdlib (or first-level "
                        "folders of --eval_data / --train_data)")
    g.add_argument("--domain_blocks", type=int, default=32,
                   help="held-out blocks per domain (at most, evenly spaced)")
    g.add_argument("--mtp", type=int, default=0, metavar="D",
                   help="multi-token prediction (DeepSeek-V3): D extra depths, each one MoE "
                        "layer predicting a token further ahead through the shared lm_head, "
                        "calibrated per depth (launch/jobs/mtp_lm.py); their CE per step in "
                        "metrics.csv (0: off)")
    g.add_argument("--mtp_scaling", type=float, default=0.1,
                   help="the MTP depths' weight, divided by D (Megatron-core's "
                        "mtp_loss_scaling_factor)")
    g = p.add_argument_group("runs")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --output_dir (its outputs and run folders)")
    for action in p._actions:  # the LM job's default is larger: 2 blocks a micro-batch here
        if action.dest == "eval_blocks":
            action.default = 64
    args = p.parse_args(argv)
    require_at_least(p, args, ("steps", "hidden_size", "num_layers", "num_experts", "top_k",
                               "moe_intermediate_size", "seq_len", "eval_blocks",
                               "domain_blocks"))
    require_at_least(p, args, ("eval_every", "mtp"), 0)
    if not args.mtp_scaling >= 0:
        p.error(f"--mtp_scaling must be >= 0, got {args.mtp_scaling}")
    if args.mtp >= args.seq_len:
        p.error(f"--mtp {args.mtp} must be < --seq_len {args.seq_len}")
    if args.hidden_size % 16:
        p.error(f"--hidden_size must be a multiple of 16 (16-wide heads), got {args.hidden_size}")
    if args.top_k > args.num_experts:
        p.error(f"--top_k {args.top_k} must be <= --num_experts {args.num_experts}")
    scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
    bad = [s for s in scopes if s not in SCOPES]
    if bad or not scopes:
        p.error(f"--scopes {args.scopes}: each must be one of {', '.join(SCOPES)}")
    if len(set(scopes)) != len(scopes):
        p.error(f"--scopes {args.scopes}: a scope is named twice")
    args.scopes = scopes
    args.domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    if args.aux_loss is not None and not args.aux_loss > 0:
        p.error(f"--aux_loss must be > 0, got {args.aux_loss}")
    # what the runner's loop reads of a run (this job does not checkpoint or resume)
    args.save_every, args.keep_checkpoints, args.resume, args.eval_only = 0, 0, None, False
    check_input_files(p, args)
    check_moe_config(p, args)
    return args


def check_moe_config(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``p.error`` when the ds_config's layout is not data parallel only, or it trains no
    load-balancing loss and ``--aux_loss`` is not given (the ``megaloss`` section's keys and
    values are the pre-flight's to check)."""
    cfg = json.loads(Path(args.deepspeed_config).read_text(encoding="utf-8"))
    section = cfg.get("megaloss", {}) if isinstance(cfg, dict) else {}
    section = section if isinstance(section, dict) else {}
    for key in ("tensor_parallel_size", "sequence_parallel_size", "pipeline_parallel_size"):
        if section.get(key, 1) != 1:
            p.error(f"--deepspeed_config {args.deepspeed_config}: megaloss.{key} is "
                    f"{section[key]}; the MoE job runs data parallel only (set it to 1): its "
                    "scopes differ by how many data-parallel ranks' tokens they pool")
    if isinstance(cfg.get("tensor_parallel"), dict) and \
            cfg["tensor_parallel"].get("autotp_size", 1) not in (0, 1):
        p.error(f"--deepspeed_config {args.deepspeed_config}: tensor_parallel.autotp_size: the "
                "MoE job runs data parallel only (remove the tensor_parallel section)")
    if args.aux_loss is not None:
        return
    router = section.get("router")
    aux = router.get("aux_loss", 0) if isinstance(router, dict) else 0
    if not isinstance(aux, (int, float)) or isinstance(aux, bool) or not aux > 0:
        p.error(f"--deepspeed_config {args.deepspeed_config}: no load-balancing loss to compare "
                "(megaloss.router.aux_loss must be > 0); add a 'router' section to its "
                "'megaloss' section, or pass --aux_loss")


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    job = MoEComparison(parse_args(argv))
    job.stop = StopRequest().install()
    for scope in job.args.scopes:
        if job.train(scope):
            break
    return job.finish()


if __name__ == "__main__":
    run_job(main)
