"""What a user copies from the top README is what CI ran: every ``python`` block of README.md is a
complete script, run here to its own asserts as ``python block.py`` runs it (``__main__``, the
repository root as the working directory), and the README shows one per loss family. Their
longer float64-checked twins are ``examples/*.py`` (``test_examples.py``).

A block that spawns its own ranks (``run_distributed``) runs as that command, a background job
(tests/conftest.py): in this process the session's pool would take its call, and the pool's
ranks cannot unpickle a rank function defined in the block's ``__main__``. The others run here,
through ``runpy`` (a fresh interpreter would only add torch's import)."""
import functools
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch

from tests.helpers.launch_helpers import REPO

README = REPO / "README.md"
# the loss families whose sections must each hold a runnable block
FAMILIES = ("cross-entropy", "global-loss-calibration", "log-probs-and-policy-losses",
            "preference-losses", "distillation", "contrastive-mnr-and-gradcache")


def _slug(heading):
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")


def readme_blocks():
    """``(section slug, block)`` of each python block, the slug that of the ``## `` heading above
    it."""
    text = README.read_text(encoding="utf-8")
    section, blocks = "top", []
    for m in re.finditer(r"^## ([^\n]+)$|^```python\n(.*?)^```", text, flags=re.S | re.M):
        if m.group(1) is not None:
            section = _slug(m.group(1))
        else:
            blocks.append((section, m.group(2)))
    return blocks


def _named_blocks():
    """``(name, block)``: the name is the section's slug and the block's number in it."""
    seen = {}
    for section, block in readme_blocks():
        seen[section] = seen.get(section, 0) + 1
        yield f"{section}-{seen[section]}", block


def _spawns(block):
    return "run_distributed" in block


def _run_script(folder, env, name, block):
    script = folder / f"readme_{name}.py"
    script.write_text(block, encoding="utf-8")
    env = dict(env, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=env)


def background_jobs(folder, env):
    """``python readme_<name>.py`` of each block that spawns ranks, started with the session."""
    return {name: functools.partial(_run_script, folder, env, name, block)
            for name, block in _named_blocks() if _spawns(block)}


def test_readme_has_a_block_per_loss_family():
    sections = {section for section, _ in readme_blocks()}
    assert set(FAMILIES) <= sections, f"no python block under {set(FAMILIES) - sections}"


def test_readme_first_python_block_is_on_the_first_screen():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert "```python" in lines[:40], "the first python block starts after line 40"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("block", [pytest.param(block, id=name) for name, block
                                   in _named_blocks() if not _spawns(block)])
def test_readme_block_runs(block, tmp_path, monkeypatch, capsys):
    """The block written to a file and run by ``runpy`` in this process, as ``__main__``."""
    script = tmp_path / "readme_block.py"
    script.write_text(block, encoding="utf-8")
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [str(script)])
    with torch.random.fork_rng():  # the blocks seed the global generator
        runpy.run_path(str(script), run_name="__main__")


@pytest.mark.distributed
@pytest.mark.timeout(1500)  # it waits for the background jobs queued before its own (nice 10)
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.background(name), id=name)
                                  for name, block in _named_blocks() if _spawns(block)])
def test_readme_block_that_spawns_ranks_runs(name, background):
    assert background.returncode == 0, background.stdout + background.stderr
