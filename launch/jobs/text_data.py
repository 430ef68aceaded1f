"""Language-modelling text that is present on every machine: the Python standard library's own
source files, plus a byte-level BPE tokenizer trained on them, and fixed-length LM blocks; and the
cache and batching helpers both jobs share.

Built-in data (no download): the ``.py`` files of ``sysconfig.get_paths()["stdlib"]`` outside
test suites, demos and vendored trees (:func:`launch.jobs.code_search.stdlib_files`, the same
subset the embedding job uses). Whole files are held out for evaluation with the same deterministic
``crc32(relative path)`` split (:func:`launch.jobs.code_search.is_held_out`). A training budget of
``max_bytes`` keeps a *strided* sorted subset (every k-th file), so the text covers the whole
library rather than its alphabetical start.

Users' own data: text files or directories of them (searched recursively for
:data:`TEXT_SUFFIXES`, sorted by relative path).

Blocks: each file's tokens are followed by ``<|endoftext|>``; the concatenated stream is cut into
blocks of ``seq_len + 1`` tokens; ``input_ids = block[:-1]`` and ``shift_labels = block[1:]``
(already shifted, Hugging Face's ``shift_labels``: the target of position t sits at t).

Shared by both jobs: :func:`files_digest` (cache keys), :func:`atomic_write` (cache files) and
:class:`StepBatches` (one rank's micro-batches of each optimizer step).

Only the standard library, torch and ``tokenizers`` (imported lazily) are used here.
"""
from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .code_search import is_held_out, stdlib_files, stdlib_root

__all__ = ["EOS", "TEXT_SUFFIXES", "text_files", "stdlib_split", "strided_subset",
           "read_texts", "check_texts", "files_digest", "atomic_write", "train_bpe_tokenizer",
           "encode_stream", "lm_blocks", "StepBatches"]

PathLike = Union[str, Path]
EOS = "<|endoftext|>"
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


def text_files(sources: Sequence[PathLike], suffixes: Sequence[str] = TEXT_SUFFIXES
               ) -> List[Path]:
    """Files named in ``sources``, directories searched recursively for ``suffixes`` (hidden
    and ``__pycache__`` entries skipped); each directory's files sorted by relative path.

    Raises:
        FileNotFoundError: a source does not exist.
        ValueError: no file found.
    """
    found: List[Path] = []
    for src in sources:
        root = Path(src)
        if not root.exists():
            raise FileNotFoundError(f"no such file or directory: {root}")
        if root.is_file():
            found.append(root)
            continue
        here = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
            here.extend(Path(dirpath, f) for f in filenames
                        if f.endswith(tuple(suffixes)) and not f.startswith("."))
        found.extend(sorted(here, key=lambda p: p.relative_to(root).as_posix()))
    if not found:
        raise ValueError(f"no text files ({', '.join(suffixes)}) in {list(map(str, sources))}")
    return found


def stdlib_split(eval_fraction: float = 0.05) -> Tuple[List[Path], List[Path]]:
    """``(train_files, eval_files)`` of the built-in standard-library corpus; whole files held
    out by ``crc32`` of their path relative to the stdlib root (deterministic everywhere)."""
    root = stdlib_root()
    train, held = [], []
    for f in stdlib_files():
        (held if is_held_out(f.relative_to(root).as_posix(), eval_fraction) else train).append(f)
    return train, held


def strided_subset(files: Sequence[Path], max_bytes: Optional[int]) -> List[Path]:
    """Every k-th file (k the smallest integer that brings the total size under ``max_bytes``;
    all files when ``max_bytes`` is None or already satisfied). Keeps the sorted order."""
    files = list(files)
    if max_bytes is None:
        return files
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be > 0 or None, got {max_bytes}")
    sizes = [f.stat().st_size for f in files]
    k = max(1, math.ceil(sum(sizes) / max_bytes))
    while k < len(files) and sum(sizes[::k]) > max_bytes:
        k += 1
    return files[::k]


def read_texts(files: Sequence[Path]) -> List[str]:
    """UTF-8 contents (undecodable bytes replaced, so any text file can be read)."""
    return [Path(f).read_text(encoding="utf-8", errors="replace") for f in files]


def check_texts(files: Sequence[Path], texts: Sequence[str], what: str,
                named: Sequence[PathLike] = ()) -> None:
    """Refuse text that cannot be trained or evaluated on, naming the file.

    Args:
        files, texts: the files and their contents (:func:`read_texts`).
        what: how the message names the set (``"--train_data"``, ``"held-out"``).
        named: the sources the user named; a *file* among them that is empty (or whitespace
            only) is an error. Empty files found inside a named directory (an empty
            ``__init__.py``) are fine as long as some file has text.

    Raises:
        SystemExit: a named file is empty, or every file is.
    """
    given = {Path(n).resolve() for n in named if Path(n).is_file()}
    empty = [f for f, t in zip(files, texts) if not t.strip()]
    for f in empty:
        if Path(f).resolve() in given:
            raise SystemExit(f"{what} file {f} is empty")
    if files and len(empty) == len(files):
        shown = ", ".join(str(f) for f in empty[:3]) + (", ..." if len(empty) > 3 else "")
        raise SystemExit(f"{what}: all {len(files)} files are empty ({shown})")


def files_digest(texts: Sequence[str], *extra: object) -> str:
    """Short sha256 of the texts' contents and ``extra`` settings: a cache key that changes when
    the data (e.g. another Python version's stdlib) or an option changes."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8", errors="replace") + b"\0")
    h.update(repr(extra).encode())
    return h.hexdigest()[:16]


def atomic_write(path: PathLike, data: Union[str, bytes]) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file and ``os.replace``, so
    a reader (another rank, another job sharing the cache) never sees a half-written file. The
    parent directory is created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    os.replace(tmp, path)


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int, *,
                        cache_dir: Optional[PathLike] = None):
    """A byte-level BPE tokenizer (GPT-2 style: any byte sequence is encodable, no unknown
    token) trained with ``tokenizers`` on ``texts``, with :data:`EOS` as its only special token
    (id 0). Cached as ``<cache_dir>/bpe-<vocab_size>-<digest>.json`` when ``cache_dir`` is given.

    Not collective: in a multi-process job let one rank build it, then the others load the
    cached file (same arguments give the same path).

    Raises:
        ValueError: ``vocab_size`` < 257 (256 byte symbols + EOS) or ``texts`` empty.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 257:
        raise ValueError(f"vocab_size must be an int >= 257, got {vocab_size!r}")
    if not texts:
        raise ValueError("texts must not be empty")
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"bpe-{vocab_size}-{files_digest(texts, vocab_size)}.json"
        if path.exists():
            return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if path is not None:
        atomic_write(path, tok.to_str())
    return tok


def encode_stream(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """int64 ``[n_tokens]``: each text's token ids followed by the :data:`EOS` id."""
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        raise ValueError(f"tokenizer has no {EOS!r} token")
    ids: List[int] = []
    for enc in tokenizer.encode_batch(list(texts)):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def lm_blocks(stream: torch.Tensor, seq_len: int, max_blocks: Optional[int] = None
              ) -> Dict[str, torch.Tensor]:
    """Cut a token stream into ``[N, seq_len]`` ``input_ids`` and their ``shift_labels`` (the next
    token of every position, so no position is lost to the shift).

    Blocks of ``seq_len + 1`` tokens do not overlap (the tail is dropped); with ``max_blocks``,
    that many blocks evenly spaced over the stream are kept (a representative eval subset).

    Raises:
        ValueError: ``seq_len`` < 1 or the stream is shorter than one block.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    n = stream.numel() // (seq_len + 1)
    if n == 0:
        raise ValueError(f"{stream.numel()} tokens cannot fill one block of {seq_len + 1}")
    blocks = stream[: n * (seq_len + 1)].view(n, seq_len + 1)
    if max_blocks is not None and max_blocks < n:
        blocks = blocks[torch.linspace(0, n - 1, max_blocks).round().long()]
    return {"input_ids": blocks[:, :-1].contiguous(), "shift_labels": blocks[:, 1:].contiguous()}


class StepBatches:
    """Endless stream of one rank's optimizer steps: ``gas`` micro-batches of ``micro`` rows of
    ``data`` (a dict of tensors with the same first dimension, e.g. :func:`lm_blocks`' output).

    Every epoch draws a permutation seeded by ``(seed, epoch)`` (identical on all ranks) and cuts
    it into global batches of ``gas x dp x micro`` rows (the tail is dropped, so every
    micro-batch has ``micro`` rows); micro-batch ``i`` of DP rank ``d`` is piece ``i * dp + d``.
    TP ranks of one DP rank get the same batches.

    Raises:
        ValueError: fewer rows than one global batch.
    """

    def __init__(self, data: Dict[str, torch.Tensor], *, micro: int, gas: int, dp_size: int,
                 dp_rank: int, seed: int = 0) -> None:
        self.data, self.micro, self.gas = data, micro, gas
        self.dp, self.rank, self.seed = dp_size, dp_rank, seed
        self.per_step = micro * gas * dp_size
        self.rows = next(iter(data.values())).shape[0]
        if self.rows < self.per_step:
            raise ValueError(f"{self.rows} rows cannot fill one global batch of {self.per_step} "
                             f"(micro {micro} x gas {gas} x dp {dp_size})")
        self.steps_per_epoch = self.rows // self.per_step

    def __iter__(self) -> Iterator[List[Dict[str, torch.Tensor]]]:
        return self.iter_from(0)

    def iter_from(self, start_step: int) -> Iterator[List[Dict[str, torch.Tensor]]]:
        """The stream from optimizer step ``start_step`` on (0-based: ``iter_from(k)`` yields
        what ``iter(self)`` yields after ``k`` steps), without drawing the skipped batches: a
        resumed job continues exactly where the checkpoint left off."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        epoch, first = divmod(start_step, self.steps_per_epoch)
        while True:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.rows, generator=g)
            for s in range(first, self.steps_per_epoch):
                pieces = order[s * self.per_step:(s + 1) * self.per_step].split(self.micro)
                yield [{k: v[pieces[i * self.dp + self.rank]] for k, v in self.data.items()}
                       for i in range(self.gas)]
            epoch, first = epoch + 1, 0
