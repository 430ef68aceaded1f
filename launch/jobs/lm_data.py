"""The LM jobs' data (``launch/train_lm.py`` and ``launch/train_lm_hf.py`` share it, cache
included): the train / held-out split of the files, a BPE tokenizer and token streams built once
and cached, fixed-length blocks with an error that names the short text, and each DP rank's
share of the held-out blocks.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from .agreement import agreed
from .code_search import is_held_out
from .text_data import (
    atomic_write,
    check_texts,
    encode_stream,
    files_digest,
    lm_blocks,
    read_texts,
    stdlib_split,
    strided_subset,
    text_files,
    train_bpe_tokenizer,
)

__all__ = ["split_files", "load_data", "make_blocks", "load_blocks", "eval_batches"]


def split_files(args):
    """``(train files, held-out files)`` of ``args.train_data`` / ``eval_data`` /
    ``eval_fraction`` (the standard library without data arguments).

    Raises:
        SystemExit: a ``--train_data`` file is empty; ``--train_data`` files that a crc32 split
            cannot divide.
    """
    if args.train_data:
        files = text_files(args.train_data)
        if args.eval_data:
            return files, text_files(args.eval_data)
        # a named file that is empty is the cause, whatever the split would say
        for name in args.train_data:
            f = Path(name)
            if f.is_file() and not f.read_text(encoding="utf-8", errors="replace").strip():
                raise SystemExit(f"--train_data file {f} is empty")
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


def load_data(args):
    """Tokenizer and token streams of ``args`` (``train_data``, ``eval_data``, ``eval_fraction``,
    ``max_train_bytes``, ``vocab_size``, ``cache_dir``); global rank 0 builds and caches them,
    the others read the cache (keyed by the data's contents and the options). Collective. Inputs
    are checked on every rank first, and a failure of rank 0's build is reported by every rank
    (:func:`launch.jobs.agreement.agreed`).

    Returns:
        ``(tokenizer, train stream, eval stream, info, cache key)``.
    """
    train_files, eval_files = split_files(args)
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
    """:func:`launch.jobs.text_data.lm_blocks` with an error that says which text is too short."""
    if stream.numel() < seq_len + 1:
        raise SystemExit(f"{what} text ({files} file{'s' if files != 1 else ''}) holds "
                         f"{stream.numel()} tokens, fewer than one block of --seq_len + 1 = "
                         f"{seq_len + 1}; give more text or a smaller --seq_len")
    return lm_blocks(stream, seq_len, max_blocks)


def load_blocks(args, log: Callable[[str], None]):
    """:func:`load_data` cut into training blocks and ``args.eval_blocks`` held-out blocks of
    ``args.seq_len`` tokens (:func:`make_blocks`), with a log line of what was loaded.
    Collective.

    Returns:
        ``(tokenizer, train blocks, held-out blocks, info, cache key)``.
    """
    tok, train_stream, eval_stream, info, key = load_data(args)
    train_blocks = make_blocks(train_stream, args.seq_len, "training", info["train_files"])
    held_blocks = make_blocks(eval_stream, args.seq_len, "held-out", info["eval_files"],
                              args.eval_blocks)
    log(f"data: {info['train_files']} train files ({info['train_bytes'] / 1e6:.1f} MB, "
        f"{info['train_tokens']} tokens, {train_blocks['input_ids'].shape[0]} blocks), "
        f"{info['eval_files']} held-out files ({held_blocks['input_ids'].shape[0]} blocks); "
        f"BPE vocab {tok.get_vocab_size()}")
    return tok, train_blocks, held_blocks, info, key


def eval_batches(blocks: Dict[str, torch.Tensor], micro: int, dp: int, dp_rank: int):
    """This DP rank's share of the eval blocks, in micro-batches; the same count on every rank
    (the block count is trimmed to a multiple of ``dp``)."""
    n = blocks["input_ids"].shape[0] // dp * dp
    mine = {k: v[:n][dp_rank::dp] for k, v in blocks.items()}
    m = mine["input_ids"].shape[0]
    return [{k: v[i:i + micro] for k, v in mine.items()} for i in range(0, m, micro)]
