"""megaloss's vocab-parallel losses on an lm_head parallelized by PyTorch's DTensor tensor
parallelism: ``parallelize_module(lm_head, tp_mesh, ColwiseParallel())`` makes the weight a
``Shard(0)`` DTensor split by ``torch.chunk``'s rule (37 rows over 2 ranks: 19 + 18, no padding);
:meth:`VocabParallelOptions.from_dtensor` gives the local rows and the options.

On 2 gloo ranks, float64, V = 37: :func:`linear_cross_entropy`, :func:`linear_log_probs` and
:func:`linear_distillation_loss` (teacher head parallelized alike) equal a single-process
full-vocabulary reference (``F.cross_entropy`` / ``F.log_softmax``) in the loss and in the
gradients of ``hidden_states`` and of the DTensor weight (its ``.grad``, local rows and
``full_tensor()``); the CE also equals torch's own ``loss_parallel()`` on DTensor logits
(``torch/distributed/tensor/parallel/loss.py``). Sequence-parallel inputs (hidden states
``Shard(1)`` over the sequence, as ``SequenceParallel`` leaves them): the local shard goes in with
``sequence_parallel=True``, no gather by the user. Placements other than ``Shard(0)`` raise a
ValueError naming what is expected. On 4 ranks, a 2 x 2 mesh FSDP x TP (``parallelize_module`` on
"tp", then ``fully_shard`` on "dp", torchtitan's order): the loss computed in a method registered
with ``register_fsdp_forward_method`` gives the reference's gradient (mean over dp).
"""
import pytest
import torch
import torch.nn.functional as F

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(300)]

V, H, HT, B, T = 37, 16, 12, 2, 6
TOL = 1e-12


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, 1] = y[1, 4] = -100
    th = torch.randn(B, T, HT, generator=g, dtype=torch.float64)
    tw = torch.randn(V, HT, generator=g, dtype=torch.float64)
    coef = torch.randn(B, T, generator=g, dtype=torch.float64)
    return h, w, y, th, tw, coef


def _reference(kind, h, w, y, th=None, tw=None, coef=None):
    """(loss, grad h, grad w) of full float64 logits, one process."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logits = h @ w.T
    valid = y != -100
    if kind == "ce":
        loss = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), ignore_index=-100)
    elif kind == "log_probs":
        lp = logits.log_softmax(-1).gather(-1, y.clamp(min=0)[..., None])[..., 0] * valid
        loss = (lp * coef).sum()
    else:
        t_logp = (th @ tw.T).log_softmax(-1)
        kl = (t_logp.exp() * (t_logp - logits.log_softmax(-1))).sum(-1)
        loss = (kl * valid).sum() / valid.sum()
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _head(weight, mesh, **style):
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    head = nn.Linear(weight.shape[1], V, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(weight)
    return parallelize_module(head, mesh, ColwiseParallel(**style))


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def _tp_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from megaloss import (
        VocabParallelOptions,
        linear_cross_entropy,
        linear_distillation_loss,
        linear_log_probs,
    )

    h, w, y, th, tw, coef = _data()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {"errors": {}, "refusals": {}}
    fp64 = dict(chunk_size=5, accum_dtype=torch.float64)

    head = _head(w, mesh)
    ws, opts = VocabParallelOptions.from_dtensor(head.weight)
    start, stop = opts.shard_range
    out["range"] = (start, stop, opts.vocab_size, tuple(ws.shape))

    def run(kind, loss_of, hidden=h):
        head.weight.grad = None
        hs = hidden.clone().requires_grad_()
        ws, opts = VocabParallelOptions.from_dtensor(head.weight, mesh_dim="tp")
        loss = loss_of(hs, ws, opts)
        loss.backward()
        ref_loss, ref_h, ref_w = _reference(kind, h, w, y, th, tw, coef)
        grad = head.weight.grad
        assert isinstance(grad, DTensor) and grad.placements == (Shard(0),), grad
        out["errors"][kind] = (float((loss.detach() - ref_loss).abs() / ref_loss.abs()),
                               _rel(hs.grad, ref_h), _rel(grad.to_local(), ref_w[start:stop]),
                               _rel(grad.full_tensor(), ref_w))
        return loss.detach(), hs.grad, grad.full_tensor()

    ce = run("ce", lambda hs, ws, o: linear_cross_entropy(hs, ws, y, vocab_parallel_options=o,
                                                           **fp64))
    run("log_probs", lambda hs, ws, o: (linear_log_probs(
        hs, ws, y, vocab_parallel_options=o, **fp64).log_probs * coef).sum())
    teacher = _head(tw, mesh)
    tws, _ = VocabParallelOptions.from_dtensor(teacher.weight)
    run("distillation", lambda hs, ws, o: linear_distillation_loss(
        hs, ws, y, teacher_hidden_states=th, teacher_weight=tws.detach(),
        vocab_parallel_options=o, **fp64))

    # torch's own vocab-parallel CE on DTensor logits [B, T, V] Shard(-1)
    lp_head = _head(w, mesh, use_local_output=False)
    hs = h.clone().requires_grad_()
    with loss_parallel():
        logits = lp_head(hs)
        assert logits.placements == (Shard(2),), logits.placements
        lp_loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        lp_loss.backward()
    lp_loss = lp_loss.full_tensor() if isinstance(lp_loss, DTensor) else lp_loss
    out["errors"]["ce vs loss_parallel"] = (
        float((ce[0] - lp_loss).abs() / lp_loss.abs()), _rel(ce[1], hs.grad),
        _rel(ce[2][start:stop], lp_head.weight.grad.to_local()),
        _rel(ce[2], lp_head.weight.grad.full_tensor()))

    # sequence parallelism: hidden states Shard(1) over the sequence (SequenceParallel's output)
    t = T // world
    sl = slice(rank * t, (rank + 1) * t)
    head.weight.grad = None
    h_sp = DTensor.from_local(h[:, sl].clone(), mesh, [Shard(1)]).detach().requires_grad_()
    ws, opts = VocabParallelOptions.from_dtensor(head.weight, sequence_parallel=True)
    loss = linear_cross_entropy(h_sp.to_local(), ws, y[:, sl].contiguous(),
                                vocab_parallel_options=opts, **fp64)
    loss.backward()
    ref_loss, ref_h, ref_w = _reference("ce", h, w, y)
    assert h_sp.grad.placements == (Shard(1),), h_sp.grad.placements
    out["errors"]["ce sequence-parallel"] = (
        float((loss.detach() - ref_loss).abs() / ref_loss.abs()),
        _rel(h_sp.grad.full_tensor(), ref_h),
        _rel(head.weight.grad.to_local(), ref_w[start:stop]),
        _rel(head.weight.grad.full_tensor(), ref_w))

    # refused placements, and a plain tensor
    for name, placement in (("Replicate", Replicate()), ("Shard(1)", Shard(1)),
                            ("Partial", Partial())):
        bad = (distribute_tensor(w.clone(), mesh, [placement]) if name != "Partial"
               else DTensor.from_local(w.clone() / world, mesh, [Partial()]))
        try:
            VocabParallelOptions.from_dtensor(bad)
        except ValueError as err:
            out["refusals"][name] = str(err)
    try:
        VocabParallelOptions.from_dtensor(w)
    except TypeError as err:
        out["refusals"]["tensor"] = str(err)
    # the DTensor weight given to a loss directly is refused, naming the helper
    try:
        linear_cross_entropy(h, head.weight, y)
    except TypeError as err:
        out["refusals"]["direct"] = str(err)
    return out


def test_dtensor_colwise_lm_head_matches_float64_and_loss_parallel():
    results = run_distributed(_tp_worker, 2, timeout=240)
    assert results[0]["range"] == (0, 19, V, (19, H))
    assert results[1]["range"] == (19, 37, V, (18, H))
    for rank, out in enumerate(results):
        assert set(out["errors"]) == {"ce", "log_probs", "distillation", "ce vs loss_parallel",
                                      "ce sequence-parallel"}
        for case, errs in out["errors"].items():
            assert max(errs) <= TOL, (rank, case, errs)
        refusals = out["refusals"]
        assert set(refusals) == {"Replicate", "Shard(1)", "Partial", "tensor", "direct"}
        for name in ("Replicate", "Shard(1)", "Partial"):
            assert "Shard(0) on one mesh dimension" in refusals[name], refusals[name]
            assert name in refusals[name], refusals[name]
        assert "must be a torch.distributed.tensor.DTensor" in refusals["tensor"]
        assert "VocabParallelOptions.from_dtensor" in refusals["direct"], refusals["direct"]


def _fsdp_tp_worker(rank, world):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from megaloss import VocabParallelOptions, linear_cross_entropy

    class Head(nn.Linear):
        def loss(self, hidden, labels):
            ws, opts = VocabParallelOptions.from_dtensor(self.weight, mesh_dim="tp")
            return linear_cross_entropy(hidden, ws, labels, vocab_parallel_options=opts,
                                        chunk_size=5, accum_dtype=torch.float64)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    _, w, _, _, _, _ = _data()
    batches = [_data(seed=1 + r) for r in range(2)]  # one batch per dp rank
    h, y = batches[dp][0], batches[dp][2]
    head = Head(H, V, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(w)
    parallelize_module(head, mesh["tp"], ColwiseParallel())
    fully_shard(head, mesh=mesh["dp"])
    register_fsdp_forward_method(head, "loss")
    refusal = None
    try:  # outside the FSDP forward the weight is sharded over dp as well
        VocabParallelOptions.from_dtensor(head.weight)
    except ValueError as err:
        refusal = str(err)
    hs = h.clone().requires_grad_()
    loss = head.loss(hs, y)
    loss.backward()
    refs = [_reference("ce", b[0], w, b[2]) for b in batches]
    ref_w = (refs[0][2] + refs[1][2]) / 2  # FSDP2 averages the gradient over dp
    grad = head.weight.grad
    assert isinstance(grad, DTensor)
    return (float((loss.detach() - refs[dp][0]).abs() / refs[dp][0].abs()),
            _rel(hs.grad, refs[dp][1]), _rel(grad.full_tensor(), ref_w)), refusal


def test_dtensor_tp_under_fsdp2_2d_mesh():
    results = run_distributed(_fsdp_tp_worker, 4, timeout=240)
    for rank, (errs, refusal) in enumerate(results):
        assert max(errs) <= TOL, (rank, errs)
        assert refusal is not None and "register_fsdp_forward_method" in refusal, refusal
