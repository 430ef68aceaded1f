"""The pre-flight check (``launch/jobs/preflight.py`` through ``python -m launch.jobs.check_args``,
what ``launch/multinode.sh`` runs before the launcher starts any rank): every everyday mistake is
refused in one line under the script's name, exit status 2, naming the argument, the value and
the fix, with no usage block unless the command line itself does not parse.

Each case used to reach the ranks (35-45 s, the message printed by every rank, often with a
traceback) or, for a binary given as both --train_data and --eval_data, to train on it. The
in-process cases are in the fast tier; ``test_the_script_refuses_before_any_rank`` runs
``launch/train_lm.sh`` itself (slow: a Python start-up per case).
"""
import json
import os
import subprocess
import time

import pytest

from launch.jobs import check_args
from tests.helpers.launch_helpers import REPO, script_env

PROG = "train_lm.sh"


def _text(path, n=40):
    path.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(n)))
    return path


def _refusal(capsys, monkeypatch, argv, world=2, job="train_lm"):
    """``check_args.main`` on ``argv`` as multinode.sh runs it: (exit status, stderr lines)."""
    monkeypatch.setenv("MEGALOSS_PROG", PROG)
    monkeypatch.setenv("MEGALOSS_WORLD_SIZE", str(world) if world else "")
    with pytest.raises(SystemExit) as err:
        check_args.main([job, *argv])
    return err.value.code, capsys.readouterr().err.strip().splitlines()


def _one_line(capsys, monkeypatch, argv, expected, **kw):
    code, lines = _refusal(capsys, monkeypatch, argv, **kw)
    assert code == 2, lines
    assert len(lines) == 1, lines  # no usage block, no traceback, once
    assert lines[0].startswith(f"{PROG}: error: "), lines
    for part in expected:
        assert part in lines[0], lines
    return lines[0]


def _config(tmp_path, **extra):
    cfg = json.loads((REPO / "configs" / "zero2.json").read_text())
    for key, value in extra.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_an_empty_train_file(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _one_line(capsys, monkeypatch, ["--train_data", str(empty)],
              [f"--train_data file {empty} is empty"])


@pytest.mark.parametrize("with_eval", [False, True], ids=["train", "train+eval"])
def test_a_binary_is_refused_as_text(tmp_path, capsys, monkeypatch, with_eval):
    binary = tmp_path / "prog"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4)
    argv = ["--train_data", str(binary)] + (["--eval_data", str(binary)] if with_eval else [])
    _one_line(capsys, monkeypatch, argv, [f"--train_data {binary} is not text", "NUL byte"])


def test_an_undecodable_eval_file(tmp_path, capsys, monkeypatch):
    good = _text(tmp_path / "good.py")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 20)
    _one_line(capsys, monkeypatch, ["--train_data", str(good), "--eval_data", str(latin)],
              [f"--eval_data {latin} is not UTF-8 text", "0xe9 at offset 3"])


def test_a_folder_without_text_files(tmp_path, capsys, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.bin").write_bytes(b"\0\1")
    line = _one_line(capsys, monkeypatch, ["--train_data", str(tmp_path / "data")],
                     ["--train_data: no text files (.py, .txt, .md, .rst)"])
    assert "Traceback" not in line and "ValueError" not in line


def test_a_folder_is_taken_as_the_job_takes_it(tmp_path, capsys, monkeypatch):
    """A whitespace-only file inside a named folder passes, as in the job's own check
    (``text_data.check_texts``: the pre-flight refused it as empty); a folder of nothing else
    does not."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "__init__.py").write_text("\n")
    _text(tmp_path / "data" / "mod.py")
    held = _text(tmp_path / "held.py")
    monkeypatch.setenv("MEGALOSS_PROG", PROG)
    monkeypatch.setenv("MEGALOSS_WORLD_SIZE", "2")
    check_args.main(["train_lm", "--train_data", str(tmp_path / "data"),
                     "--eval_data", str(held)])
    (tmp_path / "data" / "mod.py").write_text("  \n")
    _one_line(capsys, monkeypatch, ["--train_data", str(tmp_path / "data"),
                                    "--eval_data", str(held)],
              ["--train_data: all 2 files are empty"])


def test_a_split_that_leaves_nothing_held_out(tmp_path, capsys, monkeypatch):
    good = _text(tmp_path / "good.py")
    _one_line(capsys, monkeypatch, ["--train_data", str(good)],
              ["cannot split 1 files into train and held-out", "--eval_data"])


def test_a_misspelled_megaloss_key_gets_did_you_mean(tmp_path, capsys, monkeypatch):
    cfg = _config(tmp_path, megaloss={"tensor_paralel_size": 2})
    _one_line(capsys, monkeypatch, ["--deepspeed_config", cfg],
              [f"--deepspeed_config {cfg}", "megaloss.tensor_paralel_size",
               "did you mean 'megaloss.tensor_parallel_size'?"])


def test_a_misspelled_deepspeed_key_is_refused(tmp_path, capsys, monkeypatch):
    """DeepSpeed would ignore it (the run going on without gradient clipping)."""
    cfg = _config(tmp_path, gradient_clippin=1.0)
    _one_line(capsys, monkeypatch, ["--deepspeed_config", cfg],
              ["'gradient_clippin'", "did you mean 'gradient_clipping'?"])


def test_a_layout_that_does_not_divide_the_processes(capsys, monkeypatch):
    _one_line(capsys, monkeypatch, [], ["tensor_parallel_size 2", "does not divide the 3 "
                                        "processes", "NUM_PROCS to a multiple of 2"], world=3)
    _one_line(capsys, monkeypatch, ["--sequence_parallel_size", "2"],
              ["sequence_parallel_size 2", "= 4 ranks", "the 2 processes"], world=2)
    check_args.main(["train_lm"])  # unknown world size: not checked


def test_deepspeeds_batch_arithmetic(tmp_path, capsys, monkeypatch):
    cfg = _config(tmp_path, train_batch_size=64)  # micro 4 x GAS 2 x DP 2 = 16 in zero2.json
    micro = json.loads((REPO / "configs" / "zero2.json").read_text())
    expected = micro["train_micro_batch_size_per_gpu"] * micro.get(
        "gradient_accumulation_steps", 1) * 2
    _one_line(capsys, monkeypatch, ["--deepspeed_config", cfg],
              ["train_batch_size 64 is not", f"set it to {expected}"], world=4)
    monkeypatch.setenv("MEGALOSS_WORLD_SIZE", "4")
    check_args.main(["train_lm", "--deepspeed_config",
                     _config(tmp_path, train_batch_size=expected)])  # fine


def test_not_json_is_one_line_without_usage(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "ds.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 2,')
    _one_line(capsys, monkeypatch, ["--deepspeed_config", str(bad)],
              [f"--deepspeed_config {bad}: not valid JSON"])


def test_a_bad_value_is_one_line_a_bad_option_keeps_the_usage(capsys, monkeypatch):
    _one_line(capsys, monkeypatch, ["--steps", "0"], ["--steps must be >= 1"])
    code, lines = _refusal(capsys, monkeypatch, ["--stepz", "3"])
    assert code == 2 and lines[0].startswith(f"usage: {PROG}") and "--stepz" in lines[-1]


def test_the_embedding_jobs_are_checked_too(tmp_path, capsys, monkeypatch):
    binary = tmp_path / "prog.py"
    binary.write_bytes(b"\0\1\2")
    _one_line(capsys, monkeypatch, ["--train_data", str(binary)],
              [f"--train_data {binary} is not text"], job="train_embed")


def test_a_malformed_jsonl_record_is_one_line(tmp_path, capsys, monkeypatch):
    """A JSON Lines file of pairs with a bad record: one line naming the file and line (it was
    a traceback from the pre-flight itself, status 1)."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"query": "sum two numbers", "document": "def add(a, b): return a + b"}\n'
                     '{"query": "no document"\n')
    _one_line(capsys, monkeypatch, ["--train_data", str(pairs)],
              ["--train_data", f"{pairs}:2: not valid JSON"], job="train_embed")


def test_eval_data_without_train_data_is_one_line(tmp_path, capsys, monkeypatch):
    _one_line(capsys, monkeypatch, ["--eval_data", str(_text(tmp_path / "held.py"))],
              ["--eval_data", "needs train_sources"], job="train_embed")


def _run_folder(path, *names, latest=None):
    """A folder as an earlier run left it: ``names`` (a trailing ``/``: a folder) and, with
    ``latest``, a complete checkpoint of that tag."""
    path.mkdir()
    for name in names:
        (path / name.rstrip("/")).mkdir() if name.endswith("/") else (path / name).write_text("x")
    if latest is not None:
        (path / "checkpoints" / latest).mkdir(parents=True)
        (path / "checkpoints" / "latest").write_text(latest)
    return path


def test_an_output_dir_holding_a_run(tmp_path, capsys, monkeypatch):
    """The refusal rank 0 gave ~40 s into the launch, now before it, offering only the flags that
    apply: --resume only with a checkpoint to continue from."""
    done = _run_folder(tmp_path / "done", "metrics.csv", "summary.json")
    line = _one_line(capsys, monkeypatch, ["--output_dir", str(done)],
                     [f"{done} already holds a run (metrics.csv, summary.json) but no checkpoint",
                      "pass --overwrite to replace it, or another --output_dir"])
    assert "--resume" not in line
    saved = _run_folder(tmp_path / "saved", "metrics.csv", latest="step_4")
    _one_line(capsys, monkeypatch, ["--output_dir", str(saved)],
              ["its latest checkpoint is step_4", "pass --resume to continue it"])
    _one_line(capsys, monkeypatch, ["--output_dir", str(done), "--resume"],
              ["--resume latest: no checkpoint in", "holds a run saved without checkpoints"])
    _one_line(capsys, monkeypatch, ["--output_dir", str(done), "--resume",
                                    str(tmp_path / "nowhere")],
              [f"--resume {tmp_path / 'nowhere'}: "])


def test_an_output_dir_the_flags_settle_passes(tmp_path, monkeypatch):
    """--overwrite, --resume with a checkpoint, and a folder holding only what a run that crashed
    before its first checkpoint left (monitor/, an empty checkpoints/): no refusal."""
    from launch.jobs.preflight import check_output_dir
    from launch.train_lm import parse_args
    done = _run_folder(tmp_path / "done", "metrics.csv")
    saved = _run_folder(tmp_path / "saved", "summary.json", latest="step_2")
    crashed = _run_folder(tmp_path / "crashed", "monitor/", "checkpoints/")
    for argv in (["--output_dir", str(done), "--overwrite"],
                 ["--output_dir", str(saved), "--resume"],
                 ["--output_dir", str(crashed)], ["--output_dir", str(tmp_path / "new")]):
        check_output_dir(parse_args(argv))  # raises Refusal otherwise
    assert sorted(p.name for p in tmp_path.iterdir()) == ["crashed", "done", "saved"]


@pytest.mark.parametrize("job, names, expected", [
    ("train_lm_hf", ("summary.json",), "pass --overwrite to replace it, or another"),
    ("distill_lm", ("ce/",),
     "(ce); pass --overwrite to replace it (a --teacher inside it is kept)"),
], ids=["trainer_job", "distillation_phases"])
def test_jobs_without_resume_refuse_a_used_output_dir(tmp_path, capsys, monkeypatch, job, names,
                                                      expected):
    used = _run_folder(tmp_path / "used", *names)
    _one_line(capsys, monkeypatch, ["--output_dir", str(used)],
              [f"{used} already holds a run", expected], job=job)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_script_refuses_before_any_rank(tmp_path):
    """``bash launch/train_lm.sh`` itself: status 2 in seconds, one line, no rank started."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    hostfile = tmp_path / "hostfile"  # 3 slots in all: the launcher would start 3 ranks
    hostfile.write_text("# two nodes\nworker-0 slots=1\nworker-1 slots=2\n")
    cases = [(["--train_data", str(empty)], {}, f"--train_data file {empty} is empty"),
             ([], {"NUM_PROCS": "3"}, "does not divide the 3 processes"),
             ([], {"HOSTFILE": str(hostfile)}, "does not divide the 3 processes")]
    for argv, env, expected in cases:
        t0 = time.perf_counter()
        out = subprocess.run(["bash", str(REPO / "launch" / "train_lm.sh"), *argv,
                              "--output_dir", str(tmp_path / "run")], cwd=tmp_path,
                             env={**script_env(), **env}, capture_output=True, text=True,
                             timeout=100)
        seconds = time.perf_counter() - t0
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, out.stderr
        assert lines == [f"train_lm.sh: error: {lines[0].split('error: ', 1)[1]}"], lines
        assert expected in lines[0]
        assert "deepspeed" not in out.stdout.lower() and seconds < 30, (seconds, out.stdout)
        assert not (tmp_path / "run").exists()
    assert os.environ.get("MEGALOSS_PROG") is None


@pytest.mark.parametrize("key, value, expected", [
    ("train_micro_batch_size_per_gpu", "8", 'train_micro_batch_size_per_gpu must be a positive '
                                            'int, got "8"'),
    ("gradient_accumulation_steps", -2, "gradient_accumulation_steps must be a positive int, "
                                        "got -2"),
    ("gradient_clipping", -1.0, "gradient_clipping must be a number >= 0, got -1.0"),
    ("zero_optimization", {"stage": 5}, "zero_optimization.stage must be 0, 1, 2 or 3, got 5"),
    ("steps_per_print", True, "steps_per_print must be a positive int, got true"),
])
def test_a_ds_config_number_of_the_wrong_type_or_sign(tmp_path, capsys, monkeypatch, key,
                                                      value, expected):
    """DeepSpeed would take it into its arithmetic after the ranks start (a traceback 15 s
    later), or not clip at all."""
    cfg = _config(tmp_path, **{key: value})
    _one_line(capsys, monkeypatch, ["--deepspeed_config", cfg], [expected])
