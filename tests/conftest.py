"""The suite's session set-up: markers, tiers, process-group pools, background jobs, caches.

Layout: one folder per package layer (``ops``, ``parallel``, ``losses``, ``calibration``,
``integrations``), plus ``launch`` (the jobs and their data), ``tools`` (benchmarks and checkers)
and ``examples``; helpers shared by every folder (float64 references, launcher helpers, the
shared launches) are the package ``tests.helpers``. CONTRIBUTING.md says how to add a test.

Tiers: ``pytest -m "not slow"`` is the fast tier (single process, under 30 s); the full suite
(``pytest``, what CI runs) adds the tests marked ``slow``. Every test that spawns processes or
builds a DeepSpeed engine is ``slow``: marked here from its ``distributed`` / ``deepspeed``
marker (pytest_collection_modifyitems), so no such test can land in the fast tier by accident.
Test modules that need sentence-transformers (~10 CPU-s to import) are slow as a whole and
import it inside the tests, so that collecting the fast tier does not.

Markers (registered in pytest_configure below; tests/integrations/conftest.py adds
``deepspeed_pool``): ``distributed`` (spawns gloo processes), ``deepspeed`` (builds a real
engine), ``slow`` (not in the fast tier; implied by the two before), ``cuda`` (needs a GPU,
skipped without one; tools/gpu_check.sh runs them), ``fresh_processes`` (spawned ranks of its
own instead of the shared pool), ``background(name)`` (reads a background job's result, below)
and ``xdist_group(name)`` (pytest-xdist's, declared so that a run without xdist does not warn).

Process groups: ``megaloss.testing.run_distributed`` inside a test runs on a pool of spawned gloo
ranks per world size, started once per session and shared by the tests (reseeded before each
case, its subgroups destroyed after it, respawned after a failure or timeout; see
``tests/helpers/pools.py``); the fixture ``_shared_process_groups`` below routes the calls there.
Tests marked ``deepspeed`` or ``fresh_processes`` get freshly spawned ranks instead (or, in
tests/integrations, DeepSpeed-only pools). Launches that several test files read
(``shared_launch``, ``shared_launch_hf``, ``shared_launch_4procs``) are the plugin
``tests/helpers/shared_launches.py``.

Background jobs: a test that only reads what a subprocess wrote (a benchmark tool, the GPU
check's dry run) need not wait for it in line. Its module defines ``background_jobs(folder, env)
-> {name: callable}`` (``folder``: a temporary folder of the module's; ``env``: the environment
at the session's start, so a test's ``monkeypatch`` cannot leak into a job), the test is marked
``background("<name>")`` and takes the ``background`` fixture, which is what the callable
returned (its exception raised in the test). The jobs of every selected test are started when
the session starts, one at a time in collection order, in one thread at a lower priority (nice
10), so that they use what the tests leave idle (one of the 2 cores during the single-process
tests) instead of slowing them down. Under pytest-xdist a job starts when its test asks for it.

Nothing outside temporary folders: ``MEGALOSS_CACHE`` (the jobs' default ``--cache_dir``, also
read by the examples and tools) points at one temporary folder for the session unless already
set, so no test writes tokenizers or token streams into ``~/.cache/megaloss``; launched jobs
inherit it.

Speed (why the hooks below exist): the checkout's bytecode caches are written even under
PYTHONDONTWRITEBYTECODE; the pytest process runs one torch thread; the objects alive after
collection, and again before pytest's closing gc passes, are frozen out of the cyclic GC.
"""
import os
import sys
from concurrent.futures import ThreadPoolExecutor

# Bytecode caches for this checkout even where PYTHONDONTWRITEBYTECODE is set (as on this
# project's CI machine): without them pytest rewrites every test module's asserts again on each
# run (~3.5 s of the fast tier's collection) and each of the ~200 processes the full suite spawns
# compiles megaloss and launch/ from source. They go where Python puts them by default
# (``__pycache__``, ignored by git); the run's header says so (pytest_report_header).
BYTECODE_FORCED = sys.dont_write_bytecode
sys.dont_write_bytecode = False

import pytest  # noqa: E402
import torch  # noqa: E402

from megaloss.integrations.deepspeed.compat import freeze_imported_objects  # noqa: E402
from tests.helpers.launch_helpers import lower_priority  # noqa: E402
from tests.helpers.pools import shared_process_groups  # noqa: E402

# The launches that test files of every folder share (tests/helpers/shared_launches.py). The
# shared helpers are the package ``tests.helpers`` and the launch jobs the package ``launch``,
# both imported from the repository root (pytest.ini's ``pythonpath = .``) like megaloss.
pytest_plugins = ["tests.helpers.shared_launches"]

# One torch thread in the pytest process: the cases use tiny shapes, and on a small machine
# shared with other processes a second OpenMP thread mostly spins (measured: a [1, 8] x [8, 16]
# bf16 matmul 0.005 ms with one thread, 1-14 ms with two on a loaded 2-core machine).
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: spawns several gloo processes (slow tier)")
    config.addinivalue_line("markers", "deepspeed: runs a real DeepSpeed engine (slow tier)")
    config.addinivalue_line("markers", "slow: not in the fast tier (CI runs everything)")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU, skips without (gpu_check.sh)")
    # pytest-xdist's marker (``--dist loadgroup`` keeps a shared launch or pool in one worker),
    # declared here so that a run without xdist does not warn about it
    config.addinivalue_line("markers", "xdist_group(name): tests that share one launch or pool "
                            "(pytest-xdist runs a group in one worker)")
    config.addinivalue_line("markers", "fresh_processes: run_distributed spawns new ranks for "
                            "this test instead of using the shared pool")
    config.addinivalue_line("markers", "background(name): the test reads the result of its "
                            "module's background job `name` (started with the session)")


def pytest_collection_finish(session):
    # The imports and the collected items stay alive the whole session: frozen out of the
    # cyclic GC, whose automatic full collections would otherwise rescan them (~1M objects).
    freeze_imported_objects()


def pytest_report_header(config):
    if BYTECODE_FORCED:
        return ["bytecode: PYTHONDONTWRITEBYTECODE is set; this session writes the checkout's "
                "__pycache__ anyway (tests/conftest.py)"]
    return []


def pytest_unconfigure(config):
    # pytest's clean-up then runs five full collections (``gc_collect_harder``) to report the
    # exceptions raised in ``__del__``; by the end of a session that is ~2M objects, 0.4 s a
    # scan. One collection here, with pytest's unraisable hook still installed, reports them the
    # same way; freezing the survivors leaves those five only the objects created since.
    freeze_imported_objects()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("distributed") or item.get_closest_marker("deepspeed"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def _process_group_pools():
    pools = {}
    yield pools
    for pool in pools.values():
        pool.close(kill=True)  # idle between cases: nothing to finish


@pytest.fixture(autouse=True)
def _shared_process_groups(request, _process_group_pools):
    """Route ``run_distributed`` to the session's pools, except for DeepSpeed tests (an engine
    leaves process-global state behind: its comm backend, groups, ZeRO hooks) and tests marked
    ``fresh_processes``."""
    node = request.node
    if node.get_closest_marker("deepspeed") or node.get_closest_marker("fresh_processes"):
        yield
        return
    with shared_process_groups(_process_group_pools):
        yield


@pytest.fixture(scope="session", autouse=True)
def _megaloss_cache(tmp_path_factory):
    if os.environ.get("MEGALOSS_CACHE"):
        yield os.environ["MEGALOSS_CACHE"]
        return
    os.environ["MEGALOSS_CACHE"] = str(tmp_path_factory.mktemp("megaloss-cache"))
    try:
        yield os.environ["MEGALOSS_CACHE"]
    finally:
        os.environ.pop("MEGALOSS_CACHE", None)


@pytest.fixture(scope="session", autouse=True)
def _background_jobs(request, tmp_path_factory, _megaloss_cache):
    """``start((module, job name)) -> Future`` of a selected test's background job; outside
    xdist every such job is submitted at the session's start to one worker thread, in
    collection order."""
    wanted = {}  # module -> job names its selected tests read
    for item in request.session.items:
        marker = item.get_closest_marker("background")
        if marker is not None:
            wanted.setdefault(item.module, []).append(marker.args[0])
    lane = ThreadPoolExecutor(1, thread_name_prefix="background", initializer=lower_priority)
    env = dict(os.environ)
    jobs, futures = {}, {}
    for module, names in wanted.items():
        folder = tmp_path_factory.mktemp(f"{module.__name__.rsplit('.', 1)[-1]}-bg")
        for job, fn in module.background_jobs(folder, env).items():
            if job in names:
                jobs[(module, job)] = fn

    def start(key):
        if key not in futures:
            futures[key] = lane.submit(jobs[key])
        return futures[key]

    if not hasattr(request.config, "workerinput"):  # not an xdist worker: start them all now
        for key in jobs:
            start(key)
    yield start
    lane.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def background(request, _background_jobs):
    """What the module's background job named by the test's ``background`` marker returned (its
    exception raised here)."""
    job = request.node.get_closest_marker("background").args[0]
    return _background_jobs((request.node.module, job)).result()
