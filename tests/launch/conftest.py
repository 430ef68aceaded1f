"""Launches shared by the end-to-end test files that only read what their jobs wrote (each
launch costs 10-25 s of start-up: process spawn, importing torch, deepspeed and transformers;
the jobs themselves take seconds).

- ``shared_launch``: ONE ``deepspeed --num_gpus 2`` launch. A test module joins by defining
  ``shared_launch_jobs(tmp_path) -> list`` (job dicts of
  ``launch_helpers.run_jobs_in_one_launch``, writing under ``tmp_path``, its own folder).
- ``shared_launch_4procs``: ONE ``deepspeed --num_gpus 4`` launch, the same way for modules
  defining ``shared_launch_4procs_jobs(tmp_path)``.
- ``shared_launch_hf``: ONE ``deepspeed --num_gpus 2`` launch of the Hugging Face Trainer jobs
  (they import transformers' Trainer and sentence-transformers, which the others do not pay
  for), for modules defining ``shared_launch_hf_jobs(tmp_path)``; its working directory is its
  own temporary folder (not the repository).

Each fixture runs the jobs of every such module collected in this session, module by module in
collection order, jobs with an ``"env"`` (wandb) last, in one launch, and returns
``{module name: SharedRun}``. Running one file alone launches only its jobs. The tests that use
them set ``timeout(900)``: the first one pays for the launch (limit 840 s), and mark
``xdist_group("<fixture name>")`` (under pytest-xdist's
``--dist loadgroup`` one worker runs the launch for all of them).
"""
import dataclasses
from pathlib import Path
from typing import Dict, List

import pytest
from launch_helpers import job_outputs, run_jobs_in_one_launch


@dataclasses.dataclass
class SharedRun:
    tmp_path: Path  # the module's folder, as passed to its shared_launch_jobs
    jobs: List[dict]  # what its shared_launch_jobs returned
    outputs: List[str]  # rank 0's stdout of each of the module's jobs, in its order
    stdout: str  # the whole launch's output (every module's jobs)
    stderr: str


def _shared(request, tmp_path_factory, attr: str, folder: str, num_gpus: int,
            in_folder: bool = False) -> Dict[str, SharedRun]:
    """One launch of ``num_gpus`` processes running the jobs ``module.<attr>(tmp_path)`` of
    every collected module that defines it (working directory: the repository, or with
    ``in_folder`` the launch's own temporary folder)."""
    modules = []
    for item in request.session.items:
        module = getattr(item, "module", None)
        if hasattr(module, attr) and module not in modules:
            modules.append(module)
    entries = []  # (module name, index in the module's list, job)
    folders = {}
    for module in modules:
        name = module.__name__.rsplit(".", 1)[-1]
        folders[name] = tmp_path_factory.mktemp(name)
        entries += [(name, i, job) for i, job in enumerate(getattr(module, attr)(
            folders[name]))]
    entries.sort(key=lambda e: "env" in e[2])  # stable: wandb's run stays open to the end
    root = tmp_path_factory.mktemp(folder)
    proc = run_jobs_in_one_launch([job for _, _, job in entries], root / "jobs.json",
                                  timeout=840, num_gpus=num_gpus,
                                  **({"cwd": root} if in_folder else {}))
    (root / "launch.log").write_text(proc.stdout + proc.stderr)
    parts = job_outputs(proc.stdout, len(entries))
    runs = {}
    for name, path in folders.items():
        mine = sorted((i, part) for (owner, i, _), part in zip(entries, parts) if owner == name)
        runs[name] = SharedRun(path, [e[2] for e in sorted(
            (e for e in entries if e[0] == name), key=lambda e: e[1])],
            [part for _, part in mine], proc.stdout, proc.stderr)
    return runs


@pytest.fixture(scope="session")
def shared_launch(request, tmp_path_factory) -> Dict[str, SharedRun]:
    return _shared(request, tmp_path_factory, "shared_launch_jobs", "shared_launch", 2)


@pytest.fixture(scope="session")
def shared_launch_4procs(request, tmp_path_factory) -> Dict[str, SharedRun]:
    return _shared(request, tmp_path_factory, "shared_launch_4procs_jobs",
                   "shared_launch_4procs", 4)


@pytest.fixture(scope="session")
def shared_launch_hf(request, tmp_path_factory) -> Dict[str, SharedRun]:
    return _shared(request, tmp_path_factory, "shared_launch_hf_jobs", "shared_launch_hf", 2,
                   in_folder=True)
