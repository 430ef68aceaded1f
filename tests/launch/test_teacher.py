"""The distillation job's teacher loading (``launch/jobs/teacher.py``) on hand-made DeepSpeed
model files of a TP=2 run: the full lm_head is the two vocab shards concatenated (the padding
rows of the last shard cut off later), and a checkpoint of other data, of ZeRO-3, or with a
missing shard is refused with the option to change."""
import pytest
import torch

from launch.jobs.teacher import build_teacher, load_teacher_state

V, H, TP = 9, 4, 2  # Vp = 5: the second shard holds 4 real rows and 1 padding row


def _write(folder, full_head, *, zero_stage=2, files=TP, data_key="key"):
    folder.mkdir(parents=True)
    rows = -(-V // TP)
    padded = torch.cat([full_head, torch.zeros(rows * TP - V, H)])
    decoder = {"model.model.norm.weight": torch.ones(H)}
    for r in range(files):
        module = {**decoder, "model.lm_head.weight": padded[r * rows:(r + 1) * rows].clone()}
        torch.save({"module": module, "mp_world_size": TP,
                    "job": {"data_key": data_key, "steps_done": 7, "seed": 0},
                    "megaloss": {"layout": {"tp": TP, "zero_stage": zero_stage}}},
                   folder / f"mp_rank_{r:02d}_model_states.pt")
    return folder


def test_full_head_is_the_shards_concatenated(tmp_path):
    head = torch.randn(V, H, dtype=torch.float64).float()
    state, job, folder = load_teacher_state(str(_write(tmp_path / "step_7", head)))
    assert folder.name == "step_7" and job["steps_done"] == 7
    assert state["model.lm_head.weight"].shape == (10, H)
    assert torch.equal(state["model.lm_head.weight"][:V], head)
    assert torch.equal(state["model.lm_head.weight"][V:], torch.zeros(1, H))
    assert torch.equal(state["model.model.norm.weight"], torch.ones(H))


def test_refusals_name_the_cause(tmp_path):
    head = torch.randn(V, H)
    with pytest.raises(SystemExit, match="ZeRO-3"):
        load_teacher_state(str(_write(tmp_path / "z3", head, zero_stage=3)))
    with pytest.raises(SystemExit, match="1 model files .* TP=2"):
        load_teacher_state(str(_write(tmp_path / "one", head, files=1)))
    with pytest.raises(SystemExit, match="no checkpoint"):
        load_teacher_state(str(tmp_path / "nothing"))
    with pytest.raises(SystemExit, match="other data or another tokenizer.*--vocab_size"):
        build_teacher(str(_write(tmp_path / "other", head, data_key="old")), None, V,
                      data_key="new")
    with pytest.raises(SystemExit, match="no lm_head of 12 rows"):
        build_teacher(str(tmp_path / "other"), None, 12, data_key="old")
