#!/usr/bin/env python3
"""Does my layout train like one device? Run your ds_config both ways and compare.

    megaloss-check-layout                                   # the shipped zero2.json, 2 processes
    megaloss-check-layout --deepspeed_config my_ds.json --num_procs 4 --steps 5
    megaloss-check-layout --deepspeed_config my_ds.json --num_procs 4 --job embed
    megaloss-check-layout --deepspeed_config my_ds.json --model path/to/config.json \
        --config_override '{"num_hidden_layers": 2}'
    megaloss-check-layout --deepspeed_config zero2.json zero3.json --num_procs 4  # both at once

What it does:

(``python -m megaloss.cli.check_layout`` is the same.) It runs from any directory: paths are
read relative to the current one, and nothing of a megaloss checkout is needed.

1. **Your layout**: ``deepspeed --num_gpus N --module megaloss.cli.check_layout ...`` (the
``deepspeed``
   launcher, as a training job runs) builds the model on every rank from one seed, makes the
   process groups from the config's ``megaloss.tensor_parallel_size`` (``DP = N / TP``), or,
   with DeepSpeed AutoTP (``"tensor_parallel": {"autotp_size": TP, "vocab_parallel_lm_head":
   true}``, LM job), lets ``deepspeed.initialize`` shard the model and make the groups (megaloss's
   loss on AutoTP's lm_head shard, :mod:`megaloss.integrations.autotp`), and
   trains K optimizer steps through the path megaloss users train with:
   ``megaloss.integrations.deepspeed.initialize`` (the engine, the measured engine scale, the
   calibrator) and ``train_step`` for the LM job; for the embedding job the loop of
   ``launch/train_embed.py`` (``step_loss_weights``, ``engine.backward``, ``engine.step``).
2. **One device**: the same global batches (micro-batch ``m x DP``, the same accumulation
   steps) on ONE process with no parallelism (TP 1, DP 1, ZeRO stage 0), the same optimizer,
   scheduler, clipping and precision, through the same ``initialize`` + ``train_step``. It runs
   in this process while the layout's processes run.
3. **Compare**, step by step: the global loss, the gradient norm before clipping, and the
   parameters after the step (the layout's TP shards, AutoTP's included, and ZeRO-3
   partitions gathered), as the
   relative difference of the update ``|(p_layout - p0) - (p_ref - p0)| / |p_ref - p0|`` over
   all parameters. PASS when every figure is within the tolerance of the training dtype
   (:data:`TOLERANCES`, printed with the verdict); otherwise FAIL, with the likely cause.

It also prints the groups it found (TP, DP, the group DeepSpeed reduces gradients over) and the
engine scale megaloss measured on the real engine (``EngineScale``: gradient factor, loss
multiplier, group ranks), next to what ``GAS x DP`` predicts.

Models: ``--model tiny`` (default; a 2-layer Llama / 1-layer BERT from ``transformers``
configs, random init, no download) or a path to a ``transformers`` config (``config.json`` or
its folder), built with random weights; ``--config_override`` shrinks it, or ties the
embeddings (``'{"tie_word_embeddings": true}'``; a tied config, e.g. Qwen2.5's, is checked tied,
also under TP: the input embedding then uses the lm_head's vocab shard; under PP the first and
the last stage hold the tied weight, DeepSpeed's ``TiedLayerSpec``). Data: random token
ids with a different number of ignored labels per row (LM) or of padded positions (embedding),
so that a calibration counting tokens per rank, or per micro-batch, shows.

Several layouts at once: ``--deepspeed_config a.json b.json ...`` (and ``--config_override``
once for all of them, or once per config) checks every config on the same ``--num_procs``
processes in ONE launch (the ranks run the layouts one after the other), with one one-device
run per distinct reference (configs that differ only in their layout share it); a report per
layout, then a summary line.

Exit status: 0 PASS (every layout), 1 FAIL (any layout), 2 error (the layout run did not run;
its log is printed).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from .check_layout_report import compare, diagnose, report
from .check_layout_run import (
    build_model,
    full_parameters,
    global_batches,
    init_single_process,
    layout_worker,
    model_config,
    reference_key,
    run_training,
)
from .check_layout_spec import (
    DEFAULT_OPTIMIZER,
    MONITOR_SECTIONS,
    TINY_BERT,
    TINY_LLAMA,
    TOLERANCES,
    layout_config,
    make_spec,
    make_specs,
    read_user_config,
    reference_config,
    training_dtype,
)

warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*", category=FutureWarning)

__all__ = ["TOLERANCES", "MONITOR_SECTIONS", "TINY_LLAMA", "TINY_BERT", "training_dtype",
           "DEFAULT_OPTIMIZER", "layout_config", "reference_config", "read_user_config",
           "make_specs", "make_spec", "model_config", "build_model", "global_batches",
           "full_parameters", "run_training", "reference_key", "init_single_process",
           "layout_worker", "compare", "diagnose", "report", "parse_args", "main",
           "HELP_DESCRIPTION", "HELP_EPILOG"]


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
HELP_DESCRIPTION = """\
It trains a few steps of a small model twice: with your ds_config's layout on --num_procs
processes through the deepspeed launcher (DP = num_procs / TP, TP: megaloss.tensor_parallel_size
or DeepSpeed AutoTP's tensor_parallel.autotp_size), and on one process with no parallelism on
the same global batches. Then it compares the loss, the gradient norm and the parameter
update step by step, and prints PASS, or FAIL with
the likely cause (a gradient scaled by the DP size, the wrong reduce group, ...)."""

HELP_EPILOG = """\
examples:
  megaloss-check-layout                                    # the shipped zero2.json, 2 processes
  megaloss-check-layout --deepspeed_config my_ds.json --num_procs 4
  megaloss-check-layout --deepspeed_config my_ds.json --job embed --num_procs 2
  megaloss-check-layout --deepspeed_config zero2.json zero3.json --num_procs 4  # both, one launch

exit status: 0 PASS, 1 FAIL, 2 the layout did not run (its log is printed)."""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="megaloss-check-layout", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0] + "\n\n" + HELP_DESCRIPTION, epilog=HELP_EPILOG)
    p.add_argument("--deepspeed_config", nargs="+", default=None, metavar="JSON",
                   help="your ds_config JSON (default: megaloss's shipped zero2.json, "
                        "DP x TP 2 under ZeRO-2); several: every layout checked in one launch "
                        "on the same --num_procs, a report each")
    p.add_argument("--num_procs", type=int, default=2,
                   help="processes of the layout (GPUs; CPU processes without GPUs); DP = "
                        "num_procs / TP (megaloss.tensor_parallel_size, or AutoTP's "
                        "tensor_parallel.autotp_size) (default 2)")
    p.add_argument("--job", choices=("lm", "embed"), default="lm",
                   help="lm: causal LM with the (vocab-parallel) chunked CE and token "
                        "calibration; embed: bi-encoder with the gathered MNR loss (TP 1)")
    p.add_argument("--model", default="tiny",
                   help="'tiny' (built-in) or a transformers config.json / folder")
    p.add_argument("--config_override", nargs="+", default=None, metavar="JSON",
                   help="JSON of model config fields to override, e.g. "
                        "'{\"num_hidden_layers\": 2}'; once for every config, or once per "
                        "--deepspeed_config (in their order; '{}' for none)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps K (default 4)")
    p.add_argument("--seq_len", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the layout run")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="write the layout's log and results to DIR (default: a temp dir)")
    p.add_argument("--verbose", action="store_true", help="print the launcher's output")
    # the tool's own tests: the N-th layouts (1 when no N) get a wrong engine scale
    p.add_argument("--_inject_wrong_scale", type=int, nargs="*", default=None,
                   metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--_worker", metavar="SPEC", default=None, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._inject_wrong_scale == []:
        args._inject_wrong_scale = [1]
    if args.steps < 1 or args.seq_len < 2:
        p.error("--steps must be >= 1 and --seq_len >= 2")
    return args


def _launch_layout(spec_path: Path, spec: Dict[str, Any], log_path: Path, verbose: bool):
    from megaloss.testing import free_port
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}
    cpus = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // (spec["num_procs"] + 1))))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus",
           str(spec["num_procs"]), "--master_port", str(free_port()),
           "--module", "megaloss.cli.check_layout",
           "--_worker", str(spec_path)]
    out = None if verbose else open(log_path, "w")
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True), cmd


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args._worker:
        layout_worker(args._worker)
        return 0
    import torch

    t0 = time.perf_counter()
    tmp = None
    if args.keep:
        out_dir = Path(args.keep)
        out_dir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="check_layout-")
        out_dir = Path(tmp.name)
    try:
        specs = make_specs(args, out_dir)
        spec_path = out_dir / "spec.json"
        spec_path.write_text(json.dumps(specs, indent=1))
        log_path = out_dir / "layout.log"
        for spec in specs:
            pp = f" x PP {spec['pp']}" if spec.get("pp", 1) > 1 else ""
            name = f"layout {spec['index'] + 1} ({spec['config_name']}): " if len(specs) > 1 \
                else ""
            print(f"check_layout: {name}DP {spec['dp']} x TP {spec['tp']}{pp} on "
                  f"{spec['num_procs']} processes through the deepspeed launcher, and one device "
                  f"in this process ({spec['steps']} steps, {spec['dtype']})", flush=True)
            for note in spec["notes"]:
                print(f"note: {note}", flush=True)
        proc, cmd = _launch_layout(spec_path, specs[0], log_path, args.verbose)
        try:
            threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or max(
                1, (os.cpu_count() or 1) // (specs[0]["num_procs"] + 1))
            if not torch.cuda.is_available():
                torch.set_num_threads(threads)
            init_single_process()
            refs: Dict[str, Dict[str, Any]] = {}
            for spec in specs:  # one one-device run per distinct reference
                key = reference_key(spec)
                if key not in refs:
                    refs[key] = run_training(spec, "reference")
            rc = proc.wait(timeout=max(1.0, args.timeout - (time.perf_counter() - t0)))
            torch.distributed.destroy_process_group()  # the reference's (as layout_worker's)
        except BaseException:
            if proc.poll() is None:
                import signal
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
        if rc != 0 or not all(Path(s["result"]).exists() for s in specs):
            log = "" if args.verbose else log_path.read_text(errors="replace")
            print(log[-6000:], file=sys.stderr)
            print(f"ERROR: the layout run failed (exit status {rc}): {' '.join(cmd)}",
                  file=sys.stderr)
            return 2
        failed = []
        for spec in specs:
            lay = torch.load(spec["result"], weights_only=False)
            ref = refs[reference_key(spec)]
            result = compare(lay, ref, spec["dtype"])
            if len(specs) > 1:
                print(f"\n=== layout {spec['index'] + 1} of {len(specs)}: "
                      f"{spec['config_name']} ===", flush=True)
            print(report(spec, lay, ref, result, time.perf_counter() - t0), flush=True)
            if result["failures"]:
                failed.append(f"layout {spec['index'] + 1} ({spec['config_name']})")
        if len(specs) > 1:
            print(f"\nsummary: {len(specs) - len(failed)} of {len(specs)} layouts PASS"
                  + (f"; FAIL: {', '.join(failed)}" if failed else ""), flush=True)
        return 0 if not failed else 1
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
