"""Errors that name their cause (one test per case):

- an empty train or eval file is named and called empty (it used to be ``ValueError: 1 tokens
  cannot fill one block of 129``); text too short for one block says which and what to change;
- a folder of files that the held-out split cannot divide mentions ``--eval_fraction`` as well as
  ``--eval_data``;
- under the launcher, when rank 0 fails before the first collective of training (the embedding
  job's empty data; a bad JSONL line that only rank 0 reads), the output's last lines name the
  cause, not another rank's ``Connection closed by peer``;
- a rank's error is blamed right (``launch.jobs.processes.run_job``): one of megaloss's or the
  jobs' own checks (a misspelled ds_config key, a layout the world size does not fit, a folder
  without text files) is one line, its traceback only in ``<output_dir>/error_rank<r>.log``,
  and the rank is never said to have seen a peer die, even when the peers left first; a rank
  whose collective fails because a peer left on an error of its own says nothing (the peer's
  message is the cause); a peer killed is named, the failed collective's traceback in the log.

The single-process cases are in the fast tier; the launcher runs (those cases, a refused
rerun, a rank killed mid-run, ranks failing a check together or one after the other:
``tests/helpers/failing_ranks.py``) are slow: the module fixture ``launches`` starts them all at
once, two at a time, and each test waits for its own.
The misspelled ``"megalos"`` section is in tests/integrations/test_deepspeed_config.py.
"""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from launch import train_embed, train_embed_hf, train_lm, train_lm_hf
from launch.jobs import check_args
from launch.jobs.lm_data import load_data, make_blocks
from launch.jobs.pair_data import load_pairs_cached
from launch.jobs.runs import AgreedExit, agreed, run_job
from megaloss.testing import free_port, run_distributed
from tests.helpers.launch_helpers import REPO, launcher_env, script_env


def _text(path, n=40):
    path.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(n)))
    return path


def _lm_args(tmp_path, *argv):
    return train_lm.parse_args([*argv, "--vocab_size", "260", "--seq_len", "16",
                                "--cache_dir", str(tmp_path / "cache")])


@pytest.mark.parametrize("which", ["train", "eval"])
def test_empty_file_is_named(tmp_path, which):
    good, empty = _text(tmp_path / "good.py"), tmp_path / "empty.txt"
    empty.write_text("")
    train, held = (empty, good) if which == "train" else (good, empty)
    args = _lm_args(tmp_path, "--train_data", str(train), "--eval_data", str(held))
    with pytest.raises(SystemExit) as err:
        load_data(args)
    flag = "--train_data" if which == "train" else "--eval_data"
    assert str(err.value) == f"{flag} file {empty} is empty"


def test_an_empty_train_file_is_named_before_the_split(tmp_path):
    """Without --eval_data the files are split by path; an empty file is still the cause (it
    used to be "cannot split 1 files into train and held-out")."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(SystemExit) as err:
        load_data(_lm_args(tmp_path, "--train_data", str(empty)))
    assert str(err.value) == f"--train_data file {empty} is empty"


@pytest.mark.parametrize("job", [train_lm, train_embed, train_lm_hf, train_embed_hf],
                         ids=lambda j: j.__name__)
def test_a_bad_deepspeed_config_is_named_once(tmp_path, capsys, job):
    bad = tmp_path / "ds.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 2,\n "zero_optimization": {"stage": 2}')
    with pytest.raises(SystemExit) as err:
        job.parse_args(["--deepspeed_config", str(bad)])
    assert err.value.code == 2
    msg = capsys.readouterr().err
    assert f"--deepspeed_config {bad}: not valid JSON: Expecting ',' delimiter at line 2" in msg
    assert msg.count("not valid JSON") == 1
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit):
        job.parse_args(["--deepspeed_config", str(bad)])
    assert "a ds_config is a JSON object, not list" in capsys.readouterr().err


def test_a_missing_data_source_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--train_data", str(tmp_path / "nowhere.txt")])
    assert f"--train_data {tmp_path / 'nowhere.txt'}: no such file or directory" in \
        capsys.readouterr().err


def test_check_args_runs_the_jobs_parser_before_any_launch(capsys):
    """What launch/train_*.sh run before `deepspeed`: the job's own checks, once."""
    with pytest.raises(SystemExit) as err:
        check_args.main([str(REPO / "launch" / "train_lm.py"), "--steps", "-5"])
    assert err.value.code == 2 and "--steps must be >= 1" in capsys.readouterr().err
    check_args.main(["train_embed_hf", "--steps", "3"])  # fine: returns
    with pytest.raises(SystemExit, match="usage: python -m launch.jobs.check_args"):
        check_args.main(["train_nothing"])


def _exit_status(fn):
    with pytest.raises(SystemExit) as err:
        run_job(fn)
    return err.value.code


def test_run_job_leaves_a_jobs_error_for_the_script_to_print_once(tmp_path, capsys,
                                                                 monkeypatch):
    """Under ``launch/train_*.sh`` (``MEGALOSS_ERROR_FILE`` set) a rank prints nothing: the
    script prints the lowest rank's message once, last (the ranks used to print it too, each,
    before the script did). Without the script, the rank prints it."""
    from launch.jobs import processes

    monkeypatch.setattr(processes, "_RUN_DIR", [tmp_path / "run"])
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MEGALOSS_ERROR_FILE", raising=False)

    def refused():
        raise SystemExit("runs/lm already holds a run (metrics.csv)")

    assert _exit_status(refused) == 1
    assert capsys.readouterr().err == "runs/lm already holds a run (metrics.csv)\n"
    monkeypatch.setenv("MEGALOSS_ERROR_FILE", str(tmp_path / "err"))
    assert _exit_status(refused) == 1
    assert capsys.readouterr().err == ""
    assert (tmp_path / "err.rank00001").read_text() == "runs/lm already holds a run " \
                                                       "(metrics.csv)\n"
    assert (tmp_path / "err.left00001").exists()  # left on its error: no peer calls it dead

    def told():  # a rank told of another rank's failure: silent, same status
        raise AgreedExit("error on rank 0 (set-up): boom")

    assert _exit_status(told) == 1 and capsys.readouterr().err == ""
    assert _exit_status(lambda: None) == 0

    def broken():
        raise ValueError("bad value")

    assert _exit_status(broken) == 1
    assert capsys.readouterr().err.count("ValueError: bad value") == 1  # the traceback's line


def _this_node_with_rank1_gone(monkeypatch, tmp_path, *, error_file=True):
    """Rank 0 of a two-rank world on this node whose rank 1's process is gone (a real pid, reaped),
    its tracebacks kept in ``tmp_path/run``; ``MEGALOSS_ERROR_FILE`` as the scripts set it."""
    from launch.jobs import peers, processes

    gone = subprocess.Popen(["true"])
    gone.wait()
    here = peers._here()
    monkeypatch.setattr(peers, "_PEERS", [here, here._replace(pid=gone.pid)])
    monkeypatch.setattr(processes, "_RUN_DIR", [tmp_path / "run"])
    monkeypatch.setenv("RANK", "0")
    if error_file:
        monkeypatch.setenv("MEGALOSS_ERROR_FILE", str(tmp_path / "err"))
    else:
        monkeypatch.delenv("MEGALOSS_ERROR_FILE", raising=False)
    assert peers.dead_peers() == [1]
    return tmp_path / "run" / "error_rank0.log"


def test_a_peer_exiting_just_after_the_failed_collective_is_still_named(monkeypatch):
    """A killed rank's sockets reset this rank's collective a moment before ``/proc`` shows the
    process gone: ``dead_peers(wait=...)`` looks again instead of calling the failure a bug."""
    import time

    from launch.jobs import peers

    late = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.6)"])
    here = peers._here()
    monkeypatch.setattr(peers, "_PEERS", [here, here._replace(pid=late.pid)])
    try:
        assert peers.dead_peers() == []  # alive now
        t0 = time.monotonic()
        assert peers.dead_peers(wait=10.0) == [1]  # a zombie once it exits (not yet reaped)
        assert time.monotonic() - t0 < 5.0
    finally:
        late.wait()


def _misspelled_ds_config_key(tmp_path):
    from megaloss.integrations.deepspeed import load_megaloss_config

    load_megaloss_config({"megaloss": {"tensor_paralel_size": 2}})


def _folder_without_text_files(tmp_path):
    from launch.jobs.text_data import text_files

    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "notes.json").write_text("{}\n")  # not a text suffix (TEXT_SUFFIXES)
    text_files([tmp_path / "data"])


@pytest.mark.parametrize("check", [_misspelled_ds_config_key, _folder_without_text_files],
                         ids=["ds_config_key", "no_text_files"])
def test_a_check_of_the_input_is_one_line_blamed_on_this_rank(tmp_path, capsys, monkeypatch,
                                                             check):
    """megaloss's (or a job's) own ValueError on a rank whose peer has already left: its message,
    one line, naming the log with the traceback; never "rank 1 died" (it used to be
    ``rank 1 died (its process is gone: killed or crashed); this rank stopped with ValueError:
    ...``, after a traceback on every rank)."""
    log = _this_node_with_rank1_gone(monkeypatch, tmp_path)
    with pytest.raises(ValueError) as raised:
        check(tmp_path)
    assert _exit_status(lambda: check(tmp_path)) == 1
    assert capsys.readouterr().err == ""  # the script prints it, once
    assert (tmp_path / "err.rank00000").read_text() == (
        f"ValueError: {raised.value} (traceback in {log})\n")
    kept = log.read_text()
    assert "Traceback (most recent call last)" in kept and str(raised.value) in kept
    # a plain `deepspeed` launch (no script to print it): the rank prints the line, no traceback
    _this_node_with_rank1_gone(monkeypatch, tmp_path, error_file=False)
    assert _exit_status(lambda: check(tmp_path)) == 1
    assert capsys.readouterr().err == f"ValueError: {raised.value} (traceback in {log})\n"


def test_a_peer_that_left_on_its_own_error_is_not_called_dead(tmp_path, capsys, monkeypatch):
    """Rank 1 failed a check and left (its mark: ``err.left00001``); rank 0's collective then
    fails: rank 0 says nothing, rank 1's message is the cause (rank 0 used to report ``rank 1
    died ...`` and, being rank 0, that was the line the script showed)."""
    _this_node_with_rank1_gone(monkeypatch, tmp_path)
    (tmp_path / "err.left00001").write_text("")

    def collective():
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                           "closed by peer [127.0.0.1]:29500")

    assert _exit_status(collective) == 1
    assert capsys.readouterr().err == "" and not (tmp_path / "err.rank00000").exists()


def test_a_killed_peer_is_named_and_the_traceback_kept(tmp_path, capsys, monkeypatch):
    """Rank 1 gone without a word (SIGKILL, a crash): rank 0 names it, one line; the failed
    collective's traceback (61 lines under the LM job) goes to the log only."""
    log = _this_node_with_rank1_gone(monkeypatch, tmp_path)

    def collective():
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")

    assert _exit_status(collective) == 1
    assert capsys.readouterr().err == ""
    assert (tmp_path / "err.rank00000").read_text() == (
        "rank 1 died (its process is gone: killed or crashed); this rank stopped with "
        f"RuntimeError: Connection closed by peer [127.0.0.1]:29500 (traceback in {log})\n")
    assert "Traceback (most recent call last)" in log.read_text()


def test_a_killed_peer_is_named_when_another_survivor_marked_leaving(tmp_path, capsys,
                                                                     monkeypatch):
    """Three ranks, rank 2 killed: ranks 0 and 1 both see their collective fail and both mark
    leaving (``run_job`` marks before it reports). Rank 0 finds rank 1's mark, and must still
    name rank 2, whose process is gone without one (it said nothing: both survivors took the
    other's mark for the cause, and the run ended with status 1 and no reason)."""
    from launch.jobs import peers

    log = _this_node_with_rank1_gone(monkeypatch, tmp_path)
    survivor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        here = peers._here()
        killed = peers._PEERS[1]
        monkeypatch.setattr(peers, "_PEERS", [here, here._replace(pid=survivor.pid), killed])
        (tmp_path / "err.left00001").write_text("")  # the other survivor's mark

        def collective():
            raise RuntimeError("Connection closed by peer [127.0.0.1]:29500")

        assert _exit_status(collective) == 1
        assert capsys.readouterr().err == ""
        assert (tmp_path / "err.rank00000").read_text() == (
            "rank 2 died (its process is gone: killed or crashed); this rank stopped with "
            f"RuntimeError: Connection closed by peer [127.0.0.1]:29500 (traceback in {log})\n")
    finally:
        survivor.kill()
        survivor.wait()


def test_only_megaloss_and_the_jobs_own_raises_are_input_checks(tmp_path):
    import json

    from launch.jobs.processes import is_input_check

    def caught(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the test looks at it
            return e
        raise AssertionError("no error")

    assert is_input_check(caught(lambda: _misspelled_ds_config_key(tmp_path)))
    assert is_input_check(caught(lambda: _folder_without_text_files(tmp_path)))
    assert not is_input_check(caught(lambda: int("x")))  # raised here, not by megaloss
    assert not is_input_check(caught(lambda: json.loads("{")))  # inside the json module
    assert not is_input_check(caught(lambda: (_ for _ in ()).throw(RuntimeError("bug"))))


def _agreed_failure(rank, world_size):
    def fail():
        raise SystemExit(f"refused on rank {rank}")
    try:
        agreed(fail, everywhere=True)
    except AgreedExit as e:
        return "told", e.code, e.message
    except SystemExit as e:
        return "own", e.code, str(e.code)
    return "none", None, None


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_agreed_failure_is_reported_by_one_rank():
    """Every rank fails: the first reports its own cause, the others exit 1 silently naming it
    (they used to print "error on rank 0 ..." too, interleaved with rank 0's line)."""
    results = run_distributed(_agreed_failure, 2)
    assert results[0] == ("own", "refused on rank 0", "refused on rank 0")
    assert results[1] == ("told", 1, "error on rank 0 (set-up): refused on rank 0")


def test_empty_files_inside_a_folder_are_fine_unless_all_are(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "__init__.py").write_text("")
    _text(tmp_path / "d" / "mod.py")
    held = _text(tmp_path / "held.py")
    args = _lm_args(tmp_path, "--train_data", str(tmp_path / "d"), "--eval_data",
                    str(held))
    tok, train_stream, eval_stream, info, key = load_data(args)
    assert info["train_files"] == 2 and train_stream.numel() > 100 and len(key) == 16
    (tmp_path / "d" / "mod.py").write_text("  \n")
    with pytest.raises(SystemExit, match=r"--train_data: all 2 files are empty"):
        load_data(args)


def test_too_short_text_says_which_and_what_to_change(tmp_path):
    import torch
    with pytest.raises(SystemExit) as err:
        make_blocks(torch.arange(5), 128, "held-out", 1)
    assert str(err.value) == ("held-out text (1 file) holds 5 tokens, fewer than one block of "
                              "--seq_len + 1 = 129; give more text or a smaller --seq_len")


def test_unsplittable_folder_mentions_eval_fraction(tmp_path):
    for name in "abcd":
        _text(tmp_path / f"{name}.py")
    args = _lm_args(tmp_path, "--train_data", str(tmp_path), "--eval_fraction", "0")
    with pytest.raises(SystemExit) as err:
        load_data(args)
    msg = str(err.value)
    assert msg.startswith("cannot split 4 files into train and held-out with --eval_fraction 0.0")
    assert "pass --eval_data, or another --eval_fraction" in msg


def test_embed_job_names_missing_pairs(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("")
    args = train_embed.parse_args(["--train_data", str(empty), "--cache_dir", str(tmp_path / "c")])
    with pytest.raises(SystemExit) as err:
        load_pairs_cached(args)
    assert str(err.value).startswith(f"no training pairs in --train_data {empty}: it needs "
                                     "functions with a docstring")
    assert f"empty: {empty}" in str(err.value)


def _launch_failing(script, args, tmp_path):
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
           "--master_port", str(free_port()), str(script), *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=launcher_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=400)
    assert proc.returncode != 0, proc.stdout[-3000:]
    return proc.stdout


def _embed_failure(tmp_path, case):
    """The embedding job launched on data that fails on rank 0 before training. Returns the
    cause it must name and the launch's output."""
    if case == "empty_py":  # every rank sees it: no pairs, before any training collective
        data = tmp_path / "empty.py"
        data.write_text("")
        cause = f"no training pairs in --train_data {data}"
    else:  # only local rank 0 reads the sources (then caches the pairs): agreed failure
        data = tmp_path / "pairs.jsonl"
        data.write_text('{"query": "add two numbers", "document": "def add(a, b): ..."}\n'
                        "not json\n")
        cause = f"{data}:2: not valid JSON"
    output = _launch_failing(REPO / "launch" / "train_embed.py",
                             ["--train_data", str(data), "--cache_dir", str(tmp_path / "cache"),
                              "--output_dir", str(tmp_path / "out"), "--no_progress"], tmp_path)
    return cause, output


def _run_script(args, cwd, timeout=280, env=None):
    proc = subprocess.run(["bash", str(REPO / "launch" / "train_lm.sh"), *args], cwd=cwd,
                          env=script_env(env, TMPDIR=str(cwd)), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def background_jobs(folder, env):
    """The script's own argument check, started with the session (tests/conftest.py): a
    subprocess that imports torch (~2.5 s) runs on the core the fast tier leaves idle."""
    return {"bad_steps": lambda: _run_script(["--steps", "-5"], folder, timeout=100, env=env)}


def _refused_rerun(tmp_path):
    """``bash launch/train_lm.sh`` into a folder that already holds a run. Returns the folder,
    the exit status and the output."""
    out = tmp_path / "runs" / "lm"
    out.mkdir(parents=True)
    (out / "summary.json").write_text(json.dumps({"steps": 1}))
    rc, output = _run_script(["--output_dir", str(out), "--no_progress", "--cache_dir",
                              str(tmp_path / "cache")], tmp_path, timeout=400)
    return out, rc, output


def _killed_rank(tmp_path):
    """The LM job launched for (nearly) ever; once it saved a checkpoint, SIGKILL to rank 1.
    Returns the run folder, the output, the launcher's exit status and the seconds from the
    kill until every process had closed the output (None: not within 90 s)."""
    import signal
    import threading
    import time

    import psutil

    from launch.jobs.code_search import stdlib_root
    from tests.helpers.launch_helpers import wait_until

    root, out = stdlib_root(), tmp_path / "out"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
           str(free_port()), str(REPO / "launch" / "train_lm.py"), "--train_data",
           str(root / "json"), "--eval_data", str(root / "textwrap.py"), "--model_size", "tiny",
           "--seq_len", "32", "--vocab_size", "300", "--eval_blocks", "4", "--eval_every", "0",
           "--steps", "100000", "--save_every", "2", "--no_progress", "--output_dir", str(out),
           "--cache_dir", str(tmp_path / "cache")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=launcher_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_until(lambda: (out / "checkpoints" / "latest").exists(), 360, "a checkpoint",
                   alive=lambda: proc.poll() is None)
        launch_py = psutil.Process(proc.pid).children()[0]
        rank1 = [c for c in launch_py.children() if "--local_rank=1" in c.cmdline()]
        assert len(rank1) == 1
        rank1[0].kill()
        t0 = time.monotonic()
        reader.join(90)
        exited = None if reader.is_alive() else time.monotonic() - t0
        rc = proc.wait(30) if exited is not None else None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return out, "".join(lines), rc, exited


def _failing_ranks(tmp_path, how, num_procs):
    """``tests/helpers/failing_ranks.py`` under ``deepspeed --num_gpus num_procs`` failing ``how``,
    with ``MEGALOSS_ERROR_FILE`` set as ``launch/multinode.sh`` sets it. Returns the run folder,
    the launcher's status, its output and ``{file name: text}`` of what the ranks left there."""
    out, base = tmp_path / "out", tmp_path / "megaloss-error"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_procs),
           "--master_port", str(free_port()), str(REPO / "tests" / "helpers" / "failing_ranks.py"),
           "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          env=launcher_env(MEGALOSS_ERROR_FILE=str(base), MEGALOSS_FAILURE=how),
                          text=True, timeout=300)
    left = {p.name: p.read_text() for p in sorted(tmp_path.glob("megaloss-error.*"))}
    return out, proc.returncode, proc.stdout, left


# The runs under the launcher, started together by the fixture ``launches``, two at a time (one
# per core; the longest first): name -> function(tmp_path) of what its test asserts on.
_LAUNCHES = {"killed_rank": _killed_rank, "empty_py": lambda t: _embed_failure(t, "empty_py"),
             "bad_jsonl": lambda t: _embed_failure(t, "bad_jsonl"),
             "refused_rerun": _refused_rerun,
             "layout": lambda t: _failing_ranks(t, "layout", 3),
             "peer_check": lambda t: _failing_ranks(t, "peer_check", 2)}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every run of ``_LAUNCHES`` started in the background, two at a time (each is its own
    ``deepspeed`` launch: its own session, port and folder): ``{name: Future}``; a test takes
    its run's result (or its error) with ``.result()``, while the others go on."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {name: pool.submit(run, tmp_path_factory.mktemp(name))
               for name, run in _LAUNCHES.items()}


def _launched(test):
    """The marks of a test on a run of ``launches``: slow tier, one xdist worker for them all
    (the fixture runs once per worker), and a timeout that covers waiting for its launch and
    the one before it in the same slot."""
    for mark in (pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.slow,
                 pytest.mark.xdist_group("run_errors_launches"), pytest.mark.timeout(600)):
        test = mark(test)
    return test


@_launched
@pytest.mark.parametrize("case", ["empty_py", "bad_jsonl"])
def test_embed_failure_on_rank0_is_what_the_launcher_shows_last(launches, case):
    cause, output = launches[case].result()
    assert "Connection closed by peer" not in output and "Connection reset" not in output
    lines = [ln for ln in output.splitlines() if ln.strip()]
    # what a user reads last: the ranks' messages (rank 0's may come with its traceback), then
    # the launcher's own three closing lines
    tail = "\n".join(lines[-40:])
    assert cause in "\n".join(lines[-6:]) or tail.count(cause) >= 1, output[-4000:]
    if case == "bad_jsonl":  # reported once, by rank 0 (its traceback); rank 1 exits silently
        assert output.count(cause) == 1 and "error on rank 0" not in output, output[-4000:]
    assert "terminate called" not in output


@pytest.mark.timeout(1500)  # it waits for the background jobs before its own (nice 10)
@pytest.mark.background("bad_steps")
def test_script_checks_arguments_before_the_launcher_starts(background):
    rc, output = background
    assert rc == 2 and output.count("--steps must be >= 1") == 1, output
    assert "Killing subprocess" not in output and "cmd = " not in output, output


@_launched
def test_a_refused_rerun_is_one_line_before_any_rank(launches):
    """A second run into a folder that holds one: the pre-flight check refuses it before the
    launcher starts (status 2, the one line under the script's name), offering --overwrite and
    not --resume (there is no checkpoint to continue). It used to be refused by rank 0 after the
    launch (~40 s, status 1, printed by rank 0 and again by the script, and before that an exit
    in rc 250, "terminate called without an active exception")."""
    out, rc, output = launches["refused_rerun"].result()
    tmp_path = out.parents[1]
    refusal = (f"{out} already holds a run (summary.json) but no checkpoint to continue it from; "
               "pass --overwrite to replace it, or another --output_dir")
    lines = output.splitlines()
    assert rc == 2, output[-3000:]
    assert output.count(refusal) == 1 and "--resume" not in output, output[-3000:]
    assert lines[-1] == f"train_lm.sh: error: {refusal}", output[-3000:]
    assert "Killing subprocess" not in output and "cmd = " not in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert not list(tmp_path.glob("megaloss-error*")) and os.listdir(out) == ["summary.json"]


@_launched
def test_a_killed_rank_is_named_and_the_others_exit(launches):
    """SIGKILL to rank 1 mid-run: rank 0 exits within a bounded time (its next collective fails)
    with a last line naming rank 1, and the run's ``latest`` stays on a complete checkpoint."""
    out, output, rc, exited = launches["killed_rank"].result()
    assert exited is not None, f"the other rank did not exit within 90 s:\n{output[-3000:]}"
    assert rc != 0 and exited < 90, (rc, exited)
    assert "rank 1 died (its process is gone: killed or crashed); this rank stopped with" \
        in output, output[-3000:]
    # the failed collective's traceback (61 lines) is in the log the line names, not printed
    assert f"(traceback in {out / 'error_rank0.log'})" in output, output[-3000:]
    assert "Traceback (most recent call last)" not in output, output[-3000:]
    assert "Traceback (most recent call last)" in (out / "error_rank0.log").read_text()
    tag = (out / "checkpoints" / "latest").read_text()
    assert (out / "checkpoints" / tag / "rng_state_rank00001.pt").exists()


@_launched
def test_ranks_failing_one_check_report_it_once_without_a_traceback(launches):
    """3 ranks, TP=2: every rank fails megaloss's layout check; rank 0 after the others have
    left. One message for the script to print, rank 0's own (it used to be "rank 1 died ...;
    this rank stopped with ValueError", after 3 tracebacks), its traceback in the run folder."""
    out, rc, output, left = launches["layout"].result()
    cause = ("tensor_parallel_size=2 x sequence_parallel_size=1 does not divide the world "
             "size 3")
    assert rc == 1, output[-3000:]
    assert left["megaloss-error.rank00000"] == (
        f"ValueError: {cause} (traceback in {out / 'error_rank0.log'})\n"), left
    assert not any("died" in text for text in left.values()), left
    # the ranks print nothing of it: launch/train_*.sh prints the lowest rank's file, once
    assert cause not in output and "Traceback" not in output, output[-3000:]
    assert cause in (out / "error_rank0.log").read_text()


@_launched
def test_a_rank_whose_peer_left_on_its_own_error_says_nothing(launches):
    """Rank 1 fails a ds_config check while rank 0 waits in a barrier: rank 0's barrier fails,
    and it neither calls rank 1 dead nor prints the barrier's traceback; rank 1's message is
    the one the script prints."""
    out, rc, output, left = launches["peer_check"].result()
    assert rc == 1, output[-3000:]
    assert "megaloss-error.rank00000" not in left, left
    assert left["megaloss-error.rank00001"].startswith(
        "ValueError: invalid ds_config section: megaloss.tensor_paralel_size: Extra inputs are "
        "not permitted (got 2)"), left
    assert f"(traceback in {out / 'error_rank1.log'})" in left["megaloss-error.rank00001"]
    assert "died" not in output and "Traceback" not in output, output[-3000:]
