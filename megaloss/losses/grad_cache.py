r"""Gradient caching (GradCache): a contrastive loss over a batch whose encoder graph would not fit.

Gao, Zhang, Han, Callan, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup"
(RepL4NLP 2021, arXiv:2101.06983; reference code ``luyug/GradCache``,
``src/grad_cache/grad_cache.py``; sentence-transformers' ``CachedMultipleNegativesRankingLoss``).
The loss of a contrastive batch
depends on the parameters only through the embeddings, so with ``e = f_theta(x)``::

    dL/dtheta = sum_k  (dL/de_k)^T  de_k/dtheta          (k: mini-batches of rows)

Three passes, and activation memory is that of ONE mini-batch, whatever the batch size:

1. embed every mini-batch without a graph (``torch.no_grad``), saving the RNG state before each;
2. compute the loss once on the concatenated embeddings (leaf tensors) and its gradient
   ``g = dL/de`` (for the gathered MNR loss this pass holds every rank's collectives);
3. replay each mini-batch *with* its graph under the saved RNG state (same dropout masks) and
   back-propagate the surrogate ``sum(e_k * g_k)``, whose parameter gradient is exactly the
   mini-batch's share of ``dL/dtheta``.

Where the replays run. By default (``backward=None``) they run inside the caller's backward of
the returned ``surrogate``, as sentence-transformers' cached losses do (``sentence_transformers/
base/losses/gradcache.py``, ``_backward_hook``): each replay's surrogate is multiplied by the
upstream gradient the caller's backward hands the returned loss, so any factor the caller applies
(an accumulation window's ``1 / G``, ``torch.amp.GradScaler``'s loss scale) reaches every
mini-batch, and the gradients are the non-cached loss's times that factor. The replays re-enter
the forward's autocast state (as ``torch.utils.checkpoint`` does). An engine that must see each
replay as its own backward pass (DeepSpeed ZeRO-2/3 stop on a second gradient per parameter
within one ``engine.backward``) passes ``backward``: :func:`grad_cache_step` then hands every
replay but the last to it (the engine's "inside an accumulation window" backward, e.g.
:func:`megaloss.integrations.grad_cache.inner_replay_backward`) and returns the last one
as ``surrogate``, to be back-propagated exactly as the non-cached loss would be
(``engine.backward(surrogate)``, or returned to a Trainer); there the scale of the caller's
backward cannot reach the replays already run, so it is checked against theirs in that backward
(a ValueError, not a wrong gradient). Either way the value of ``surrogate`` is the loss, so logs
read the same.

Collectives: one all-reduce (MAX) of the number of mini-batches, so that every rank runs the same
number of encoder passes and replays (ranks with fewer rows re-run a mini-batch with a zero
gradient, ranks with no rows the empty batch): engines that reduce gradients in every backward
(DeepSpeed ZeRO-2/3), and ZeRO-3's per-forward check that every rank traced the same modules,
then enter the same collectives on every rank. Plus whatever ``loss_fn`` does in pass 2, once.
Under DDP every replay's backward is reduced (correct, as reduction is linear, at ``num_replays``
times the gradient traffic; none inside ``no_sync``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..parallel.comm import all_reduce_max_, backend_device
from ..parallel.groups import GroupLike

__all__ = ["grad_cache_step", "GradCacheStep", "RandomState", "split_rows"]

Encode = Callable[[Any], Sequence[Tensor]]


class RandomState:
    """The CPU (and current CUDA device's) RNG state, to replay a forward with the same dropout.

    ``RandomState()`` captures; ``with state.restored():`` runs its body from that state and
    leaves the global RNG as it was before the block (``torch.random.fork_rng``).
    """

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self.cuda = (torch.cuda.get_rng_state(self.cuda_device)
                     if self.cuda_device is not None else None)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        devices = [] if self.cuda_device is None else [self.cuda_device]
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.cuda_device)
            yield


def split_rows(batch: Any, mini_batch_size: int) -> List[Any]:
    """Split a batch along dim 0 into mini-batches of at most ``mini_batch_size`` rows.

    Args:
        batch: a tensor, or a mapping / list / tuple (nested) of tensors that share dim 0 (other
            leaves are copied into every mini-batch; mappings come back as dicts).
        mini_batch_size: rows per mini-batch (>= 1).

    Returns:
        ``ceil(B / mini_batch_size)`` structures like ``batch`` (views, no copies); ``[]`` for
        ``B == 0``.

    Raises:
        ValueError: ``mini_batch_size < 1``, no tensor in ``batch``, or tensors whose dim 0
            differ.
    """
    if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) \
            or mini_batch_size < 1:
        raise ValueError(f"mini_batch_size must be an int >= 1, got {mini_batch_size!r}")
    sizes = {t.shape[0] for t in _tensors(batch) if t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError("batch must hold tensors that share dim 0 (the rows), got dim-0 sizes "
                         f"{sorted(sizes) or 'none'}")
    rows = sizes.pop()
    return [_slice(batch, start, min(start + mini_batch_size, rows))
            for start in range(0, rows, mini_batch_size)]


def _tensors(tree: Any) -> Iterator[Tensor]:
    if isinstance(tree, Tensor):
        yield tree
    elif isinstance(tree, Mapping):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


def _fresh(tree: Any) -> Any:
    """``tree`` in new containers around the same tensors. An encoder that writes its outputs
    into its input mapping (sentence-transformers' modules add ``token_embeddings`` /
    ``sentence_embedding`` to the features dict) would otherwise find an earlier pass's outputs
    among a later pass's inputs: graph tensors whose backward runs again, and under FSDP2 extra
    hooks on them (``fully_shard`` registers its post-backward on every input that requires
    grad), so that rank's all-gathers and reduce-scatters no longer match its peers'."""
    if isinstance(tree, Mapping):
        return {k: _fresh(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_fresh(v) for v in tree)
    return tree


def _slice(tree: Any, start: int, stop: int) -> Any:
    if isinstance(tree, Tensor):
        return tree[start:stop] if tree.dim() > 0 else tree
    if isinstance(tree, Mapping):  # tokenizers' BatchEncoding is a Mapping, not a dict
        return {k: _slice(v, start, stop) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_slice(v, start, stop) for v in tree)
    return tree


class GradCacheStep(NamedTuple):
    """What :func:`grad_cache_step` returns.

    Attributes:
        loss: 0-dim, detached: ``loss_fn``'s value on the whole batch.
        surrogate: 0-dim with a graph: back-propagate it once, as the non-cached loss would be
            (its value equals ``loss``). With ``backward=None`` that backward runs every replay,
            scaled by the upstream gradient it hands ``surrogate``; with a ``backward``, it
            back-propagates the last replay's share.
        num_replays: replays this rank runs (the maximum over the group's ranks).
    """

    loss: Tensor
    surrogate: Tensor
    num_replays: int


def grad_cache_step(encode: Encode, mini_batches: Sequence[Any],
                    loss_fn: Callable[[List[Tensor]], Tensor], *,
                    backward: Optional[Callable[[Tensor], None]] = None,
                    empty_embeddings: Optional[Callable[[], Sequence[Tensor]]] = None,
                    loss_parameters: Sequence[Tensor] = (),
                    group: GroupLike = None) -> GradCacheStep:
    """One GradCache step (module docstring): exact gradients of ``loss_fn`` over all the
    mini-batches with the activation memory of one.

    Args:
        encode: ``encode(mini_batch)`` -> the mini-batch's embedding columns, a sequence of
            tensors with the mini-batch's rows in dim 0 (e.g. ``[query [b, D], positive [b, D],
            negatives [b, K, D]]``); run through the engine / wrapped model so its hooks fire.
            Called once without a graph and once with, per mini-batch, each time on new
            containers around the mini-batch's tensors (an encoder may write its outputs into
            its input mapping, as sentence-transformers' modules do).
        mini_batches: this rank's batch split by rows (:func:`split_rows`); may be empty.
        loss_fn: ``loss_fn(columns)`` -> 0-dim loss, where ``columns[i]`` is column ``i`` of every
            mini-batch concatenated along dim 0 (leaf tensors). Its collectives run once.
        backward: ``None`` (plain torch, DDP, the Hugging Face Trainer without DeepSpeed): the
            replays run inside the caller's backward of ``surrogate``, each scaled by the
            upstream gradient that backward hands ``surrogate`` (any caller scale, a
            ``torch.amp.GradScaler``'s included). Otherwise a callable that back-propagates
            every replay but the last right here, at the scale the caller's backward will apply
            to ``surrogate`` (e.g. ``lambda t: (t / window).backward()`` for a caller that
            divides its loss by its accumulation window; under DeepSpeed
            :func:`megaloss.integrations.grad_cache.inner_replay_backward`).
        empty_embeddings: for a rank with no mini-batches: columns with 0 rows whose graph
            reaches every trainable parameter (a zero gradient; required then).
        loss_parameters: tensors that ``loss_fn`` itself trains (a learnable temperature): their
            gradient is routed through ``surrogate``, so the engine reduces it like the rest.
        group: the group whose ranks must run the same number of replays (the data-parallel
            group; ``None``: torch's default group).

    Returns:
        :class:`GradCacheStep`. The caller's backward of ``surrogate`` with upstream gradient
        ``s`` (plus, with a ``backward``, the replays it ran) leaves ``s`` times the gradients of
        the non-cached loss.

    Raises:
        ValueError: ``encode`` returned different column counts, or other shapes on a replay
            (with ``backward=None``, from the caller's backward); some rank has no mini-batches
            and no ``empty_embeddings`` (raised on every rank). With a
            ``backward``, later, from
            the caller's backward of ``surrogate``: the upstream gradient it applies differs
            (rel 1e-6) from the one each replay got through ``backward``, which would weight the
            mini-batches differently (same on every rank that scales alike).
    """
    # Every rank runs the same number of encoder passes: engines that reduce in every backward
    # (ZeRO-2/3) and ZeRO-3's check, at each forward, that all ranks traced the same modules
    # are collectives. Ranks with fewer mini-batches re-run their last one (or the empty batch)
    # and discard the result.
    # The flag lets every rank raise together when one cannot join (no rank waits forever).
    stuck = not mini_batches and empty_embeddings is None
    agreed = torch.tensor([len(mini_batches), int(stuck)], dtype=torch.int64,
                          device=backend_device(group))
    most, stuck_anywhere = all_reduce_max_(agreed, group).tolist()
    num_replays = max(1, most)
    if stuck_anywhere:
        raise ValueError("a rank has no mini-batches and no empty_embeddings: pass "
                         "empty_embeddings (0-row columns through the encoder) so it can join")
    states: List[RandomState] = []
    cached: List[List[Tensor]] = []
    for k in range(num_replays):
        with torch.no_grad():
            if k < len(mini_batches):
                states.append(RandomState())
                cached.append([t.detach() for t in encode(_fresh(mini_batches[k]))])
            elif mini_batches:
                encode(_fresh(mini_batches[-1]))
            else:
                cached.append([t.detach() for t in empty_embeddings()])
    widths = {len(c) for c in cached}
    if len(widths) != 1:
        raise ValueError(f"encode returned different numbers of columns: {sorted(widths)}")
    columns = [torch.cat([c[i] for c in cached]).requires_grad_(True)
               for i in range(len(cached[0]))]
    loss = loss_fn(columns)
    loss_parameters = [p for p in loss_parameters if p.requires_grad]
    grads = torch.autograd.grad(loss, columns + loss_parameters, allow_unused=True)
    column_grads = [torch.zeros_like(c) if g is None else g
                    for c, g in zip(columns, grads[:len(columns)])]
    offsets = [0]
    for c in cached:
        offsets.append(offsets[-1] + c[0].shape[0])
    replays = _Replays(encode, mini_batches, empty_embeddings, states, column_grads, offsets,
                       num_replays, loss.new_zeros(()))
    value = loss.detach()
    # With a backward: the upstream gradient each replay's surrogate received, i.e. the scale
    # its backward applied. The caller's backward of the returned surrogate must apply the same
    # (checked there).
    replay_scales: List[Tensor] = []
    if backward is None:
        # The replays wait for the caller's backward: the upstream gradient it hands the
        # returned loss scales every one of them (no replay runs at another scale).
        anchor = torch.zeros((), dtype=value.dtype, device=value.device, requires_grad=True)
        surrogate = _ReplayInBackward.apply(anchor, replays)
    else:
        for k in range(num_replays - 1):
            part = replays.surrogate(k)
            if part.requires_grad:
                part.register_hook(lambda g: replay_scales.append(g.detach().reshape(())))
            backward(part)
        surrogate = replays.surrogate(num_replays - 1)
    for p, g in zip(loss_parameters, grads[len(columns):]):
        if g is not None:
            surrogate = surrogate + (p * g).sum()
    surrogate = surrogate - surrogate.detach() + value
    if replay_scales and surrogate.requires_grad:
        surrogate.register_hook(lambda g: _check_replay_scales(replay_scales, g))
    return GradCacheStep(loss=value, surrogate=surrogate, num_replays=num_replays)


class _Replays:
    """Pass 3 of one step (module docstring): replay ``k`` under its saved RNG state as the
    surrogate ``sum(e_k * g_k)``, whose backward leaves the mini-batch's share; from the
    caller's backward, every replay under the forward's autocast state."""

    def __init__(self, encode: Encode, mini_batches: Sequence[Any],
                 empty_embeddings: Optional[Callable[[], Sequence[Tensor]]],
                 states: List[RandomState], column_grads: List[Tensor], offsets: List[int],
                 num_replays: int, zero: Tensor) -> None:
        self.encode, self.mini_batches, self.empty_embeddings = encode, mini_batches, \
            empty_embeddings
        self.states, self.column_grads, self.offsets = states, column_grads, offsets
        self.num_replays, self.zero = num_replays, zero
        self.autocast = _AutocastState()

    def surrogate(self, k: int) -> Tensor:
        if k < len(self.mini_batches):
            with self.states[k].restored():
                out = list(self.encode(_fresh(self.mini_batches[k])))
            rows = slice(self.offsets[k], self.offsets[k + 1])
            upstream = [g[rows] for g in self.column_grads]
        else:  # nothing left to replay on this rank: a zero gradient, same collectives
            out = (list(self.encode(_fresh(self.mini_batches[-1]))) if self.mini_batches
                   else list(self.empty_embeddings()))
            upstream = [torch.zeros_like(t) for t in out]
        if len(out) != len(upstream) or any(o.shape != u.shape for o, u in zip(out, upstream)):
            raise ValueError("encode's replay returned other shapes than its first pass: "
                             f"{[tuple(o.shape) for o in out]} vs "
                             f"{[tuple(u.shape) for u in upstream]}")
        # in the upstream's dtype (fp32 for megaloss's losses): the gradient reaching a
        # half-precision embedding is formed before its cast, as the non-cached backward does
        return sum(((o.to(u.dtype) * u).sum() for o, u in zip(out, upstream)), self.zero)

    def backward_all(self, upstream: Tensor) -> None:
        """Every replay, back-propagated with ``upstream`` (the caller's scale), from inside the
        caller's backward: grad mode and the forward's autocast state back on."""
        with torch.enable_grad(), self.autocast.restored():
            for k in range(self.num_replays):
                part = self.surrogate(k)
                if part.requires_grad:  # a frozen encoder has nothing to replay into
                    part.backward(upstream.detach().to(part.dtype).reshape(part.shape))


class _AutocastState:
    """The autocast state (CPU and CUDA) when captured; ``restored()`` re-enters it where the
    current one differs (a backward runs outside the forward's ``torch.autocast``), as
    ``torch.utils.checkpoint`` does for its recomputation."""

    def __init__(self) -> None:
        self.devices = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d),
                            torch.is_autocast_cache_enabled())
                        for d in ("cpu", "cuda") if torch.amp.is_autocast_available(d)}

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device, (enabled, dtype, cache) in self.devices.items():
                if enabled or torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled,
                                                       cache_enabled=cache))
            yield


class _ReplayInBackward(torch.autograd.Function):
    """A 0-valued node whose backward runs the step's replays with its upstream gradient."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, replays: _Replays) -> Tensor:
        ctx.replays = replays
        return torch.zeros_like(anchor)

    @staticmethod
    def backward(ctx: Any, upstream: Tensor) -> Any:
        ctx.replays.backward_all(upstream)
        return None, None


def _check_replay_scales(replay_scales: List[Tensor], upstream: Tensor) -> None:
    """Every replay must be back-propagated at the scale the caller's backward applies to the
    returned surrogate (the gradient would otherwise weight the mini-batches differently)."""
    scales = torch.stack([s.to(torch.float64) for s in replay_scales]
                         + [upstream.detach().reshape(()).to(torch.float64)])
    last = scales[-1]
    if not bool(torch.all((scales - last).abs() <= 1e-6 * last.abs())):
        raise ValueError(
            "grad_cache_step: the replays were back-propagated at scales "
            f"{[float(s) for s in scales[:-1]]} but the caller's backward of the returned "
            f"surrogate at {float(last)}: pass a backward that scales each replay as the "
            "caller scales the returned loss (e.g. divide by the window's gradient accumulation "
            "steps; under DeepSpeed inner_replay_backward(engine, scale=...))")
