"""What a user installs: the package metadata states ranges (never exact pins of torch or
DeepSpeed, which would replace the user's own build), one version source, the shipped configs
and py.typed as package data, the console scripts. The wheel itself is built and installed into
a fresh venv by ``tools/wheel_check.sh`` (CI)."""
import inspect
import re
from pathlib import Path

import pytest
import tomllib

import megaloss
from megaloss.configs import config_names, config_path

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _requirements():
    reqs = list(PROJECT["dependencies"])
    for extra in PROJECT["optional-dependencies"].values():
        reqs += extra
    return reqs


def test_metadata_states_ranges_not_pins():
    for req in _requirements():
        spec = req.split(";")[0]  # the environment marker may compare with ==
        assert "==" not in spec, f"exact pin in the package metadata: {req}"
    torch_req = next(r for r in PROJECT["dependencies"] if r.startswith("torch"))
    assert torch_req.startswith("torch>="), torch_req


def test_lower_bounds_are_what_the_lowest_check_installs():
    """Every lower bound of a range whose package tools/constraints-lowest.txt pins is that pin:
    the wheel check proves the bound it states."""
    lowest = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$",
                             (REPO / "tools" / "constraints-lowest.txt").read_text(), re.M))
    assert {"torch", "deepspeed", "transformers", "pydantic", "numpy"} <= set(lowest)
    bounds = {}
    for req in _requirements():
        m = re.match(r"^([A-Za-z0-9_.-]+)>=([0-9.]+)", req)
        if m:
            bounds[m.group(1)] = m.group(2)
    for name, version in lowest.items():
        assert bounds[name] == version or version.startswith(bounds[name] + "."), \
            (name, bounds[name], version)


def test_constraints_pin_torch_for_the_install_script():
    pins = (REPO / "tools" / "constraints.txt").read_text()
    assert re.search(r"^torch==2\.13\.0$", pins, re.M)
    install = (REPO / "tools" / "install.sh").read_text()
    assert "-c \"$C\"" in install and "C=tools/constraints.txt" in install


def test_one_version_source():
    assert PROJECT["dynamic"] == ["version"] and "version" not in PROJECT
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "megaloss.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", megaloss.__version__)
    assert f"## {megaloss.__version__}" in (REPO / "CHANGELOG.md").read_text()


def test_package_data_and_console_scripts():
    assert (Path(megaloss.__file__).parent / "py.typed").is_file()
    assert {"zero0", "zero1", "zero2", "zero3", "zero2_hf"} <= set(config_names())
    assert config_path("zero2.json") == config_path("zero2")
    assert config_path("zero2").parent == Path(megaloss.__file__).parent / "configs"
    with pytest.raises(ValueError, match="no shipped ds_config named 'zero9'"):
        config_path("zero9")
    scripts = PROJECT["scripts"]
    assert scripts == {"megaloss-check-layout": "megaloss.cli.check_layout:main",
                       "megaloss-comm-model": "megaloss.cli.comm_model:main"}
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["megaloss"] and "*.json" in data["megaloss.configs"]
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert PROJECT["license"] == "Apache-2.0"


@pytest.mark.slow  # a fresh interpreter importing torch: ~2 s of the fast tier
def test_import_megaloss_leaves_the_integrations_to_first_use():
    """``import megaloss`` imports neither deepspeed nor transformers; its lazy names do, on
    first use, and are then the integration modules' objects."""
    import subprocess
    import sys
    code = ("import sys, megaloss; assert not {'deepspeed', 'transformers'} & set(sys.modules), "
            "sorted({'deepspeed', 'transformers'} & set(sys.modules)); "
            "from megaloss.integrations.hf.causal_lm import CausalLMWithLoss; "
            "assert megaloss.CausalLMWithLoss is CausalLMWithLoss")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_the_public_surface():
    """``megaloss.__all__`` is what a user calls: every name resolves, the losses' surface is in
    it, and the subpackages export no helper beside it (the helpers are imported from their
    modules); a name that left the top level still resolves, with a warning naming its home."""
    import megaloss.calibration
    import megaloss.configs
    import megaloss.losses
    import megaloss.ops
    import megaloss.parallel
    eager = [n for n in megaloss.__all__ if n not in megaloss._LAZY]
    assert all(hasattr(megaloss, n) for n in eager)
    assert set(megaloss.losses.__all__) <= set(megaloss.__all__)
    assert {"Topology", "LossCalibrator", "MegalossConfig", "CausalLMWithLoss"} <= set(
        megaloss.__all__)
    for package in (megaloss.losses, megaloss.ops, megaloss.parallel, megaloss.calibration):
        assert all(hasattr(package, n) for n in package.__all__)
        public = {n for n in vars(package) if not n.startswith("_")
                  and not inspect.ismodule(getattr(package, n))}
        assert public == set(package.__all__), (package.__name__, public ^ set(package.__all__))
    surface = set(megaloss.__all__) | set(megaloss.configs.__all__)
    for package in (megaloss.losses, megaloss.ops, megaloss.parallel, megaloss.calibration):
        surface |= set(package.__all__)
    assert len(surface) <= 72, len(surface)  # a surface a user can hold in mind
    with pytest.warns(DeprecationWarning, match="megaloss.calibration.probe_fsdp"):
        assert megaloss.probe_fsdp is megaloss.calibration.probe_fsdp
