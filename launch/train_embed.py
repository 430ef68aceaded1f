#!/usr/bin/env python3
"""Train a small code-search embedding model with gathered MNR under DeepSpeed.

Run through the launcher (it passes ``--local_rank``)::

    deepspeed --num_gpus 2 launch/train_embed.py                 # built-in ZeRO-2 config
    deepspeed --num_gpus 2 launch/train_embed.py --deepspeed_config configs/zero3.json \
        --micro_batch_size 32 --gradient_accumulation_steps 1
    deepspeed --num_gpus 2 launch/train_embed.py --micro_batch_size 512 --mini_batch_size 32

With no data arguments the job uses built-in real data: (docstring -> function source) pairs
extracted from this interpreter's standard library, whole files held out for evaluation
(``launch/jobs/code_search.py``). It trains a byte-level BPE tokenizer on the training texts
(cached; ``launch/jobs/text_data.py``), a small BERT-style encoder from a ``transformers``
config (random init, no download), mean pooling, and the gathered MNR loss computed inside the
module ``engine.forward`` runs (``megaloss.integrations.hf.embedding``); every step's loss is the
query mean over the global batch, with the engine's gradient scale measured at start-up.
``--mini_batch_size`` (or ``"mini_batch_size"`` in the ``megaloss.mnr`` section) turns on
GradCache (``megaloss.integrations.hf.embedding.cached_mnr_forward``): the same loss and
gradients with the encoder's activations of one mini-batch at a time. It
reports held-out MRR@10 and recall@1 before and after training, a progress bar and a summary
table on rank 0, metrics through ``engine.monitor`` (so the ds_config's ``csv_monitor`` /
``tensorboard`` / ``wandb`` sections work; every event at DeepSpeed's global sample count), and
writes ``metrics.csv``, ``loss_curve.png`` and ``summary.json`` to ``--output_dir`` (default
``runs/embed`` under the current directory; a folder that holds a run is refused unless
``--resume`` or ``--overwrite``).

Checkpoints (``--save_every N``, ``--resume [latest|PATH]``, ``--eval_only``) go through
DeepSpeed's ``engine.save_checkpoint`` / ``load_checkpoint`` with the data position, every rank's
RNG states (dropout), the data cache key and the metrics so far; SIGTERM / SIGINT save at the
next step boundary and write what ran.
"""
from __future__ import annotations

import argparse
import json
import math
import os
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

from jobs.code_search import CodePair, load_code_search, source_files  # noqa: E402
from jobs.runs import (  # noqa: E402
    CHECKPOINTS, StopRequest, add_run_arguments, agreed, check_run_arguments, open_run,
    progress_bar, save_run, step_boundary)
from jobs.text_data import (  # noqa: E402
    EOS, StepBatches, atomic_write, files_digest, read_texts, train_bpe_tokenizer)
from megaloss.integrations.deepspeed.grad_cache import inner_replay_backward  # noqa: E402
from megaloss.integrations.hf import (EmbeddingModelWithMNR, cached_mnr_forward,  # noqa: E402
                                     step_loss_weights)
from megaloss.parallel import all_gather_dim0, all_gather_sizes  # noqa: E402
from jobs.reporting import (  # noqa: E402
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
    p.add_argument("--mini_batch_size", type=int, default=None,
                   help="GradCache: encode this many pairs at a time (same loss and gradients, "
                        "activation memory of one mini-batch); overrides megaloss.mnr."
                        "mini_batch_size of the ds_config")
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
    p.add_argument("--output_dir", type=str, default=os.path.join("runs", "embed"),
                   help="the run's folder, relative to the current directory: metrics.csv, "
                        "summary.json, loss_curve.png, monitor/, wandb/, checkpoints/")
    p.add_argument("--cache_dir", type=str,
                   default=os.environ.get("MEGALOSS_CACHE",
                                          os.path.join(Path.home(), ".cache", "megaloss")),
                   help="where extracted pairs and the tokenizer are cached")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                   help="set by the deepspeed launcher")
    add_run_arguments(p)
    args = p.parse_args(argv)
    check_run_arguments(p, args)
    if args.mini_batch_size is not None and args.mini_batch_size < 1:
        p.error("--mini_batch_size must be >= 1")
    for name in ("steps", "vocab_size", "max_query_len", "max_doc_len", "eval_batch_size",
                 "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


# caching helpers (local rank 0 of each node builds, every rank agrees on failure) ----------------
def load_pairs_cached(args: argparse.Namespace) -> Tuple[List[CodePair], List[CodePair], str]:
    """Training and held-out pairs, cached under a key of the source files' paths and contents
    and the options, so an edited source or another Python's stdlib invalidates it.

    Returns:
        ``(train pairs, held-out pairs, cache key)``.

    Raises:
        SystemExit: no training or no held-out pairs (every rank, naming the sources).
    """
    train_files = source_files(args.train_data)
    eval_files = source_files(args.eval_data) if args.eval_data else []
    key = files_digest(read_texts(train_files) + ["\0eval\0"] + read_texts(eval_files),
                       "pairs-v2", [str(f) for f in train_files + eval_files],
                       args.eval_fraction, args.max_train, args.max_eval)
    path = Path(args.cache_dir) / f"code_search-{key}.json"

    def build():
        if args.local_rank == 0 and not path.exists():
            train, held = load_code_search(args.train_data, args.eval_data,
                                           eval_fraction=args.eval_fraction,
                                           max_train=args.max_train, max_eval=args.max_eval)
            atomic_write(path, json.dumps({"train": [p.__dict__ for p in train],
                                           "eval": [p.__dict__ for p in held]}))

    agreed(build, everywhere=True, what="extracting the code-search pairs")
    data = json.loads(path.read_text(encoding="utf-8"))
    train = [CodePair(**d) for d in data["train"]]
    held = [CodePair(**d) for d in data["eval"]]
    named = " ".join(map(str, args.train_data)) if args.train_data else "the standard library"
    empty = [str(f) for f in train_files if f.is_file() and f.stat().st_size == 0]
    if not train:
        raise SystemExit(
            f"no training pairs in --train_data {named}: it needs functions with a docstring of "
            "3 words or more (or JSON Lines of {\"query\", \"document\"})"
            + (f"; empty: {', '.join(empty[:3])}" if empty else ""))
    if not held:
        raise SystemExit(
            "no held-out pairs: " + (f"--eval_data {' '.join(map(str, args.eval_data))} has "
                                       "none (or only pairs also in training)"
                                       if args.eval_data else
                                       f"--eval_fraction {args.eval_fraction} holds out no file "
                                       f"with pairs of {named}; pass --eval_data or a larger "
                                       "--eval_fraction"))
    return train, held, key


def tokenizer_cached(texts: List[str], vocab_size: int, cache_dir: str, local_rank: int):
    """Byte-level BPE trained on the training texts (launch/jobs/text_data.py), built once per
    node by local rank 0 and read from the cache by the others."""
    agreed(lambda: local_rank == 0 and train_bpe_tokenizer(texts, vocab_size,
                                                           cache_dir=cache_dir),
           everywhere=True, what="training the tokenizer")
    return train_bpe_tokenizer(texts, vocab_size, cache_dir=cache_dir)


def encode_pairs(tokenizer, pairs: Sequence[CodePair], max_query_len: int,
                 max_doc_len: int) -> Dict[str, torch.Tensor]:
    """``query_input_ids`` / ``query_attention_mask`` ``[N, Tq]`` and ``document_*`` ``[N, Td]``:
    texts truncated to the side's maximum length and right-padded (with EOS, masked out) to the
    side's longest sequence by the tokenizer."""
    tokenizer.enable_padding(pad_id=tokenizer.token_to_id(EOS), pad_token=EOS)
    out = {}
    for side, texts, max_len in (("query", [p.query for p in pairs], max_query_len),
                                 ("document", [p.document for p in pairs], max_doc_len)):
        tokenizer.enable_truncation(max_len)
        enc = tokenizer.encode_batch(texts)
        out[f"{side}_input_ids"] = torch.tensor([e.ids for e in enc], dtype=torch.long)
        out[f"{side}_attention_mask"] = torch.tensor([e.attention_mask for e in enc],
                                                     dtype=torch.long)
    return out


# evaluation -------------------------------------------------------------------------------------
@torch.no_grad()
def embed_all(engine, ids: torch.Tensor, mask: torch.Tensor, batch_size: int,
              group) -> torch.Tensor:
    """Embeddings ``[N, H]`` of all ``N`` sequences on every rank. Each rank encodes a contiguous
    shard; all ranks run the same number of forwards (ZeRO-3 gathers parameters collectively), a
    rank with nothing left encodes the first sequence again and drops it."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    per = math.ceil(len(ids) / world)
    first = ids[:1], mask[:1]
    ids, mask = ids[rank * per: (rank + 1) * per], mask[rank * per: (rank + 1) * per]
    rounds = max(1, math.ceil(per / batch_size))
    module = engine.module
    outs = []
    for r in range(rounds):
        rows = slice(r * batch_size, (r + 1) * batch_size)
        n = len(ids[rows])
        chunk_ids, chunk_mask = (ids[rows], mask[rows]) if n else first
        emb = module.encode(chunk_ids.to(engine.device), chunk_mask.to(engine.device)).float()
        outs.append(emb[:n])
    local = torch.cat(outs)
    # no gradient here: pad to the largest shard, gather, trim
    sizes = all_gather_sizes(local.shape[0], group, local.device)
    padded = torch.cat([local, local.new_zeros((max(sizes) - local.shape[0],) + local.shape[1:])])
    gathered = all_gather_dim0(padded, group)
    return torch.cat([gathered[r * max(sizes): r * max(sizes) + n] for r, n in enumerate(sizes)])


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


def evaluate(engine, pairs: Dict[str, torch.Tensor], batch_size: int, group) -> Dict[str, float]:
    """Held-out retrieval metrics of ``pairs`` (:func:`encode_pairs`), the same on every rank."""
    was_training = engine.module.training
    engine.module.eval()
    q = embed_all(engine, pairs["query_input_ids"], pairs["query_attention_mask"], batch_size,
                  group)
    d = embed_all(engine, pairs["document_input_ids"], pairs["document_attention_mask"],
                  batch_size, group)
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
    if args.mini_batch_size is not None:
        section = config.setdefault("megaloss", {})
        if isinstance(section, dict):
            section.setdefault("mnr", {})["mini_batch_size"] = args.mini_batch_size
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
    title = (f"code-search embedding: MRR@10 {b['mrr@10']:.3f} -> {a['mrr@10']:.3f}" if a else
             f"code-search embedding: MRR@10 {b['mrr@10']:.3f} (stopped at step "
             f"{summary['steps']})")
    plot_loss_curve(
        out_dir / "loss_curve.png",
        [Curve("MNR loss (global batch)", steps, [r["loss"] for r in rows], style={"lw": 1})],
        secondary=[Curve("in-batch accuracy", steps, [r["accuracy"] for r in rows],
                         style={"color": "tab:orange", "alpha": 0.6, "lw": 1})],
        title=title, ylabel="loss", secondary_ylabel="in-batch top-1 accuracy")


def print_summary(summary: Dict) -> None:
    """The before/after table of held-out retrieval metrics and training figures."""
    b, a = summary["eval_before"], summary["eval_after"] or {}
    rows = [("held-out MRR@10", f"{b['mrr@10']:.4f}", f"{a['mrr@10']:.4f}" if a else "-"),
            ("held-out recall@1", f"{b['recall@1']:.4f}", f"{a['recall@1']:.4f}" if a else "-")]
    if summary["first_loss"] is not None:
        rows += [("train MNR loss (first/last step)", f"{summary['first_loss']:.4f}",
                  f"{summary['last_loss']:.4f}"),
                 ("train in-batch accuracy", f"{summary['first_accuracy']:.4f}",
                  f"{summary['last_accuracy']:.4f}")]
    stopped = summary.get("stopped")
    extra = (f"{summary['train_pairs']} train / {summary['eval_pairs']} held-out pairs, "
             f"{summary['steps']} steps x {summary['global_batch']} pairs, "
             f"{summary['parameters'] / 1e6:.2f} M params, {summary['train_seconds']:.0f} s"
             + (f"; stopped by {stopped['signal']} at step {stopped['step']} (resume with "
                "--resume)" if stopped else ""))
    print_summary_table("code-search embedding (gathered MNR)", rows, extra)


# main -------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> Dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    import deepspeed
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from megaloss import Topology
    from megaloss.integrations.deepspeed import (
        close_monitors, configure_launched_process, initialize, load_checkpoint, load_ds_config,
        peak_memory_mib, write_metrics)

    from deepspeed.accelerator import get_accelerator

    configure_launched_process()  # quiet DeepSpeed, threads per process on CPU, no JIT build
    deepspeed.init_distributed()
    # this rank's device before the first object collective (NCCL needs it; a no-op on CPU)
    get_accelerator().set_device(args.local_rank)
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    out_dir = Path(args.output_dir)
    ckpt_dir = out_dir / CHECKPOINTS
    log = rank0_logger("embed", rank, t_start)

    ds_config, ml = load_ds_config(prepare_ds_config(args), output_dir=str(out_dir))
    resume_from = open_run(args, out_dir, ds_config)

    topo = Topology.build(1)
    group = topo.dp_group  # pure data parallel: the DP group is the world
    dp_size, dp_rank = topo.dp_size, topo.dp_rank
    micro = int(ds_config["train_micro_batch_size_per_gpu"])
    gas = int(ds_config["gradient_accumulation_steps"])

    train, held, data_key = load_pairs_cached(args)
    tokenizer = tokenizer_cached([t for p in train for t in (p.query, p.document)],
                                 args.vocab_size, args.cache_dir, args.local_rank)
    pad_id = tokenizer.token_to_id(EOS)  # any id works under the attention mask
    train_enc = encode_pairs(tokenizer, train, args.max_query_len, args.max_doc_len)
    held_enc = encode_pairs(tokenizer, held, args.max_query_len, args.max_doc_len)
    if len(train) < micro * gas * dp_size:
        raise SystemExit(f"{len(train)} training pairs cannot fill one global batch of "
                         f"{micro * gas * dp_size} (micro-batch {micro} x GAS {gas} x DP "
                         f"{dp_size}): give more data or a smaller --micro_batch_size")
    log(f"data: {len(train)} train / {len(held)} held-out pairs "
        f"({'stdlib' if args.train_data is None else 'user data'}), BPE vocab "
        f"{tokenizer.get_vocab_size()}")

    encoder = build_encoder(args.model_size, tokenizer.get_vocab_size(),
                            max(args.max_query_len, args.max_doc_len), pad_id, args.dropout)
    model = EmbeddingModelWithMNR(encoder, options=ml.mnr.options(), group=group)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = lr_scheduler = None
    if "optimizer" not in ds_config:
        # A torch optimizer: DeepSpeed's FusedAdam / CPUAdam would JIT-compile ops on CPU.
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        if "scheduler" not in ds_config:  # linear warm-up, cosine decay to 10 % of --lr
            lr_scheduler = get_cosine_with_min_lr_schedule_with_warmup(
                optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.steps,
                min_lr_rate=0.1)
    me = initialize(model, ds_config, topology=topo, optimizer=optimizer,
                    lr_scheduler=lr_scheduler, output_dir=str(out_dir))
    engine = me.engine
    # The engine leaves c * (sum of all ranks' micro-batch gradients); the probe measured 1/c.
    multiplier = me.engine_scale.loss_multiplier
    log(f"engine ready: DP={dp_size}, ZeRO-{engine.zero_optimization_stage()}, micro-batch "
        f"{micro} x GAS {gas} x DP {dp_size} = {micro * gas * dp_size} pairs/step, "
        f"{n_params / 1e6:.2f} M params, measured engine loss multiplier {multiplier:g} "
        f"({me.engine_scale.engine}), MNR {ml.mnr.model_dump()}")

    # what a resumed run needs besides the engine's own state
    job_state: Dict = {"rows": [], "before": None, "train_seconds": 0.0, "saves": []}
    if resume_from is not None:
        t0 = time.perf_counter()
        path, client = load_checkpoint(me, resume_from)
        saved = client.get("job", {})
        if saved.get("data_key") != data_key or saved.get("vocab_size") != args.vocab_size:
            raise SystemExit(
                f"checkpoint {path} was trained on other pairs or another tokenizer (cache key "
                f"{saved.get('data_key')}, vocab {saved.get('vocab_size')}; these options give "
                f"{data_key}, vocab {args.vocab_size}): pass the same --train_data / --eval_data "
                "/ --eval_fraction / --max_train / --max_eval / --vocab_size")
        job_state.update({k: saved[k] for k in job_state if k in saved})
        log(f"resumed from {path} at step {engine.global_steps} "
            f"({engine.global_samples} samples) in {time.perf_counter() - t0:.2f} s")
    start = int(engine.global_steps)

    if args.eval_only:
        result = evaluate(engine, held_enc, args.eval_batch_size, group)
        report = {"checkpoint": str(resume_from), "step": start, "eval": result}
        if rank == 0:
            write_summary_json(out_dir / f"eval_step{start}.json", report)
            print_summary_table("code-search embedding: checkpoint evaluation",
                                [(k, f"{v:.4f}") for k, v in result.items()],
                                f"step {start} of {resume_from}", columns=("metric", "value"))
        dist.barrier()
        return report

    rows: List[Dict[str, float]] = job_state["rows"]
    saves: List[Dict] = job_state["saves"]
    before = job_state["before"]
    if before is None:
        before = evaluate(engine, held_enc, args.eval_batch_size, group)
        write_metrics(engine, before, prefix="Eval/megaloss/")
        log(f"before training: held-out MRR@10 {before['mrr@10']:.4f}, "
            f"recall@1 {before['recall@1']:.4f}")

    def save(step: int) -> None:
        job = {"name": "embed", "data_key": data_key, "vocab_size": args.vocab_size,
               "seed": args.seed, "steps_done": step, "rows": rows, "before": before,
               "saves": saves,
               "train_seconds": train_seconds_before + time.perf_counter() - t_train}
        save_run(me, ckpt_dir, step, job, tokenizer, args.keep_checkpoints, saves, log)

    mini = ml.mnr.mini_batch_size
    batches = StepBatches(train_enc, micro=micro, gas=gas, dp_size=dp_size, dp_rank=dp_rank,
                          seed=args.seed).iter_from(start)
    bar = progress_bar(args, start)
    stop = StopRequest().install()
    train_seconds_before = job_state["train_seconds"]
    t_train = time.perf_counter()
    stopped = None
    for step in range(start + 1, args.steps + 1):
        t0 = time.perf_counter()
        # The step's micro-batches, known up front: their sizes give the GAS compensation
        # weights (one all-reduce); all ones when every micro-batch has the same global
        # size.
        micro_batches = next(batches)
        weights = step_loss_weights([len(b["query_input_ids"]) for b in micro_batches],
                                    group, loss_multiplier=multiplier, device=engine.device)
        # The step's global loss and accuracy, sum_m (n_m / N) (L_m, acc_m), and the
        # gradient norm (a device tensor under ZeRO-1/2) stay on the device until one read
        # per step.
        stats = torch.zeros(3, device=engine.device)
        for b, w in zip(micro_batches, weights):
            batch = {k: v.to(engine.device) for k, v in b.items()}
            if mini is None:
                out = engine(**batch, loss_weight=w)
            else:  # GradCache: the replays but the last run as accumulation passes
                out = cached_mnr_forward(engine, batch, mini_batch_size=mini,
                                         backward=inner_replay_backward(engine), loss_weight=w)
            engine.backward(out.loss)
            engine.step()
            share = w * (dp_size / multiplier)
            stats[:2] += share * torch.stack([out.value, out.accuracy]).float()
        norm = engine.get_global_grad_norm()
        stats[2] = float("nan") if norm is None else norm
        loss, accuracy, grad_norm = stats.tolist()  # the step's one host sync
        seconds = time.perf_counter() - t0
        row = {"step": int(engine.global_steps), "loss": loss, "accuracy": accuracy,
               "lr": float(engine.get_lr()[0]), "grad_norm": grad_norm,
               "pairs_per_s": micro * gas * dp_size / seconds, "step_time_s": seconds,
               "peak_memory_mib": peak_memory_mib(engine.device),
               "samples": int(engine.global_samples)}
        rows.append(row)
        if step % args.log_every == 0 or step == args.steps:
            events = {("mnr_" + k if k in ("loss", "accuracy") else k): v
                      for k, v in row.items() if k not in ("step", "samples")}
            events["optimizer_step"] = row["step"]
            write_metrics(engine, events)  # Train/megaloss/mnr_loss, ...
        if bar is not None:
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accuracy']:.2f}")
            bar.update(1)
        stopped = step_boundary(stop, engine.device, step, args, save, log)
        if stopped:
            break
    train_seconds = train_seconds_before + time.perf_counter() - t_train
    if bar is not None:
        bar.close()
    last = rows[-1]["step"] if rows else start
    after = None
    if stopped is None:
        log(f"trained {last} steps in {train_seconds:.1f} s")
        after = evaluate(engine, held_enc, args.eval_batch_size, group)
        write_metrics(engine, after, prefix="Eval/megaloss/")
        log(f"after training: held-out MRR@10 {after['mrr@10']:.4f}, "
            f"recall@1 {after['recall@1']:.4f}")

    first_row, last_row = (rows[0], rows[-1]) if rows else ({}, {})
    summary = {"eval_before": before, "eval_after": after, "steps": last,
               "steps_requested": args.steps, "stopped": stopped,
               "resumed_from": resume_from and str(resume_from), "resumed_at_step": start,
               "first_loss": first_row.get("loss"), "last_loss": last_row.get("loss"),
               "first_accuracy": first_row.get("accuracy"),
               "last_accuracy": last_row.get("accuracy"),
               "train_pairs": len(train), "eval_pairs": len(held), "dp": dp_size,
               "micro_batch": micro, "gas": gas, "global_batch": micro * gas * dp_size,
               "parameters": n_params, "model": f"BERT {args.model_size} "
               f"({encoder.config.num_hidden_layers}L x {encoder.config.hidden_size})",
               "zero_stage": engine.zero_optimization_stage(),
               "engine_loss_multiplier": multiplier, "mnr": ml.mnr.model_dump(),
               "data": "stdlib" if args.train_data is None else "user data",
               "peak_memory_mib": max((r["peak_memory_mib"] for r in rows), default=0.0),
               "checkpoints": None if not saves else {
                   "saves": len(saves),
                   "seconds_per_save": sum(x["seconds"] for x in saves) / len(saves),
                   "mib_per_save": sum(x["mib"] for x in saves) / len(saves),
                   "last": saves[-1]["path"]},
               "data_key": data_key,
               "train_seconds": train_seconds, "total_seconds": time.perf_counter() - t_start}
    close_monitors(engine)
    if rank == 0:
        write_outputs(out_dir, rows, summary)
        print_summary(summary)
        log(f"wrote {out_dir / 'metrics.csv'}, {out_dir / 'loss_curve.png'}, "
            f"{out_dir / 'summary.json'}")
    dist.barrier()
    stop.restore()  # only now: a second signal must not cut the outputs' writing short
    return summary


if __name__ == "__main__":
    main()
