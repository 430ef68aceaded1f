"""The preference job's pairs (launch/jobs/preference_data.py): deterministic in the generator,
chosen the real continuation, rejected a different one of the same length (``other``: from
another offset; ``swap``: two neighbouring tokens exchanged; ``shuffle``: the same tokens), and
the batch layout the step and the SFT phase read."""
import pytest
import torch

from launch.jobs.preference_data import (
    REJECTED_KINDS,
    Pairs,
    draw_pairs,
    pair_batch,
    sft_batch,
)


def _draw(kind, stream=None, n=64, seed=0):
    stream = torch.arange(5000) if stream is None else stream
    return draw_pairs(stream, n, 6, 5, kind, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", REJECTED_KINDS)
def test_chosen_is_the_real_continuation_and_rejected_differs(kind):
    pairs = _draw(kind)
    again = _draw(kind)
    assert all(torch.equal(a, b) for a, b in zip(pairs, again))  # deterministic
    assert not torch.equal(pairs.prompts, _draw(kind, seed=1).prompts)
    # on arange the real continuation follows the prompt's last token
    assert torch.equal(pairs.chosen[:, 0], pairs.prompts[:, -1] + 1)
    assert torch.equal(pairs.chosen.diff(dim=1), torch.ones(64, 4, dtype=torch.long))
    assert pairs.rejected.shape == pairs.chosen.shape
    assert (pairs.rejected != pairs.chosen).any(-1).all()
    if kind == "swap":
        assert ((pairs.rejected != pairs.chosen).sum(-1) == 2).all()
    if kind != "other":
        assert torch.equal(pairs.rejected.sort(-1).values, pairs.chosen.sort(-1).values)


def test_a_continuation_a_shuffle_cannot_change_takes_another_one():
    pairs = _draw("shuffle", n=4000, stream=torch.cat([torch.zeros(40, dtype=torch.long),
                                                       torch.arange(1, 4001)]))
    flat = (pairs.chosen == pairs.chosen[:, :1]).all(-1)
    assert flat.any()
    assert (pairs.rejected[flat] != pairs.chosen[flat]).any(-1).all()


def test_batches():
    pairs = Pairs(torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5]]), torch.tensor([[9, 8]]))
    b = pair_batch(pairs)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 9, 8]]
    assert b["shift_labels"].tolist() == [[-100, -100, 4, 5, -100], [-100, -100, 9, 8, -100]]
    s = sft_batch(pairs)
    assert s["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert s["shift_labels"].tolist() == [[2, 3, 4, 5, -100]]


def test_refusals():
    with pytest.raises(ValueError, match="kind must be one of"):
        _draw("reverse")
    with pytest.raises(ValueError, match="fewer than one prompt and continuation"):
        _draw("other", stream=torch.arange(10))
