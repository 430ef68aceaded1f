"""Multi-token prediction in the one calibrated step
(``megaloss.integrations.step.mtp.MultiTokenPredictionStepLoss``): 2 gloo ranks (DP 2, and SP 2
cutting the sequences), 2 micro-batches per rank of uneven rows and valid tokens, 2 depths: the
update of one SGD step (lr 1) and every depth's logged CE equal one device's on the whole global
batch in float64, where each depth is the token mean over *its own* valid rolled targets (a
depth's last ``k`` positions of each sequence have none). Tolerance 1e-10 relative.

The module is token-wise (each depth's hidden state a function of its own position's), so a
sequence cut over SP ranks is computed exactly as whole; the depths' targets are rolled on the
full sequences before the cut, as the step does.
"""
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megaloss.testing import run_distributed

VOCAB, HIDDEN, DEPTH, SCALE = 23, 8, 2, 0.3


class ToyMTP(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64))
        self.depths = nn.Parameter(torch.randn(DEPTH, HIDDEN, HIDDEN, generator=g,
                                               dtype=torch.float64) * 0.5)
        self.head = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64))

    def hidden(self, input_ids):
        h = torch.tanh(self.embed[input_ids])
        return h, [torch.tanh(h @ self.depths[k]) for k in range(DEPTH)]

    def forward(self, input_ids, shift_labels=None, loss_weights=None, mtp_labels=None, **_):
        from megaloss.losses.multi_token import multi_token_prediction_loss
        from megaloss.ops.cross_entropy_options import CrossEntropyOptions

        h, depths = self.hidden(input_ids)
        out = multi_token_prediction_loss(h, self.head, shift_labels, depths,
                                          loss_weights=loss_weights, depth_labels=mtp_labels,
                                          scaling_factor=SCALE,
                                          options=CrossEntropyOptions(reduction="sum"))
        return _Out(out.loss, torch.zeros(()), out.depth_losses)


class _Out(NamedTuple):
    loss: torch.Tensor
    z_loss: torch.Tensor
    depth_losses: torch.Tensor


def _batches(rank):
    g = torch.Generator().manual_seed(60 + rank)
    out = []
    for m in range(2):
        rows = 1 + (rank + m) % 2
        ids = torch.randint(0, VOCAB, (rows, 8), generator=g)
        labels = torch.randint(0, VOCAB, (rows, 8), generator=g)
        labels[0, : 1 + rank + m] = -100
        out.append({"input_ids": ids, "shift_labels": labels})
    return out


def _rank(rank, world, sp):
    import megaloss
    from megaloss.integrations.fsdp import FSDPStepEngine
    from megaloss.integrations.step import run_step
    from megaloss.integrations.step.mtp import MultiTokenPredictionStepLoss
    from tests.integrations.test_step_router import _engine

    topology = megaloss.Topology.build(1, sequence_parallel_size=sp)
    model = ToyMTP()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = _engine(model, topology, "sum", 2)
    assert isinstance(engine, FSDPStepEngine)
    metrics = run_step(engine, MultiTokenPredictionStepLoss(DEPTH),
                       _batches(topology.dp_rank), log=False)
    return metrics, {n: before[n] - p.detach() for n, p in model.named_parameters()}


def _rolled(labels, k):
    out = torch.full_like(labels, -100)
    out[:, : labels.shape[1] - k] = labels[:, k:]
    return out


def _reference(ranks):
    model = ToyMTP()
    terms = [[0.0, 0] for _ in range(DEPTH + 1)]
    for r in range(ranks):
        for mb in _batches(r):
            h, depths = model.hidden(mb["input_ids"])
            for k, hk in enumerate([h] + depths):
                y = _rolled(mb["shift_labels"], k).reshape(-1)
                terms[k][0] = terms[k][0] + F.cross_entropy(
                    hk.reshape(-1, HIDDEN) @ model.head.T, y, ignore_index=-100,
                    reduction="sum")
                terms[k][1] += int((y != -100).sum())
    means = [s / n for s, n in terms]
    loss = means[0] + SCALE / DEPTH * sum(means[1:])
    loss.backward()
    return (float(loss.detach()), [float(m.detach()) for m in means[1:]],
            {n: p.grad for n, p in model.named_parameters()})


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("sp", [1, 2], ids=["dp2", "sp2"])
def test_mtp_step_equals_one_device(sp):
    results = run_distributed(_rank, 2, sp, timeout=180)
    loss, depth_means, grads = _reference(2 // sp)
    for metrics, deltas in results:
        assert abs(metrics.loss - loss) <= 1e-10 * abs(loss)
        assert metrics.mtp_losses == pytest.approx(depth_means, rel=1e-10)
        assert "mtp_loss_2" in metrics.as_dict()
        for name, g in grads.items():
            torch.testing.assert_close(deltas[name], g, rtol=1e-10, atol=1e-13, msg=name)
