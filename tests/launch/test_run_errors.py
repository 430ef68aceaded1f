"""Errors that name their cause (one test per case):

- an empty train or eval file is named and called empty (it used to be ``ValueError: 1 tokens
  cannot fill one block of 129``); text too short for one block says which and what to change;
- a folder of files that the held-out split cannot divide mentions ``--eval_fraction`` as well as
  ``--eval_data``;
- under the launcher, when rank 0 fails before the first collective of training (the embedding
  job's empty data; a bad JSONL line that only rank 0 reads), the output's last lines name the
  cause, not another rank's ``Connection closed by peer``.

The single-process cases are in the fast tier; the launcher runs are slow.
The misspelled ``"megalos"`` section is in tests/integrations/test_deepspeed_config.py.
"""
import subprocess
import sys

import pytest
from launch_helpers import REPO, launcher_env

from launch import train_embed, train_lm
from launch.jobs.lm_data import load_data, make_blocks
from launch.jobs.pair_data import load_pairs_cached
from megaloss.testing import free_port


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
                          stderr=subprocess.STDOUT, text=True, timeout=280)
    assert proc.returncode != 0, proc.stdout[-3000:]
    return proc.stdout


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["empty_py", "bad_jsonl"])
def test_embed_failure_on_rank0_is_what_the_launcher_shows_last(tmp_path, case):
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
    assert "Connection closed by peer" not in output and "Connection reset" not in output
    lines = [ln for ln in output.splitlines() if ln.strip()]
    # what a user reads last: the ranks' messages (rank 0's may come with its traceback), then
    # the launcher's own three closing lines
    tail = "\n".join(lines[-40:])
    assert cause in "\n".join(lines[-6:]) or tail.count(cause) >= 2, output[-4000:]
    if case == "bad_jsonl":  # the rank that did not read the file names rank 0's cause
        assert "error on rank 0 (extracting the code-search pairs): ValueError: " + cause in tail
