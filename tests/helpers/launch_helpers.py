"""Shared by the end-to-end launcher tests (``tests/launch/``): run a script under ``deepspeed
--num_gpus N`` on CPU, run several jobs' ``main`` in one launch (this file is then the script
the launcher runs), and read what DeepSpeed's ``csv_monitor`` wrote.

Not a test module (no ``test_`` prefix); imported as ``tests.helpers.launch_helpers``. The
launched processes import the jobs as ``launch.*`` and the helpers as ``tests.helpers.*``: the
repository root is first on their PYTHONPATH (:func:`launcher_env`).
"""
import argparse
import csv
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, List, Mapping, Optional, Sequence

from megaloss.testing import free_port

REPO = Path(__file__).resolve().parents[2]
BACKGROUND_NICE = 10  # the priority of the suite's background work (lower_priority)


def lower_priority() -> None:
    """The calling thread's nice value raised to ``BACKGROUND_NICE`` (a ``ThreadPoolExecutor``'s
    initializer). Linux: the nice value is per thread and inherited by the processes a thread
    starts, so background work's subprocesses take the cores the tests leave idle and yield
    otherwise; elsewhere a no-op."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except (AttributeError, OSError):
        pass


def launcher_env(**extra: str) -> dict:
    """The environment of a launched job: one thread per process, the repository root first on
    PYTHONPATH (the jobs import ``launch.jobs``; the ranks import this checkout's megaloss)."""
    path = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def script_env(base: Optional[Mapping[str, str]] = None, **extra: str) -> dict:
    """The environment of a ``bash launch/<job>.sh`` run as the README shows it: ``base``
    (default ``os.environ``; a background job passes the session's) with one thread per process
    and no PYTHONPATH (the script puts the repository root there itself)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "PYTHONPATH"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def run_deepspeed_launcher(script: Path, args: Sequence[str], *, timeout: float,
                           num_gpus: int = 2, tail: int = 4000,
                           cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run ``deepspeed --num_gpus {num_gpus} script *args`` in ``cwd`` (default the repo root),
    one thread per process, and assert it exits with status 0 (the message shows the last
    ``tail`` characters of stdout and stderr).

    Returns:
        the completed process (``stdout``/``stderr`` as text).
    """
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_gpus),
           "--master_port", str(free_port()), str(script), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=launcher_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-tail:] + proc.stderr[-tail:]
    return proc


def run_jobs_in_one_launch(jobs: List[dict], spec: Path, *, timeout: float, num_gpus: int = 2,
                           tail: int = 6000, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """One ``deepspeed`` launch that runs every job of ``jobs`` in turn in the same processes
    (process start-up, i.e. importing torch / deepspeed / transformers, costs more than these
    tiny jobs, and the suite shares 2 cores).

    A job is ``{"job": "train_lm" | "train_embed" | "train_embed_hf" | "distill_lm" |
    "train_grpo" | ..., "argv": [...]}`` (the module ``launch.<job>``, imported when a job needs
    it), plus optionally:

    - ``"expect_exit": path``: it must stop with ``SystemExit``; rank 0 writes the message to
      ``path``, and every rank the message it got to ``<path>.rank<global rank>``;
    - ``"truncate": file``: local rank 0 cuts ``file`` to half its length before the job
      starts, as a crash while writing it would;
    - ``"stop_after": k``: its stop request fires at the k-th step boundary, as a SIGTERM there
      would;
    - ``"env": {name: value or None}``: set, or with None unset, in the ranks' environment for
      that job only, then restored.

    A test module's own worker is ``{"worker": path of the module, "argv": [...]}``: the module
    is loaded by path (its folder put on ``sys.path``) and its ``_worker_main(argv)`` runs, on
    every rank; the whole environment is restored after it.

    ``spec`` is where the list is written for the launched processes. Before each job, local
    rank 0 prints :func:`job_marker` on stdout and stderr (:func:`job_outputs` splits either
    with it).
    """
    spec.write_text(json.dumps(jobs))
    return run_deepspeed_launcher(Path(__file__), ["--jobs", str(spec)], timeout=timeout,
                                  num_gpus=num_gpus, tail=tail, cwd=cwd)


def run_jobs_in_one_process(jobs: List[dict], spec: Path, *, timeout: float, tail: int = 6000,
                            cwd: Path = REPO) -> subprocess.CompletedProcess:
    """:func:`run_jobs_in_one_launch` on one process started as plain ``python`` (the jobs'
    single-process mode: world size 1, no launcher), which saves the launcher's and
    ``deepspeed.launcher.launch``'s start-up; asserts exit status 0.

    Returns:
        the completed process (``stdout``/``stderr`` as text).
    """
    spec.write_text(json.dumps(jobs))
    env = {k: v for k, v in launcher_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(Path(__file__)), "--jobs", str(spec)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-tail:] + proc.stderr[-tail:]
    return proc


def script_command(script: str, *args: str, **env: str) -> List[str]:
    """The command ``bash launch/<script> *args`` runs (``DRY_RUN=1`` makes launch/multinode.sh
    print it instead), split into words; single node, ``env`` added to :func:`script_env`."""
    import shlex

    base = {k: v for k, v in script_env().items()
            if k not in ("NUM_PROCS", "DS_CONFIG", "NNODES", "PET_NNODES", "SLURM_NNODES",
                         "SLURM_JOB_NUM_NODES", "HOSTFILE", "MASTER_PORT")}
    proc = subprocess.run(["bash", str(REPO / "launch" / script), *args], cwd=REPO,
                          env={**base, **env, "DRY_RUN": "1"}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout.strip().splitlines()[-1])


def assert_launches(cmd: List[str], num_gpus: int, job: str, config: str,
                    args: Sequence[str]) -> None:
    """``cmd`` (:func:`script_command`) is ``deepspeed --num_gpus {num_gpus} --master_port P
    launch/{job}.py --deepspeed_config configs/{config}.json *args``."""
    assert cmd[:3] == ["deepspeed", "--num_gpus", str(num_gpus)] and cmd[3] == "--master_port", cmd
    assert cmd[5:] == [str(REPO / "launch" / f"{job}.py"), "--deepspeed_config",
                       str(REPO / "configs" / f"{config}.json"), *args], cmd


def job_marker(k: int) -> str:
    """The line local rank 0 prints on stdout and stderr before the ``k``-th job of a launch."""
    return f"=== launch_helpers: job {k} ==="


def job_outputs(stdout: str, n_jobs: int) -> List[str]:
    """``stdout`` (or ``stderr``) of :func:`run_jobs_in_one_launch` cut into the ``n_jobs`` jobs'
    parts (the lines from a job's marker to the next one; lines of rank 1 that came late may sit
    in the next part)."""
    parts, rest = [], stdout
    for k in range(n_jobs):
        marker = job_marker(k) + "\n"
        assert marker in rest, f"no output of job {k}"
        rest = rest.split(marker, 1)[1]
        nxt = job_marker(k + 1) + "\n"
        parts.append(rest.split(nxt, 1)[0] if k + 1 < n_jobs else rest)
    return parts


def wait_until(condition: Callable[[], bool], timeout: float, what: str,
               alive: Optional[Callable[[], bool]] = None, poll: float = 0.1) -> None:
    """Poll ``condition`` until it holds; ``AssertionError`` naming ``what`` after ``timeout``
    seconds, or as soon as ``alive()`` (the process that should make it true) says it is gone."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert alive is None or alive(), f"exited before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(poll)


def monitor_column(path: Path) -> List[float]:
    """The values of a ``csv_monitor`` file (``<output_path>/<job>/<tag, / -> _>.csv``: a header,
    then ``step,value`` rows)."""
    with open(path) as f:
        return [float(r[1]) for r in list(csv.reader(f))[1:]]


def _stop_after(base, k: int):
    class StopAfter(base):
        calls = 0

        def should_stop(self, device="cpu"):
            StopAfter.calls += 1
            if StopAfter.calls == k:
                self.received = "SIGTERM"
            return super().should_stop(device)
    return StopAfter


def _drive() -> None:
    """Under the launcher (:func:`run_jobs_in_one_launch`): each job's ``main`` in turn, as in a
    fresh process (DeepSpeed's globals reset), the groups it built destroyed after it (their
    gloo threads would poll through the rest of the launch)."""
    from tests.helpers.deepspeed_state import fresh_deepspeed_state
    from tests.helpers.pools import destroy_subgroups

    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--jobs", type=str, required=True)
    args = p.parse_args()
    for k, job in enumerate(json.loads(Path(args.jobs).read_text())):
        if args.local_rank == 0:
            print(job_marker(k), flush=True)
            print(job_marker(k), file=sys.stderr, flush=True)
        with fresh_deepspeed_state():
            if "worker" in job:
                _run_worker(job["worker"], job["argv"])
            else:
                _run_launch_job(job, args.local_rank)
        destroy_subgroups()


def _run_launch_job(job: dict, local_rank: int) -> None:
    """A ``launch.<job>`` job's ``main`` with the job dict's options (see
    :func:`run_jobs_in_one_launch`)."""
    import importlib

    from launch.jobs.runs import StopRequest

    module = importlib.import_module(f"launch.{job['job']}")
    argv = job["argv"] + ["--local_rank", str(local_rank)]
    assert hasattr(module, "StopRequest") or "stop_after" not in job, job
    if hasattr(module, "StopRequest"):
        module.StopRequest = (_stop_after(StopRequest, job["stop_after"])
                              if "stop_after" in job else StopRequest)
    if job.get("truncate") and local_rank == 0:
        data = Path(job["truncate"]).read_bytes()
        Path(job["truncate"]).write_bytes(data[:len(data) // 2])
    saved = {name: os.environ.get(name) for name in job.get("env", {})}
    _set_env(job.get("env", {}))
    attention = dict(_attention_functions())
    try:
        _run(module, argv, job, local_rank)
    finally:
        _set_env(saved)
        _attention_functions().clear()
        _attention_functions().update(attention)


def _run_worker(file: str, argv: List[str]) -> None:
    """A test module's ``_worker_main(argv)`` (a ``"worker"`` job), the environment it changed
    (a W&B case sets ``WANDB_*``) restored after it."""
    import importlib.util

    from megaloss.integrations.deepspeed.compat import freeze_imported_objects

    folder = str(Path(file).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(Path(file).stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pickling and dataclasses look the module up by name
    spec.loader.exec_module(module)
    freeze_imported_objects()  # the module's imports (and the earlier jobs' survivors)
    environ = dict(os.environ)
    try:
        module._worker_main(argv)
    finally:
        os.environ.clear()
        os.environ.update(environ)
        if "wandb" in sys.modules:  # wandb reads WANDB_DIR once per setup: a later job's run
            sys.modules["wandb"].teardown()  # would land in this worker's folder


def _attention_functions() -> dict:
    """The overrides in transformers' attention registry (``ALL_ATTENTION_FUNCTIONS``), restored
    after each job as a fresh process would have them (the LM job's Ulysses SP wraps its
    ``"sdpa"`` entry and leaves it wrapped; a later job's model would run it); ``{}`` (a
    throwaway) while transformers is not imported."""
    module = sys.modules.get("transformers.modeling_utils")
    functions = getattr(module, "ALL_ATTENTION_FUNCTIONS", None)
    return {} if functions is None else functions._local_mapping


def _set_env(values: dict) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _run(module, argv, job: dict, local_rank: int) -> None:
    if job.get("expect_exit"):
        try:
            module.main(argv)
        except SystemExit as e:
            if local_rank == 0:
                Path(job["expect_exit"]).write_text(str(e.code))
            # the other ranks of a failure found on one (launch.jobs.runs.agreed) exit with
            # an AgreedExit naming that rank and the cause
            Path(f"{job['expect_exit']}.rank{os.environ['RANK']}").write_text(
                str(getattr(e, "message", e.code)))
            return
        raise AssertionError(f"{job} did not stop")
    module.main(argv)


if __name__ == "__main__":
    from launch.jobs.runs import run_job

    run_job(_drive)
