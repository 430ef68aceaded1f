"""Code-search pairs (docstring -> function source) from real Python files, CodeSearchNet style.

The built-in data set needs no download: it is extracted with :mod:`ast` from the Python standard
library that ships with the interpreter (``sysconfig.get_paths()["stdlib"]``), so it is present on
every machine. For each function or method with a docstring:

* ``query`` = the docstring's first paragraph, whitespace collapsed (what a user would type);
* ``document`` = the function's source with the docstring lines removed (so the answer does not
  contain the question), dedented.

As in CodeSearchNet, functions whose remaining body is trivial (``pass``, ``...``,
``raise NotImplementedError``), ``test*`` functions and docstrings of fewer than
``min_query_words`` words are skipped.

Split: whole FILES are held out for evaluation (``crc32(relative path) % 1000 <
eval_fraction * 1000``), so no function, and no sibling method of an evaluated function, is seen
in training; the split is deterministic and independent of file order. Within each split repeated
queries or documents keep their first occurrence (in sorted path order) because a retrieval query
with two correct answers is ill-posed, and evaluation pairs whose query or document also occurs in
training are dropped (copied code across files would otherwise leak).

Users' own data: ``.py`` files, directories of them (searched recursively, sorted), or JSON Lines
files with one ``{"query": ..., "document": ...}`` object per line.

Only the standard library is used here (``ast``, ``json``, ``zlib``); :mod:`launch.jobs.text_data`
builds on it.
"""
from __future__ import annotations

import ast
import functools
import inspect
import json
import os
import re
import sysconfig
import textwrap
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple, Union

__all__ = [
    "CodePair",
    "extract_pairs",
    "stdlib_root",
    "stdlib_files",
    "python_files",
    "source_files",
    "is_held_out",
    "read_jsonl",
    "load_code_search",
]

PathLike = Union[str, Path]

# Parts of the standard library that are not library code (test suites, demos, vendored or
# generated trees). Excluded by path component so the subset is the same on every install.
EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
    "ensurepip", "__pycache__", "__phello__", "encodings",
})

_WS = re.compile(r"\s+")
_DOC_START = re.compile(r"""\s*[rRuU]?('|")""")


@dataclass(frozen=True)
class CodePair:
    """One retrieval example.

    Attributes:
        query: natural-language description (first docstring paragraph).
        document: code that answers it (function source without its docstring).
        origin: where it came from, ``"relative/path.py:Qualified.name"`` or ``"file.jsonl:line"``.
    """

    query: str
    document: str
    origin: str


# extraction -------------------------------------------------------------------------------------
def _first_paragraph(docstring: str) -> str:
    text = inspect.cleandoc(docstring).strip()
    para = re.split(r"\n\s*\n", text, maxsplit=1)[0]
    return _WS.sub(" ", para).strip()


def _is_trivial(body: Sequence[ast.stmt]) -> bool:
    """Body that says nothing about the docstring (abstract methods, stubs)."""
    for stmt in body:
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # ``...`` or a stray string
        if isinstance(stmt, ast.Raise) and stmt.exc is not None:
            exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
            if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
                continue
        return False
    return True


def _strip_docstring(node: ast.AST, lines: List[str]) -> str:
    """Source of ``node`` (a def with a docstring and a non-empty rest) without the docstring.

    Line-based, so comments and formatting survive; falls back to ``ast.unparse`` when the
    docstring shares a line with other code (``def f(): "doc"; return 1``).
    """
    doc, rest = node.body[0], node.body[1]
    # The docstring must start its own line (not share it with the signature or other code).
    own_line = doc.lineno > node.lineno and _DOC_START.match(lines[doc.lineno - 1]) is not None
    if own_line and rest.lineno > doc.end_lineno:
        before = lines[node.lineno - 1: doc.lineno - 1]
        after = lines[doc.end_lineno: node.end_lineno]
        # Drop blank lines that only separated the docstring from the code.
        while after and not after[0].strip():
            after = after[1:]
        return textwrap.dedent("\n".join(before + after)).rstrip()
    stripped = ast.parse(ast.unparse(node)).body[0]
    stripped.body = stripped.body[1:]
    return ast.unparse(stripped)


def extract_pairs(source: str, origin: str = "<string>", *, min_query_words: int = 3,
                  max_document_lines: int = 200) -> List[CodePair]:
    """All (docstring -> code) pairs of the functions and methods in one Python source text.

    Args:
        source: Python source code.
        origin: label stored in each pair's ``origin`` (usually the relative path).
        min_query_words: skip docstrings whose first paragraph has fewer words.
        max_document_lines: skip functions longer than this (generated tables, huge parsers).

    Returns:
        Pairs in source order (nested functions included, qualified names in ``origin``).
        A file that does not parse (another Python version's syntax) yields ``[]``.

    Raises:
        ValueError: ``min_query_words`` < 1 or ``max_document_lines`` < 2.
    """
    if min_query_words < 1:
        raise ValueError(f"min_query_words must be >= 1, got {min_query_words}")
    if max_document_lines < 2:
        raise ValueError(f"max_document_lines must be >= 2, got {max_document_lines}")
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    pairs: List[CodePair] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                pair = _pair_of(child, name)
                if pair is not None:
                    pairs.append(pair)
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    def _pair_of(fn: ast.AST, name: str) -> Optional[CodePair]:
        doc = ast.get_docstring(fn, clean=False)
        if not doc or fn.name.startswith("test") or len(fn.body) < 2 or _is_trivial(fn.body[1:]):
            return None
        if fn.end_lineno - fn.lineno + 1 > max_document_lines:
            return None
        query = _first_paragraph(doc)
        if len(query.split()) < min_query_words:
            return None
        document = _strip_docstring(fn, lines)
        if not document.strip():
            return None
        return CodePair(query=query, document=document, origin=f"{origin}:{name}")

    visit(tree, "")
    return pairs


# file selection ---------------------------------------------------------------------------------
def stdlib_root() -> Path:
    """Directory of this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def python_files(root: PathLike, *, excluded_dirs: Iterable[str] = ("__pycache__",)) -> List[Path]:
    """``.py`` files under ``root`` (or ``[root]`` if it is a file), sorted by relative POSIX path.

    Raises:
        FileNotFoundError: ``root`` does not exist.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"no such file or directory: {root}")
    if root.is_file():
        return [root]
    excluded = frozenset(excluded_dirs)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so excluded trees (site-packages is huge) are never walked.
        dirnames[:] = [d for d in dirnames if d not in excluded and not d.startswith(".")]
        found.extend(Path(dirpath, f) for f in filenames
                     if f.endswith(".py") and not f.startswith("test_"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def stdlib_files() -> List[Path]:
    """The fixed standard-library subset: every ``.py`` file outside test suites, demos and
    vendored trees (:data:`EXCLUDED_DIRS`), sorted."""
    return python_files(stdlib_root(), excluded_dirs=EXCLUDED_DIRS)


def source_files(sources: Optional[Sequence[PathLike]]) -> List[Path]:
    """Every file :func:`load_code_search` reads for ``sources`` (``None``: the standard library),
    e.g. to key a cache of its pairs by their contents.

    Raises:
        FileNotFoundError: a source does not exist.
    """
    if sources is None:
        return stdlib_files()
    return [f for src in map(Path, sources)
            for f in ([src] if _is_jsonl(src) else python_files(src))]


def is_held_out(key: str, eval_fraction: float) -> bool:
    """Deterministic split: ``True`` for the ~``eval_fraction`` of keys held out for evaluation.

    ``crc32`` (not Python's salted ``hash``) so every process and machine agrees.

    Raises:
        ValueError: ``eval_fraction`` outside ``[0, 1)``.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    return zlib.crc32(key.encode("utf-8")) % 1000 < round(eval_fraction * 1000)


def read_jsonl(path: PathLike) -> List[CodePair]:
    """Pairs from a JSON Lines file of ``{"query": str, "document": str}`` objects (other keys are
    ignored, blank lines skipped).

    Raises:
        ValueError: a line is not a JSON object with non-empty string ``query`` and ``document``
            (the message names the file and line).
    """
    path = Path(path)
    pairs = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{i}: expected a JSON object, got {type(obj).__name__}")
            for key in ("query", "document"):
                if not isinstance(obj.get(key), str) or not obj[key].strip():
                    raise ValueError(f"{path}:{i}: '{key}' must be a non-empty string")
            pairs.append(CodePair(obj["query"], obj["document"], f"{path.name}:{i}"))
    return pairs


# loading and splitting --------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _pairs_of_file(path: str, origin: str, min_query_words: int) -> Tuple[CodePair, ...]:
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ()
    return tuple(extract_pairs(source, origin, min_query_words=min_query_words))


def _is_jsonl(path: Path) -> bool:
    return path.is_file() and path.suffix in (".jsonl", ".json", ".ndjson")


def _collect(sources: Sequence[PathLike], split: str, eval_fraction: float,
             min_query_words: int, excluded_dirs: Iterable[str]) -> List[CodePair]:
    """Pairs of ``sources`` in ``split`` ("train", "eval" or "all")."""
    pairs: List[CodePair] = []
    for src in sources:
        src = Path(src)
        if _is_jsonl(src):
            for p in read_jsonl(src):
                # No file structure to split by: hold out by the query text.
                if split == "all" or is_held_out(p.query, eval_fraction) == (split == "eval"):
                    pairs.append(p)
            continue
        root = src if src.is_dir() else src.parent
        for f in python_files(src, excluded_dirs=excluded_dirs):
            rel = f.relative_to(root).as_posix()
            if split != "all" and is_held_out(rel, eval_fraction) != (split == "eval"):
                continue
            pairs.extend(_pairs_of_file(str(f), rel, min_query_words))
    return pairs


def _dedupe(pairs: Iterable[CodePair], seen_queries: set, seen_documents: set) -> List[CodePair]:
    out = []
    for p in pairs:
        q, d = _WS.sub(" ", p.query).strip().lower(), p.document.strip()
        if q in seen_queries or d in seen_documents:
            continue
        seen_queries.add(q)
        seen_documents.add(d)
        out.append(p)
    return out


def load_code_search(train_sources: Optional[Sequence[PathLike]] = None,
                     eval_sources: Optional[Sequence[PathLike]] = None, *,
                     eval_fraction: float = 0.1, min_query_words: int = 3,
                     max_train: Optional[int] = None,
                     max_eval: Optional[int] = None) -> Tuple[List[CodePair], List[CodePair]]:
    """Training and held-out evaluation pairs.

    * no sources: the standard library (:func:`stdlib_files`), whole files held out;
    * only ``train_sources``: they are split the same way (``.py`` by file, JSONL by query);
    * both: each is used whole.

    Both lists are deduplicated, and evaluation pairs whose query or document occurs in the
    training pairs are removed, so nothing evaluated was trained on.

    Args:
        train_sources / eval_sources: ``.py`` files, directories, or ``.jsonl`` files.
        eval_fraction: share of files (or JSONL queries) held out when splitting, in ``[0, 1)``.
        min_query_words: see :func:`extract_pairs`.
        max_train / max_eval: keep only the first N pairs (deterministic order) of each split;
            the training cut is applied after the leak check so it never changes the eval set.

    Returns:
        ``(train_pairs, eval_pairs)``.

    Raises:
        ValueError: ``eval_fraction`` outside ``[0, 1)``, or a JSONL line is malformed.
        FileNotFoundError: a source does not exist.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    for name, n in (("max_train", max_train), ("max_eval", max_eval)):
        if n is not None and n < 1:
            raise ValueError(f"{name} must be >= 1 or None, got {n}")
    if train_sources is None and eval_sources is not None:
        raise ValueError("eval_sources needs train_sources (the built-in data has its own split)")
    if train_sources is None:
        sources: Sequence[PathLike] = [stdlib_root()]
        excluded: Iterable[str] = EXCLUDED_DIRS
    else:
        sources, excluded = list(train_sources), ("__pycache__",)
    if eval_sources is None:
        train = _collect(sources, "train", eval_fraction, min_query_words, excluded)
        held = _collect(sources, "eval", eval_fraction, min_query_words, excluded)
    else:
        train = _collect(sources, "all", eval_fraction, min_query_words, excluded)
        held = _collect(list(eval_sources), "all", eval_fraction, min_query_words, ("__pycache__",))
    train_q, train_d = set(), set()
    train = _dedupe(train, train_q, train_d)
    held = _dedupe(held, train_q, train_d)  # seeded with training texts: drops leaks too
    if max_train is not None:
        train = train[:max_train]
    if max_eval is not None:
        held = held[:max_eval]
    return train, held
