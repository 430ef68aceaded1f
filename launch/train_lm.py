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
``wandb`` sections), and writes ``metrics.csv``, ``loss_curve.png`` and ``summary.json`` to
``--output_dir``.
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

from jobs.text_data import (  # noqa: E402
    StepBatches, atomic_write, encode_stream, files_digest, lm_blocks, read_texts, stdlib_split,
    strided_subset, text_files, train_bpe_tokenizer)
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
    p.add_argument("--output_dir", type=str, default=str(REPO / "runs" / "lm"))
    p.add_argument("--cache_dir", type=str,
                   default=os.environ.get("MEGALOSS_CACHE", str(Path.home() / ".cache" /
                                                                "megaloss")))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
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
            raise SystemExit(f"cannot split {len(files)} files into train and held-out; pass "
                             "--eval_data")
        return train, held
    train, held = stdlib_split(args.eval_fraction)
    if args.eval_data:
        held = text_files(args.eval_data)
    return train, held


def load_data(args, rank: int):
    """Tokenizer and token streams; global rank 0 builds and caches them, the others wait on a
    barrier and read the cache (keyed by the data's contents and the options)."""
    train_files, eval_files = _split_files(args)
    train_files = strided_subset(train_files, args.max_train_bytes or None)
    train_texts, eval_texts = read_texts(train_files), read_texts(eval_files)
    key = files_digest(train_texts + ["\0eval\0"] + eval_texts, args.vocab_size)
    cache = Path(args.cache_dir) / f"lm-tokens-{key}.pt"
    if rank == 0 and not cache.exists():
        tok = train_bpe_tokenizer(train_texts, args.vocab_size, cache_dir=args.cache_dir)
        streams = {"train": encode_stream(tok, train_texts), "eval": encode_stream(tok, eval_texts),
                   "tokenizer": tok.to_str()}
        buf = io.BytesIO()
        torch.save(streams, buf)
        atomic_write(cache, buf.getvalue())
    if dist.is_initialized():
        dist.barrier()
    streams = torch.load(cache)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(streams["tokenizer"])
    info = {"train_files": len(train_files), "eval_files": len(eval_files),
            "train_bytes": sum(len(t.encode("utf-8", "replace")) for t in train_texts),
            "train_tokens": int(streams["train"].numel()),
            "eval_tokens_available": int(streams["eval"].numel())}
    return tok, streams["train"], streams["eval"], info


# model ------------------------------------------------------------------------------------------
def build_model(args, vocab_size: int):
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
    rows = [
        ("held-out perplexity", f"{summary['eval_before']['perplexity']:.1f}",
         f"{summary['eval_after']['perplexity']:.1f}"),
        ("held-out CE (nats/token)", f"{summary['eval_before']['loss']:.4f}",
         f"{summary['eval_after']['loss']:.4f}"),
        ("train loss (first / last step)", f"{summary['first_loss']:.4f}",
         f"{summary['last_loss']:.4f}"),
    ]
    info = (f"{summary['steps']} steps in {summary['train_seconds']:.1f} s, "
            f"{summary['tokens_per_s']:.0f} tokens/s, layout DP={summary['dp']} x "
            f"TP={summary['tp']}, ZeRO-{summary['zero_stage']}, engine loss multiplier "
            f"{summary['engine_loss_multiplier']:g}, peak memory "
            f"{summary['peak_memory_mib']:.0f} MiB/rank")
    print_summary_table("megaloss LM job", rows, info)


# main -------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    t_start = time.perf_counter()
    import deepspeed

    from megaloss import CausalLMWithLoss, Topology
    from megaloss.integrations.deepspeed import (configure_launched_process, evaluate, initialize,
                                                 load_ds_config, train_step)
    from megaloss.testing import free_port

    configure_launched_process()  # quiet DeepSpeed, threads per process on CPU, no JIT build
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        # Started as plain `python launch/train_lm.py`: one process (DeepSpeed would otherwise
        # look for MPI).
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    deepspeed.init_distributed()
    rank = dist.get_rank()
    out_dir = Path(args.output_dir)
    log = rank0_logger("lm", rank, t_start)

    ds_config, ml = load_ds_config(args.deepspeed_config, output_dir=str(out_dir))
    topo = Topology.build(ml.tensor_parallel_size)
    micro = ds_config.get("train_micro_batch_size_per_gpu", 1)
    gas = ds_config.get("gradient_accumulation_steps", 1)

    tok, train_stream, eval_stream, info = load_data(args, rank)
    vocab = tok.get_vocab_size()
    train_blocks = lm_blocks(train_stream, args.seq_len)
    held_blocks = lm_blocks(eval_stream, args.seq_len, args.eval_blocks)
    log(f"data: {info['train_files']} train files ({info['train_bytes'] / 1e6:.1f} MB, "
        f"{info['train_tokens']} tokens, {train_blocks['input_ids'].shape[0]} blocks), "
        f"{info['eval_files']} held-out files ({held_blocks['input_ids'].shape[0]} blocks); "
        f"BPE vocab {vocab}")

    model, cfg = build_model(args, vocab)
    wrapper = CausalLMWithLoss(model, options=ml.ce.options(), tp_group=topo.tp_group)
    # decoder + the full (unsharded) lm_head, whatever the TP size
    n_params = sum(p.numel() for p in model.base_model.parameters()) + vocab * cfg.hidden_size
    me = initialize(wrapper, ds_config, topology=topo, output_dir=str(out_dir))
    engine = me.engine
    log(f"engine ready: DP={topo.dp_size} x TP={topo.tp_size}, "
        f"ZeRO-{engine.zero_optimization_stage()}, micro-batch {micro} x GAS {gas} x DP "
        f"{topo.dp_size} = {micro * gas * topo.dp_size} x {args.seq_len} tokens/step, "
        f"{n_params / 1e6:.2f} M params, measured engine loss multiplier "
        f"{me.engine_scale.loss_multiplier:g} ({me.engine_scale.engine}), CE {ml.ce.model_dump()}")

    held = eval_batches(held_blocks, micro, topo.dp_size, topo.dp_rank)
    evals = [{"step": 0, **vars(evaluate(me, held, log_step=0))}]
    log(f"before training: held-out CE {evals[0]['loss']:.4f}, perplexity "
        f"{evals[0]['perplexity']:.1f}")

    batches = iter(StepBatches(train_blocks, micro=micro, gas=gas, dp_size=topo.dp_size,
                             dp_rank=topo.dp_rank, seed=args.seed))
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, desc="train", unit="step", dynamic_ncols=True)
    rows: List[Dict[str, Any]] = []
    t_train = time.perf_counter()
    for step in range(1, args.steps + 1):
        m = train_step(me, next(batches))
        rows.append(m.as_dict())
        if args.eval_every and step % args.eval_every == 0 and step != args.steps:
            evals.append({"step": m.step, **vars(evaluate(me, held, log_step=m.step))})
        if bar is not None:
            bar.set_postfix(loss=f"{m.loss:.3f}", ppl_eval=f"{evals[-1]['perplexity']:.0f}",
                            tok_s=f"{m.tokens_per_s:.0f}")
            bar.update(1)
    train_seconds = time.perf_counter() - t_train
    if bar is not None:
        bar.close()
    evals.append({"step": rows[-1]["step"], **vars(evaluate(me, held, log_step=rows[-1]["step"]))})
    log(f"after training: held-out CE {evals[-1]['loss']:.4f}, perplexity "
        f"{evals[-1]['perplexity']:.1f}")

    tokens = sum(r["num_tokens"] for r in rows)
    summary = {
        "eval_before": evals[0], "eval_after": evals[-1], "steps": args.steps,
        "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
        "train_seconds": train_seconds, "tokens_per_s": tokens / train_seconds,
        "train_tokens_seen": tokens, "peak_memory_mib": max(r["peak_memory_mib"] for r in rows),
        "dp": topo.dp_size, "tp": topo.tp_size,
        "zero_stage": engine.zero_optimization_stage(), "micro_batch": micro, "gas": gas,
        "seq_len": args.seq_len, "vocab_size": vocab, "parameters": int(n_params),
        "engine_loss_multiplier": me.engine_scale.loss_multiplier,
        "ce": ml.ce.model_dump(), "data": "stdlib" if not args.train_data else "user files",
        "model": f"Llama {cfg.num_hidden_layers}L x {cfg.hidden_size}",
        "total_seconds": time.perf_counter() - t_start, **info,
    }
    if rank == 0:
        write_outputs(out_dir, rows, evals, summary)
        print_summary(summary)
        log(f"wrote {out_dir / 'metrics.csv'}, {out_dir / 'loss_curve.png'}, "
            f"{out_dir / 'summary.json'}")
    dist.barrier()
    return summary


if __name__ == "__main__":
    main()
