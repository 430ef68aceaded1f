#!/usr/bin/env python3
"""Benchmark, end to end: TRL's ``SFTTrainer`` on a Hugging Face model with
:func:`megaloss.integrations.hf.apply` against the same run without, side by side in one run (CPU,
float32, a fresh process per method and round).

Both methods train the same random-init ``transformers.LlamaForCausalLM`` (seeded; ``--vocab``,
``--hidden``, ``--layers``, untied head) with the same ``SFTTrainer`` (TRL's defaults but
``bf16=False``, SGD, constant learning rate, ``--batch`` rows a step, no gradient accumulation)
on the same rows:

* ``trl``: the trainer as shipped. TRL 1.16 patches the model with its own fused lm_head
  (``trl.trainer.utils.add_fused_lm_head``): per-token log-probs, entropy and top-1 match in
  tiles of up to 4096 tokens x 32768 vocabulary columns, its softmax statistics in float32
  (``trl/kernels/chunked_logprob.py``; its GEMMs in the autocast dtype, here float32 as
  ``bf16=False``: TRL's configs default to ``bf16=True``, which on CPU runs them in bf16);
* ``megaloss``: ``apply(model)`` before the trainer is built: the same call answered by
  megaloss's chunked log-probs (:func:`megaloss.linear_log_probs`, entropy and greedy match).

The rows are text that ships with Python (the ``.py`` files of the standard library, as the
launch jobs read them, ``launch.jobs.code_search.stdlib_files``), cut into ``--batch * --steps``
pieces of ``--min-len``..``--max-len`` words; the tokenizer is a word-level one built here from
the same files (the ``--vocab`` - 3 most frequent words, ``<pad>``, ``<eos>``, ``<unk>``), so a
piece of n words is n + 1 tokens with the EOS SFTTrainer appends. No download.

Measured per method (a fresh process per method and round, ``--repeats`` rounds interleaved,
min over the rounds): seconds per optimizer step (median over the steps after ``--warmup``,
``on_step_begin`` to ``on_step_end``); the peak RSS of the training steps above the RSS when
training begins (``step_MiB``: activations, the head's buffers, gradients, the collator; malloc
settings and the probe of ``tools/_bench_common.py``). The logged training loss (and
``entropy``) of each step side by side: the same model, data and token-mean NLL, both in
float32, so they agree to float32 rounding (``max_loss_rel_diff``, against ``trl``).

    python3 tools/bench_hf_apply.py                    # V 32000, H 256, 2 layers, batch 4
    python3 tools/bench_hf_apply.py --vocab 2000 --hidden 32 --min-len 32 --max-len 64 --steps 3
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, ROOT)  # launch.jobs.code_search: the built-in corpus
from _bench_common import (  # noqa: E402
    MemoryProbe,
    add_process_arguments,
    answer_worker,
    finish,
    format_table,
    median,
    require_positive,
    run_in_this_process,
    run_worker,
    trim_memory,
)

METHODS = ("trl", "megaloss")
SPECIALS = ("<pad>", "<eos>", "<unk>")
WORD = re.compile(r"\w+|[^\w\s]+")  # the tokenizers library's Whitespace pre-tokenizer
COLUMNS = ["method", "vocab", "hidden", "layers", "batch", "min_len", "max_len", "steps",
           "repeats", "s_per_step", "step_MiB", "time_ratio", "mem_ratio", "max_loss_rel_diff",
           "max_entropy_rel_diff", "first_loss", "last_loss", "mem_method", "error"]
TABLE_COLUMNS = ["method", "s_per_step", "step_MiB", "time_ratio", "mem_ratio",
                 "max_loss_rel_diff", "max_entropy_rel_diff", "first_loss", "last_loss"]


def corpus(spec: Dict[str, Any]):
    """``(rows, vocabulary)``: ``batch * steps`` rows ``{"text": ...}`` of ``min_len`` ..
    ``max_len`` words of the standard library's sources (consecutive, from the start of the
    sorted file list; lengths a function of ``seed``), and the word list of the tokenizer
    (``SPECIALS``, then the most frequent words of the files read, ``vocab`` in all)."""
    import random

    from launch.jobs.code_search import stdlib_files
    rng = random.Random(spec["seed"])
    lengths = [rng.randint(spec["min_len"], spec["max_len"])
               for _ in range(spec["batch"] * spec["steps"])]
    need = max(sum(lengths), 50 * spec["vocab"])  # enough text for a vocabulary too
    words: List[str] = []
    for path in stdlib_files():
        try:
            words += WORD.findall(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        if len(words) >= need:
            break
    counts = Counter(words)
    vocabulary = list(SPECIALS) + [w for w, _ in counts.most_common(spec["vocab"] - len(SPECIALS))
                                   if w not in SPECIALS]
    rows, start = [], 0
    for n in lengths:
        rows.append({"text": " ".join(words[start:start + n])})
        start += n
    return rows, vocabulary


def tokenizer(vocabulary: List[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocabulary)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def model(spec: Dict[str, Any]):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(spec["seed"])
    heads = max(1, spec["hidden"] // 64)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=spec["vocab"], hidden_size=spec["hidden"],
        intermediate_size=4 * spec["hidden"], num_hidden_layers=spec["layers"],
        num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=spec["max_len"] + 1, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1))


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One method's run: build, train ``steps`` steps, report times, the steps' peak and the
    logged losses."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer
    torch.set_num_threads(spec["threads"])
    rows, vocabulary = corpus(spec)
    net = model(spec)
    if spec["method"] == "megaloss":
        from megaloss.integrations.hf import apply
        apply(net)
    probe = MemoryProbe("cpu")
    times: List[float] = []

    class Measure(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            trim_memory()
            probe.start()

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t0)

    args = SFTConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=spec["batch"],
                     max_steps=spec["steps"], max_length=spec["max_len"] + 1, learning_rate=1e-3,
                     optim="sgd", lr_scheduler_type="constant", logging_steps=1, report_to=[],
                     bf16=False, use_cpu=True, save_strategy="no", disable_tqdm=True,
                     seed=spec["seed"], dataloader_num_workers=0)
    trainer = SFTTrainer(model=net, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tokenizer(vocabulary), callbacks=[Measure()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"times": times[spec["warmup"]:], "step_bytes": probe.peak_above_baseline(),
            "mem_method": probe.method, "losses": [float(h["loss"]) for h in logs],
            "entropy": [float(h["entropy"]) for h in logs]}


def _max_rel(a: List[float], b: List[float]) -> float:
    if not a or len(a) != len(b):
        return math.nan
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary V (default 32000)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size H (default 256)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--batch", type=int, default=4, help="rows per step (default 4)")
    p.add_argument("--min-len", type=int, default=512, help="fewest words a row (default 512)")
    p.add_argument("--max-len", type=int, default=1023,
                   help="most words a row (default 1023: 1024 tokens with the EOS)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--warmup", type=int, default=1,
                   help="first steps left out of the timing (default 1)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds, a fresh process per method each (default 3)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads (default: the cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", metavar="PATH", help="write every column as CSV")
    add_process_arguments(p, timeout_help="seconds per process")
    args = p.parse_args(argv)
    if answer_worker(args, _worker):
        return 0
    require_positive(p, args, ("vocab", "hidden", "layers", "batch", "min_len", "max_len",
                               "steps", "repeats", "threads"))
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be in [0, --steps)")
    if args.min_len > args.max_len:
        p.error("--min-len must be <= --max-len")
    if args.vocab <= len(SPECIALS):
        p.error(f"--vocab must be > {len(SPECIALS)}")
    spec = {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers,
            "batch": args.batch, "min_len": args.min_len, "max_len": args.max_len,
            "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
            "seed": args.seed}
    runs: Dict[str, List[Dict[str, Any]]] = {m: [] for m in METHODS}
    for r in range(args.repeats):
        for method in METHODS:
            t0 = time.perf_counter()
            one = {**spec, "method": method}
            runs[method].append(run_in_this_process(_worker, one) if args.same_process
                                else run_worker(__file__, one, args.threads, args.timeout))
            print(f"# round {r + 1}, {method}: {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr, flush=True)
    rows = []
    for method in METHODS:
        ok = [x for x in runs[method] if "error" not in x]
        row = {"method": method, **{k: spec[k] for k in ("vocab", "hidden", "layers", "batch",
                                                         "min_len", "max_len", "steps")},
               "repeats": len(ok), "error": "; ".join(x["error"] for x in runs[method]
                                                      if "error" in x)}
        if not ok:
            rows.append(dict(row, s_per_step=math.nan, step_MiB=math.nan, _losses=[],
                             _entropy=[]))
            continue
        rows.append(dict(row, s_per_step=min(median(x["times"]) for x in ok),
                         step_MiB=min(x["step_bytes"] for x in ok) / 2 ** 20,
                         mem_method=ok[0]["mem_method"], _losses=ok[0]["losses"],
                         _entropy=ok[0]["entropy"], first_loss=ok[0]["losses"][0],
                         last_loss=ok[0]["losses"][-1]))
    trl, mega = rows
    for r in rows:
        r["time_ratio"] = mega["s_per_step"] / r["s_per_step"]
        r["mem_ratio"] = mega["step_MiB"] / r["step_MiB"] if r["step_MiB"] else math.nan
        r["max_loss_rel_diff"] = _max_rel(r["_losses"], trl["_losses"])
        r["max_entropy_rel_diff"] = _max_rel(r["_entropy"], trl["_entropy"])
    import trl as trl_module
    print(f"TRL {trl_module.__version__} SFTTrainer, random-init Llama V={args.vocab} "
          f"H={args.hidden} {args.layers} layers, batch {args.batch} rows of {args.min_len}.."
          f"{args.max_len} words (+EOS), {args.steps} steps ({args.warmup} untimed), CPU float32 "
          f"(bf16=False), {args.threads} threads; min over {args.repeats} rounds, a fresh process "
          f"each; *_ratio = megaloss / this row; loss and entropy against trl's, step by step")
    print(format_table(rows, TABLE_COLUMNS))
    print("losses (trl | megaloss): " + "  ".join(
        f"{a:.6f}|{b:.6f}" for a, b in zip(trl["_losses"], mega["_losses"])))
    errors = [f"{r['method']}: {r['error']}" for r in rows if r["error"]]
    return finish(errors, args.csv, rows, COLUMNS)


if __name__ == "__main__":
    sys.exit(main())
