"""Preemption, end to end under ``deepspeed --num_gpus 2`` on CPU, with real signals:

- the LM job gets SIGINT to the whole process group (launcher and ranks) twice in a row, as a
  scheduler's signal arrives beside a terminal's Ctrl-C (and the launcher then forwards a
  SIGTERM to every rank): one stop request, not an abort;
- the embedding job gets SIGTERM at the launcher's ``launch.py`` only, which forwards it to its
  ranks one after the other (rank 0 first, the next only once rank 0 has exited), so the ranks
  must agree to stop at the same step boundary by themselves;
- a second LM run gets SIGUSR1 (``sbatch --signal=USR1``) at rank 1 only: rank 0 learns of it
  at the step boundary, both save, and the launcher exits 0 (not resumed below);
- a third, started as the README says (``bash launch/train_lm.sh``), gets SIGTERM at every
  process twice (SLURM's time limit, then ``scancel``): one stop, and the script exits 75 (not
  resumed below);
- a fourth, started as the README says (``bash launch/train_lm.sh``), gets SIGUSR1 at every
  process (``sbatch --signal=USR1``): the launcher's processes survive it, the ranks save, and
  the script exits 75 (not resumed below).

Both must save a checkpoint at the next step boundary, write ``metrics.csv``, ``summary.json``
(saying where and why they stopped) and the plot for the steps that ran, and exit; a new
launcher run with ``--resume`` (one for both jobs) then continues them: metrics and monitor files
hold every step once, with one header.

The six launches are independent (own session, port and folder): they run two at a time, one
per core (the resume once the two it continues have stopped).
"""
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from launch.jobs.code_search import stdlib_root
from megaloss.testing import free_port
from tests.helpers.launch_helpers import (
    REPO,
    launcher_env,
    run_jobs_in_one_launch,
    script_env,
    wait_until,
)

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.xdist_group("preemption")]  # one xdist worker runs the fixture


class Launched:
    """``deepspeed --num_gpus 2 script args`` in a session of its own, its output collected by a
    thread."""

    def __init__(self, script: Path, args: list) -> None:
        if script.suffix == ".sh":  # as a user runs it: the script's own launcher command
            cmd, env = ["bash", str(script), *args], script_env(NUM_PROCS="2")
        else:
            cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                   "--master_port", str(free_port()), str(script), *args]
            env = launcher_env()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def alive(self) -> bool:
        return self.proc.poll() is None or self.reader.is_alive()

    def wait_for_steps(self, monitor_file: Path, steps: int, timeout: float) -> None:
        """Until the run has logged ``steps`` optimizer steps (DeepSpeed's csv_monitor appends
        one ``step,value`` line per step to ``monitor_file``)."""
        def logged():
            return monitor_file.exists() and len(monitor_file.read_text().splitlines()) > steps
        try:
            wait_until(logged, timeout, f"{steps} steps in {monitor_file}", alive=self.alive)
        except AssertionError as e:
            raise AssertionError(f"{e}:\n{self.output[-4000:]}") from None

    def kill(self) -> None:
        """SIGKILL to the whole session (launcher and ranks) if any of it still runs."""
        if self.proc.poll() is None or self.reader.is_alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)

    def finish(self, timeout: float) -> str:
        """Wait until every process of the session has closed the output (all exited)."""
        self.reader.join(timeout)
        if self.reader.is_alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"still running after {timeout} s:\n{self.output[-4000:]}")
        self.proc.wait(30)
        return self.output


def _rows(out: Path) -> list:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _check_stopped(out: Path, output: str, sig: str, tag: str) -> int:
    """The stopped run's files: a checkpoint at the step it stopped after, every step's metrics,
    the summary saying so, the plot. Returns that step."""
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"]["signal"] == sig, summary["stopped"]
    k = summary["stopped"]["step"]
    assert k >= 1 and summary["steps"] == k and summary["eval_after"] is None
    assert [int(r["step"]) for r in _rows(out)] == list(range(1, k + 1))
    assert (out / "checkpoints" / "latest").read_text() == f"step_{k}"
    assert (out / "checkpoints" / f"step_{k}" / "rng_state_rank00001.pt").exists()
    assert (out / "loss_curve.png").stat().st_size > 0
    assert f"{sig}: stopping at the next step boundary" in output
    assert f"[{tag}" in output and f"stopped by {sig} after step {k}" in output
    return k


def _check_continued(out: Path, k: int, extra: int, monitor_file: str) -> None:
    rows = _rows(out)
    assert [int(r["step"]) for r in rows] == list(range(1, k + extra + 1))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] is None and summary["resumed_at_step"] == k
    lines = (out / "monitor" / "megaloss" / monitor_file).read_text().splitlines()
    assert sum(ln.startswith("step,") for ln in lines) == 1, lines
    assert [int(ln.split(",")[0]) for ln in lines[1:]] == [int(r["samples"]) for r in rows]


def _lm_args(out: Path, cache: Path) -> list:
    root = stdlib_root()
    return ["--train_data", str(root / "json"), str(root / "csv.py"), "--eval_data",
            str(root / "textwrap.py"), "--model_size", "tiny", "--seq_len", "32",
            "--vocab_size", "300", "--eval_blocks", "8", "--eval_every", "0",
            "--output_dir", str(out), "--cache_dir", str(cache), "--no_progress"]


def _embed_args(out: Path, cache: Path) -> list:
    root = stdlib_root()
    return ["--train_data", str(root / "email"), str(root / "json"), "--eval_fraction", "0.2",
            "--max_eval", "24", "--micro_batch_size", "4", "--gradient_accumulation_steps", "1",
            "--model_size", "tiny", "--vocab_size", "300", "--max_doc_len", "32",
            "--max_query_len", "16", "--output_dir", str(out), "--cache_dir", str(cache),
            "--no_progress"]


def _stopped_at(out: Path):
    """The step the stopped run says it stopped after (None when it wrote no such summary: its
    test then fails on the stopped run's files)."""
    try:
        return json.loads((out / "summary.json").read_text())["stopped"]["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _ctrl_c(job):  # SIGINT to the whole process group, twice (a scheduler, then Ctrl-C)
    os.killpg(job.proc.pid, signal.SIGINT)
    # the second once both ranks have taken the first (two at once would be one signal)
    wait_until(lambda: job.output.count("SIGINT: stopping at the next step boundary") >= 2,
               120, "both ranks' stop message", alive=job.alive)
    os.killpg(job.proc.pid, signal.SIGINT)


def _sigterm_to_launch_py(job):
    launch_py = psutil.Process(job.proc.pid).children()[0]  # deepspeed.launcher.launch
    assert "deepspeed.launcher.launch" in " ".join(launch_py.cmdline())
    launch_py.send_signal(signal.SIGTERM)


def _sigusr1_to_rank_1(job):
    launch_py = psutil.Process(job.proc.pid).children()[0]
    rank1 = [p for p in launch_py.children() if "--local_rank=1" in p.cmdline()]
    assert len(rank1) == 1, [p.cmdline() for p in launch_py.children()]
    rank1[0].send_signal(signal.SIGUSR1)


def _sigterm_to_all_twice(job):
    os.killpg(job.proc.pid, signal.SIGTERM)
    wait_until(lambda: job.output.count("SIGTERM: stopping at the next step boundary") >= 2,
               120, "both ranks' stop message", alive=job.alive)
    os.killpg(job.proc.pid, signal.SIGTERM)


def _sigusr1_to_all(job):
    os.killpg(job.proc.pid, signal.SIGUSR1)


# name: (arguments, monitor file, signal pattern, script suffix); the first two are resumed
_STOPPED = {
    "lm": (_lm_args, "Train_megaloss_loss.csv", _ctrl_c, ".py"),
    "embed": (_embed_args, "Train_megaloss_mnr_loss.csv", _sigterm_to_launch_py, ".py"),
    "lm-usr1": (_lm_args, "Train_megaloss_loss.csv", _sigusr1_to_rank_1, ".py"),
    "lm-term": (_lm_args, "Train_megaloss_loss.csv", _sigterm_to_all_twice, ".sh"),
    "lm-usr1-all": (_lm_args, "Train_megaloss_loss.csv", _sigusr1_to_all, ".sh"),
}


def _stopped_run(tmp: Path, name: str) -> tuple:
    """Launch job ``name`` of ``_STOPPED`` for (nearly) ever, deliver its signal pattern once 2
    steps are logged, and wait until every process has exited. Returns ``(folder, output,
    launcher's exit status)``."""
    args, monitor_file, stop, suffix = _STOPPED[name]
    out = tmp / name
    job = Launched(REPO / "launch" / f"train_{name.split('-')[0]}{suffix}",
                   args(out, tmp / "cache") + ["--steps", "100000"])
    try:
        job.wait_for_steps(out / "monitor" / "megaloss" / monitor_file, 2, timeout=360)
        stop(job)
        output = job.finish(timeout=240)
        return out, output, job.proc.returncode
    finally:
        job.kill()


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """The five stopped launches of ``_STOPPED`` (the LM job stopped by Ctrl-C and the embedding
    job by SIGTERM at the launcher, their folders copied as they were when they stopped; three
    more signal patterns), then one new launch resuming the first two for 2 more steps. The
    launches are independent (own session, port and folder; the token cache is written
    atomically): they run two at a time (2 cores), the resume as soon as its two are done.
    Returns ``{name: (folder, copy of the stopped folder, output)}`` for the resumed two,
    ``{name: (folder, output, exit status)}`` for the others, and the resuming launch's
    stdout."""
    tmp = tmp_path_factory.mktemp("preemption")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_stopped_run, tmp, name) for name in _STOPPED}
        resumes = []
        for name in ("lm", "embed"):
            out, _, _ = futures[name].result()
            shutil.copytree(out, out.with_name(f"{name}-stopped"))
            k = _stopped_at(out)
            if k is not None:
                args = (_lm_args if name == "lm" else _embed_args)(out, tmp / "cache")
                resume = ["--resume"] if name == "lm" else ["--resume", "latest"]
                resumes.append({"job": f"train_{name}",
                                "argv": args + ["--steps", str(k + 2)] + resume})
        resumed = pool.submit(run_jobs_in_one_launch, resumes, tmp / "resume.json",
                              timeout=360)
        runs = {name: f.result() for name, f in futures.items()}
        stdout = resumed.result().stdout
    for name in ("lm", "embed"):
        out, output, _ = runs[name]
        runs[name] = (out, out.with_name(f"{name}-stopped"), output)
    return runs, stdout


@pytest.mark.timeout(900)  # the fixture: six launches, two at a time
def test_ctrl_c_saves_lm(preempted):
    _, stopped, output = preempted[0]["lm"]
    _check_stopped(stopped, output, "SIGINT", "lm")


@pytest.mark.timeout(420)
def test_sigterm_to_the_launcher_saves_embed(preempted):
    _, stopped, output = preempted[0]["embed"]
    _check_stopped(stopped, output, "SIGTERM", "embed")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("name,monitor_file", [("lm", "Train_megaloss_loss.csv"),
                                                ("embed", "Train_megaloss_mnr_loss.csv")])
def test_resume_in_a_new_launch_continues(preempted, name, monitor_file):
    out, stopped, _ = preempted[0][name]
    k = _stopped_at(stopped)
    assert k is not None, f"{name} did not stop"
    assert f"resumed from {out / 'checkpoints' / f'step_{k}'} at step {k}" in preempted[1]
    _check_continued(out, k, 2, monitor_file)


@pytest.mark.timeout(420)
def test_sigusr1_to_one_rank_saves_on_every_rank(preempted):
    out, output, returncode = preempted[0]["lm-usr1"]
    assert returncode == 0, output[-3000:]  # the ranks saved and exited 0: so did the launcher
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"]["signal"] == "a signal on another rank", summary["stopped"]
    k = summary["stopped"]["step"]
    assert (out / "checkpoints" / "latest").read_text() == f"step_{k}"
    for rank in (0, 1):
        assert (out / "checkpoints" / f"step_{k}" / f"rng_state_rank0000{rank}.pt").exists()
    assert [int(r["step"]) for r in _rows(out)] == list(range(1, k + 1))
    assert output.count("SIGUSR1: stopping at the next step boundary") == 1
    assert f"stopped by a signal on another rank after step {k}" in output


@pytest.mark.timeout(420)
def test_sigterm_to_every_process_twice_saves_lm(preempted):
    """Through ``bash launch/train_lm.sh``: before, the script (and the ``deepspeed`` command)
    died of the first SIGTERM with status 143 while the ranks were still saving."""
    out, output, returncode = preempted[0]["lm-term"]
    assert returncode == 75, output[-3000:]
    _check_stopped(out, output, "SIGTERM", "lm")
    assert "stopped on request after a checkpoint on every rank: exit status 75" in output


def test_sigusr1_to_every_process_of_the_script_saves_and_exits_75(preempted):
    out, output, returncode = preempted[0]["lm-usr1-all"]
    assert returncode == 75, output[-3000:]
    k = _check_stopped(out, output, "SIGUSR1", "lm")
    assert k >= 2
    assert "stopped on request after a checkpoint on every rank: exit status 75" in output
