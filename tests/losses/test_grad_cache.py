"""GradCache (megaloss.losses.grad_cache) gives the non-cached loss and gradients.

Reference for one process: the same encoder run with its graph over the same mini-batches in the
same order from the same seed (so dropout draws the same masks), the loss on the concatenation,
one backward: float64, equal to 1e-12. Without restoring the RNG state for the replays, the
dropout masks would differ and the gradients with them (the dropout case pins that down).
Distributed: 3 gloo ranks with 5, 2 and 0 rows (uneven replay counts, an empty rank), gradients
averaged as DDP / ZeRO do, against the float64 single-process global batch (1e-10).

The caller's loss scale (the replays run in the caller's backward, scaled by its upstream
gradient): ``(surrogate * s).backward()`` gives ``s`` times the reference gradients (1e-12), a
``torch.amp.GradScaler`` (2**16) the reference gradients after ``unscale_`` (1e-12); CPU bf16
autocast around the forward only: the replays rerun under it (the gradients of replays run in the
forward, rtol 1e-6); 2 gloo ranks, gathered, scale 0.5 and DDP with 2**16: the float64
single-process gradients after unscaling (1e-10).
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


def test_each_pass_gets_new_containers_around_the_mini_batch():
    """An encoder that writes its outputs into its input mapping (sentence-transformers' modules
    add ``sentence_embedding`` to the features dict) never finds an earlier pass's outputs among
    its inputs, also where a rank re-runs its last mini-batch; the gradients are the
    non-cached loss's."""
    torch.manual_seed(0)
    enc = _Encoder(dropout=0.0).double()
    batch = _batch(5)
    _loss(_columns(enc, batch), 0.05).backward()
    ref = {n: p.grad.clone() for n, p in enc.named_parameters()}
    enc.zero_grad()
    seen = []

    def encode(mini):
        seen.append(sorted(mini))
        columns = _columns(enc, mini)
        mini["sentence_embedding"] = columns[0]  # as SentenceTransformer.forward does
        return columns

    step = grad_cache(encode, split_rows(batch, 3), lambda c: _loss(c, 0.05))
    step.surrogate.backward()
    assert len(seen) == 4 and all(keys == ["n", "p", "q"] for keys in seen), seen
    for name, p in enc.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-12, atol=1e-13, msg=name)


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
        assert loss == pytest.approx(float(ref.detach()), abs=1e-12)
        assert (replays, inner) == (3, 2)  # ceil(5 / 2) on every rank, the last one by the caller
        for name, p in enc.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12,
                                       msg=f"rank {rank} {name}")


# the caller's loss scale (an accumulation window, a GradScaler) ------------------------------
def _scaled_loss(columns, temperature, group=None):
    return mnr_loss(columns[0], columns[1], columns[2], temperature=temperature, symmetric=True,
                    gather_across_ranks=group is not None, group=group)


@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_caller_scale_reaches_every_replay(scale):
    """``(surrogate * s).backward()`` (a window's ``1 / G``, any factor): ``s`` times the
    non-cached gradients, the learnable temperature's included (1e-12, as above)."""
    torch.manual_seed(0)
    enc = _Encoder(dropout=0.3).double()
    log_t = torch.tensor(-2.0, dtype=torch.float64, requires_grad=True)
    mini = split_rows(_batch(7), 3)  # 3 replays
    torch.manual_seed(11)
    cols = [_columns(enc, m) for m in mini]
    (_scaled_loss([torch.cat(c) for c in zip(*cols)], log_t.exp()) * scale).backward()
    ref = {n: p.grad.clone() for n, p in enc.named_parameters()}
    ref_t = log_t.grad.clone()
    enc.zero_grad()
    log_t.grad = None

    torch.manual_seed(11)
    step = grad_cache(lambda m: _columns(enc, m), mini,
                      lambda c: _scaled_loss(c, log_t.exp()), loss_parameters=[log_t])
    assert all(p.grad is None for p in enc.parameters())  # every replay waits for the backward
    (step.surrogate * scale).backward()
    for name, p in enc.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-12, atol=1e-13, msg=name)
    torch.testing.assert_close(log_t.grad, ref_t, rtol=1e-12, atol=1e-13)


def test_grad_scaler_trains_like_the_non_cached_loss():
    """torch.amp.GradScaler (init scale 2**16): ``scaler.scale(surrogate).backward()`` then
    ``unscale_``: the non-cached gradients (float64, 1e-12), and the step is taken."""
    def run(cached):
        torch.manual_seed(0)
        enc = _Encoder(dropout=0.0).double()
        opt = torch.optim.SGD(enc.parameters(), lr=1.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        batch = _batch(7)
        if cached:
            loss = grad_cache(lambda m: _columns(enc, m), split_rows(batch, 2),
                              lambda c: _scaled_loss(c, 0.1)).surrogate
        else:
            loss = _scaled_loss(_columns(enc, batch), 0.1)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads = {n: p.grad.clone() for n, p in enc.named_parameters()}
        scaler.step(opt)
        scaler.update()
        return grads, {n: p.detach().clone() for n, p in enc.named_parameters()}

    ref_grads, ref_after = run(cached=False)
    grads, after = run(cached=True)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-12, atol=1e-13,
                                   msg=name)
        torch.testing.assert_close(after[name], ref_after[name], rtol=1e-12, atol=1e-13,
                                   msg=name)


def test_replays_in_backward_run_under_the_forward_autocast():
    """CPU autocast (bf16) around the forward, the backward outside it, loss * 0.5: the replays
    run in bf16 as the first pass did, so the gradients equal those of replays run inside the
    forward with a matching ``backward`` (rtol 1e-6: the same bf16 ops; fp32 replays would differ
    at bf16's resolution, ~1e-2), and the non-cached bf16 run's (5e-2 / 5e-3, bf16)."""
    def run(mode):
        torch.manual_seed(0)
        enc = _Encoder(dropout=0.0)
        batch = _batch(6)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if mode == "plain":
                loss = _scaled_loss(_columns(enc, batch), 0.05)
            else:
                eager = (lambda t: (t * 0.5).backward()) if mode == "eager" else None
                loss = grad_cache(lambda m: _columns(enc, m), split_rows(batch, 4),
                                  lambda c: _scaled_loss(c, 0.05), backward=eager).surrogate
        (loss * 0.5).backward()
        return {n: p.grad.clone() for n, p in enc.named_parameters()}

    plain, eager, in_backward = run("plain"), run("eager"), run("in_backward")
    for name in plain:
        torch.testing.assert_close(in_backward[name], eager[name], rtol=1e-6, atol=1e-8,
                                   msg=name)
        torch.testing.assert_close(in_backward[name], plain[name], rtol=5e-2, atol=5e-3,
                                   msg=name)


SCALED_SIZES = (5, 2)  # mini-batch 2: 3 replays on both ranks, rank 1 re-runs its last one twice


class _ColumnsModule(torch.nn.Module):
    """The encoder's three columns in one forward, so DDP sees one forward per backward."""

    def __init__(self, enc):
        super().__init__()
        self.enc = enc

    def forward(self, mini):
        return _columns(self.enc, mini)


def _scaled_worker(rank, world):
    import torch.distributed as dist

    full = _batch(sum(SCALED_SIZES), seed=5)
    lo = sum(SCALED_SIZES[:rank])
    mine = {k: v[lo:lo + SCALED_SIZES[rank]] for k, v in full.items()}
    out = {}
    # plain: the ranks' gradients averaged by hand (what DDP / ZeRO do), loss * 0.5; DDP: its own
    # averaging inside the replays' backward, a GradScaler-style 2**16 then unscaled
    for mode, scale in (("plain", 0.5), ("ddp", 2.0 ** 16)):
        torch.manual_seed(0)
        enc = _Encoder(dropout=0.0).double()
        model = _ColumnsModule(enc)
        if mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        step = grad_cache(model, split_rows(mine, 2),
                          lambda c: _scaled_loss(c, 0.1, group=dist.group.WORLD),
                          group=dist.group.WORLD)
        (step.surrogate * scale).backward()
        grads = {}
        for n, p in enc.named_parameters():
            g = p.grad.clone()
            if mode == "plain":
                dist.all_reduce(g)
                g /= world
            grads[n] = g / scale
        out[mode] = (float(step.loss), step.num_replays, grads)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_ranks_gathered_caller_scale_and_ddp():
    """2 gloo ranks, 5 and 2 rows, the gathered loss; the caller scales the returned loss by 0.5
    (gradients averaged by hand) and, under DDP, by 2**16: after unscaling, the float64
    single-process gradients of the global batch (1e-10)."""
    results = run_distributed(_scaled_worker, 2, timeout=100)
    torch.manual_seed(0)
    enc = _Encoder(dropout=0.0).double()
    ref = _scaled_loss(_columns(enc, _batch(sum(SCALED_SIZES), seed=5)), 0.1)
    ref.backward()
    for rank, res in enumerate(results):
        for mode, (loss, replays, grads) in res.items():
            assert loss == pytest.approx(float(ref.detach()), abs=1e-12)
            assert replays == 3
            for name, p in enc.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12,
                                           msg=f"rank {rank} {mode} {name}")
