#!/usr/bin/env python3
"""Train a small Llama-style causal LM with megaloss's fused cross-entropy under DeepSpeed.

Run through the launcher (it passes ``--local_rank``)::

    deepspeed --num_gpus 2 launch/train_lm.py --deepspeed_config configs/zero2.json

With no data arguments the job uses built-in real data: this interpreter's standard-library
source files (``launch/jobs/text_data.py``; whole files held out for evaluation). It trains a
byte-level BPE tokenizer on the training files (cached), builds a small Llama from a
``transformers`` ``LlamaConfig`` (random init, no download), and trains it with the loss computed
inside the module ``engine.forward`` runs: decoder hidden states -> vocab-parallel chunked CE over
the TP group (``megaloss.tensor_parallel_size`` in the ds_config; the default configs use TP=2,
ZeRO-2), no logits. Every optimizer step is globally calibrated (token mean over all micro-batches
and DP ranks, the engine's gradient scale measured at start-up).

Reports held-out perplexity before and after training, a progress bar and a summary table on
rank 0, metrics through ``engine.monitor`` (the ds_config's ``csv_monitor`` / ``tensorboard`` /
``wandb`` sections, all at DeepSpeed's global sample count), and writes ``metrics.csv``,
``loss_curve.png`` and ``summary.json`` to ``--output_dir`` (default ``runs/lm`` under the
current directory; a folder that holds a run is refused unless ``--resume`` or ``--overwrite``).

Checkpoints (``--save_every N``, ``--resume [latest|PATH]``, ``--eval_only``) go through
DeepSpeed's ``engine.save_checkpoint`` / ``load_checkpoint`` with the data position, RNG states,
tokenizer cache key and metrics so far; SIGTERM / SIGINT save at the next step boundary and
write what ran. A resumed run continues bitwise as if uninterrupted.
"""
from __future__ import annotations

import argparse
import io
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch 2.13 deprecates all_gather_into_tensor (DeepSpeed's ZeRO uses it) with one warning per
# call; keep the training log readable.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*", category=FutureWarning)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from jobs.runs import (  # noqa: E402
    CHECKPOINTS, StopRequest, add_run_arguments, agreed, check_run_arguments, open_run,
    progress_bar, save_run, step_boundary)
from jobs.text_data import (  # noqa: E402
    StepBatches, atomic_write, check_texts, encode_stream, files_digest, lm_blocks, read_texts,
    stdlib_split, strided_subset, text_files, train_bpe_tokenizer)
from jobs.reporting import (  # noqa: E402
    Curve, plot_loss_curve, print_summary_table, rank0_logger, write_metrics_csv,
    write_summary_json)

REPO = Path(__file__).resolve().parent.parent
# hidden, layers, heads, kv heads, feed-forward
MODEL_SIZES = {
    "tiny": (32, 1, 2, 1, 64),
    "small": (128, 4, 4, 2, 352),
    "base": (256, 6, 8, 4, 704),
}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--deepspeed_config", type=str, default=str(REPO / "configs" / "zero2.json"),
                   help="ds_config JSON; its 'megaloss' section sets TP size and CE options")
    p.add_argument("--sequence_parallel_size", type=int, default=None,
                   help="DeepSpeed-Ulysses sequence parallelism: ranks sharing each sample's "
                        "tokens (overrides megaloss.sequence_parallel_size of the config); "
                        "NUM_PROCS must be a multiple of tp x sp")
    p.add_argument("--train_data", nargs="*", default=None,
                   help="text files or directories (.py/.txt/.md/.rst); default: the stdlib")
    p.add_argument("--eval_data", nargs="*", default=None,
                   help="held-out text files or directories; default: the stdlib's held-out "
                        "files, or a crc32 split of --train_data files")
    p.add_argument("--eval_fraction", type=float, default=0.05,
                   help="share of files held out when --eval_data is not given")
    p.add_argument("--max_train_bytes", type=int, default=2_500_000,
                   help="keep a strided subset of training files under this size (0: all)")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--vocab_size", type=int, default=2048, help="BPE vocabulary size")
    p.add_argument("--model_size", choices=sorted(MODEL_SIZES), default="small")
    p.add_argument("--hidden_size", type=int, default=None, help="overrides --model_size")
    p.add_argument("--num_layers", type=int, default=None, help="overrides --model_size")
    p.add_argument("--num_heads", type=int, default=None, help="overrides --model_size")
    p.add_argument("--eval_blocks", type=int, default=64,
                   help="held-out blocks of seq_len tokens evaluated (evenly spaced)")
    p.add_argument("--eval_every", type=int, default=50, help="steps between evaluations (0: "
                   "only before and after)")
    p.add_argument("--output_dir", type=str, default=os.path.join("runs", "lm"),
                   help="the run's folder, relative to the current directory: metrics.csv, "
                        "summary.json, loss_curve.png, monitor/ (csv_monitor, tensorboard), "
                        "wandb/, checkpoints/")
    p.add_argument("--cache_dir", type=str,
                   default=os.environ.get("MEGALOSS_CACHE", str(Path.home() / ".cache" /
                                                                "megaloss")))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    add_run_arguments(p)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    check_run_arguments(p, args)
    return args


# data -------------------------------------------------------------------------------------------
def _split_files(args):
    if args.train_data:
        from jobs.code_search import is_held_out
        files = text_files(args.train_data)
        if args.eval_data:
            return files, text_files(args.eval_data)
        train = [f for f in files if not is_held_out(f.as_posix(), args.eval_fraction)]
        held = [f for f in files if is_held_out(f.as_posix(), args.eval_fraction)]
        if not train or not held:
            raise SystemExit(
                f"cannot split {len(files)} files into train and held-out with --eval_fraction "
                f"{args.eval_fraction} (whole files are held out by a crc32 of their path: "
                f"{len(held)} held out, {len(train)} left to train); pass --eval_data, or another "
                "--eval_fraction (larger when nothing is held out, smaller when nothing is left)")
        return train, held
    train, held = stdlib_split(args.eval_fraction)
    if args.eval_data:
        held = text_files(args.eval_data)
    return train, held


def load_data(args, rank: int):
    """Tokenizer and token streams; global rank 0 builds and caches them, the others read the
    cache (keyed by the data's contents and the options). Inputs are checked on every rank
    first, and a failure of rank 0's build is reported by every rank (:func:`jobs.runs.agreed`).

    Returns:
        ``(tokenizer, train stream, eval stream, info, cache key)``.
    """
    train_files, eval_files = _split_files(args)
    train_files = strided_subset(train_files, args.max_train_bytes or None)
    train_texts, eval_texts = read_texts(train_files), read_texts(eval_files)
    check_texts(train_files, train_texts, "--train_data", args.train_data or ())
    check_texts(eval_files, eval_texts, "--eval_data" if args.eval_data else "held-out",
                args.eval_data or ())
    key = files_digest(train_texts + ["\0eval\0"] + eval_texts, args.vocab_size)
    cache = Path(args.cache_dir) / f"lm-tokens-{key}.pt"

    def build():
        if cache.exists():
            return
        tok = train_bpe_tokenizer(train_texts, args.vocab_size, cache_dir=args.cache_dir)
        streams = {"train": encode_stream(tok, train_texts), "eval": encode_stream(tok, eval_texts),
                   "tokenizer": tok.to_str()}
        buf = io.BytesIO()
        torch.save(streams, buf)
        atomic_write(cache, buf.getvalue())

    agreed(build, what="tokenizer and token cache")
    streams = torch.load(cache)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(streams["tokenizer"])
    info = {"train_files": len(train_files), "eval_files": len(eval_files),
            "train_bytes": sum(len(t.encode("utf-8", "replace")) for t in train_texts),
            "train_tokens": int(streams["train"].numel()),
            "eval_tokens_available": int(streams["eval"].numel())}
    return tok, streams["train"], streams["eval"], info, key


def make_blocks(stream: torch.Tensor, seq_len: int, what: str, files: int,
                max_blocks: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """:func:`jobs.text_data.lm_blocks` with an error that says which text is too short."""
    if stream.numel() < seq_len + 1:
        raise SystemExit(f"{what} text ({files} file{'s' if files != 1 else ''}) holds "
                         f"{stream.numel()} tokens, fewer than one block of --seq_len + 1 = "
                         f"{seq_len + 1}; give more text or a smaller --seq_len")
    return lm_blocks(stream, seq_len, max_blocks)


# model ------------------------------------------------------------------------------------------
def build_model(args, vocab_size: int, attn_implementation: Optional[str] = None):
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden, layers, heads, kv, ffn = MODEL_SIZES[args.model_size]
    hidden = args.hidden_size or hidden
    layers = args.num_layers or layers
    heads = args.num_heads or heads
    if args.hidden_size and not args.num_heads:
        heads = max(1, hidden // 32)
    kv = heads if heads % kv else kv
    if args.hidden_size:
        ffn = 64 * math.ceil(8 * hidden / 3 / 64)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, max_position_embeddings=args.seq_len,
                      tie_word_embeddings=False)
    if attn_implementation is not None:  # Ulysses wraps transformers' sdpa attention
        cfg._attn_implementation = attn_implementation
    # Same seed on every rank: TP ranks must hold the same replicated decoder (DeepSpeed
    # broadcasts from DP rank 0 only within the DP group).
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg), cfg


def eval_batches(blocks: Dict[str, torch.Tensor], micro: int, dp: int, dp_rank: int):
    """This DP rank's share of the eval blocks, in micro-batches; the same count on every rank
    (the block count is trimmed to a multiple of ``dp``)."""
    n = blocks["input_ids"].shape[0] // dp * dp
    mine = {k: v[:n][dp_rank::dp] for k, v in blocks.items()}
    m = mine["input_ids"].shape[0]
    return [{k: v[i:i + micro] for k, v in mine.items()} for i in range(0, m, micro)]


# outputs ----------------------------------------------------------------------------------------
def write_outputs(out_dir: Path, rows: List[Dict[str, Any]], evals: List[Dict[str, float]],
                  summary: Dict[str, Any]) -> None:
    """``metrics.csv`` (the step rows plus the held-out CE / perplexity at evaluated steps),
    ``summary.json`` and ``loss_curve.png`` in ``out_dir``."""
    eval_at = {e["step"]: e for e in evals}
    write_metrics_csv(out_dir / "metrics.csv", [
        {**r, "eval_loss": eval_at.get(r["step"], {}).get("loss", ""),
         "eval_perplexity": eval_at.get(r["step"], {}).get("perplexity", "")} for r in rows])
    write_summary_json(out_dir / "summary.json", summary)
    plot_loss_curve(
        out_dir / "loss_curve.png",
        [Curve("train (global loss)", [r["step"] for r in rows], [r["loss"] for r in rows]),
         Curve("held-out CE", [e["step"] for e in evals], [e["loss"] for e in evals], "o-")],
        title=f"megaloss LM: {summary['model']} on {summary['data']}",
        ylabel="cross-entropy (nats / token)", grid=True)


def print_summary(summary: Dict[str, Any]) -> None:
    """The before/after table of held-out perplexity and losses, with the run's figures."""
    before, after = summary["eval_before"], summary["eval_after"] or {}
    rows = [
        ("held-out perplexity", f"{before['perplexity']:.1f}",
         f"{after['perplexity']:.1f}" if after else "-"),
        ("held-out CE (nats/token)", f"{before['loss']:.4f}",
         f"{after['loss']:.4f}" if after else "-"),
    ]
    if summary["last_loss"] is not None:
        rows.append(("train loss (first / last step)", f"{summary['first_loss']:.4f}",
                     f"{summary['last_loss']:.4f}"))
    stopped = summary.get("stopped")
    info = (f"{summary['steps']} steps in {summary['train_seconds']:.1f} s, "
            f"{summary['tokens_per_s']:.0f} tokens/s, layout DP={summary['dp']} x "
            f"SP={summary.get('sp', 1)} x TP={summary['tp']}, ZeRO-{summary['zero_stage']}, "
            f"engine loss multiplier {summary['engine_loss_multiplier']:g}, peak memory "
            f"{summary['peak_memory_mib']:.0f} MiB/rank"
            + (f"; stopped by {stopped['signal']} at step {stopped['step']} (resume with "
               "--resume)" if stopped else ""))
    last = "after" if not (stopped and after) else f"step {after['step']}"
    print_summary_table("megaloss LM job", rows, info, columns=("metric", "before", last))


def _checkpoint_stats(saves: List[Dict[str, float]]) -> Optional[Dict[str, float]]:
    if not saves:
        return None
    return {"saves": len(saves), "seconds_per_save": sum(x["seconds"] for x in saves) / len(saves),
            "mib_per_save": sum(x["mib"] for x in saves) / len(saves),
            "last": saves[-1]["path"]}


# main -------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    import deepspeed

    from megaloss import CausalLMWithLoss, Topology
    from megaloss.integrations.hf.ulysses import enable_ulysses_attention
    from megaloss.integrations.deepspeed import (
        close_monitors, configure_launched_process, evaluate, initialize, load_checkpoint,
        load_ds_config, train_step)
    from megaloss.testing import free_port

    from deepspeed.accelerator import get_accelerator

    configure_launched_process()  # quiet DeepSpeed, threads per process on CPU, no JIT build
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        # Started as plain `python launch/train_lm.py`: one process (DeepSpeed would otherwise
        # look for MPI).
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    deepspeed.init_distributed()
    # this rank's device before the first object collective (NCCL needs it; a no-op on CPU)
    get_accelerator().set_device(args.local_rank)
    rank = dist.get_rank()
    out_dir = Path(args.output_dir)
    ckpt_dir = out_dir / CHECKPOINTS
    log = rank0_logger("lm", rank, t_start)

    # Inputs first, on every rank (same files, same answers), then the run folder on rank 0 with
    # its verdict shared: no rank fails alone.
    ds_config, ml = load_ds_config(args.deepspeed_config, output_dir=str(out_dir))
    resume_from = open_run(args, out_dir, ds_config)

    if args.sequence_parallel_size is not None:
        ml.sequence_parallel_size = args.sequence_parallel_size
        ds_config.setdefault("megaloss", {})["sequence_parallel_size"] = args.sequence_parallel_size
    topo = Topology.build(ml.tensor_parallel_size,
                          sequence_parallel_size=ml.sequence_parallel_size)
    micro = ds_config.get("train_micro_batch_size_per_gpu", 1)
    gas = ds_config.get("gradient_accumulation_steps", 1)

    tok, train_stream, eval_stream, info, data_key = load_data(args, rank)
    vocab = tok.get_vocab_size()
    train_blocks = make_blocks(train_stream, args.seq_len, "training", info["train_files"])
    held_blocks = make_blocks(eval_stream, args.seq_len, "held-out", info["eval_files"],
                              args.eval_blocks)
    log(f"data: {info['train_files']} train files ({info['train_bytes'] / 1e6:.1f} MB, "
        f"{info['train_tokens']} tokens, {train_blocks['input_ids'].shape[0]} blocks), "
        f"{info['eval_files']} held-out files ({held_blocks['input_ids'].shape[0]} blocks); "
        f"BPE vocab {vocab}")

    model, cfg = build_model(args, vocab, "sdpa" if topo.sp_size > 1 else None)
    # With SP each rank runs the decoder on its slice of every sample; attention all-to-alls
    # heads over the SP group (DeepSpeed's UlyssesSPAttentionHF).
    enable_ulysses_attention(model, topo, micro_batch_size=micro)
    wrapper = CausalLMWithLoss(model, options=ml.ce.options(), tp_group=topo.tp_group)
    # decoder + the full (unsharded) lm_head, whatever the TP size
    n_params = sum(p.numel() for p in model.base_model.parameters()) + vocab * cfg.hidden_size
    me = initialize(wrapper, ds_config, topology=topo, output_dir=str(out_dir))
    engine = me.engine
    log(f"engine ready: DP={topo.dp_size} x SP={topo.sp_size} x TP={topo.tp_size}, "
        f"ZeRO-{engine.zero_optimization_stage()}, micro-batch {micro} x GAS {gas} x DP "
        f"{topo.dp_size} = {micro * gas * topo.dp_size} x {args.seq_len} tokens/step, "
        f"{n_params / 1e6:.2f} M params, measured engine loss multiplier "
        f"{me.engine_scale.loss_multiplier:g} ({me.engine_scale.engine}), CE {ml.ce.model_dump()}")
    held = eval_batches(held_blocks, micro, topo.dp_size, topo.dp_rank)

    # what a resumed run needs besides the engine's own state
    job_state: Dict[str, Any] = {"rows": [], "evals": [], "train_seconds": 0.0, "saves": []}
    if resume_from is not None:
        t0 = time.perf_counter()
        path, client = load_checkpoint(me, resume_from)
        saved = client.get("job", {})
        if saved.get("data_key") != data_key:
            raise SystemExit(
                f"checkpoint {path} was trained on other data or another tokenizer (cache key "
                f"{saved.get('data_key')}, these options give {data_key}): pass the same "
                "--train_data / --eval_data / --eval_fraction / --max_train_bytes / --vocab_size")
        job_state.update({k: saved[k] for k in job_state if k in saved})
        log(f"resumed from {path} at step {engine.global_steps} "
            f"({engine.global_samples} samples) in {time.perf_counter() - t0:.2f} s")
    start = int(engine.global_steps)

    if args.eval_only:
        result = evaluate(me, held)
        report = {"checkpoint": str(resume_from), "step": start, "eval": vars(result)}
        if rank == 0:
            write_summary_json(out_dir / f"eval_step{start}.json", report)
            print_summary_table("megaloss LM job: checkpoint evaluation", [
                ("held-out perplexity", f"{result.perplexity:.1f}"),
                ("held-out CE (nats/token)", f"{result.loss:.4f}")],
                f"step {start} of {resume_from}", columns=("metric", "value"))
        dist.barrier()
        return report

    rows: List[Dict[str, Any]] = job_state["rows"]
    evals: List[Dict[str, Any]] = job_state["evals"]
    saves: List[Dict[str, Any]] = job_state["saves"]
    if not evals:
        evals.append({"step": 0, **vars(evaluate(me, held, log=True))})
        log(f"before training: held-out CE {evals[0]['loss']:.4f}, perplexity "
            f"{evals[0]['perplexity']:.1f}")

    def save(step: int) -> None:
        job = {"name": "lm", "data_key": data_key, "seed": args.seed, "seq_len": args.seq_len,
               "steps_done": step, "rows": rows, "evals": evals, "saves": saves,
               "train_seconds": train_seconds_before + time.perf_counter() - t_train}
        save_run(me, ckpt_dir, step, job, tok, args.keep_checkpoints, saves, log)

    batches = StepBatches(train_blocks, micro=micro, gas=gas, dp_size=topo.dp_size,
                          dp_rank=topo.dp_rank, seed=args.seed).iter_from(start)
    bar = progress_bar(args, start)
    stop = StopRequest().install()
    train_seconds_before = job_state["train_seconds"]
    t_train = time.perf_counter()
    stopped = None
    for step in range(start + 1, args.steps + 1):
        m = train_step(me, next(batches))
        rows.append(m.as_dict())
        if args.eval_every and step % args.eval_every == 0 and step != args.steps:
            evals.append({"step": m.step, **vars(evaluate(me, held, log=True))})
        if bar is not None:
            bar.set_postfix(loss=f"{m.loss:.3f}", ppl_eval=f"{evals[-1]['perplexity']:.0f}",
                            tok_s=f"{m.tokens_per_s:.0f}")
            bar.update(1)
        stopped = step_boundary(stop, engine.device, step, args, save, log)
        if stopped:
            break
    train_seconds = train_seconds_before + time.perf_counter() - t_train
    if bar is not None:
        bar.close()
    last = rows[-1]["step"] if rows else start
    if stopped is None and evals[-1]["step"] != last:
        evals.append({"step": last, **vars(evaluate(me, held, log=True))})
        log(f"after training: held-out CE {evals[-1]['loss']:.4f}, perplexity "
            f"{evals[-1]['perplexity']:.1f}")

    tokens = sum(r["num_tokens"] for r in rows)
    summary = {
        "eval_before": evals[0], "eval_after": evals[-1] if len(evals) > 1 else None,
        "steps": last, "steps_requested": args.steps, "stopped": stopped,
        "resumed_from": resume_from and str(resume_from), "resumed_at_step": start,
        "first_loss": rows[0]["loss"] if rows else None,
        "last_loss": rows[-1]["loss"] if rows else None,
        "train_seconds": train_seconds, "tokens_per_s": tokens / max(train_seconds, 1e-9),
        "train_tokens_seen": tokens,
        "peak_memory_mib": max((r["peak_memory_mib"] for r in rows), default=0.0),
        "dp": topo.dp_size, "sp": topo.sp_size, "tp": topo.tp_size,
        "zero_stage": engine.zero_optimization_stage(), "micro_batch": micro, "gas": gas,
        "seq_len": args.seq_len, "vocab_size": vocab, "parameters": int(n_params),
        "engine_loss_multiplier": me.engine_scale.loss_multiplier,
        "ce": ml.ce.model_dump(), "data": "stdlib" if not args.train_data else "user files",
        "model": f"Llama {cfg.num_hidden_layers}L x {cfg.hidden_size}",
        "checkpoints": _checkpoint_stats(saves), "data_key": data_key,
        "total_seconds": time.perf_counter() - t_start, **info,
    }
    close_monitors(engine)
    if rank == 0:
        write_outputs(out_dir, rows, evals, summary)
        print_summary(summary)
        log(f"wrote {out_dir / 'metrics.csv'}, {out_dir / 'loss_curve.png'}, "
            f"{out_dir / 'summary.json'}")
    dist.barrier()
    stop.restore()  # only now: a second signal must not cut the outputs' writing short
    return summary


if __name__ == "__main__":
    main()
