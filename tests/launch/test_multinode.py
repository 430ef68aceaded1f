"""Several nodes through DeepSpeed's launcher, as ``launch/train_lm.sh`` / ``train_embed.sh``
start them from a scheduler's environment (``launch/multinode.sh``).

- Fast: the command each script builds (``DRY_RUN=1``) from SLURM, torchrun / Kubernetes and
  hostfile settings, and that one node without any of them is launched as before.
- Slow: the one-launcher-per-node form on loopback. Two "nodes" (``NNODES=2``, ``NODE_RANK=0/1``,
  ``MASTER_ADDR=127.0.0.1``, ``NUM_PROCS=1`` each, i.e. ``deepspeed --hostfile H --no_ssh
  --num_nodes 2 --node_rank R --num_gpus 1``) run the LM job with TP=2 across the two nodes; the
  reference is the same job on one node of 2 processes, a job of the launch the tests/launch
  files share (shared_launches.py ``shared_launch``: no launcher of its own). The per-step losses,
  gradient norms and token counts in ``metrics.csv`` and the held-out loss in ``summary.json``
  must be identical (same ranks, same gloo collectives, one thread per process: bitwise).
"""
import csv
import json
import os
import shlex
import signal
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest

from megaloss.testing import free_port
from tests.helpers.launch_helpers import REPO

SCRIPTS = ("train_lm.sh", "train_embed.sh")
_SCHEDULER_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "HOSTFILE", "NUM_PROCS",
                   "PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
                   "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_JOB_NODELIST",
                   "SLURM_JOB_ID", "DRY_RUN", "DS_CONFIG",
                   "PYTHONPATH")  # the scripts put the repository root there themselves


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in _SCHEDULER_VARS}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _dry_run(script: str, *args: str, **env) -> list:
    """The deepspeed command ``launch/<script>`` would run, split into words (a hostfile it
    writes goes to ``TMPDIR``: pass the test's ``tmp_path``)."""
    proc = subprocess.run(["bash", str(REPO / "launch" / script), *args], cwd=REPO,
                          env=_clean_env(DRY_RUN=1, **env), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return shlex.split(proc.stdout.strip().splitlines()[-1])


def _flag(cmd: list, name: str):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def _hostfile_lines(cmd: list) -> list:
    return Path(_flag(cmd, "--hostfile")).read_text().split("\n")[:-1]


@pytest.mark.parametrize("script", SCRIPTS)
def test_one_node_unchanged(script):
    cmd = _dry_run(script, "--steps", "3", NUM_PROCS=4, MASTER_PORT=12345)
    job = str(REPO / "launch" / script.replace(".sh", ".py"))
    assert cmd[:6] == ["deepspeed", "--num_gpus", "4", "--master_port", "12345", job]
    assert cmd[-2:] == ["--steps", "3"] and "--hostfile" not in cmd and "--no_ssh" not in cmd
    if script == "train_lm.sh":
        assert cmd[6:8] == ["--deepspeed_config", str(REPO / "configs" / "zero2.json")]
    cmd = _dry_run(script)  # no port given: a free one, 2 processes
    assert cmd[1:3] == ["--num_gpus", "2"] and int(_flag(cmd, "--master_port")) > 0
    # a one-node SLURM allocation is one node
    cmd = _dry_run(script, SLURM_NNODES=1, SLURM_NODEID=0, SLURM_JOB_NODELIST="gpu01")
    assert "--no_ssh" not in cmd and "--hostfile" not in cmd


@pytest.mark.parametrize("script", SCRIPTS)
def test_torchrun_style_environment(script, tmp_path):
    cmd = _dry_run(script, "--steps", "3", NNODES=2, NODE_RANK=1, MASTER_ADDR="10.1.2.3",
                   MASTER_PORT=6000, NUM_PROCS=8, TMPDIR=tmp_path)
    assert "--no_ssh" in cmd
    assert [_flag(cmd, f) for f in ("--num_nodes", "--node_rank", "--master_addr",
                                    "--master_port", "--num_gpus")] == ["2", "1", "10.1.2.3",
                                                                        "6000", "8"]
    assert cmd[-2:] == ["--steps", "3"]
    assert _hostfile_lines(cmd) == ["node0 slots=8", "node1 slots=8"]
    assert Path(_flag(cmd, "--hostfile")).parent == tmp_path
    # the same settings again: the same file, not a new one per launch
    again = _dry_run(script, NNODES=2, NODE_RANK=0, MASTER_ADDR="10.1.2.3", NUM_PROCS=8,
                     TMPDIR=tmp_path)
    assert _flag(again, "--hostfile") == _flag(cmd, "--hostfile")
    assert len(list(tmp_path.iterdir())) == 1
    # Kubeflow's torchrun variables (PET_*); "MIN:MAX" node counts use the minimum
    cmd = _dry_run(script, PET_NNODES="4:4", PET_NODE_RANK=3, PET_MASTER_ADDR="master-0",
                   PET_MASTER_PORT=23456, TMPDIR=tmp_path)
    assert [_flag(cmd, f) for f in ("--num_nodes", "--node_rank", "--master_addr",
                                    "--master_port", "--num_gpus")] == ["4", "3", "master-0",
                                                                        "23456", "2"]
    assert len(_hostfile_lines(cmd)) == 4


@pytest.mark.parametrize("script", SCRIPTS)
def test_slurm_environment(script, tmp_path):
    cmd = _dry_run(script, SLURM_NNODES=3, SLURM_NODEID=2, SLURM_JOB_ID=1234567,
                   SLURM_JOB_NODELIST="gpu[08-09,11]", NUM_PROCS=4, TMPDIR=tmp_path)
    assert "--no_ssh" in cmd
    # master: the first host of the allocation; port: the same on every node, from the job id
    assert [_flag(cmd, f) for f in ("--num_nodes", "--node_rank", "--master_addr",
                                    "--master_port", "--num_gpus")] == [
        "3", "2", "gpu08", str(20000 + 1234567 % 20000), "4"]
    assert _hostfile_lines(cmd) == ["gpu08 slots=4", "gpu09 slots=4", "gpu11 slots=4"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_hostfile_forms(script, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nworker-0 slots=4\nworker-1 slots=4\n")
    # without a node rank: one launcher starts every node over ssh (pdsh)
    cmd = _dry_run(script, HOSTFILE=hostfile)
    assert "--no_ssh" not in cmd and "--num_gpus" not in cmd and "--node_rank" not in cmd
    assert [_flag(cmd, f) for f in ("--hostfile", "--num_nodes", "--master_addr",
                                    "--master_port")] == [str(hostfile), "2", "worker-0", "29500"]
    # with one: a launcher per node, the hostfile's slots
    cmd = _dry_run(script, HOSTFILE=hostfile, NODE_RANK=1, MASTER_PORT=7000)
    assert "--no_ssh" in cmd and "--num_gpus" not in cmd
    assert [_flag(cmd, f) for f in ("--hostfile", "--num_nodes", "--node_rank", "--master_addr",
                                    "--master_port")] == [str(hostfile), "2", "1", "worker-0",
                                                          "7000"]


def test_several_nodes_without_master_is_an_error():
    proc = subprocess.run(["bash", str(REPO / "launch" / "train_lm.sh")], cwd=REPO,
                          env=_clean_env(DRY_RUN=1, NNODES=2, NODE_RANK=0), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "MASTER_ADDR" in proc.stderr


# the loopback run --------------------------------------------------------------------------------
STEPS = 4


def _ds_config(path: Path) -> Path:
    cfg = json.loads((REPO / "configs" / "zero2.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    cfg.pop("scheduler")
    cfg["optimizer"]["params"]["lr"] = 1e-2
    cfg["megaloss"]["tensor_parallel_size"] = 2  # TP=2 across the two "nodes"
    cfg["megaloss"]["ce"]["chunk_size"] = 48
    cfg["csv_monitor"]["enabled"] = False
    path.write_text(json.dumps(cfg))
    return path


def _job_args(tmp_path: Path, out: str) -> list:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return ["--deepspeed_config", str(_ds_config(tmp_path / "tp2.json")), "--model_size", "tiny",
            "--seq_len", "32", "--vocab_size", "300", "--steps", str(STEPS), "--eval_blocks",
            "4", "--eval_every", "0", "--no_progress", "--cache_dir", str(tmp_path / "cache"),
            "--train_data", *(str(stdlib / f) for f in ("heapq.py", "textwrap.py", "shlex.py")),
            "--eval_data", str(stdlib / "bisect.py"), "--output_dir", str(tmp_path / out)]


def _start(tmp_path: Path, name: str, env: dict, out: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(["bash", str(REPO / "launch" / "train_lm.sh"),
                             *_job_args(tmp_path, out)], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env=_clean_env(OMP_NUM_THREADS=1, TMPDIR=tmp_path, **env))


def _wait_all(procs: dict, tmp_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for name, p in procs.items():
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            log = (tmp_path / f"{name}.log").read_text()
            assert rc == 0, f"{name} exited {rc}:\n{log[-4000:]}"
    finally:
        for p in procs.values():  # one failed launcher must not leave the others waiting
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)


def _metrics(out: Path) -> list:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def shared_launch_jobs(tmp_path) -> list:
    """The one-node reference of the loopback run, a job of the shared launch (shared_launches.py):
    TP=2 over its 2 processes, into ``tmp_path / "single"``."""
    return [{"job": "train_lm", "argv": _job_args(tmp_path, "single")}]


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(900)  # the shared launch (the reference), if no test ran it yet, then these
def test_two_launchers_on_loopback_equal_one_node(shared_launch):
    # The two "nodes" run at once; they share the reference's token cache and ds_config (its
    # rank 0 wrote the cache atomically).
    tmp_path = shared_launch["test_multinode"].tmp_path
    port = free_port()
    nodes = {f"node{r}": {"NNODES": 2, "NODE_RANK": r, "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": port, "NUM_PROCS": 1} for r in (0, 1)}
    procs = {name: _start(tmp_path, name, env, "multi") for name, env in nodes.items()}
    _wait_all(procs, tmp_path, timeout=400)
    node0 = (tmp_path / "node0.log").read_text()
    assert "node 0 of 2: rendezvous at 127.0.0.1" in node0
    single, multi = _metrics(tmp_path / "single"), _metrics(tmp_path / "multi")
    assert [int(r["step"]) for r in multi] == list(range(1, STEPS + 1))
    for key in ("loss", "z_loss", "num_tokens", "grad_norm", "lr"):
        assert [float(r[key]) for r in multi] == [float(r[key]) for r in single], key
    s1 = json.loads((tmp_path / "single" / "summary.json").read_text())
    s2 = json.loads((tmp_path / "multi" / "summary.json").read_text())
    assert (s2["dp"], s2["tp"], s2["zero_stage"]) == (1, 2, 2)
    assert s2["eval_after"] == s1["eval_after"] and s2["eval_before"] == s1["eval_before"]
    assert s2["last_loss"] < s2["first_loss"]


@pytest.mark.parametrize("rank_error", [False, True])
def test_run_status_when_the_launcher_fails(tmp_path, rank_error):
    """launch/_stop_status.sh under the launchers' ``set -euo pipefail``: a failed launcher's
    status comes through as it is, after the lowest failed rank's message where one wrote it;
    with none written it still does (it used to end with 2, the failed ls's), and the ranks'
    files are removed either way."""
    err = tmp_path / "errors"
    err.write_text("")
    if rank_error:
        (tmp_path / "errors.rank1").write_text("ValueError: rank 1's message")
    script = (f"set -euo pipefail; MEGALOSS_ERROR_FILE={shlex.quote(str(err))}; "
              f"source {shlex.quote(str(REPO / 'launch' / '_stop_status.sh'))}; "
              "exit_with_run_status 3")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 3, done
    assert ("error: ValueError: rank 1's message" in done.stderr) == rank_error, done.stderr
    assert list(tmp_path.iterdir()) == []
