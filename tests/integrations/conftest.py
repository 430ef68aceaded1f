"""Shared processes for this folder's multi-process tests: DeepSpeed ranks for the engine tests
(``deepspeed_pool``, below); the Trainer tests' modules run their ``_worker_main`` in the
``shared_launch_hf`` launch (``tests/helpers/shared_launches.py``) by defining
``shared_launch_hf_jobs(tmp_path)``.

A test marked ``deepspeed`` gets freshly spawned ranks from the root conftest (an engine leaves
process-global state behind). Most of the cost of these tests is that spawn: each rank imports
torch, deepspeed and transformers (~7 CPU-s) for a few seconds of work. Modules marked
``deepspeed_pool`` (in ``pytestmark``) instead run their ``run_distributed`` calls on DeepSpeed-only
:class:`tests.helpers.pools.ProcessGroupPool` s, one per world size, shared by every such test of
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

import pytest

from megaloss.testing import DEFAULT_TIMEOUT_S
from tests.helpers.pools import ProcessGroupPool, shared_process_groups

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
        if "shared_launch_hf" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("shared_launch_hf"))


class _DeepSpeedPool(ProcessGroupPool):
    """Runs every case through ``deepspeed_state.run_with_fresh_deepspeed_state``."""

    def run(self, fn, *args, timeout=DEFAULT_TIMEOUT_S):
        from tests.helpers.deepspeed_state import run_with_fresh_deepspeed_state
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
