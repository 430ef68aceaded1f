"""What a user copies is what CI ran: the docs' Examples page shows the scripts of ``examples/``
whole (``pymdownx.snippets`` includes the files), every ``python`` code block of
``launch/README.md`` is, verbatim, one of them, and every example runs to its own checks (each
asserts its result against a float64 single-device reference). The top README's short blocks
are run as they are by ``test_readme_snippets.py``."""
import os
import re
import runpy
import sys

import pytest
import torch

from tests.helpers.launch_helpers import REPO

READMES = [REPO / "launch" / "README.md"]  # their python blocks: whole example scripts
EXAMPLES = sorted((REPO / "examples").glob("*.py"))
EXAMPLES_PAGE = REPO / "docs" / "examples.md"
# one per loss family: the scripts the top README showed before it kept short snippets
FAMILY_EXAMPLES = {"cross_entropy.py", "vocab_parallel.py", "calibration.py", "mnr.py",
                   "post_training.py", "dpo.py", "distillation.py"}


def _python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_readme_python_blocks_are_example_scripts(readme):
    scripts = {p.read_text(encoding="utf-8"): p.name for p in EXAMPLES}
    blocks = _python_blocks(readme)
    assert blocks, f"{readme} has no python block"
    for block in blocks:
        assert block in scripts, (f"a python block of {readme.name} is not verbatim one of "
                                  f"examples/*.py:\n{block[:300]}")


def test_examples_page_includes_whole_example_scripts():
    """Each python block of docs/examples.md is one ``--8<-- "examples/<name>.py"`` line, which
    mkdocs (``pymdownx.snippets``, ``check_paths``) replaces by the file itself: the page shows
    exactly the scripts the tests below run, one per loss family at least."""
    shown = []
    for block in _python_blocks(EXAMPLES_PAGE):
        m = re.fullmatch(r'--8<-- "(examples/\w+\.py)"\n', block)
        assert m, f"a python block of docs/examples.md is not one included example:\n{block[:300]}"
        assert REPO / m.group(1) in EXAMPLES, f"{m.group(1)} is not one of examples/*.py"
        shown.append(m.group(1).split("/")[1])
    missing = FAMILY_EXAMPLES - set(shown)
    assert not missing, f"docs/examples.md does not show {sorted(missing)}"


# run in this process, each to its own asserts (docs/examples.md shows all but single_device.py)
SINGLE_PROCESS_EXAMPLES = ["single_device.py", "cross_entropy.py", "calibration.py", "mnr.py",
                           "post_training.py", "dpo.py", "distillation.py",
                           # the Hugging Face Trainer's set-up takes seconds: slow tier
                           pytest.param("hf_apply.py", marks=pytest.mark.slow)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", SINGLE_PROCESS_EXAMPLES)
def test_single_process_example_runs(name, capsys, monkeypatch):
    """Run as ``python examples/<name>`` would (``__main__``, the repository root as the working
    directory), but in this process: a fresh interpreter would only add the cost of importing
    torch again. Its own asserts raise here."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [str(REPO / "examples" / name)])
    with torch.random.fork_rng():   # the example seeds the global generator
        runpy.run_path(str(REPO / "examples" / name), run_name="__main__")
    out = capsys.readouterr().out
    assert "reference" in out or "whole batch" in out, out
    if name == "single_device.py":
        assert "linear_cross_entropy" in out and "mnr_loss" in out, out


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_vocab_parallel_example_matches_one_device():
    """``examples/vocab_parallel.py``'s rank function on 2 gloo ranks (the session's shared
    ranks: the module is importable as ``examples.vocab_parallel``, pytest.ini's pythonpath);
    ``python examples/vocab_parallel.py`` spawns its own."""
    from examples import vocab_parallel
    from megaloss.testing import run_distributed
    results = run_distributed(vocab_parallel.tp_rank, 2)
    assert len(results) == 2
    for loss, ref in results:
        assert loss == pytest.approx(ref, rel=1e-10)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_fsdp2_example_matches_one_process():
    """``examples/fsdp2.py``'s rank function on 2 gloo ranks (the session's shared ranks), as
    the vocab-parallel example: its own asserts compare every FSDP2 gradient with the float64
    single-process one."""
    from examples import fsdp2
    from megaloss.testing import run_distributed
    results = run_distributed(fsdp2.fsdp_rank, 2)
    assert len(results) == 2
    for loss, ref in results:
        assert loss == pytest.approx(ref, rel=1e-10)


DEEPSPEED_EXAMPLES = [REPO / "examples" / "deepspeed_calibration.py",
                      REPO / "examples" / "hf_causal_lm.py"]


def _worker_main(argv):
    """In the shared Trainer launch (``shared_launch_hf``, ``deepspeed --num_gpus 2``): each
    DeepSpeed example named in ``argv``, in turn, as ``python <script>`` would run it
    (``__main__``, its own ``sys.argv``), in the launch's ranks; an example's failing assert
    fails the launch. An example ends with ``destroy_process_group()``, as a script run on its
    own must; here that call destroys only the subgroups (the launch's default group serves the
    later jobs; initialising it again in one process is not reliable), and DeepSpeed's cached
    groups are reset between the examples (``deepspeed_state.fresh_deepspeed_state``)."""
    import torch.distributed as dist

    from megaloss.integrations.deepspeed.compat import freeze_imported_objects
    from tests.helpers.deepspeed_state import fresh_deepspeed_state
    from tests.helpers.pools import destroy_subgroups

    destroy, calls, argv_before = dist.destroy_process_group, [], sys.argv

    def destroy_process_group(group=None):
        if group is not None:
            return destroy(group)
        calls.append(True)
        destroy_subgroups()

    dist.destroy_process_group = destroy_process_group
    try:
        for i, script in enumerate(argv, start=1):
            sys.argv = [script, f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"]
            freeze_imported_objects()  # the earlier examples' imports, out of DeepSpeed's gc
            with fresh_deepspeed_state():
                runpy.run_path(script, run_name="__main__")
            assert len(calls) == i, f"{script} did not end with destroy_process_group()"
    finally:
        dist.destroy_process_group, sys.argv = destroy, argv_before


def shared_launch_hf_jobs(tmp_path):
    """Both DeepSpeed examples, one after the other, in the shared Trainer launch (its working
    directory is its own folder: hf_causal_lm.py writes ``runs/mine`` there)."""
    return [{"worker": __file__, "argv": [str(p) for p in DEEPSPEED_EXAMPLES]}]


@pytest.fixture(scope="module")
def deepspeed_examples(shared_launch_hf):
    """Rank 0's stdout of the examples. Their lines differ (``rank r: loss ... worst relative
    update error ...`` vs rank 0's ``step k: loss ...``)."""
    return shared_launch_hf["test_examples"].outputs[0]


@pytest.mark.deepspeed
@pytest.mark.xdist_group("shared_launch_hf")
@pytest.mark.timeout(900)  # the first test using the shared launch waits for it
def test_deepspeed_calibration_example_gives_the_single_device_update(deepspeed_examples):
    assert deepspeed_examples.count("worst relative update error") == 2, deepspeed_examples


@pytest.mark.deepspeed
@pytest.mark.xdist_group("shared_launch_hf")
@pytest.mark.timeout(900)
def test_hf_causal_lm_example_trains(deepspeed_examples):
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)$", deepspeed_examples,
                                           flags=re.M)]
    assert len(losses) == 20 and losses[-1] < losses[0] - 1.0, losses


def test_every_example_is_run():
    single = (getattr(n, "values", (n,))[0] for n in SINGLE_PROCESS_EXAMPLES)
    run = {*single, "vocab_parallel.py", "fsdp2.py", *(p.name for p in DEEPSPEED_EXAMPLES)}
    assert {p.name for p in EXAMPLES} == run, "an example in examples/ that no test runs"
