"""Bad input to the vocabulary-level losses, through the public functions: every case is a
``ValueError`` / ``TypeError`` naming the argument and what it must be (or, for an empty batch
or all-ignored labels, the documented zero loss), never a NaN, a crash deep inside the kernel or
a hang. ``linear_cross_entropy``, ``linear_log_probs`` and ``linear_distillation_loss`` (with a
teacher head) alike; one 2-process case: NaN hidden states on ONE tensor-parallel rank raise the
same error on both ranks (before: a NaN loss on every rank, the NaN travelling through the
all-reduces of the log-sum-exp)."""
import contextlib
import os

import pytest
import torch

import megaloss
from megaloss import VocabParallelOptions
from megaloss.testing import run_distributed

N, H, V = 6, 4, 11


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, H, generator=g), torch.randn(V, H, generator=g),
            torch.randint(0, V, (N,), generator=g))


def _distillation(hidden, weight, labels, **kw):
    teacher = torch.randn(hidden.shape[0] if hidden.dim() > 1 else 1, H)
    return megaloss.linear_distillation_loss(hidden, weight, labels, teacher_hidden_states=teacher,
                                             teacher_weight=torch.randn(V, H), **kw)


FUNCTIONS = {
    "ce": megaloss.linear_cross_entropy,
    "log_probs": lambda h, w, y, **kw: megaloss.linear_log_probs(h, w, y, **kw).log_probs,
    "distillation": _distillation,
}


def _nan_row(h, value=float("nan")):
    h = h.clone()
    h[3, 1] = value
    return h


def _dtensor(w):
    """``w`` as a 1-rank DTensor (Shard(0)); needs :func:`_one_rank_group` around its use."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    return distribute_tensor(w.clone(), init_device_mesh("cpu", (1,)), [Shard(0)])


@contextlib.contextmanager
def _one_rank_group():
    """A 1-process gloo group for the DTensor case, destroyed after it: a default group left
    behind would change what ``group=None`` means in every later test of the session."""
    import torch.distributed as dist

    from megaloss.testing import free_port
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# (name, make(h, w, y) -> (h, w, y, kwargs), exception, message fragment)
CASES = [
    ("int hidden_states", lambda h, w, y: (h.long(), w, y, {}), TypeError,
     "hidden_states must be a floating tensor, got torch.int64"),
    ("float labels", lambda h, w, y: (h, w, y.float(), {}), TypeError,
     "labels must be an integer tensor, got torch.float32"),
    ("hidden size", lambda h, w, y: (torch.randn(N, H + 1), w, y, {}), ValueError,
     "weight has hidden size 4 but hidden_states has 5"),
    ("labels length", lambda h, w, y: (h, w, y[:-1], {}), ValueError,
     "labels must have shape (6,) (hidden_states.shape[:-1]), got (5,)"),
    ("3-D labels", lambda h, w, y: (h, w, y.view(1, 2, 3), {}), ValueError,
     "labels must have shape (6,)"),
    ("devices", lambda h, w, y: (h, w.to("meta"), y, {}), ValueError,
     "all inputs must be on one device, got hidden_states on cpu, labels on cpu, weight on meta"),
    ("NaN hidden_states", lambda h, w, y: (_nan_row(h), w, y, {}), ValueError,
     "hidden_states holds NaN or inf (first at token 3 of 6)"),
    ("inf hidden_states", lambda h, w, y: (_nan_row(h, float("-inf")), w, y, {}), ValueError,
     "hidden_states holds NaN or inf (first at token 3 of 6)"),
    ("label >= vocab", lambda h, w, y: (h, w, torch.full((N,), V), {}), ValueError,
     "labels must be in [0, 11) or ignore_index=-100, found 11"),
    ("negative label", lambda h, w, y: (h, w, torch.full((N,), -5), {}), ValueError,
     "labels must be in [0, 11) or ignore_index=-100, found -5"),
    ("vocab_parallel_options", lambda h, w, y: (
        h, w, y, {"vocab_parallel_options": VocabParallelOptions(vocab_size=V + 3)}), ValueError,
     "weight must have ceil(vocab_size / tp) = 14 rows for vocab_size=14, tp=1; got 11"),
    ("DTensor weight", lambda h, w, y: (h, _dtensor(w), y, {}), TypeError,
     "weight is a DTensor"),
    ("ZeRO-3 placeholder", lambda h, w, y: (h, torch.empty(0, requires_grad=True), y, {}),
     ValueError, "weight must have shape [V, H], got (0,): an empty placeholder, as a ZeRO-3"),
]


@pytest.mark.parametrize("fn", FUNCTIONS, ids=str)
@pytest.mark.parametrize("name, make, error, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_named(fn, name, make, error, message):
    with _one_rank_group() if name == "DTensor weight" else contextlib.nullcontext():
        h, w, y, kw = make(*_inputs())
        with pytest.raises(error) as raised:
            FUNCTIONS[fn](h, w, y, **kw)
    assert message in str(raised.value), str(raised.value)


def test_the_teachers_hidden_states_are_checked_too():
    h, w, y = _inputs()
    with pytest.raises(ValueError, match=r"teacher_hidden_states holds NaN or inf"):
        megaloss.linear_distillation_loss(h, w, y, teacher_weight=torch.randn(V, H),
                                          teacher_hidden_states=_nan_row(torch.randn(N, H)))


@pytest.mark.parametrize("fn", FUNCTIONS, ids=str)
@pytest.mark.parametrize("empty", ["no tokens", "all ignored"])
def test_empty_batches_are_a_zero_loss_with_zero_gradients(fn, empty):
    h, w, y = _inputs()
    if empty == "no tokens":
        h, y = h[:0], y[:0]
    else:
        y = torch.full_like(y, -100)
    h.requires_grad_()
    out = FUNCTIONS[fn](h, w, y)
    assert torch.isfinite(out).all() and not out.any()
    out.sum().backward()
    assert h.grad is not None and not h.grad.any()


def _nan_on_rank_one(rank, world):
    import megaloss
    h, w, y = _inputs()
    if rank == 1:
        h = _nan_row(h)
    rows = w[6 * rank:6 * (rank + 1)] if rank == 0 else torch.cat([w[6:], torch.zeros(1, H)])
    try:
        megaloss.linear_cross_entropy(h, rows, y,
                                      vocab_parallel_options=VocabParallelOptions(vocab_size=V))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_nan_on_one_tensor_parallel_rank_raises_on_every_rank():
    messages = run_distributed(_nan_on_rank_one, 2, timeout=100)
    assert messages[0] == messages[1] and messages[0] is not None, messages
    assert messages[0].startswith("hidden_states holds NaN or inf (first at token 3 of 6)")
    assert messages[0].endswith("(raised on tensor-parallel rank(s) [1])"), messages


def _mnr_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


MNR_CASES = {
    "int query": (lambda q, p: (q.long(), p, {}), TypeError, "query must be a floating tensor"),
    "bf16 query, fp32 positive": (lambda q, p: (q.bfloat16(), p, {}), TypeError,
                                  "positive dtype torch.float32 differs"),
    "positive of another D": (lambda q, p: (q, torch.randn(4, 9), {}), ValueError,
                              "positive must have query's shape"),
    "3-D query": (lambda q, p: (q.view(1, 4, 8), p.view(1, 4, 8), {}), ValueError,
                  "query must be [B, D]"),
    "positive on another device": (lambda q, p: (q, p.to("meta"), {}), ValueError,
                                   "positive must be on query's device cpu, got meta"),
    "negatives on another device": (lambda q, p: (q, p, {"negatives": torch.randn(4, 2, 8,
                                                                                   device="meta")}),
                                    ValueError, "negatives must be on query's device"),
    "NaN in query": (lambda q, p: (q.masked_fill(q > 1, float("nan")), p, {}), ValueError,
                     "query contains NaN or inf"),
    "float duplicate_ids": (lambda q, p: (q, p, {"duplicate_ids": torch.zeros(4)}), TypeError,
                            "duplicate_ids must be an integer tensor"),
}


@pytest.mark.parametrize("name", list(MNR_CASES))
def test_bad_mnr_input_is_named(name):
    make, error, message = MNR_CASES[name]
    q, p, kw = make(*_mnr_inputs())
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        megaloss.mnr_loss(q, p, gather_across_ranks=False, **kw)


def test_an_empty_mnr_batch_is_a_zero_loss():
    q = torch.randn(0, 8, requires_grad=True)
    loss = megaloss.mnr_loss(q, torch.randn(0, 8), gather_across_ranks=False)
    assert float(loss.detach()) == 0.0
