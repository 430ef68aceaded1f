"""The embedding jobs' data (``launch/train_embed.py`` and ``launch/train_embed_hf.py`` share
it, cache included): (docstring -> function source) pairs extracted once per node and cached, a
BPE tokenizer trained on them, and the pairs encoded as padded id / mask tensors. Local rank 0 of
each node builds, every rank agrees on failure (:func:`launch.jobs.agreement.agreed`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch

from .agreement import agreed
from .code_search import CodePair, load_code_search, source_files
from .text_data import EOS, atomic_write, files_digest, read_texts, train_bpe_tokenizer

__all__ = ["load_pairs_cached", "tokenizer_cached", "encode_pairs"]


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
    """Byte-level BPE trained on the training texts
    (:func:`launch.jobs.text_data.train_bpe_tokenizer`), built once per node by local rank 0 and
    read from the cache by the others. Collective."""
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
