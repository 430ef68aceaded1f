"""Shared launches: ONE ``deepspeed`` launch runs the jobs of every test file that only reads
what its jobs wrote. A launch costs 10-25 s of start-up (process spawn, importing torch,
deepspeed and transformers) while the jobs themselves take seconds, so the files share it. A
pytest plugin (``pytest_plugins`` of tests/conftest.py), so that a test file of any folder can
join.

Joining, in a test module (tests/launch/test_train_embed.py is a short example)::

    def shared_launch_jobs(tmp_path):   # tmp_path: this module's own folder
        return [{"job": "train_lm", "argv": [..., "--output_dir", str(tmp_path / "out")]}]

    @pytest.fixture(scope="module")
    def run(shared_launch):
        return shared_launch["test_my_module"]   # keyed by the module's name (no package)

    @pytest.mark.timeout(900)   # the first test to ask pays for the launch (limit 840 s)
    def test_it(run):
        assert (run.tmp_path / "out" / "summary.json").exists(), run.outputs[0]

A job is a dict of ``launch_helpers.run_jobs_in_one_launch``: ``{"job": <launch.* module>,
"argv": [...]}`` plus options, or ``{"worker": __file__, "argv": [...]}`` to run the module's
own ``_worker_main(argv)`` on every rank. The test reads a :class:`SharedRun`: its folder, its
jobs, rank 0's stdout of each of them (``outputs``), the ranks' stderr (``errors``) and the
whole launch's output.

The three launches, one fixture each, and the function a module defines to join:

- ``shared_launch``: ``deepspeed --num_gpus 2``; ``shared_launch_jobs(tmp_path) -> list``.
- ``shared_launch_4procs``: ``deepspeed --num_gpus 4``; ``shared_launch_4procs_jobs(tmp_path)``.
- ``shared_launch_hf``: ``deepspeed --num_gpus 2`` for the Hugging Face Trainer jobs and test
  workers (they import transformers' Trainer and sentence-transformers, which the others do not
  pay for); ``shared_launch_hf_jobs(tmp_path)``. tests/launch' job scripts and
  tests/integrations' ``_worker_main`` workers join it; its working directory is its own
  temporary folder (not the repository).

How a launch runs: its jobs are those of every joining module collected in this session (so
running one file alone launches only that file's jobs), module by module in collection order,
jobs with an ``"env"`` (wandb) last, in one launch. A job that fails fails the launch, and every
test that reads it gets the launch's output in its failure. Every launch the session's selected
modules need starts with the session, at most two at a time, in background threads at a lower
priority (nice 10, ``launch_helpers.lower_priority``): they take the core the single-process
tests leave idle and yield to the tests otherwise, their start-up (the launcher and
``deepspeed.launcher.launch`` start one after the other on one core) and single-rank phases
overlap on the suite's 2 cores, and a test asking for a launch waits only for the rest of it.
Under pytest-xdist each worker starts only the launches its tests ask for, when they ask; the
tests mark ``xdist_group("<fixture name>")`` (``--dist loadgroup``: one worker runs a launch for
all of them).
"""
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from tests.helpers.launch_helpers import job_outputs, lower_priority, run_jobs_in_one_launch

# fixture name -> (the modules' function giving its jobs, processes, runs in its own folder)
LAUNCHES = {"shared_launch": ("shared_launch_jobs", 2, False),
            "shared_launch_hf": ("shared_launch_hf_jobs", 2, True),
            "shared_launch_4procs": ("shared_launch_4procs_jobs", 4, False)}
MAX_CONCURRENT = 2  # launches at a time: the suite runs on 2 cores


@dataclasses.dataclass
class SharedRun:
    tmp_path: Path  # the module's folder, as passed to its shared_launch_jobs
    jobs: List[dict]  # what its shared_launch_jobs returned
    outputs: List[str]  # rank 0's stdout of each of the module's jobs, in its order
    errors: List[str]  # the ranks' stderr of each of the module's jobs (split at rank 0's marks)
    stdout: str  # the whole launch's output (every module's jobs)
    stderr: str
    started: float  # time.time() when the launch started


@dataclasses.dataclass
class _Launch:
    entries: List[Tuple[str, int, dict]]  # (module name, index in the module's list, job)
    folders: Dict[str, Path]  # module name -> its folder
    future: Future  # of (time.time() at its start, the launch's CompletedProcess)

    def runs(self) -> Dict[str, SharedRun]:
        started, proc = self.future.result()
        parts = job_outputs(proc.stdout, len(self.entries))
        errors = job_outputs(proc.stderr, len(self.entries))
        runs = {}
        for name, path in self.folders.items():
            mine = [(i, job, part, error) for (owner, i, job), part, error
                    in zip(self.entries, parts, errors) if owner == name]
            mine.sort(key=lambda m: m[0])
            runs[name] = SharedRun(path, [m[1] for m in mine], [m[2] for m in mine],
                                   [m[3] for m in mine], proc.stdout, proc.stderr, started)
        return runs


def _start(request, tmp_path_factory, pool: ThreadPoolExecutor, fixture: str) -> _Launch:
    """Collect the jobs of launch ``fixture`` (in this thread: the modules' functions write their
    configs) and queue the launch on ``pool``."""
    attr, num_gpus, in_folder = LAUNCHES[fixture]
    modules = []
    for item in request.session.items:
        module = getattr(item, "module", None)
        if hasattr(module, attr) and module not in modules:
            modules.append(module)
    entries, folders = [], {}
    for module in modules:
        name = module.__name__.rsplit(".", 1)[-1]
        folders[name] = tmp_path_factory.mktemp(name)
        entries += [(name, i, job) for i, job in enumerate(getattr(module, attr)(
            folders[name]))]
    entries.sort(key=lambda e: "env" in e[2])  # stable: wandb's run stays open to the end
    root = tmp_path_factory.mktemp(fixture)

    def launch():
        started = time.time()
        proc = run_jobs_in_one_launch([job for _, _, job in entries], root / "jobs.json",
                                      timeout=840, num_gpus=num_gpus,
                                      **({"cwd": root} if in_folder else {}))
        (root / "launch.log").write_text(proc.stdout + proc.stderr)
        return started, proc

    return _Launch(entries, folders, pool.submit(launch))


@pytest.fixture(scope="session")
def _launches(request, tmp_path_factory):
    """``start(fixture)``: the launch ``fixture``, started (with, outside pytest-xdist, every
    other launch the session's modules need) on its first call."""
    started: Dict[str, _Launch] = {}
    pool = ThreadPoolExecutor(MAX_CONCURRENT, thread_name_prefix="shared-launch",
                              initializer=lower_priority)

    def start(fixture: str) -> _Launch:
        if fixture not in started:
            wanted = [fixture]
            if not hasattr(request.config, "workerinput"):  # not an xdist worker
                wanted += [f for f in LAUNCHES if f != fixture and any(
                    hasattr(getattr(item, "module", None), LAUNCHES[f][0])
                    for item in request.session.items)]
            for f in wanted:
                if f not in started:
                    started[f] = _start(request, tmp_path_factory, pool, f)
        return started[fixture]

    yield start
    pool.shutdown(wait=True, cancel_futures=True)  # a queued launch no test waited for: dropped


@pytest.fixture(scope="session", autouse=True)
def _launches_with_the_session(request, _launches) -> None:
    """Outside pytest-xdist, the launches the selected tests need start with the session (at
    ``lower_priority``): they take the core the single-process tests leave idle instead of
    starting when their first test asks, which then waits with one core idle."""
    if hasattr(request.config, "workerinput"):
        return
    for fixture in LAUNCHES:  # a selected test that reads one (the fast tier reads none)
        if any(fixture in getattr(item, "fixturenames", ()) for item in request.session.items):
            _launches(fixture)  # starts every launch the session needs, two at a time
            return


@pytest.fixture(scope="session")
def shared_launch(_launches) -> Dict[str, SharedRun]:
    return _launches("shared_launch").runs()


@pytest.fixture(scope="session")
def shared_launch_hf(_launches) -> Dict[str, SharedRun]:
    return _launches("shared_launch_hf").runs()


@pytest.fixture(scope="session")
def shared_launch_4procs(_launches) -> Dict[str, SharedRun]:
    return _launches("shared_launch_4procs").runs()
