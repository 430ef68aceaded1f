"""Code-search pair extraction (``launch/jobs/code_search.py``): what a pair contains, that the
split is deterministic and leak-free, and that users' files and JSONL load. Single process, no
torch."""
import ast
import json
import textwrap
from pathlib import Path

import pytest

from launch.jobs import code_search as cs

SOURCE = textwrap.dedent('''
    import os

    def add(a, b):
        """Add two numbers and return the sum.

        Second paragraph that must not reach the query.
        """
        # keep this comment
        return a + b

    def short(x):
        """Too short."""
        return x

    def no_doc(x):
        return x

    def abstract(self):
        """Subclasses must implement this method."""
        raise NotImplementedError

    def test_something():
        """Tests are not search targets at all."""
        assert 1 + 1 == 2

    def oneliner(x): "Return x doubled for the caller."; return 2 * x

    class Box:
        def get(self, key, default=None):
            \'\'\'Look up a key in the box, falling back to a default.\'\'\'
            value = self.data.get(key)
            return default if value is None else value

        def outer(self):
            """Build the inner function used as a callback."""
            def inner(y):
                """Multiply by three for the callback."""
                return 3 * y
            return inner
''')


def test_extract_pairs_contents():
    pairs = cs.extract_pairs(SOURCE, "mod.py")
    by_name = {p.origin.split(":", 1)[1]: p for p in pairs}
    # short docstrings, missing docstrings, stubs and tests are skipped
    assert sorted(by_name) == ["Box.get", "Box.outer", "Box.outer.inner", "add", "oneliner"]
    add = by_name["add"]
    assert add.query == "Add two numbers and return the sum."
    assert add.document == "def add(a, b):\n    # keep this comment\n    return a + b"
    assert add.origin == "mod.py:add"
    # methods are dedented; the docstring is gone, the code kept verbatim
    assert by_name["Box.get"].document.startswith("def get(self, key, default=None):\n    value")
    assert by_name["Box.outer.inner"].document == "def inner(y):\n    return 3 * y"
    # a docstring sharing its line with code falls back to ast.unparse
    assert by_name["oneliner"].document == "def oneliner(x):\n    return 2 * x"
    for p in pairs:  # the function's own docstring is gone (a nested def keeps its own)
        assert p.query not in p.document
        assert ast.get_docstring(ast.parse(p.document).body[0]) is None
    assert '"""Multiply by three' in by_name["Box.outer"].document


def test_extract_pairs_options_and_bad_source():
    assert cs.extract_pairs("def broken(:\n  pass") == []
    names = [p.origin for p in cs.extract_pairs(SOURCE, "m", min_query_words=1)]
    assert "m:short" in names
    assert "m:add" not in [p.origin for p in cs.extract_pairs(SOURCE, "m", max_document_lines=4)]
    with pytest.raises(ValueError, match="min_query_words"):
        cs.extract_pairs(SOURCE, min_query_words=0)
    with pytest.raises(ValueError, match="max_document_lines"):
        cs.extract_pairs(SOURCE, max_document_lines=1)


def test_real_stdlib_file():
    path = cs.stdlib_root() / "json" / "__init__.py"
    pairs = cs.extract_pairs(path.read_text(encoding="utf-8"), "json/__init__.py")
    names = {p.origin.split(":")[1] for p in pairs}
    assert {"dump", "dumps", "load", "loads"} <= names
    for p in pairs:
        assert p.document.startswith("def ")
        assert p.query not in p.document
        compile(p.document, p.origin, "exec")  # still valid Python without its docstring


def test_stdlib_file_split_is_fixed_and_disjoint():
    files = cs.stdlib_files()
    assert files == cs.stdlib_files()  # deterministic order
    rel = [f.relative_to(cs.stdlib_root()).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 100
    assert not any(part in cs.EXCLUDED_DIRS for r in rel for part in r.split("/")[:-1])
    held = {r for r in rel if cs.is_held_out(r, 0.1)}
    train = set(rel) - held
    assert 0.03 * len(rel) < len(held) < 0.2 * len(rel) and train
    assert cs.is_held_out("json/__init__.py", 0.1) == cs.is_held_out("json/__init__.py", 0.1)
    with pytest.raises(ValueError, match="eval_fraction"):
        cs.is_held_out("x", 1.0)


def _write_tree(root: Path, n_files: int, order):
    for i in order:
        body = "\n".join(
            f'def f{i}_{j}(x):\n    """Function {j} of module {i} computes something."""\n'
            f"    return x + {i * 100 + j}\n" for j in range(3))
        # an identical function in every file: must never appear in both splits
        body += ('\ndef shared(x):\n    """The same helper copied into every module."""\n'
                 "    return -x\n")
        (root / f"mod_{i:02d}.py").write_text(body, encoding="utf-8")


def test_user_dir_split_deterministic_and_leak_free(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    _write_tree(a, 30, range(30))
    _write_tree(b, 30, reversed(range(30)))  # creation order must not matter
    train, held = cs.load_code_search([a], eval_fraction=0.3)
    train_b, held_b = cs.load_code_search([b], eval_fraction=0.3)
    assert [(p.query, p.document, p.origin) for p in train] == \
           [(p.query, p.document, p.origin) for p in train_b]
    assert [p.origin for p in held] == [p.origin for p in held_b]
    assert train and held
    train_files = {p.origin.split(":")[0] for p in train}
    held_files = {p.origin.split(":")[0] for p in held}
    assert not train_files & held_files  # whole files held out
    assert {f for f in held_files if cs.is_held_out(f, 0.3)} == held_files
    # the copied helper is deduplicated and kept only on the training side
    assert sum(p.origin.endswith(":shared") for p in train) == 1
    assert not any(p.origin.endswith(":shared") for p in held)
    assert not {p.query for p in train} & {p.query for p in held}
    assert not {p.document for p in train} & {p.document for p in held}
    # caps keep the first pairs, and the training cap does not change the held-out set
    t2, h2 = cs.load_code_search([a], eval_fraction=0.3, max_train=5, max_eval=2)
    assert t2 == train[:5] and h2 == held[:2]


def test_jsonl_sources(tmp_path):
    rows = [{"query": f"query number {i}", "document": f"def f{i}(): return {i}", "x": 1}
            for i in range(50)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert [p.query for p in cs.read_jsonl(path)] == [r["query"] for r in rows]
    train, held = cs.load_code_search([path], eval_fraction=0.2)
    assert len(train) + len(held) == 50 and held and train
    assert {p.query for p in held} == {r["query"] for r in rows if cs.is_held_out(r["query"], 0.2)}
    # explicit eval sources are used whole; pairs also in training are dropped from eval
    ev = tmp_path / "eval.jsonl"
    ev.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"query": "new", "document": "x"}),
                  encoding="utf-8")
    train, held = cs.load_code_search([path], [ev])
    assert len(train) == 50 and [p.query for p in held] == ["new"]


@pytest.mark.parametrize("line, match", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"query": "q"}', "'document' must be a non-empty string"),
    ('{"query": "", "document": "d"}', "'query' must be a non-empty string"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"query": "q", "document": "d"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=match) as err:
        cs.read_jsonl(path)
    assert "bad.jsonl:2" in str(err.value)


def test_source_files(tmp_path):
    assert cs.source_files(None) == cs.stdlib_files()
    (tmp_path / "pkg").mkdir()
    for name in ("pkg/b.py", "pkg/a.py", "pkg/notes.txt", "pairs.jsonl"):
        (tmp_path / name).write_text("", encoding="utf-8")
    assert cs.source_files([tmp_path / "pkg", tmp_path / "pairs.jsonl"]) == [
        tmp_path / "pkg" / "a.py", tmp_path / "pkg" / "b.py", tmp_path / "pairs.jsonl"]
    with pytest.raises(FileNotFoundError):
        cs.source_files([tmp_path / "missing"])


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        cs.load_code_search([tmp_path / "missing"])
    with pytest.raises(ValueError, match="eval_fraction"):
        cs.load_code_search([tmp_path], eval_fraction=-0.1)
    with pytest.raises(ValueError, match="eval_sources needs train_sources"):
        cs.load_code_search(None, [tmp_path])
    with pytest.raises(ValueError, match="max_train"):
        cs.load_code_search([tmp_path], max_train=0)
