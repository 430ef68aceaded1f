"""``--resume PATH`` checks the checkpoint's files before it changes anything in the run folder:
a damaged checkpoint other than the one ``latest`` names is refused with its path, and ``latest``
still names the last good one (it used to be pointed at the damaged branch first, so every later
plain ``--resume`` failed too until ``latest`` was edited by hand)."""
import argparse

import pytest

from launch.jobs.checkpoints import open_run


def test_a_damaged_branch_does_not_move_latest(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for tag in ("step_10", "step_20"):
        (ckpts / tag).mkdir(parents=True)
        (ckpts / tag / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04 cut short")
    (ckpts / "latest").write_text("step_20")
    args = argparse.Namespace(resume=str(ckpts / "step_10"), overwrite=False, eval_only=False)
    with pytest.raises(SystemExit, match="step_10.*truncated or corrupted"):
        open_run(args, tmp_path, {})
    assert (ckpts / "latest").read_text() == "step_20"
