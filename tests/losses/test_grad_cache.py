"""GradCache (megaloss.losses.grad_cache) gives the non-cached loss and gradients.

Reference for one process: the same encoder run with its graph over the same mini-batches in the
same order from the same seed (so dropout draws the same masks), the loss on the concatenation,
one backward: float64, equal to 1e-12. Without restoring the RNG state for the replays, the
dropout masks would differ and the gradients with them (the dropout case pins that down).
Distributed: 3 gloo ranks with 5, 2 and 0 rows (uneven replay counts, an empty rank), gradients
averaged as DDP / ZeRO do, against the float64 single-process global batch (1e-10).
"""
import pytest
import torch

from megaloss.losses.grad_cache import grad_cache_step as grad_cache
from megaloss.losses.grad_cache import split_rows
from megaloss.losses.mnr import mnr_loss
from megaloss.testing import run_distributed

V, H, T = 17, 6, 5


class _Encoder(torch.nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.proj = torch.nn.Linear(H, H)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, ids):  # [b, T] -> [b, H]
        return self.drop(torch.tanh(self.proj(self.emb(ids)))).mean(1)


def _columns(enc, mini):
    q = enc(mini["q"])
    p = enc(mini["p"])
    b, k, t = mini["n"].shape
    return [q, p, enc(mini["n"].reshape(b * k, t)).reshape(b, k, H)]


def _batch(rows, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randint(0, V, (rows, T), generator=g),
            "p": torch.randint(0, V, (rows, T), generator=g),
            "n": torch.randint(0, V, (rows, 2, T), generator=g)}


def _loss(columns, temperature, duplicate_ids=None, group=None, gather=False):
    return mnr_loss(columns[0], columns[1], columns[2], temperature=temperature, symmetric=True,
                    duplicate_ids=duplicate_ids, gather=gather, group=group)


@pytest.mark.parametrize("mini_batch_size", [1, 3, 7, 9])
def test_matches_graph_run_with_dropout_and_learnable_temperature(mini_batch_size):
    torch.manual_seed(0)
    enc = _Encoder(dropout=0.3).double()
    log_t = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
    batch = _batch(7)
    ids = torch.tensor([0, 1, 2, 0, 3, 4, 1])  # duplicates: rows 0/3 and 1/6
    mini = split_rows(batch, mini_batch_size)
    assert [m["q"].shape[0] for m in mini] == [len(range(s, min(s + mini_batch_size, 7)))
                                               for s in range(0, 7, mini_batch_size)]

    torch.manual_seed(11)
    cols = [_columns(enc, m) for m in mini]
    ref = _loss([torch.cat(c) for c in zip(*cols)], log_t.exp(), ids)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in enc.named_parameters()}
    ref_t = log_t.grad.clone()
    enc.zero_grad()
    log_t.grad = None

    torch.manual_seed(11)
    step = grad_cache(lambda m: _columns(enc, m), mini,
                      lambda c: _loss(c, log_t.exp(), ids), loss_parameters=[log_t])
    assert step.num_replays == len(mini)
    assert log_t.grad is None  # its gradient waits in the surrogate, with the last replay's
    step.surrogate.backward()
    assert float(step.surrogate.detach()) == float(step.loss)
    assert float(step.loss) == pytest.approx(float(ref.detach()), abs=1e-12)
    for name, p in enc.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-12, atol=1e-13,
                                   msg=f"{name} at mini-batch size {mini_batch_size}")
    torch.testing.assert_close(log_t.grad, ref_t, rtol=1e-12, atol=1e-13)


def test_half_precision_embeddings_take_fp32_upstream():
    """bf16 encoder: the replay forms the embedding gradient from the fp32 upstream before its
    cast, as the non-cached backward does; same gradients as the non-cached bf16 run (5e-3,
    bf16's resolution)."""
    torch.manual_seed(0)
    enc = _Encoder(dropout=0.0).to(torch.bfloat16)
    batch = _batch(6)
    _loss(_columns(enc, batch), 0.05).backward()
    ref = {n: p.grad.float().clone() for n, p in enc.named_parameters()}
    enc.zero_grad()
    step = grad_cache(lambda m: _columns(enc, m), split_rows(batch, 4), lambda c: _loss(c, 0.05))
    step.surrogate.backward()
    for name, p in enc.named_parameters():
        torch.testing.assert_close(p.grad.float(), ref[name], rtol=5e-2, atol=5e-3, msg=name)


def test_split_rows_and_errors():
    batch = {"a": torch.zeros(5, 2), "nested": [torch.arange(5)], "flag": True,
             "scalar": torch.tensor(1.0)}
    parts = split_rows(batch, 2)
    assert [p["a"].shape[0] for p in parts] == [2, 2, 1]
    assert parts[2]["nested"][0].tolist() == [4] and parts[1]["flag"] is True
    assert parts[0]["scalar"].dim() == 0
    assert split_rows({"a": torch.zeros(0, 3)}, 4) == []
    with pytest.raises(ValueError, match="mini_batch_size"):
        split_rows(batch, 0)
    with pytest.raises(ValueError, match="share dim 0"):
        split_rows({"a": torch.zeros(2), "b": torch.zeros(3)}, 1)
    with pytest.raises(ValueError, match="share dim 0"):
        split_rows({"a": 1}, 1)
    with pytest.raises(ValueError, match="empty_embeddings"):
        grad_cache(lambda m: [m], [], lambda c: c[0].sum())
    enc = _Encoder(0.0)
    with pytest.raises(ValueError, match="columns"):
        flip = iter([1, 2])
        grad_cache(lambda m: _columns(enc, m)[:next(flip)], split_rows(_batch(2), 1),
                   lambda c: c[0].sum())


# distributed: uneven and empty ranks ---------------------------------------------------------
SIZES = (5, 2, 0)


def _global_batch():
    return _batch(sum(SIZES), seed=5)


def _worker(rank, world, mini_batch_size):
    import torch.distributed as dist

    torch.manual_seed(0)
    enc = _Encoder(dropout=0.0).double()
    full = _global_batch()
    lo = sum(SIZES[:rank])
    mine = {k: v[lo:lo + SIZES[rank]] for k, v in full.items()}
    calls = []

    def backward(t):
        calls.append(1)
        t.backward()

    step = grad_cache(lambda m: _columns(enc, m), split_rows(mine, mini_batch_size),
                      lambda c: _loss(c, 0.1, gather=True, group=dist.group.WORLD),
                      backward=backward, empty_embeddings=lambda: _columns(enc, mine))
    step.surrogate.backward()
    grads = {}
    for n, p in enc.named_parameters():  # what DDP / ZeRO do: average over the ranks
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[n] = g / world
    return float(step.loss), step.num_replays, len(calls), grads


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_uneven_and_empty_ranks_match_global_batch():
    results = run_distributed(_worker, 3, 2, timeout=100)
    torch.manual_seed(0)
    enc = _Encoder(dropout=0.0).double()
    ref = _loss(_columns(enc, _global_batch()), 0.1)
    ref.backward()
    for rank, (loss, replays, inner, grads) in enumerate(results):
        assert loss == pytest.approx(float(ref), abs=1e-12)
        assert (replays, inner) == (3, 2)  # ceil(5 / 2) on every rank, the last one by the caller
        for name, p in enc.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12,
                                       msg=f"rank {rank} {name}")
