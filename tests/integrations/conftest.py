"""Shared processes for this folder's multi-process tests: DeepSpeed ranks for the engine tests
(``deepspeed_pool``), one ``deepspeed --num_gpus 2`` launch for the Trainer tests
(``shared_hf_launch``, below).

A test marked ``deepspeed`` gets freshly spawned ranks from the root conftest (an engine leaves
process-global state behind). Most of the cost of these tests is that spawn: each rank imports
torch, deepspeed and transformers (~7 CPU-s) for a few seconds of work. Modules marked
``deepspeed_pool`` (in ``pytestmark``) instead run their ``run_distributed`` calls on DeepSpeed-only
:class:`megaloss.testing.ProcessGroupPool` s, one per world size, shared by every such test of
this folder (started on first use, stopped after the last such module): one spawn and one set
of imports per world size for all the engine test files.

What makes the sharing safe: every case builds its own groups, topology and engine and
destroys the engine (its ZeRO hooks) at the end; DeepSpeed's comm backend is initialised once
per process and reused (``deepspeed.init_distributed`` is idempotent); DeepSpeed's module
globals (the last engine's ``mpu``, cached groups) are reset before every case
(``tests/helpers/deepspeed_state.py``); the pool reseeds torch /
Python / NumPy and resets the default dtype and grad mode before each case; a case that fails or
times out reports its own traceback to its own test and takes the pool down, so the next test
gets fresh ranks. DeepSpeed and the plain collective tests never share ranks (separate pools).

Under pytest-xdist ``--dist loadgroup`` the pooled tests carry
``xdist_group("deepspeed_spawn")``, so they land on one worker and share its pools.
"""
import dataclasses
import json
import subprocess
import time
from pathlib import Path
from typing import Dict, Optional

import pytest

from megaloss.testing import DEFAULT_TIMEOUT_S, ProcessGroupPool, shared_process_groups

# A collective of these tests never waits this long; a deadlock still fails at the case's own
# (shorter) run_distributed timeout.
COLLECTIVE_TIMEOUT_S = 900.0


def pytest_configure(config):
    config.addinivalue_line("markers", "deepspeed_pool: run_distributed runs on the shared "
                            "DeepSpeed ranks of tests/integrations (see its conftest.py)")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("deepspeed_pool") and item.get_closest_marker("deepspeed"):
            item.add_marker(pytest.mark.xdist_group("deepspeed_spawn"))
        if "shared_hf_launch" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("shared_hf_launch"))


class _DeepSpeedPool(ProcessGroupPool):
    """Runs every case through ``deepspeed_state.run_with_fresh_deepspeed_state``."""

    def run(self, fn, *args, timeout=DEFAULT_TIMEOUT_S):
        from deepspeed_state import run_with_fresh_deepspeed_state
        return super().run(run_with_fresh_deepspeed_state, fn, *args, timeout=timeout)


@pytest.fixture(scope="session")
def _deepspeed_pools():
    # built here, not by run_distributed (which would build plain pools), for every world size
    # these tests use; ranks start on first use
    pools = {(world, 1): _DeepSpeedPool(world, 1, collective_timeout=COLLECTIVE_TIMEOUT_S)
             for world in (1, 2, 3, 4)}
    yield pools
    for pool in pools.values():
        pool.close(kill=True)  # idle between cases: nothing to finish


@pytest.fixture(scope="module", autouse=True)
def _shared_deepspeed_ranks(request):
    """Module scope, so that module-scoped fixtures running the cases share the ranks too (a
    module opts in with ``pytestmark``). After the last such module the ranks are stopped (the
    rest of the session does not hold their memory)."""
    if not request.node.get_closest_marker("deepspeed_pool"):
        yield
        return
    pools = request.getfixturevalue("_deepspeed_pools")
    with shared_process_groups(pools):
        yield
    pooled = [getattr(item, "module", None) for item in request.session.items
              if item.get_closest_marker("deepspeed_pool")]
    if pooled and pooled[-1] is request.module:
        for pool in pools.values():
            pool.close(kill=True)  # a later start would spawn fresh ranks


# one deepspeed --num_gpus 2 launch for the Hugging Face Trainer modules ------------------------
@dataclasses.dataclass
class SharedLaunchRun:
    """One module's part of the shared launch."""

    tmp_path: Path  # the module's folder, as passed to its shared_hf_launch_argv
    started: float  # time.time() when the launch that ran the module started
    error: Optional[str] = None  # None: its worker returned on every rank

    def check(self):
        """Fail the calling test with the module's own traceback if its worker did not finish."""
        if self.error is not None:
            pytest.fail(self.error, pytrace=False)


def _read_crash(crash: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(crash.parent.glob(crash.name + ".rank*")))


@pytest.fixture(scope="session")
def shared_hf_launch(request, tmp_path_factory) -> Dict[str, SharedLaunchRun]:
    """Run the ``_worker_main`` of every collected module that defines
    ``shared_hf_launch_argv(tmp_path) -> argv`` (its worker's arguments; it may write inputs
    under ``tmp_path``, its own folder) in ONE ``deepspeed --num_gpus 2`` launch of
    ``shared_launch_worker.py``, modules in collection order; returns ``{module name:
    SharedLaunchRun}``. A module whose worker raises gets its traceback; the launch stops there
    (the ranks may be out of step) and the modules after it run in a new launch. The tests that
    use it set ``timeout(900)``: the first one pays for the launch (all launches within 840 s).
    """
    from launch_helpers import run_deepspeed_launcher
    modules = []
    for item in request.session.items:
        module = getattr(item, "module", None)
        if hasattr(module, "shared_hf_launch_argv") and module not in modules:
            modules.append(module)
    root = tmp_path_factory.mktemp("shared_hf_launch")
    runs, pending = {}, []
    for module in modules:
        name = module.__name__.rsplit(".", 1)[-1]
        folder = tmp_path_factory.mktemp(name)
        runs[name] = SharedLaunchRun(folder, 0.0)
        pending.append({"name": name, "file": module.__file__,
                        "argv": module.shared_hf_launch_argv(folder),
                        "done": str(root / f"{name}.done"), "crash": str(root / f"{name}.crash")})
    deadline = time.monotonic() + 840
    while pending:
        spec = root / f"spec-{pending[0]['name']}.json"
        spec.write_text(json.dumps(pending))
        started, failure = time.time(), None
        try:
            run_deepspeed_launcher(Path(__file__).with_name("shared_launch_worker.py"),
                                   ["--spec", str(spec)],
                                   timeout=max(1.0, deadline - time.monotonic()))
        except (AssertionError, subprocess.TimeoutExpired) as e:
            failure = f"the shared launch failed: {e}"
        while pending and Path(pending[0]["done"]).exists():
            runs[pending.pop(0)["name"]].started = started
        if not pending:
            break
        entry = pending.pop(0)  # the module the launch stopped in
        crash = _read_crash(Path(entry["crash"]))
        runs[entry["name"]].started = started
        runs[entry["name"]].error = (crash or failure
                                     or "its worker returned but rank 0 wrote no marker")
        if time.monotonic() >= deadline:
            for rest in pending:
                runs[rest["name"]].error = "not run: the shared launch ran out of time"
            break
    return runs
