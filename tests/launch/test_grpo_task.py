"""The GRPO job's task, reward, advantages and rollout layout (launch/jobs/grpo_task.py,
launch/jobs/rollout.py) against values written out by hand."""
import pytest
import torch

from launch.jobs.grpo_task import ListTask
from launch.jobs.rollout import group_advantages, make_rollout


def _task(kind="reverse"):
    return ListTask(kind=kind, items=(10, 11, 12, 13), prefix_ids=(1, 2), arrow_ids=(3,),
                    length=3, eval_fraction=0.25)


def test_prompts_answers_and_partial_credit_reward():
    task = _task()
    lists = torch.tensor([[0, 1, 3], [2, 2, 0]])
    assert task.prompts(lists).tolist() == [[1, 2, 10, 11, 13, 3], [1, 2, 12, 12, 10, 3]]
    assert task.answers(lists).tolist() == [[13, 11, 10], [10, 12, 12]]
    assert _task("sort").answers(lists).tolist() == [[10, 11, 13], [10, 12, 12]]
    completions = torch.tensor([[13, 11, 10], [12, 12, 12]])
    assert task.reward(completions, task.answers(lists)).tolist() == pytest.approx([1.0, 2 / 3])
    with pytest.raises(ValueError, match="completions must be"):
        task.reward(completions[:, :2], task.answers(lists))


def test_held_out_lists_are_never_drawn_for_training():
    task = _task()
    g = torch.Generator().manual_seed(0)
    train = task.draw(200, g, held_out=False)
    held = task.draw(50, g, held_out=True)
    assert not any(task.is_held_out(r.tolist()) for r in train)
    assert all(task.is_held_out(r.tolist()) for r in held)


def test_group_advantages_and_rollout_layout():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    a = group_advantages(r, 2)
    std = 0.5 ** 0.5  # unbiased std of (1, 0); that of (0.5, 0.5) is 0
    assert a.tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.0, 0.0],
                                       rel=1e-6)
    assert group_advantages(r, 2, scale_rewards=False).tolist() == [0.5, -0.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="multiple of 3"):
        group_advantages(r, 3)
    prompts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    completions = torch.tensor([[7, 8], [9, 9], [8, 7], [0, 0]])
    ro = make_rollout(prompts, completions, r.float(), 2)
    assert ro.input_ids[1].tolist() == [1, 2, 3, 9, 9] and ro.input_ids[2].tolist()[:3] == [4, 5, 6]
    assert ro.completion_mask.tolist() == [[0, 0, 1, 1, 0]] * 4  # the next token is a completion
    mbs = ro.micro_batches(2)
    assert [mb["input_ids"].shape[0] for mb in mbs] == [2, 2] and "old_log_probs" not in mbs[0]
