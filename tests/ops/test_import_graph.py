"""The package's modules import each other without a cycle, counting imports inside functions
(the lazy ``from .triton_epilogue import ...``) too: read from the source with ``ast``."""
import ast
import pathlib

import pytest

import megaloss

ROOT = pathlib.Path(megaloss.__file__).resolve().parent


def _modules():
    out = {}
    for path in ROOT.rglob("*.py"):
        if path.name != "__init__.py":  # packages re-export; the modules carry the imports
            rel = path.relative_to(ROOT.parent).with_suffix("")
            out[".".join(rel.parts)] = path
    return out


def import_graph():
    """``{module: {megaloss modules it imports anywhere in its source}}``."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1]
                                    + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            targets.update(n for n in names if n in modules and n != name)
        graph[name] = targets
    return graph


def find_cycle(graph):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


@pytest.fixture(scope="module")
def graph():
    """The package's import graph, parsed once for the tests of this module."""
    return import_graph()


def test_the_graph_reader_sees_the_known_edges(graph):
    assert "megaloss.ops.triton_epilogue" in graph["megaloss.ops.cross_entropy_chunk"]  # lazy
    assert "megaloss.ops.chunk_stats" in graph["megaloss.ops.triton_epilogue"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_chunk_epilogues_share_a_leaf_and_do_not_import_each_other(graph):
    assert "megaloss.ops.cross_entropy_chunk" not in graph["megaloss.ops.triton_epilogue"]
    options = {"megaloss.ops.options", "megaloss.ops.cross_entropy_options"}
    assert graph["megaloss.ops.chunk_stats"] <= options
    assert graph["megaloss.ops.cross_entropy_options"] <= options


def test_options_import_no_loss_or_kernel(graph):
    """The options base and the kernels' options are leaves under the kernels; each loss's
    options module imports the base, not the other way round."""
    assert graph["megaloss.ops.options"] == set()
    assert graph["megaloss.ops.cross_entropy_options"] == {"megaloss.ops.options"}
    for kernel in ("log_probs", "distillation"):  # the reductions / epilogues are the CE's
        assert graph[f"megaloss.ops.{kernel}_options"] == {
            "megaloss.ops.options", "megaloss.ops.cross_entropy_options"}
    assert graph["megaloss.losses.policy_options"] == {"megaloss.ops.options"}


def test_no_import_cycle_in_the_package(graph):
    assert find_cycle(graph) is None
