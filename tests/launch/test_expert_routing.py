"""The MoE job's routing figures (launch/jobs/expert_routing.py) on counts whose answers are
known by hand, the domain of a file, and the counts of a decoder's router logits against a
one-hot count of its top-k choices."""
from pathlib import Path

import torch

from launch.jobs.expert_routing import (
    TOP_LEVEL,
    domain_of,
    expert_load,
    lift,
    routing_counts,
    specialisation,
)


def test_load_and_specialisation_by_hand():
    counts = torch.tensor([[4.0, 4.0, 4.0, 4.0],     # balanced
                           [10.0, 6.0, 0.0, 0.0],    # two experts take everything
                           [7.0, 5.0, 3.0, 1.0]], dtype=torch.float64)
    assert expert_load(counts) == [1.0, 2.5, 7.0 / 4.0]
    assert specialisation(counts, top_k=2) == [0.5, 1.0, 12.0 / 16.0]


def test_lift_is_the_share_beyond_the_corpus_share():
    domain = torch.tensor([[6.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    corpus = torch.tensor([[3.0, 3.0, 1.0, 1.0]], dtype=torch.float64)
    assert lift(domain, corpus, top_k=2) == [1.0 - 0.75]
    assert lift(corpus, corpus, top_k=2) == [0.0]


def test_domain_of(tmp_path):
    root = tmp_path / "lib"
    assert domain_of(root / "email" / "mime" / "text.py", root) == "email"
    assert domain_of(root / "json" / "decoder.py", root) == "json"
    assert domain_of(root / "os.py", root) == TOP_LEVEL
    assert domain_of(Path("/elsewhere/x/y.py"), root) == TOP_LEVEL


class _Router(torch.nn.Module):
    """A decoder stand-in: two 'layers' of fixed router logits per token id."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = torch.randn(2, 11, 5, generator=g)

    def forward(self, input_ids, output_router_logits, use_cache):
        assert output_router_logits and not self.training
        ids = input_ids.reshape(-1)
        return type("Out", (), {"router_logits": tuple(t[ids] for t in self.table)})


def test_routing_counts_are_the_top_k_choices():
    model = _Router().train()
    batches = [{"input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]])},
               {"input_ids": torch.tensor([[7, 8, 9], [10, 0, 1]])}]
    from megaloss.parallel.groups import SINGLE_RANK

    counts = routing_counts(model, 2, batches, "cpu", SINGLE_RANK)
    ids = torch.cat([b["input_ids"].reshape(-1) for b in batches])
    top = model.table[:, ids].topk(2, dim=-1).indices  # [layers, tokens, 2]
    expected = torch.nn.functional.one_hot(top, 5).sum((1, 2)).to(torch.float64)
    assert torch.equal(counts, expected) and model.training  # mode put back
