"""Embedding model + gathered MNR loss as ONE module, so ``engine.forward`` runs the loss.

Why the loss lives inside the module (measured on DeepSpeed 0.19.8, ``runtime/engine.py``): a direct
``loss.backward()`` is divided by the gradient-accumulation steps ``G`` only through hooks that
``engine.forward`` puts on its outputs, and under ZeRO-3 a parameter is only materialised inside
its module's forward. Encoding queries and documents and computing
:func:`megaloss.mnr_loss` (``return_stats=True``) in one ``forward`` keeps both right for
any ZeRO stage, with ``engine.backward(out.loss)`` as well as ``out.loss.backward()``.

Gradient scaling. ``mnr_loss`` returns the loss ``L_m`` of micro-batch m's *global* batch (every
DP rank's queries, every rank's documents as negatives) on every rank, with gradients prepared for
an engine that *averages* over the DP group: ``sum_r grad(loss_r) = D * grad(L_m)``. DeepSpeed's
``engine.backward`` also divides by ``G``, so without compensation a step's gradient is
``(1/G) sum_m grad L_m``, the mean of micro-batch means. That is the global mean over the step's
queries only when every micro-batch holds the same global number of queries. The compensation
(:func:`step_loss_weights`, one all-reduce per step) weights micro-batch m by
``w_m = (n_m / N) * M / D``, ``n_m`` its global queries, ``N`` the step's, ``M`` the engine's
loss multiplier (``1 / c``, measured on the real engine by
:func:`megaloss.calibration.deepspeed_scale.probe_deepspeed`; ``G * D`` for ``engine.backward``, so
``w_m = G n_m / N``). The step gradient is then that of ``sum_m (n_m / N) L_m``, the query mean
over the whole step, as the token calibration does for language models.

Math of the pooled embedding (Sentence-BERT mean pooling):
``e_b = sum_t m_bt h_bt / max(sum_t m_bt, 1)`` with ``h [B, T, H]`` the encoder's last hidden
states and ``m [B, T]`` the attention mask.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from ..._deprecation import renamed_keywords
from ...losses.grad_cache import grad_cache_step, split_rows
from ...losses.mnr import MNROptions, mnr_loss
from ...ops.options import resolve_options
from ...parallel.groups import GroupLike
from ..step.mnr import step_loss_weights

__all__ = ["mean_pool", "EmbeddingOutput", "EmbeddingModelWithMNR", "cached_mnr_forward",
           "step_loss_weights"]


def mean_pool(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the hidden states over the non-padded positions.

    Args:
        hidden_states: ``[B, T, H]`` float.
        attention_mask: ``[B, T]``, 1 (or True) for real tokens, 0 for padding.

    Returns:
        ``[B, H]`` in ``promote_types(hidden_states.dtype, float32)``: the sum over up to ``T``
        positions is taken in fp32 at least (a bf16 sum of hundreds of tokens loses ~3 digits,
        which the contrastive loss's 1/T scale would amplify). An all-padding row gives zeros.

    Raises:
        ValueError: the shapes do not match.
    """
    if hidden_states.dim() != 3 or attention_mask.shape != hidden_states.shape[:2]:
        raise ValueError(f"hidden_states must be [B, T, H] and attention_mask [B, T], got "
                         f"{tuple(hidden_states.shape)} and {tuple(attention_mask.shape)}")
    acc = torch.promote_types(hidden_states.dtype, torch.float32)
    mask = attention_mask.to(acc).unsqueeze(-1)
    return (hidden_states.to(acc) * mask).sum(1) / mask.sum(1).clamp_min(1.0)


class EmbeddingOutput(NamedTuple):
    """What :meth:`EmbeddingModelWithMNR.forward` returns (a tuple, so DeepSpeed finds ``loss``).

    Attributes:
        loss: scalar to call ``engine.backward`` on: the micro-batch's global MNR loss times
            ``loss_weight`` (requires grad).
        value: the micro-batch's global MNR loss, detached (same on every rank; for logging).
        accuracy: detached in-batch top-1 accuracy of this micro-batch's global queries
            (the positive outscores every other gathered document); NaN for an empty batch.
        mean_rank: detached mean rank of the positive among the gathered documents (1 = best).
    """

    loss: torch.Tensor
    value: torch.Tensor
    accuracy: torch.Tensor
    mean_rank: torch.Tensor


class EmbeddingModelWithMNR(nn.Module):
    """A bi-encoder (shared weights for queries and documents) trained with gathered MNR.

    Args:
        encoder: module called as ``encoder(input_ids=..., attention_mask=...)`` returning either a
            ``[B, T, H]`` tensor or an object with ``last_hidden_state`` (any ``transformers``
            encoder or decoder base model, e.g. ``BertModel``).
        temperature: MNR softmax temperature (> 0); 0.05 = sentence-transformers' ``scale=20``.
        similarity: ``"cosine"`` or ``"dot"``.
        symmetric: also score positives against all queries and average both directions.
        gather_across_ranks: use every rank of ``group``'s documents as negatives.
        group: the data-parallel group the batch is spread over, the one the engine averages
            gradients over; ``None`` is torch's default group. Pass it explicitly under tensor
            parallelism (``topology.dp_group``).
        local_loss: each rank computes only its own queries' rows (memory ``B_local x B_global``).
        chunk_size: score rows per block of the loss (memory ``chunk_size x C``).
        options: the fields above (but ``group``) as one :class:`~megaloss.MNROptions`
            (e.g. ``MegalossConfig.mnr.options()`` from a ds_config), instead of the keywords;
            kept as ``self.options``.

    Raises:
        TypeError: ``encoder`` is not an ``nn.Module``; ``options`` together with option
            keywords not at their default; a non-bool flag.
        ValueError: ``temperature`` <= 0, ``similarity`` unknown, ``chunk_size`` < 1.
    """

    @renamed_keywords(gather="gather_across_ranks")
    def __init__(self, encoder: nn.Module, *, temperature: float = 0.05,
                 similarity: str = "cosine", symmetric: bool = False,
                 gather_across_ranks: bool = True, group: GroupLike = None,
                 local_loss: bool = True, chunk_size: int = 1024,
                 options: Optional[MNROptions] = None) -> None:
        arguments = locals()  # the option keywords, read by field name
        super().__init__()
        if not isinstance(encoder, nn.Module):
            raise TypeError(f"encoder must be an nn.Module, got {type(encoder).__name__}")
        self.options = resolve_options(MNROptions, options, arguments)
        self.encoder = encoder
        self.group = group

    temperature = property(lambda self: self.options.temperature)
    similarity = property(lambda self: self.options.similarity)
    symmetric = property(lambda self: self.options.symmetric)
    gather_across_ranks = property(lambda self: self.options.gather_across_ranks)
    local_loss = property(lambda self: self.options.local_loss)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.as_dict().items())

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[B, H]`` (mean-pooled, not normalised) of token ids ``[B, T]``."""
        out: Any = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        hidden = out if isinstance(out, torch.Tensor) else out.last_hidden_state
        return mean_pool(hidden, attention_mask)

    def forward(self, query_input_ids: torch.Tensor, query_attention_mask: torch.Tensor,
                document_input_ids: torch.Tensor, document_attention_mask: torch.Tensor,
                negative_input_ids: Optional[torch.Tensor] = None,
                negative_attention_mask: Optional[torch.Tensor] = None, *,
                duplicate_ids: Optional[torch.Tensor] = None,
                loss_weight: Optional[torch.Tensor] = None,
                embeddings_only: bool = False) -> Union[EmbeddingOutput, List[torch.Tensor]]:
        """Encode and return the gathered MNR loss of one micro-batch.

        Args:
            query_input_ids / query_attention_mask: ``[B, Tq]`` long / ``[B, Tq]``.
            document_input_ids / document_attention_mask: ``[B, Td]``: the positives.
            negative_input_ids / negative_attention_mask: optional ``[B, K, Tn]`` hard negatives.
            duplicate_ids: optional ``[B]`` long; same id = same text, not a negative.
            loss_weight: optional scalar multiplying ``loss`` (the GAS compensation of
                :func:`step_loss_weights`); ``None`` = 1.
            embeddings_only: return the embedding columns ``[query [B, H], positive [B, H]
                (, negatives [B, K, H])]`` and no loss (no collective): the encoder pass of
                :func:`cached_mnr_forward`, run through the engine so its hooks fire.

        Every rank of ``group`` must call forward the same number of times (the gathers are
        collective), even with ``B = 0``.
        """
        columns = [self.encode(query_input_ids, query_attention_mask),
                   self.encode(document_input_ids, document_attention_mask)]
        if negative_input_ids is not None:
            if negative_attention_mask is None:
                raise ValueError("negative_attention_mask is required with negative_input_ids")
            b, k, t = negative_input_ids.shape
            flat = self.encode(negative_input_ids.reshape(b * k, t),
                               negative_attention_mask.reshape(b * k, t))
            columns.append(flat.reshape(b, k, flat.shape[-1]))  # b may be 0
        if embeddings_only:
            return columns
        return self.loss_from_embeddings(columns, duplicate_ids=duplicate_ids,
                                         loss_weight=loss_weight)

    def loss_from_embeddings(self, columns: Sequence[torch.Tensor], *,
                             duplicate_ids: Optional[torch.Tensor] = None,
                             loss_weight: Optional[torch.Tensor] = None) -> EmbeddingOutput:
        """The gathered MNR loss of embedding columns ``[query, positive (, negatives)]`` (what
        ``forward(..., embeddings_only=True)`` returns); collective over ``group``."""
        negatives = columns[2] if len(columns) > 2 else None
        out = mnr_loss(columns[0], columns[1], negatives, return_stats=True,
                       options=self.options, group=self.group, duplicate_ids=duplicate_ids)
        loss = out.loss if loss_weight is None else out.loss * loss_weight
        return EmbeddingOutput(loss=loss, value=out.loss.detach(), accuracy=out.accuracy,
                               mean_rank=out.mean_rank)


def cached_mnr_forward(model: nn.Module, batch: Dict[str, torch.Tensor], *,
                       mini_batch_size: int, backward: Optional[Callable[[torch.Tensor], None]]
                       = None, loss_weight: Optional[torch.Tensor] = None) -> EmbeddingOutput:
    """:meth:`EmbeddingModelWithMNR.forward` with gradient caching (GradCache, Gao et al. 2021,
    arXiv:2101.06983; :mod:`megaloss.losses.grad_cache`): the encoder holds the activations of
    ``mini_batch_size`` rows at a time, whatever the micro-batch size, with the same loss and
    gradients.

    Args:
        model: the DeepSpeed engine (or DDP / bare module) around an
            :class:`EmbeddingModelWithMNR`; the encoder runs through it.
        batch: the keyword arguments of ``forward`` (``[B, ...]`` tensors; ``duplicate_ids``
            ``[B]`` optional); ``B`` may differ per rank, or be 0.
        mini_batch_size: rows encoded per pass (>= 1).
        backward: ``None`` (one process, DDP): the replays run inside the caller's backward of
            ``out.loss``, each scaled by its upstream gradient, so any caller scale (``loss /
            window``, a ``GradScaler``'s) is exact (under DDP every replay is reduced: correct,
            as reduction is linear, at ``num_replays`` times the traffic). Under DeepSpeed
            :func:`megaloss.integrations.grad_cache.inner_replay_backward` (``engine.
            backward(out.loss)``; with ``scale=s`` for ``engine.backward(s * out.loss,
            scale_wrt_gas=False)``): it back-propagates every replay but the last here, at the
            scale the caller's backward applies to ``out.loss``; a mismatch raises a ValueError
            from the caller's backward.
        loss_weight: as in ``forward``.

    Returns:
        :class:`EmbeddingOutput` whose ``loss`` (value: the weighted loss) back-propagates as
        the non-cached ``model(**batch).loss`` would: with ``backward=None`` its backward runs
        every replay; with a ``backward`` it carries the last replay's graph and
        ``engine.backward(out.loss)`` completes the micro-step exactly as the non-cached
        ``engine.backward(engine(**batch).loss)`` would, with the same ``loss_weight`` (the
        engine scale is unchanged, :mod:`megaloss.integrations.grad_cache`), after
        ``backward`` ran ``num_replays - 1`` times on every rank.

    A window shorter than the ds_config's ``gradient_accumulation_steps`` ``G`` (an epoch's
    last): ``engine.backward`` still divides every replay and the last backward by ``G``, so the
    scales agree; the caller must (1) weight the window's micro-batches with
    :func:`step_loss_weights` over the window's own sizes and the measured ``loss_multiplier``
    (the engine's ``1 / c``, which includes that ``G``), and (2) own the boundary, since the
    engine's micro-step counter assumes windows of ``G``: ``engine.set_gradient_accumulation_
    boundary(m == last)`` before each micro-batch ``m``'s ``cached_mnr_forward`` (the replays
    keep and restore it), then ``engine.step()``.

    Raises:
        ValueError: ``mini_batch_size < 1``; ``model`` does not hold an
            :class:`EmbeddingModelWithMNR`.
    """
    module = getattr(model, "module", model)
    if not isinstance(module, EmbeddingModelWithMNR):
        raise ValueError(f"model must be (or wrap) an EmbeddingModelWithMNR, got "
                         f"{type(module).__name__}")
    inputs = {k: v for k, v in batch.items() if k != "duplicate_ids"}
    duplicate_ids = batch.get("duplicate_ids")
    outputs: List[EmbeddingOutput] = []

    def loss_fn(columns: List[torch.Tensor]) -> torch.Tensor:
        outputs.append(module.loss_from_embeddings(columns, duplicate_ids=duplicate_ids,
                                                   loss_weight=loss_weight))
        return outputs[-1].loss

    step = grad_cache_step(lambda mini: model(**mini, embeddings_only=True),
                           split_rows(inputs, mini_batch_size), loss_fn, backward=backward,
                           empty_embeddings=lambda: model(**inputs, embeddings_only=True),
                           group=module.group)  # the engine's DP group: equal replay counts
    out = outputs[-1]
    return EmbeddingOutput(loss=step.surrogate, value=out.value, accuracy=out.accuracy,
                           mean_rank=out.mean_rank)
