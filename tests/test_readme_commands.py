"""The shell blocks of the READMEs and the docs pages, checked without launching: every ``bash
launch/<job>.sh ARGS`` line is parsed by its job's own ``parse_args`` (run from the repository
root, as the READMEs say),
and a block run top to bottom never starts a second run in a folder an earlier line of the
block created unless the line says ``--overwrite`` / ``--resume`` / ``--eval_only`` (the jobs
refuse it otherwise). The jobs themselves are run end to end by ``tests/launch``; a shell block
that fits on 2 cores in seconds has no job line (``tools/...``, ``printf``) and is not run here.
"""
import importlib
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
READMES = ("README.md", "launch/README.md", "megaloss/configs/README.md", "tools/README.md",
           "CONTRIBUTING.md",
           *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")))
# what the top README promises a fresh machine; .ci/run is the second line
FRESH_MACHINE = ("bash tools/install.sh && bash launch/train_lm.sh",
                 "bash tools/install.sh && python3 -m pytest -q")
MULTI_NODE = ("NODE_RANK", "HOSTFILE", "srun")  # one run spread over machines: same folder


def bash_blocks(path: Path):
    text = path.read_text(encoding="utf-8")
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    return [block.replace("\\\n", " ") for block in blocks]  # continued lines joined


def job_commands(line: str):
    """``(job name, argv)`` of each ``bash launch/<job>.sh ...`` in one shell line."""
    line = line.split(" #", 1)[0].strip()
    if not line or line.startswith("#"):
        return
    for part in line.split("&&"):
        words = shlex.split(part)
        for i, word in enumerate(words[:-1]):
            m = re.fullmatch(r"launch/(\w+)\.sh", words[i + 1])
            if word == "bash" and m:
                yield m.group(1), words[i + 2:]


def made_by_an_earlier_line(error: str, created: set) -> bool:
    """Whether ``error`` is a missing path inside a run folder an earlier line created."""
    m = re.search(r"(\S+): no such file or directory", error)
    return bool(m) and any(Path(m.group(1)).is_relative_to(folder) for folder in created)


def cases():
    for name in READMES:
        path = REPO / name
        if path.exists():
            for b, block in enumerate(bash_blocks(path)):
                yield pytest.param(name, block, id=f"{name}-block{b}")


def test_readmes_have_job_lines():
    lines = [cmd for _, block in cases_values() for line in block.splitlines()
             for cmd in job_commands(line)]
    assert {job for job, _ in lines} >= {"train_lm", "train_embed", "train_lm_hf",
                                          "train_embed_hf"}


def test_readme_gives_the_fresh_machine_commands():
    """The two commands stay on the README's first screen, each on its own line of a shell block,
    and CI runs the second as written: the install, then exactly ``python3 -m pytest -q``."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    first_screen = "\n".join(text.splitlines()[:40])
    lines = [line.split(" #", 1)[0].strip() for block in bash_blocks(REPO / "README.md")
             for line in block.splitlines()]
    for command in FRESH_MACHINE:
        assert command in lines, f"README.md has no shell line `{command}`"
        assert command in first_screen, f"`{command}` is not within README.md's first 40 lines"
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "bash tools/install.sh" in ci
    assert ci[-1].rsplit(";", 1)[-1].strip() == "python3 -m pytest -q", ci[-1]


def cases_values():
    return [p.values for p in cases()]


@pytest.mark.parametrize("readme,block", list(cases()))
def test_shell_block_runs_top_to_bottom(readme, block, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    created = set()
    for line in block.splitlines():
        for job, argv in job_commands(line):
            module = importlib.import_module(f"launch.{job}")
            try:
                args = module.parse_args(argv)
            except SystemExit as e:  # argparse's error: its message is on stderr
                err = capsys.readouterr().err.strip()
                if not made_by_an_earlier_line(err, created):
                    pytest.fail(f"{readme}: `{line.strip()}` is refused by {job}.parse_args "
                                f"(status {e.code}): {err}")
                continue  # a path an earlier line's run writes (its teacher checkpoint, ...)
            out = Path(args.output_dir)
            if any(word in line for word in MULTI_NODE):
                continue
            continues = (args.overwrite or getattr(args, "resume", None) is not None
                         or getattr(args, "eval_only", False))
            assert out not in created or continues, (
                f"{readme}: `{line.strip()}` writes into {out}, which an earlier line of the "
                "same block created: the job refuses it (add --overwrite, --resume or another "
                "--output_dir)")
            created.add(out)
