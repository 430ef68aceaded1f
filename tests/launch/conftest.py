"""One ``deepspeed --num_gpus 2`` launch shared by the end-to-end test files that only read what
their jobs wrote (each launch costs 10-25 s of start-up: process spawn, importing torch,
deepspeed and transformers; the jobs themselves take seconds).

A test module joins by defining ``shared_launch_jobs(tmp_path) -> list`` (job dicts of
``launch_helpers.run_jobs_in_one_launch``, writing under ``tmp_path``, its own folder). The
fixture ``shared_launch`` runs the jobs of every such module collected in this session, module
by module in collection order, jobs with an ``"env"`` (wandb) last, in ONE launch, and returns
``{module name: SharedRun}``. Running one file alone launches only its jobs. The tests that
use it set ``timeout(900)``: the first one pays for the launch (limit 840 s).
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


@pytest.fixture(scope="session")
def shared_launch(request, tmp_path_factory) -> Dict[str, SharedRun]:
    modules = []
    for item in request.session.items:
        module = getattr(item, "module", None)
        if hasattr(module, "shared_launch_jobs") and module not in modules:
            modules.append(module)
    entries = []  # (module name, index in the module's list, job)
    folders = {}
    for module in modules:
        name = module.__name__.rsplit(".", 1)[-1]
        folders[name] = tmp_path_factory.mktemp(name)
        entries += [(name, i, job) for i, job in enumerate(module.shared_launch_jobs(
            folders[name]))]
    entries.sort(key=lambda e: "env" in e[2])  # stable: wandb's run stays open to the end
    root = tmp_path_factory.mktemp("shared_launch")
    proc = run_jobs_in_one_launch([job for _, _, job in entries], root / "jobs.json",
                                  timeout=840)
    (root / "launch.log").write_text(proc.stdout + proc.stderr)
    parts = job_outputs(proc.stdout, len(entries))
    runs = {}
    for name, folder in folders.items():
        mine = sorted((i, part) for (owner, i, _), part in zip(entries, parts) if owner == name)
        runs[name] = SharedRun(folder, [e[2] for e in sorted(
            (e for e in entries if e[0] == name), key=lambda e: e[1])],
            [part for _, part in mine], proc.stdout, proc.stderr)
    return runs
