r"""Multiple Negatives Ranking (InfoNCE) loss over the global batch, exact under data parallelism.

Math (van den Oord et al. 2018 "InfoNCE"; Henderson et al. 2017 and sentence-transformers'
``MultipleNegativesRankingLoss``; CLIP / ``MultipleNegativesSymmetricRankingLoss`` for the
symmetric form). The global batch is the concatenation, in rank order, of every rank's pairs:
``N = sum_r B_r`` queries ``q_g`` with positives ``p_g`` and ``K_r`` hard negatives each. The
candidate documents are every positive and every hard negative of the global batch
(``C = sum_r B_r (1 + K_r)`` columns). With ``sim`` cosine or dot and temperature ``T``::

    s_gj = sim(q_g, d_j) / T
    l_g  = logsumexp_{j not masked} s_gj - s_{g, pos(g)}           (query -> document)
    L    = (1/N) sum_g l_g

``symmetric=True`` adds the document -> query direction over the in-batch pairs only
(``m_g = logsumexp_h sim(p_g, q_h)/T - sim(p_g, q_g)/T``, hard negatives are not rows) and returns
``(1/N) sum_g (l_g + m_g) / 2``. ``duplicate_ids`` (one integer per pair) masks out of the softmax
every *positive* of another pair that carries the query's id (a repeated text is not a negative);
hard negatives carry no id and are never masked.

Distribution contract (the autograd gather of open_clip's ``ClipLoss(gather_with_grad=True,
local_loss=True)``, ``src/open_clip/loss.py``, extended to uneven batches). Documents (and queries
when
they are needed as columns or rows) are gathered with an autograd all-gather whose backward is a
SUM reduce-scatter, so rank r's embeddings receive the gradient of the *sum of every rank's
loss*. Then:

* ``local_loss=True`` (open_clip's ``local_loss``): rank r scores only its own ``B_r`` rows
  (``B_r x C`` scores, computed ``chunk_size`` rows at a time with gradients formed in forward),
  forms its share ``S_r = sum_{g on r} l_g / N`` and returns
  ``all_reduce_sum(S_r)`` -- the global ``L`` on every rank, whose backward multiplies each share's
  gradient by the group size ``W``.
* ``local_loss=False``: every rank scores all ``N`` rows (``N x C`` scores, W times the work)
  and returns ``L``.

Either way rank r's gradient is ``W x`` (its part of ``dL``) for the embeddings it produced, and
the data-parallel engine's *average* over ``group`` (DDP, DeepSpeed ZeRO 0-2) of the ranks'
parameter gradients is exactly the single-device gradient of ``L`` on the concatenated global
batch (a replicated learnable temperature included). The returned value is ``L`` on every rank.
Requirements: ``group`` is the group the engine averages over (the DP group) and every rank calls
the loss once per micro-step. Gradient accumulation: DeepSpeed's ``engine.backward`` divides by
GAS, so the DeepSpeed integration multiplies the loss by its compensation (``GAS * N_m / N_step``
for micro-batch ``m`` of a step with ``N_step`` global queries; ``GAS`` for equal micro-batches;
``N_m`` is :attr:`MNROutput.num_queries`); with plain ``loss.backward()`` and no averaging,
divide the gradients by ``W`` instead. (The gather trims its padding, so no padded column ever
enters a softmax.)

Collectives per call (all entered by every rank, whatever its ``B_r``, including 0): one small
all-gather of per-rank metadata (sizes, ``D``, flags -- also the only host sync), one autograd
all-gather of embeddings, one of ``duplicate_ids`` when given, one autograd all-reduce of the loss
(``local_loss``), one all-reduce of the metric sums when metrics are asked for. Backward: one
reduce-scatter, plus one all-reduce with ``local_loss``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, List, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from .._deprecation import ReturnStatsAliases, renamed_keywords
from ..ops.infonce_rows import infonce_rows
from ..ops.options import (
    OptionsBase,
    bad_chunk_size,
    finite_positive_error,
    option_values,
    resolve_options,
)
from ..parallel.comm import all_gather_dim0, all_reduce_sum_
from ..parallel.groups import (
    SINGLE_RANK,
    GroupLike,
    group_rank,
    group_size,
    is_trivial,
    resolve_group,
)
from ..parallel.mappings import all_reduce_sum_autograd, gather_from_region

__all__ = ["mnr_loss", "MNROutput", "MNROptions", "MultipleNegativesRankingLoss", "SIMILARITIES",
           "mnr_option_error"]
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# metadata exchanged by every rank before anything else (one all-gather, one host sync)
_OK, _B, _D, _K, _DTYPE, _GRAD, _IDS, _BAD_T, _NF_Q, _NF_P, _NF_N = range(11)
_NAMES = ("query", "positive", "negatives")


class MNROutput(NamedTuple):
    """What :func:`mnr_loss` returns with ``return_stats=True`` (0-dim tensors, identical on
    every rank).

    Attributes:
        loss: the global loss (what :func:`mnr_loss` returns without ``return_stats``; carries
            the gradient).
        accuracy: fraction of the ``N`` global queries whose positive no unmasked candidate
            outscores (ties count as hits; query -> document direction; no gradient). NaN when
            ``N == 0``.
        mean_rank: mean over global queries of ``1 + #(unmasked candidates scoring strictly above
            the positive)``; 1.0 is perfect. Float64, no gradient. NaN when ``N == 0``.
        num_queries: ``N``, the number of queries of the global batch (a Python int, known from the
            metadata exchange at no extra cost; what a gradient-accumulation compensation needs).
    """

    loss: torch.Tensor
    accuracy: torch.Tensor
    mean_rank: torch.Tensor
    num_queries: int


SIMILARITIES = ("cosine", "dot")


@dataclass(frozen=True)
class MNROptions(OptionsBase):
    """Options of :func:`megaloss.mnr_loss` and :class:`megaloss.MultipleNegativesRankingLoss`.

    Attributes:
        temperature: ``T > 0`` (finite): scores are ``sim / T``; sentence-transformers'
            ``scale=20`` is ``T=0.05``. (:func:`~megaloss.mnr_loss` also takes a 0-dim tensor,
            e.g. a learnable temperature, outside these options.)
        similarity: ``"cosine"`` (embeddings L2-normalised first) or ``"dot"``.
        symmetric: also average in the document -> query direction (CLIP-style).
        gather_across_ranks: use every rank's documents as candidates (``False``: this rank's
            batch only).
        local_loss: score only this rank's rows and all-reduce the loss share (open_clip's
            ``local_loss``); ``False`` scores every row on every rank (same value and gradients).
        chunk_size: score rows per block (``>= 1``); memory ``chunk_size x C``, the same result
            for any value up to summation order.

    Raises:
        ValueError / TypeError: an option out of range or of the wrong type, naming it.
    """

    temperature: float = 0.05
    similarity: str = "cosine"
    symmetric: bool = False
    gather_across_ranks: bool = True
    local_loss: bool = True
    chunk_size: int = 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            error = mnr_option_error(f.name, getattr(self, f.name))
            if error is not None:
                raise error
        object.__setattr__(self, "temperature", float(self.temperature))


def mnr_option_error(name: str, value: Any) -> Optional[Exception]:
    """The error for MNR option ``name`` set to ``value``, or ``None`` when it is valid (one
    message per bound, shared by :class:`MNROptions` and :func:`megaloss.mnr_loss`'s checks,
    which raise it on every rank)."""
    if name == "temperature":
        return finite_positive_error(name, value)
    elif name == "similarity":
        if not isinstance(value, str) or value not in SIMILARITIES:
            return ValueError(f"similarity must be one of {SIMILARITIES}, got {value!r}")
    elif name == "chunk_size":
        if bad_chunk_size(value):
            return ValueError(f"chunk_size must be an int >= 1, got {value!r}")
    elif not isinstance(value, bool):  # symmetric, gather_across_ranks, local_loss
        return TypeError(f"{name} must be a bool, got {value!r}")
    return None


Temperature = Union[float, torch.Tensor]


@renamed_keywords(gather="gather_across_ranks")
def mnr_loss(query: torch.Tensor, positive: torch.Tensor,
             negatives: Optional[torch.Tensor] = None, *, temperature: Temperature = 0.05,
             similarity: str = "cosine", symmetric: bool = False,
             gather_across_ranks: bool = True, group: GroupLike = None, local_loss: bool = True,
             duplicate_ids: Optional[torch.Tensor] = None, chunk_size: int = 1024,
             return_stats: bool = False, options: Optional[MNROptions] = None):
    """Multiple Negatives Ranking / InfoNCE loss against every document of the global batch.

    Args:
        query: ``[B, D]`` float embeddings of this rank's queries (``B`` may differ per rank, or
            be 0).
        positive: ``[B, D]``, ``positive[i]`` is the document that ``query[i]`` must rank first.
        negatives: ``[B, K, D]`` hard negatives (``K >= 0``; may differ per rank) or ``None``.
        temperature: ``T > 0``, a float or a 0-dim tensor (e.g. ``exp(-logit_scale)``, learnable).
            Scores are ``sim / T``; sentence-transformers' ``scale=20`` is ``T=0.05``.
        similarity: ``"cosine"`` (embeddings L2-normalised first) or ``"dot"``.
        symmetric: also average in the document -> query direction (CLIP-style).
        gather_across_ranks: use every rank's documents as candidates (``False``: this rank's
            batch only).
        group: the data-parallel group to gather over (the group the engine averages over);
            ``None`` is torch's default group, as everywhere in megaloss. Ignored with
            ``gather_across_ranks=False``.
        local_loss: score only this rank's ``B`` rows and all-reduce the loss share; ``False``
            scores all ``N`` rows on every rank (W times the compute; same value and gradients).
        duplicate_ids: ``[B]`` integer id per pair; positives of other pairs sharing the query's id
            are removed from its softmax (and queries sharing it, in the symmetric direction).
        chunk_size: score rows per block; with gradients computed in forward
            (:mod:`megaloss.ops.infonce_rows`) the loss's working memory is
            ``chunk_size x C`` floats instead of several ``rows x C`` matrices. Any value gives
            the same result up to summation order.
        return_stats: return an :class:`MNROutput` (the loss, in-batch top-1 accuracy and
            mean rank of the positive) instead of the loss alone; one extra small all-reduce
            with ``local_loss=True``.
        options: ``temperature``, ``similarity``, ``symmetric``, ``gather_across_ranks``,
            ``local_loss`` and ``chunk_size`` as one :class:`~megaloss.MNROptions`
            (e.g. from a ds_config, ``MegalossConfig.mnr.options()``), instead of the keywords.

    Returns:
        0-dim tensor (an :class:`MNROutput` holding it with ``return_stats=True``), the global
        mean loss ``L`` (same value on every rank), in
        ``promote_types(dtype, float32)``. Scaled so that after the data-parallel engine averages
        gradients over ``group``, every parameter gradient equals the single-device gradient of
        ``L`` on the concatenated global batch (module docstring). ``0`` when ``N == 0``.

    Raises:
        ValueError: bad shapes, ``D`` / dtype / ``requires_grad`` / use of ``duplicate_ids``
            differing across ranks, ``T <= 0``, NaN or inf in an embedding, unknown ``similarity``,
            ``chunk_size < 1``.
            Raised on *every* rank (after one metadata all-gather) so no rank waits forever.
        TypeError: non-floating embeddings, non-integer ``duplicate_ids``; ``options``
            together with option keywords not at their default (naming them).
    """
    values = _option_values(options, locals())
    out = _mnr(query, positive, negatives, values, group, duplicate_ids, metrics=return_stats)
    return out if return_stats else out.loss


def _option_values(options: Optional[MNROptions], arguments: dict) -> dict:
    """The option values of a call: its keywords, or ``options``'s fields. Not validated here
    unless ``options`` is given: :func:`_local_problem` checks them so that every rank raises."""
    if options is None:
        return option_values(MNROptions, arguments)
    return resolve_options(MNROptions, options, arguments).as_dict()


# validation and metadata exchange ------------------------------------------------------------
def _resolve_group(gather_across_ranks: bool, group: GroupLike) -> GroupLike:
    """The group to gather over: SINGLE_RANK when not gathering or when the group is trivial."""
    if not gather_across_ranks:
        return SINGLE_RANK
    group = resolve_group(group)
    return SINGLE_RANK if is_trivial(group) else group


def _local_problem(query, positive, negatives, temperature, similarity, duplicate_ids,
                   chunk_size) -> Optional[Exception]:
    """Everything checkable on this rank without a host sync; the error to raise, or None."""
    problem = (mnr_option_error("chunk_size", chunk_size)
               or mnr_option_error("similarity", similarity))
    if problem is not None:
        return problem
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            return ValueError(f"temperature must be a float or a 1-element tensor, got shape "
                              f"{tuple(temperature.shape)}")
    else:
        problem = mnr_option_error("temperature", temperature)
        if problem is not None:
            return problem
    for name, t in zip(_NAMES, (query, positive, negatives)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            return TypeError(f"{name} must be a floating tensor ({_DTYPES}), got {t.dtype}")
    if query.dim() != 2:
        return ValueError(f"query must be [B, D], got shape {tuple(query.shape)}")
    if positive.shape != query.shape:
        return ValueError(f"positive must have query's shape {tuple(query.shape)}, got "
                          f"{tuple(positive.shape)}")
    if positive.dtype != query.dtype:
        return TypeError(f"positive dtype {positive.dtype} differs from query dtype {query.dtype}")
    if negatives is not None:
        b, d = query.shape
        if negatives.dim() != 3 or negatives.shape[0] != b or negatives.shape[2] != d:
            return ValueError(f"negatives must be [B, K, D] = [{b}, K, {d}], got shape "
                              f"{tuple(negatives.shape)}")
        if negatives.dtype != query.dtype:
            return TypeError(f"negatives dtype {negatives.dtype} differs from query dtype "
                             f"{query.dtype}")
    if duplicate_ids is not None:
        if not isinstance(duplicate_ids, torch.Tensor):
            return TypeError(f"duplicate_ids must be a torch.Tensor, got "
                             f"{type(duplicate_ids).__name__}")
        if duplicate_ids.dtype.is_floating_point or duplicate_ids.dtype.is_complex \
                or duplicate_ids.dtype == torch.bool:
            return TypeError(f"duplicate_ids must be an integer tensor, got {duplicate_ids.dtype}")
        if duplicate_ids.shape != (query.shape[0],):
            return ValueError(f"duplicate_ids must be [B] = [{query.shape[0]}], got shape "
                              f"{tuple(duplicate_ids.shape)}")
    others = (("positive", positive), ("negatives", negatives), ("duplicate_ids", duplicate_ids))
    for name, t in others:
        if isinstance(t, torch.Tensor) and t.device != query.device:
            return ValueError(f"{name} must be on query's device {query.device}, got {t.device}")
    return None


def _nonfinite(t: Optional[torch.Tensor], device) -> torch.Tensor:
    if t is None or t.numel() == 0:
        return torch.zeros((), dtype=torch.long, device=device)
    return (~torch.isfinite(t.detach())).any().long()


def _exchange(query, positive, negatives, temperature, duplicate_ids, problem, group):
    """One all-gather of every rank's metadata; raises the same error on every rank."""
    device = query.device if isinstance(query, torch.Tensor) else torch.device("cpu")
    if problem is None:
        b, d = query.shape
        k = 0 if negatives is None else negatives.shape[1]
        grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (query, positive, negatives))
        fixed = [1, b, d, k, _DTYPES.index(query.dtype), int(grad), int(duplicate_ids is not None)]
        if isinstance(temperature, torch.Tensor):
            t = temperature.detach().reshape(())
            bad_t = ((t <= 0) | ~torch.isfinite(t)).long().to(device)
        else:
            bad_t = torch.zeros((), dtype=torch.long, device=device)
        flags = torch.stack([bad_t.to(device), _nonfinite(query, device),
                             _nonfinite(positive, device), _nonfinite(negatives, device)])
        local = torch.cat([torch.tensor(fixed, dtype=torch.long, device=device), flags])
    else:
        local = torch.zeros(11, dtype=torch.long, device=device)
    if is_trivial(group):
        table = [local.tolist()]
    else:
        table = all_gather_dim0(local, group).view(group_size(group), -1).tolist()
    _raise_if_inconsistent(table, problem, group)
    return table


def _raise_if_inconsistent(table: List[List[int]], problem: Optional[Exception], group) -> None:
    failed = [r for r, row in enumerate(table) if not row[_OK]]
    if failed:
        if problem is not None:
            raise problem
        raise ValueError(f"mnr_loss: rank(s) {failed} of the group passed invalid inputs (their "
                         f"error names the argument); raising on every rank so none waits in a "
                         f"collective")
    where = "" if len(table) == 1 else " on rank(s) {}"
    for col, name in ((_NF_Q, "query"), (_NF_P, "positive"), (_NF_N, "negatives")):
        bad = [r for r, row in enumerate(table) if row[col]]
        if bad:
            raise ValueError(f"{name} contains NaN or inf" + where.format(bad))
    bad = [r for r, row in enumerate(table) if row[_BAD_T]]
    if bad:
        raise ValueError("temperature must be finite and > 0" + where.format(bad))
    for col, what in ((_D, "embedding size D"), (_DTYPE, "dtype"),
                      (_GRAD, "requires_grad (backward would deadlock)"),
                      (_IDS, "use of duplicate_ids")):
        values = [row[col] for row in table]
        if len(set(values)) > 1:
            shown = [_DTYPES[v] for v in values] if col == _DTYPE else values
            raise ValueError(f"{what} differs across ranks: {shown} (rank order)")


# the loss --------------------------------------------------------------------------------------
def _mnr(query, positive, negatives, options: dict, group, duplicate_ids, *,
         metrics: bool) -> MNROutput:
    temperature, similarity, symmetric = (options["temperature"], options["similarity"],
                                          options["symmetric"])
    local_loss, chunk_size = options["local_loss"], options["chunk_size"]
    group = _resolve_group(options["gather_across_ranks"], group)
    problem = _local_problem(query, positive, negatives, temperature, similarity, duplicate_ids,
                             chunk_size)
    if problem is not None and is_trivial(group):
        raise problem
    table = _exchange(query, positive, negatives, temperature, duplicate_ids, problem, group)
    rank = group_rank(group)
    bs = [row[_B] for row in table]
    ks = [row[_K] for row in table]
    n = sum(bs)
    acc_dtype = torch.promote_types(query.dtype, torch.float32)
    if n == 0:  # every rank knows it: skip the collectives together, keep the graph connected
        zero = query.sum() * 0 + positive.sum() * 0
        if negatives is not None:
            zero = zero + negatives.sum() * 0
        if isinstance(temperature, torch.Tensor):
            zero = zero + temperature.sum() * 0
        nan = torch.full((), float("nan"), dtype=torch.float64, device=query.device)
        return MNROutput(zero.to(acc_dtype), nan, nan.clone(), 0)

    b, d = query.shape
    if negatives is None:
        negatives = query.new_zeros((b, 0, d))
    keep_negatives = negatives  # a [B, 0, D] input still gets its (empty) gradient below
    if similarity == "cosine":
        # Normalise before the gather (each rank differentiates its own normalisation), in
        # fp32 at least: bf16 unit vectors carry ~3e-3 relative error into every score, which
        # the 1/T = 20 scale turns into a visible loss error (sentence-transformers' MNRL
        # normalises in the input dtype after an fp32 matmul). The cast's backward returns the
        # gradient in the input dtype.
        query, positive, negatives = (F.normalize(t.to(acc_dtype), dim=-1)
                                      for t in (query, positive, negatives))

    # one autograd gather of [positives; negatives; (queries)] per rank
    need_queries = symmetric or not local_loss
    parts = [positive, negatives.reshape(-1, d)] + ([query] if need_queries else [])
    rows_per_rank = [bb * (1 + kk + int(need_queries)) for bb, kk in zip(bs, ks)]
    parts = [x for x in parts if x.shape[0]] or parts[:1]  # K=0: no copy of a lone positive
    local_rows = parts[0] if len(parts) == 1 else torch.cat(parts)
    gathered = gather_from_region(local_rows, group, rows_per_rank)
    starts = [sum(rows_per_rank[:r]) for r in range(len(bs))]
    pos_idx = [torch.arange(s, s + bb) for s, bb in zip(starts, bs)]
    neg_idx = [torch.arange(s + bb, s + bb * (1 + kk)) for s, bb, kk in zip(starts, bs, ks)]
    doc_idx = torch.cat(pos_idx + neg_idx).to(query.device)  # positive of pair g is column g
    identity = not need_queries and (len(bs) == 1 or not any(ks))  # gathered is already docs
    docs = gathered if identity else gathered.index_select(0, doc_idx)
    q_all = None
    if need_queries:
        q_idx = torch.cat([torch.arange(s + bb * (1 + kk), s + bb * (2 + kk))
                           for s, bb, kk in zip(starts, bs, ks)]).to(query.device)
        q_all = gathered.index_select(0, q_idx)

    ids_all = None
    if duplicate_ids is not None:  # integers: no gradient, same uneven gather
        ids_all = gather_from_region(duplicate_ids.to(query.device), group, bs)

    offset = sum(bs[:rank])
    if local_loss:
        rows = torch.arange(offset, offset + b, device=query.device)
        q_rows, p_rows = query, positive
    else:
        rows = torch.arange(n, device=query.device)
        q_rows, p_rows = q_all, docs[:n]

    row_ids = None if ids_all is None else ids_all[rows]
    total, above = infonce_rows(q_rows, docs, temperature, rows, row_ids=row_ids, col_ids=ids_all,
                                chunk_size=chunk_size, ranks=metrics)
    if symmetric:  # positives against every query of the global batch: [R, N]
        back, _ = infonce_rows(p_rows, q_all, temperature, rows, row_ids=row_ids,
                               col_ids=ids_all, chunk_size=chunk_size)
        total = (total + back) / 2
    share = total / n
    if keep_negatives is not None and keep_negatives.numel() == 0 and keep_negatives.requires_grad:
        share = share + keep_negatives.sum() * 0  # K = 0: an empty gradient, as torch gives
    loss = all_reduce_sum_autograd(share, group) if local_loss else share

    if not metrics:
        nan = torch.full((), float("nan"), dtype=torch.float64, device=query.device)
        return MNROutput(loss, nan, nan, n)
    stats = torch.stack([(above == 0).sum(), (above + 1).sum()]).to(torch.float64)
    if local_loss:
        all_reduce_sum_(stats, group)
    stats = stats / n
    return MNROutput(loss, stats[0], stats[1], n)


# module form ----------------------------------------------------------------------------------
class MultipleNegativesRankingLoss(ReturnStatsAliases, nn.Module):
    """Gathered MNR / InfoNCE loss (see the module docstring for the math and the
    data-parallel gradient contract).

    Args:
        temperature: initial ``T > 0`` (``0.05`` = sentence-transformers' ``scale=20``).
        learnable_temperature: learn ``logit_scale = ln(1/T)`` as a parameter (CLIP, Radford et al.
            2021; open_clip). Its value is clamped to ``max_logit_scale`` in forward (no gradient
            past the clamp), i.e. ``T >= exp(-max_logit_scale)``.
        max_logit_scale: upper clamp of ``logit_scale``; CLIP's ``ln(100)``.
        similarity, symmetric, gather_across_ranks, group, local_loss, chunk_size: as in
            :func:`mnr_loss` (keyword-only).
        options: ``temperature`` (the initial one) and the other :func:`mnr_loss` options as
            one :class:`~megaloss.MNROptions`, instead of the keywords (kept as
            ``self.options``).

    ``forward(query [B, D], positive [B, D], negatives [B, K, D] | None, duplicate_ids [B] | None,
    *, return_stats=False)`` returns what :func:`mnr_loss` does.
    Under ZeRO-3 call ``forward`` (the module's hooks gather ``logit_scale`` only there).

    Raises:
        ValueError: ``temperature <= 0``, unknown ``similarity``, ``chunk_size < 1``, or a
            learnable temperature whose initial ``logit_scale`` already exceeds
            ``max_logit_scale``.
        TypeError: a non-bool flag; ``options`` together with option keywords not at their
            default.
    """

    @renamed_keywords(gather="gather_across_ranks")
    def __init__(self, temperature: float = 0.05, *, learnable_temperature: bool = False,
                 max_logit_scale: float = math.log(100.0), similarity: str = "cosine",
                 symmetric: bool = False, gather_across_ranks: bool = True,
                 group: GroupLike = None, local_loss: bool = True,
                 chunk_size: int = 1024, options: Optional[MNROptions] = None) -> None:
        super().__init__()
        self.options = resolve_options(MNROptions, options, locals())
        temperature = self.options.temperature
        init_scale = math.log(1.0 / temperature)
        if learnable_temperature and init_scale > max_logit_scale + 1e-12:
            raise ValueError(f"temperature={temperature} gives logit_scale {init_scale:.4f} above "
                             f"max_logit_scale={max_logit_scale:.4f}")
        self.learnable_temperature = learnable_temperature
        self.max_logit_scale = float(max_logit_scale)
        self.group = group
        if learnable_temperature:
            self.logit_scale = nn.Parameter(torch.tensor(init_scale, dtype=torch.float32))
        else:
            self.register_parameter("logit_scale", None)
            self._temperature = float(temperature)

    similarity = property(lambda self: self.options.similarity)
    symmetric = property(lambda self: self.options.symmetric)
    gather_across_ranks = property(lambda self: self.options.gather_across_ranks)
    local_loss = property(lambda self: self.options.local_loss)
    chunk_size = property(lambda self: self.options.chunk_size)

    @property
    def temperature(self):
        """Current ``T``: a float, or a 0-dim tensor ``exp(-min(logit_scale, max))`` (with grad)."""
        if self.logit_scale is None:
            return self._temperature
        return torch.exp(-self.logit_scale.clamp(max=self.max_logit_scale))

    def _options(self):
        return dict(self.options.as_dict(), temperature=self.temperature, group=self.group)

    def forward(self, query: torch.Tensor, positive: torch.Tensor,
                negatives: Optional[torch.Tensor] = None,
                duplicate_ids: Optional[torch.Tensor] = None, *, return_stats: bool = False):
        return mnr_loss(query, positive, negatives, duplicate_ids=duplicate_ids,
                        return_stats=return_stats, **self._options())

    def extra_repr(self) -> str:
        t = (f"logit_scale=learnable(max={self.max_logit_scale:.4f})" if self.learnable_temperature
             else f"temperature={self._temperature}")
        return (f"{t}, similarity={self.similarity!r}, symmetric={self.symmetric}, "
                f"gather_across_ranks={self.gather_across_ranks}, local_loss={self.local_loss}")
