"""What a user copies is what CI ran: every ``python`` code block of the READMEs is, verbatim, one
of the scripts in ``examples/``, and every example runs to its own checks (each asserts its result
against a float64 single-device reference)."""
import re
import runpy
import sys

import pytest
import torch
from launch_helpers import REPO, run_deepspeed_launcher

READMES = [REPO / "README.md", REPO / "launch" / "README.md"]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))


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


@pytest.mark.timeout(120)
def test_single_device_example_runs(capsys, monkeypatch):
    """Run as ``python examples/single_device.py`` would (``__main__``, the repository root as
    the working directory), but in this process: a fresh interpreter would only add the cost of
    importing torch again. Its own asserts raise here."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [str(REPO / "examples" / "single_device.py")])
    with torch.random.fork_rng():   # the example seeds the global generator
        runpy.run_path(str(REPO / "examples" / "single_device.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "linear_cross_entropy" in out and "mnr_loss" in out, out


DEEPSPEED_EXAMPLES = [REPO / "examples" / "deepspeed_calibration.py",
                      REPO / "examples" / "hf_causal_lm.py"]


@pytest.fixture(scope="module")
def deepspeed_examples():
    """Both DeepSpeed examples in ONE ``deepspeed --num_gpus 2`` launch, one after the other in
    the same ranks (``examples_in_one_launch.py``); the launch must exit with status 0, so an
    assert failing in either example fails both tests. Their stdout lines differ (``rank r:
    loss ... worst relative update error ...`` vs rank 0's ``step k: loss ...``)."""
    driver = REPO / "tests" / "examples" / "examples_in_one_launch.py"
    return run_deepspeed_launcher(driver, [str(p) for p in DEEPSPEED_EXAMPLES],
                                  timeout=560).stdout


@pytest.mark.deepspeed
@pytest.mark.xdist_group("deepspeed_examples")  # one launch for both, on one worker
@pytest.mark.timeout(600)
def test_deepspeed_calibration_example_gives_the_single_device_update(deepspeed_examples):
    assert deepspeed_examples.count("worst relative update error") == 2, deepspeed_examples


@pytest.mark.deepspeed
@pytest.mark.xdist_group("deepspeed_examples")  # one launch for both, on one worker
@pytest.mark.timeout(600)
def test_hf_causal_lm_example_trains(deepspeed_examples):
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([0-9.]+)$", deepspeed_examples,
                                           flags=re.M)]
    assert len(losses) == 20 and losses[-1] < losses[0] - 1.0, losses
