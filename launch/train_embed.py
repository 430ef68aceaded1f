#!/usr/bin/env python3
"""Train a small code-search embedding model with gathered MNR under DeepSpeed.

Run through the launcher (it passes ``--local_rank``)::

    deepspeed --num_gpus 2 launch/train_embed.py                 # built-in ZeRO-2 config
    deepspeed --num_gpus 2 launch/train_embed.py --deepspeed_config configs/zero3.json \
        --micro_batch_size 32 --gradient_accumulation_steps 1

With no data arguments the job uses built-in real data: (docstring -> function source) pairs
extracted from this interpreter's standard library, whole files held out for evaluation
(``megaloss.data.code_search``). It trains a byte-level BPE tokenizer on the training texts
(cached; ``megaloss.data.stdlib_text``), a small BERT-style encoder from a ``transformers``
config (random init, no download), mean pooling, and the gathered MNR loss computed inside the
module ``engine.forward`` runs (``megaloss.integrations.embedding``); every step's loss is the
query mean over the global batch, with the engine's gradient scale measured at start-up. It
reports held-out MRR@10 and recall@1 before and after training, a progress bar and a summary
table on rank 0, metrics through ``engine.monitor`` (so the ds_config's ``csv_monitor`` /
``tensorboard`` / ``wandb`` sections work), and writes
``metrics.csv``, ``loss_curve.png`` and ``summary.json`` to ``--output_dir``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch 2.13 deprecates all_gather_into_tensor (used by megaloss's gathers) with one warning per
# call; keep the training log readable.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*", category=FutureWarning)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megaloss.data.code_search import CodePair, load_code_search, python_files  # noqa: E402
from megaloss.data.stdlib_text import EOS, train_bpe_tokenizer  # noqa: E402
from megaloss.distributed.collectives import gather_along_dim0_uneven  # noqa: E402
from megaloss.integrations.embedding import EmbeddingModelWithMNR, step_loss_weights  # noqa: E402
from megaloss.integrations.reporting import (  # noqa: E402
    Curve, plot_loss_curve, print_summary_table, rank0_logger, write_metrics_csv,
    write_summary_json)

# hidden, layers, heads, feed-forward
MODEL_SIZES: Dict[str, Tuple[int, int, int, int]] = {
    "tiny": (64, 1, 2, 128),
    "small": (128, 2, 4, 512),
    "base": (256, 4, 4, 1024),
}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--deepspeed_config", type=str, default=None,
                   help="ds_config JSON (its 'megaloss.mnr' section sets the loss); default: "
                        "a built-in ZeRO-2 config (micro-batch 32, GAS 1)")
    p.add_argument("--train_data", nargs="+", default=None,
                   help=".py files, directories or .jsonl files of {query, document}; "
                        "default: the Python standard library")
    p.add_argument("--eval_data", nargs="+", default=None,
                   help="held-out sources; default: whole files held out from --train_data")
    p.add_argument("--eval_fraction", type=float, default=0.1)
    p.add_argument("--max_train", type=int, default=None, help="cap on training pairs")
    p.add_argument("--max_eval", type=int, default=None, help="cap on held-out pairs")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--micro_batch_size", type=int, default=None,
                   help="pairs per rank per micro-batch (overrides the ds_config)")
    p.add_argument("--gradient_accumulation_steps", type=int, default=None,
                   help="overrides the ds_config")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup_steps", type=int, default=20)
    p.add_argument("--model_size", choices=sorted(MODEL_SIZES), default="small")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="encoder dropout (the training set is small: it curbs memorisation)")
    p.add_argument("--vocab_size", type=int, default=4096)
    p.add_argument("--max_query_len", type=int, default=32)
    p.add_argument("--max_doc_len", type=int, default=128)
    p.add_argument("--eval_batch_size", type=int, default=128)
    p.add_argument("--log_every", type=int, default=1,
                   help="write monitor events every N steps (metrics.csv gets every step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", type=str, default="runs/embed")
    p.add_argument("--cache_dir", type=str,
                   default=os.environ.get("MEGALOSS_CACHE",
                                          os.path.join(Path.home(), ".cache", "megaloss")),
                   help="where extracted pairs and the tokenizer are cached")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    args = p.parse_args(argv)
    for name in ("steps", "vocab_size", "max_query_len", "max_doc_len", "eval_batch_size",
                 "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


# caching helpers (rank 0 of each node builds, the others wait and read) --------------------------
def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _source_fingerprint(sources: Optional[Sequence[str]]) -> List:
    """Paths, sizes and mtimes of every input file, so an edited source invalidates the cache."""
    if sources is None:
        return [sys.version, sys.prefix]
    out = []
    for s in sources:
        path = Path(s)
        files = [path] if path.suffix in (".jsonl", ".json", ".ndjson") else python_files(path)
        out += [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return out


def load_pairs_cached(args: argparse.Namespace) -> Tuple[List[CodePair], List[CodePair]]:
    key = _key("pairs-v1", _source_fingerprint(args.train_data),
               _source_fingerprint(args.eval_data),
               args.eval_fraction, args.max_train, args.max_eval)
    path = Path(args.cache_dir) / f"code_search-{key}.json"

    def build() -> None:
        if path.exists():
            return
        train, held = load_code_search(args.train_data, args.eval_data,
                                       eval_fraction=args.eval_fraction,
                                       max_train=args.max_train, max_eval=args.max_eval)
        _atomic_write(path, json.dumps({"train": [p.__dict__ for p in train],
                                        "eval": [p.__dict__ for p in held]}))

    if args.local_rank == 0:
        build()
    _barrier()
    data = json.loads(path.read_text(encoding="utf-8"))
    return ([CodePair(**d) for d in data["train"]], [CodePair(**d) for d in data["eval"]])


def tokenizer_cached(texts: List[str], vocab_size: int, cache_dir: str, local_rank: int):
    """Byte-level BPE trained on the training texts (megaloss.data.stdlib_text), built once per
    node by local rank 0 and read from the cache by the others."""
    if local_rank == 0:
        train_bpe_tokenizer(texts, vocab_size, cache_dir=cache_dir)
    _barrier()
    return train_bpe_tokenizer(texts, vocab_size, cache_dir=cache_dir)


# batching ---------------------------------------------------------------------------------------
def encode_texts(tokenizer, texts: List[str], max_len: int) -> List[List[int]]:
    """Token ids, truncated to ``max_len`` (at least one token per text)."""
    eos = tokenizer.token_to_id(EOS)
    return [e.ids[:max_len] or [eos] for e in tokenizer.encode_batch(texts)]


def pad_batch(seqs: List[List[int]], pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` ids and mask, padded to the longest sequence of the batch (T >= 1)."""
    width = max([len(s) for s in seqs] + [1])
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask


class MicroBatches:
    """Endless stream of this rank's micro-batches: every epoch a seeded permutation (same on
    all ranks), cut into global batches of ``micro * dp`` pairs (the tail is dropped so every
    micro-batch has the same size), each rank taking its contiguous slice."""

    def __init__(self, queries, documents, micro: int, dp_size: int, dp_rank: int, seed: int,
                 pad_id: int):
        if len(queries) < micro * dp_size:
            raise ValueError(f"{len(queries)} training pairs cannot fill one global batch of "
                             f"{micro} x {dp_size}")
        self.q, self.d, self.micro, self.dp, self.rank = queries, documents, micro, dp_size, dp_rank
        self.seed, self.pad_id, self.epoch = seed, pad_id, 0
        self._order: List[int] = []

    def __iter__(self):
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        global_batch = self.micro * self.dp
        if len(self._order) < global_batch:
            perm = list(range(len(self.q)))
            random.Random(self.seed * 1000003 + self.epoch).shuffle(perm)
            self.epoch += 1
            self._order = perm[: len(perm) - len(perm) % global_batch]
        batch, self._order = self._order[:global_batch], self._order[global_batch:]
        mine = batch[self.rank * self.micro: (self.rank + 1) * self.micro]
        q_ids, q_mask = pad_batch([self.q[i] for i in mine], self.pad_id)
        d_ids, d_mask = pad_batch([self.d[i] for i in mine], self.pad_id)
        return {"query_input_ids": q_ids, "query_attention_mask": q_mask,
                "document_input_ids": d_ids, "document_attention_mask": d_mask}


# evaluation -------------------------------------------------------------------------------------
@torch.no_grad()
def embed_all(engine, seqs: List[List[int]], batch_size: int, pad_id: int, group) -> torch.Tensor:
    """Embeddings ``[N, H]`` of all ``seqs`` on every rank. Each rank encodes a contiguous shard;
    all ranks run the same number of forwards (ZeRO-3 gathers parameters collectively), a rank
    with nothing left encodes one dummy sequence and drops it."""
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    per = math.ceil(len(seqs) / world)
    shard = seqs[rank * per: (rank + 1) * per]
    rounds = max(1, math.ceil(per / batch_size))
    module = engine.module
    outs = []
    for r in range(rounds):
        chunk = shard[r * batch_size: (r + 1) * batch_size]
        ids, mask = pad_batch(chunk or [[pad_id]], pad_id)
        emb = module.encode(ids.to(engine.device), mask.to(engine.device)).float()
        outs.append(emb[: len(chunk)])
    local = torch.cat(outs)
    return gather_along_dim0_uneven(local, group)


def retrieval_metrics(q: torch.Tensor, d: torch.Tensor, k: int = 10) -> Dict[str, float]:
    """MRR@k and recall@1 of retrieving document i for query i among all documents (cosine)."""
    q = torch.nn.functional.normalize(q.double(), dim=-1)
    d = torch.nn.functional.normalize(d.double(), dim=-1)
    scores = q @ d.T
    target = scores.diagonal().unsqueeze(1)
    # rank = 1 + number of documents scoring strictly higher (ties resolved in the query's favour)
    rank = 1 + (scores > target).sum(1)
    rr = torch.where(rank <= k, 1.0 / rank.double(), torch.zeros_like(rank, dtype=torch.float64))
    return {f"mrr@{k}": rr.mean().item(), "recall@1": (rank == 1).double().mean().item()}


def evaluate(engine, queries, documents, args, pad_id: int, group) -> Dict[str, float]:
    was_training = engine.module.training
    engine.module.eval()
    q = embed_all(engine, queries, args.eval_batch_size, pad_id, group)
    d = embed_all(engine, documents, args.eval_batch_size, pad_id, group)
    engine.module.train(was_training)
    return retrieval_metrics(q, d)


# model and config -------------------------------------------------------------------------------
def build_encoder(size: str, vocab_size: int, max_len: int, pad_id: int,
                  dropout: float = 0.1) -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    hidden, layers, heads, ffn = MODEL_SIZES[size]
    config = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=ffn,
                        max_position_embeddings=max_len, pad_token_id=pad_id,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertModel(config, add_pooling_layer=False)


# Used when --deepspeed_config is not given. Same conventions as configs/*.json (torch AdamW via
# the launcher, huge steps_per_print, csv_monitor on); ZeRO-2 like the LM job's default.
DEFAULT_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 32,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 1000000000,
    "csv_monitor": {"enabled": True, "output_path": "", "job_name": "megaloss"},
    "megaloss": {"mnr": {"temperature": 0.05, "symmetric": True}},
}


def prepare_ds_config(args: argparse.Namespace) -> dict:
    """The ds_config dict: the file (or :data:`DEFAULT_DS_CONFIG`) with the command line's batch
    overrides. The embedding job is data parallel only: ``megaloss.tensor_parallel_size`` is set
    to 1 (the same JSON can drive the TP=2 LM job)."""
    if args.deepspeed_config:
        with open(args.deepspeed_config, encoding="utf-8") as f:
            config = json.load(f)
    else:
        config = json.loads(json.dumps(DEFAULT_DS_CONFIG))
    if args.micro_batch_size is not None:
        config["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    if args.gradient_accumulation_steps is not None:
        config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    # Keep DeepSpeed's three batch keys consistent after the overrides.
    config.pop("train_batch_size", None)
    config.setdefault("train_micro_batch_size_per_gpu", 32)
    config.setdefault("gradient_accumulation_steps", 1)
    section = config.setdefault("megaloss", {})
    if isinstance(section, dict):
        section["tensor_parallel_size"] = 1
    return config


# reporting --------------------------------------------------------------------------------------
def write_outputs(out_dir: Path, rows: List[Dict[str, float]], summary: Dict) -> None:
    """``metrics.csv`` (one row per step), ``summary.json`` and ``loss_curve.png`` (MNR loss and
    in-batch accuracy) in ``out_dir``."""
    write_metrics_csv(out_dir / "metrics.csv", rows)
    write_summary_json(out_dir / "summary.json", summary)
    steps = [r["step"] for r in rows]
    b, a = summary["eval_before"], summary["eval_after"]
    plot_loss_curve(
        out_dir / "loss_curve.png",
        [Curve("MNR loss (global batch)", steps, [r["loss"] for r in rows], style={"lw": 1})],
        secondary=[Curve("in-batch accuracy", steps, [r["accuracy"] for r in rows],
                         style={"color": "tab:orange", "alpha": 0.6, "lw": 1})],
        title=f"code-search embedding: MRR@10 {b['mrr@10']:.3f} -> {a['mrr@10']:.3f}",
        ylabel="loss", secondary_ylabel="in-batch top-1 accuracy")


def print_summary(summary: Dict) -> None:
    """The before/after table of held-out retrieval metrics and training figures."""
    b, a = summary["eval_before"], summary["eval_after"]
    rows = [("held-out MRR@10", f"{b['mrr@10']:.4f}", f"{a['mrr@10']:.4f}"),
            ("held-out recall@1", f"{b['recall@1']:.4f}", f"{a['recall@1']:.4f}"),
            ("train MNR loss (first/last step)", f"{summary['first_loss']:.4f}",
             f"{summary['last_loss']:.4f}"),
            ("train in-batch accuracy", f"{summary['first_accuracy']:.4f}",
             f"{summary['last_accuracy']:.4f}")]
    extra = (f"{summary['train_pairs']} train / {summary['eval_pairs']} held-out pairs, "
             f"{summary['steps']} steps x {summary['global_batch']} pairs, "
             f"{summary['parameters'] / 1e6:.2f} M params, {summary['train_seconds']:.0f} s")
    print_summary_table("code-search embedding (gathered MNR)", rows, extra)


# main -------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> Dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    import deepspeed

    from megaloss.integrations.deepspeed import (build_parallel, configure_launched_process,
                                                 initialize, load_ds_config, write_metrics)
    from megaloss.integrations.trainer import peak_memory_mib

    configure_launched_process()  # quiet DeepSpeed, threads per process on CPU, no JIT build
    deepspeed.init_distributed()
    rank = dist.get_rank()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out_dir = Path(args.output_dir)
    log = rank0_logger("embed", rank, t_start)

    ds_config, ml = load_ds_config(prepare_ds_config(args), output_dir=str(out_dir))
    parallel = build_parallel(1)
    group = parallel.topology.dp_group  # pure data parallel: the DP group is the world
    dp_size, dp_rank = parallel.dp_size, parallel.topology.dp_rank
    micro = int(ds_config["train_micro_batch_size_per_gpu"])
    gas = int(ds_config["gradient_accumulation_steps"])

    train, held = load_pairs_cached(args)
    tokenizer = tokenizer_cached([t for p in train for t in (p.query, p.document)],
                                 args.vocab_size, args.cache_dir, args.local_rank)
    pad_id = tokenizer.token_to_id(EOS)  # any id works under the attention mask
    tq = encode_texts(tokenizer, [p.query for p in train], args.max_query_len)
    td = encode_texts(tokenizer, [p.document for p in train], args.max_doc_len)
    eq = encode_texts(tokenizer, [p.query for p in held], args.max_query_len)
    ed = encode_texts(tokenizer, [p.document for p in held], args.max_doc_len)
    log(f"data: {len(train)} train / {len(held)} held-out pairs "
        f"({'stdlib' if args.train_data is None else 'user data'}), BPE vocab "
        f"{tokenizer.get_vocab_size()}")

    encoder = build_encoder(args.model_size, tokenizer.get_vocab_size(),
                            max(args.max_query_len, args.max_doc_len), pad_id, args.dropout)
    model = EmbeddingModelWithMNR(encoder, temperature=ml.mnr.temperature,
                                  symmetric=ml.mnr.symmetric, gather=ml.mnr.gather_across_ranks,
                                  group=group)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = lr_scheduler = None
    if "optimizer" not in ds_config:
        # A torch optimizer: DeepSpeed's FusedAdam / CPUAdam would JIT-compile ops on CPU.
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        if "scheduler" not in ds_config:
            def schedule(step: int) -> float:  # linear warm-up, cosine decay to 10 %
                if step < args.warmup_steps:
                    return (step + 1) / args.warmup_steps
                t = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
                return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
            lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    me = initialize(model, ds_config, parallel=parallel, optimizer=optimizer,
                    lr_scheduler=lr_scheduler, output_dir=str(out_dir))
    engine = me.engine
    # The engine leaves c * (sum of all ranks' micro-batch gradients); the probe measured 1/c.
    multiplier = me.engine_scale.loss_multiplier
    log(f"engine ready: DP={dp_size}, ZeRO-{engine.zero_optimization_stage()}, micro-batch "
        f"{micro} x GAS {gas} x DP {dp_size} = {micro * gas * dp_size} pairs/step, "
        f"{n_params / 1e6:.2f} M params, measured engine loss multiplier {multiplier:g} "
        f"({me.engine_scale.engine}), MNR {ml.mnr.model_dump()}")

    before = evaluate(engine, eq, ed, args, pad_id, group)
    write_metrics(engine, before, 0, prefix="Eval/megaloss/")
    log(f"before training: held-out MRR@10 {before['mrr@10']:.4f}, "
        f"recall@1 {before['recall@1']:.4f}")

    batches = MicroBatches(tq, td, micro, dp_size, dp_rank, args.seed, pad_id)
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, desc="train", unit="step", dynamic_ncols=True)
    rows: List[Dict[str, float]] = []
    t_train = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        # Prefetch the step's micro-batches: their sizes give the GAS compensation weights
        # (one all-reduce); all ones when every micro-batch has the same global size.
        micro_batches = [next(batches) for _ in range(gas)]
        weights = step_loss_weights([len(b["query_input_ids"]) for b in micro_batches], group,
                                    loss_multiplier=multiplier)
        loss_sum = torch.zeros(())
        acc_sum = torch.zeros(())
        for b, w in zip(micro_batches, weights):
            out = engine(**{k: v.to(engine.device) for k, v in b.items()}, loss_weight=w)
            engine.backward(out.loss)
            engine.step()
            # The step's global value sum_m (n_m / N) L_m, kept on device until logging.
            share = w * (dp_size / multiplier)
            loss_sum += share * out.value.float().cpu()
            acc_sum += share * out.accuracy.float().cpu()
        seconds = time.perf_counter() - t0
        norm = engine.get_global_grad_norm()
        row = {"step": int(engine.global_steps), "loss": float(loss_sum),
               "accuracy": float(acc_sum), "lr": float(engine.get_lr()[0]),
               "grad_norm": float(norm) if norm is not None else float("nan"),
               "pairs_per_s": micro * gas * dp_size / seconds, "step_time_s": seconds,
               "peak_memory_mib": peak_memory_mib(engine.device)}
        rows.append(row)
        if step % args.log_every == 0 or step == args.steps:
            events = {("mnr_" + k if k in ("loss", "accuracy") else k): v
                      for k, v in row.items() if k != "step"}
            write_metrics(engine, events, row["step"])  # Train/megaloss/mnr_loss, ...
        if bar is not None:
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accuracy']:.2f}")
            bar.update(1)
    train_seconds = time.perf_counter() - t_train
    if bar is not None:
        bar.close()
    log(f"trained {args.steps} steps in {train_seconds:.1f} s")
    after = evaluate(engine, eq, ed, args, pad_id, group)
    write_metrics(engine, after, rows[-1]["step"], prefix="Eval/megaloss/")
    log(f"after training: held-out MRR@10 {after['mrr@10']:.4f}, "
        f"recall@1 {after['recall@1']:.4f}")

    summary = {"eval_before": before, "eval_after": after, "steps": args.steps,
               "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
               "first_accuracy": rows[0]["accuracy"], "last_accuracy": rows[-1]["accuracy"],
               "train_pairs": len(train), "eval_pairs": len(held), "dp": dp_size,
               "micro_batch": micro, "gas": gas, "global_batch": micro * gas * dp_size,
               "parameters": n_params, "model": f"BERT {args.model_size} "
               f"({encoder.config.num_hidden_layers}L x {encoder.config.hidden_size})",
               "zero_stage": engine.zero_optimization_stage(),
               "engine_loss_multiplier": multiplier, "mnr": ml.mnr.model_dump(),
               "data": "stdlib" if args.train_data is None else "user data",
               "peak_memory_mib": max(r["peak_memory_mib"] for r in rows),
               "train_seconds": train_seconds, "total_seconds": time.perf_counter() - t_start}
    if rank == 0:
        write_outputs(out_dir, rows, summary)
        print_summary(summary)
        log(f"wrote {out_dir / 'metrics.csv'}, {out_dir / 'loss_curve.png'}, "
            f"{out_dir / 'summary.json'}")
    dist.barrier()
    return summary


if __name__ == "__main__":
    main()
