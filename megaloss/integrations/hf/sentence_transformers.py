"""A sentence-transformers loss that is megaloss's gathered MNR: a drop-in for
``SentenceTransformerTrainer`` (and ``model.fit``) that stays exact across data-parallel ranks with
uneven, even empty, per-rank batches.

sentence-transformers' ``MultipleNegativesRankingLoss(gather_across_devices=True)``
(``sentence_transformers/sentence_transformer/losses/multiple_negatives_ranking.py``) gathers
with ``all_gather_with_grad``, which needs the same batch size on every rank (gloo aborts the
process otherwise). :class:`GatheredMultipleNegativesRankingLoss` follows the same conventions
(``model`` first in the constructor, ``forward(sentence_features, labels)``, ``get_config_dict``,
``citation``, ``compute_loss_from_embeddings``) and computes :func:`megaloss.mnr_loss`:

- columns: ``(anchor, positive, negative_1, ..., negative_k)``; the extra columns are hard
  negatives of their row (they become ``negatives [B, k, D]``);
- ``scale`` is sentence-transformers' (``scale = 1 / temperature``; 20 is ``T = 0.05``),
  ``similarity_fct`` ``"cosine"`` / ``"dot"`` (or ST's ``util.cos_sim`` / ``util.dot_score``);
- ``symmetric=True`` is ST's ``directions=("query_to_doc", "doc_to_query"),
  partition_mode="per_direction"`` (ST's MultipleNegativesSymmetricRankingLoss);
- ``labels_as_duplicate_ids=True``: the dataset's ``label`` column is an integer id per row; rows
  sharing an id are not each other's negatives (a repeated text is not a negative);
- the gather group is the data-parallel group (``group=None``: torch's default group, which is the
  DP group of ``SentenceTransformerTrainer`` / DeepSpeed without model parallelism).

Gradient contract (:mod:`megaloss.losses.mnr`): the value is the loss of the *global* batch on
every rank, and after the engine *averages* gradients over the DP group (DDP, DeepSpeed ZeRO 0-3;
``SentenceTransformerTrainer`` under ZeRO-2 and ZeRO-3, uneven and empty ranks included, is
checked against float64 in ``tests/integrations/test_hf_sentence_transformers_deepspeed.py``)
they are the single-device gradients of that loss. Gradient accumulation: the Trainer divides each
micro-batch's loss by the accumulation steps, so a step is the mean of its micro-batches' global
losses (exact when every micro-batch has the same global size, as with the Trainer's samplers).

An empty per-rank batch: Hugging Face encoders cannot run 0 rows (attention reshapes fail), so
the encoder is skipped and a ``[0, D]`` embedding tied to the trainable parameters with a zero
gradient stands in (ZeRO 0-2 / DDP then reduce a zero gradient from that rank, as they must).
Under DeepSpeed ZeRO-3 every module forward all-gathers its partitioned parameters, so skipping
the encoder would leave the other ranks waiting: there the rank embeds one placeholder row per
column through the same forwards and keeps none of it (a zero gradient, matched collectives).
The same under PyTorch FSDP2 (``fully_shard``; DTensor parameters: all-gathers in each unit's
forward, reduce-scatters in its backward; the zero-gradient tie would also read the shards
outside a forward). FSDP2 averages gradients over its mesh by default, as DDP: the contract
above holds for its default reduction (not after ``set_gradient_divide_factor``); checked with
the SentenceTransformer ``fully_shard``-ed per BERT layer and as the root, uneven and empty
ranks, in ``tests/integrations/test_hf_sentence_transformers_fsdp2.py``.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ...losses.grad_cache import grad_cache_step, split_rows
from ...losses.mnr import SIMILARITIES, mnr_loss
from ...ops.validation import is_dtensor
from ...parallel.groups import GroupLike

__all__ = ["GatheredMultipleNegativesRankingLoss", "CachedGatheredMultipleNegativesRankingLoss",
           "caller_loss_scale"]

CITATION = """
@misc{oord2019representationlearningcontrastivepredictive,
      title={Representation Learning with Contrastive Predictive Coding},
      author={Aaron van den Oord and Yazhe Li and Oriol Vinyals},
      year={2019},
      eprint={1807.03748},
      archivePrefix={arXiv},
      primaryClass={cs.LG},
      url={https://arxiv.org/abs/1807.03748},
}
"""


GRADCACHE_CITATION = """
@misc{gao2021scaling,
      title={Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup},
      author={Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan},
      year={2021},
      eprint={2101.06983},
      archivePrefix={arXiv},
      primaryClass={cs.LG},
      url={https://arxiv.org/abs/2101.06983},
}
"""


def _similarity_name(similarity_fct: Any) -> str:
    if isinstance(similarity_fct, str):
        name = {"cos_sim": "cosine", "dot_score": "dot"}.get(similarity_fct, similarity_fct)
    else:
        name = {"cos_sim": "cosine", "dot_score": "dot"}.get(
            getattr(similarity_fct, "__name__", ""), "")
    if name not in SIMILARITIES:
        raise ValueError(f"similarity_fct must be 'cosine', 'dot', sentence_transformers.util."
                         f"cos_sim or util.dot_score, got {similarity_fct!r}")
    return name


def _rows(features: Dict[str, Any]) -> int:
    for key in ("input_ids", "attention_mask", "pixel_values", "inputs_embeds"):
        value = features.get(key)
        if isinstance(value, Tensor) and value.dim() >= 1:
            return int(value.shape[0])
    for value in features.values():
        if isinstance(value, Tensor) and value.dim() >= 1:
            return int(value.shape[0])
    raise ValueError("cannot tell the batch size of a sentence_features dict (no tensor in it)")


def _calling_trainer() -> Tuple[Any, Any]:
    """The ``transformers.Trainer`` whose ``training_step`` is on the call stack, and that
    frame's ``num_items_in_batch`` (``(None, None)`` outside one)."""
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover - sentence-transformers depends on transformers
        return None, None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "training_step":
            trainer = frame.f_locals.get("self")
            if isinstance(trainer, Trainer):
                return trainer, frame.f_locals.get("num_items_in_batch")
        frame = frame.f_back
    return None, None


def caller_loss_scale(*, deepspeed: bool) -> Optional[float]:
    """The factor the caller will multiply the returned loss by before its backward.

    Inside ``transformers.Trainer.training_step`` (transformers 5.x ``trainer.py``): ``1 /
    trainer.current_gradient_accumulation_steps`` (the micro-batches ``get_batch_samples``
    returned for this window: fewer than ``gradient_accumulation_steps`` in an epoch's last
    window), or 1 when the Trainer's ``loss_is_scaled_for_ga`` rule says the loss is already
    scaled; without DeepSpeed also divided by accelerate's ``gradient_accumulation_steps`` (its
    ``Accelerator.backward`` divides by it), under DeepSpeed passed with ``scale_wrt_gas=False``.
    Outside a Trainer: ``None``, i.e. the caller's ``loss.backward()`` (scale 1) or
    ``engine.backward(loss)`` (the engine divides by its accumulation steps).

    :class:`CachedGatheredMultipleNegativesRankingLoss` needs it only under DeepSpeed, whose
    replays run before the caller's backward; a caller there that scales otherwise makes
    :func:`megaloss.losses.grad_cache.grad_cache_step` raise a ValueError in its backward (the
    replays' scales are checked against the caller's). Without DeepSpeed the replays run inside
    the caller's backward and take its scale from the upstream gradient, whatever it is.
    """
    trainer, num_items_in_batch = _calling_trainer()
    if trainer is None:
        return None
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (bool(getattr(trainer, "model_accepts_loss_kwargs", False))
                  and num_items_in_batch is not None) \
            or getattr(trainer, "compute_loss_func", None) is not None
    window = getattr(trainer, "current_gradient_accumulation_steps", None) \
        or trainer.args.gradient_accumulation_steps
    scale = 1.0 if scaled else 1.0 / int(window)
    if not deepspeed:
        scale /= int(getattr(trainer.accelerator, "gradient_accumulation_steps", 1) or 1)
    return scale


def _zero3_partitioned(model: nn.Module) -> bool:
    """DeepSpeed ZeRO-3 partitioned parameters (they carry ``ds_id``, set in
    ``deepspeed/runtime/zero/partition_parameters.py``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _collective_forwards(model: nn.Module) -> bool:
    """Whether ``model``'s forwards and backwards are collectives every rank must run: DeepSpeed
    ZeRO-3 (all-gathers per module forward) or PyTorch FSDP2 (``fully_shard``: DTensor
    parameters, all-gathered in each unit's forward, reduce-scattered in its backward)."""
    return _zero3_partitioned(model) or any(is_dtensor(p) for p in model.parameters())


def _placeholder_row(features: Dict[str, Any]) -> Dict[str, Any]:
    """One row shaped like the (empty) column ``features``: token id 0, attention on."""
    out = dict(features)
    for key, value in features.items():
        if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == 0:
            shape = (1,) + tuple(max(int(s), 1) for s in value.shape[1:])
            fill = torch.ones if key == "attention_mask" else torch.zeros
            out[key] = fill(shape, dtype=value.dtype, device=value.device)
    return out


class GatheredMultipleNegativesRankingLoss(nn.Module):
    """megaloss's gathered MNR / InfoNCE as a sentence-transformers loss (module docstring).

    Args:
        model: the ``SentenceTransformer`` (the Trainer swaps in its wrapped model, as for ST's
            own losses).
        scale: ``1 / temperature`` (> 0); ST's default 20.
        similarity_fct: ``"cosine"`` (default), ``"dot"``, or ST's ``util.cos_sim`` /
            ``util.dot_score``.
        symmetric: average with the document -> query direction.
        gather_across_devices: use every rank's documents as candidates (default True; False:
            this rank's batch only, as ST's default).
        group: the data-parallel group; ``None`` is torch's default group.
        labels_as_duplicate_ids: read ``labels`` (an integer ``[B]`` tensor from the dataset's
            ``label`` column) as duplicate ids; otherwise labels are ignored, as in ST's MNRL.
        chunk_size: score rows per block (memory ``chunk_size x C``; same result for any value).

    Raises:
        ValueError: ``scale <= 0`` or an unknown similarity.
    """

    def __init__(self, model: nn.Module, scale: float = 20.0, similarity_fct: Any = "cosine", *,
                 symmetric: bool = False, gather_across_devices: bool = True,
                 group: GroupLike = None, labels_as_duplicate_ids: bool = False,
                 chunk_size: int = 1024) -> None:
        super().__init__()
        if not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        self.model = model
        self.scale = float(scale)
        self.similarity = _similarity_name(similarity_fct)
        self.symmetric = bool(symmetric)
        self.gather_across_devices = bool(gather_across_devices)
        self.group = group
        self.labels_as_duplicate_ids = bool(labels_as_duplicate_ids)
        self.chunk_size = int(chunk_size)

    @property
    def temperature(self) -> float:
        return 1.0 / self.scale

    # embeddings ------------------------------------------------------------------------------
    def _embedding_dim(self) -> int:
        get = getattr(self.model, "get_sentence_embedding_dimension", None)
        if get is None:  # a wrapped model (DeepSpeed engine, DDP): ask the module inside
            inner = getattr(self.model, "module", None)
            get = getattr(inner, "get_sentence_embedding_dimension", None)
        dim = get() if get is not None else None
        if not dim:
            raise ValueError("an empty batch needs the model's sentence embedding dimension "
                             "(model.get_sentence_embedding_dimension() returned nothing)")
        return int(dim)

    def _empty_embeddings(self, columns: int) -> List[Tensor]:
        """``[0, D]`` embeddings whose backward gives every trainable parameter a zero gradient."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        dtype = params[0].dtype if params else torch.float32
        device = params[0].device if params else torch.device("cpu")
        tie = sum((p.reshape(-1)[:1].sum() * 0 for p in params),
                  torch.zeros((), dtype=dtype, device=device))
        dim = self._embedding_dim()
        return [torch.zeros(0, dim, dtype=dtype, device=device) + tie for _ in range(columns)]

    def embed(self, sentence_features: Iterable[Dict[str, Any]]) -> List[Tensor]:
        """One ``[B, D]`` embedding per column (ST's ``embed_columns``: candidate columns share
        one forward when they tokenise alike)."""
        features = list(sentence_features)
        if len(features) < 2:
            raise ValueError(f"expected at least 2 columns (anchor, positive), got {len(features)}")
        if _rows(features[0]) == 0:
            if not _collective_forwards(self.model):
                return self._empty_embeddings(len(features))
            # ZeRO-3 / FSDP2 all-gather the parameters in every module (unit) forward and FSDP2
            # reduce-scatters in its backward (collectives): this rank runs the forwards the
            # others run, on one placeholder row per column, keeps 0 rows (zero gradients).
            return [e[:0] for e in self.embed([_placeholder_row(f) for f in features])]
        try:
            from sentence_transformers.base.losses.merged_forward import embed_columns
        except ImportError:  # older sentence-transformers: one forward per column
            return [self.model(f)["sentence_embedding"] for f in features]
        return embed_columns(self.model, features)

    # the loss --------------------------------------------------------------------------------
    def forward(self, sentence_features: Iterable[Dict[str, Any]],
                labels: Optional[Tensor] = None, *,
                duplicate_ids: Optional[Tensor] = None) -> Tensor:
        """The global batch's MNR loss (same value on every rank).

        Args:
            sentence_features: one tokenised dict per column: anchor, positive, hard negatives.
            labels: ignored unless ``labels_as_duplicate_ids`` (then ``[B]`` integer ids).
            duplicate_ids: explicit ``[B]`` integer ids (overrides ``labels``).
        """
        return self.compute_loss_from_embeddings(self.embed(sentence_features), labels,
                                                 duplicate_ids=duplicate_ids)

    def compute_loss_from_embeddings(self, embeddings: Sequence[Tensor],
                                     labels: Optional[Tensor] = None, *,
                                     duplicate_ids: Optional[Tensor] = None) -> Tensor:
        """The loss from per-column embeddings ``[anchor, positive, negative_1, ...]``."""
        if len(embeddings) < 2:
            raise ValueError(f"expected at least 2 embeddings, got {len(embeddings)}")
        query, positive = embeddings[0], embeddings[1]
        negatives = torch.stack(list(embeddings[2:]), dim=1) if len(embeddings) > 2 else None
        if duplicate_ids is None and self.labels_as_duplicate_ids:
            if labels is None:
                raise ValueError("labels_as_duplicate_ids=True needs an integer label column")
            duplicate_ids = labels.reshape(-1).to(query.device)
        return mnr_loss(query, positive, negatives, temperature=self.temperature,
                        similarity=self.similarity, symmetric=self.symmetric,
                        gather_across_ranks=self.gather_across_devices, group=self.group,
                        duplicate_ids=duplicate_ids, chunk_size=self.chunk_size)

    def get_config_dict(self) -> Dict[str, Any]:
        return {"scale": self.scale, "similarity_fct": self.similarity,
                "symmetric": self.symmetric,
                "gather_across_devices": self.gather_across_devices,
                "labels_as_duplicate_ids": self.labels_as_duplicate_ids}

    @property
    def citation(self) -> str:
        return CITATION

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.get_config_dict().items())


class CachedGatheredMultipleNegativesRankingLoss(GatheredMultipleNegativesRankingLoss):
    """:class:`GatheredMultipleNegativesRankingLoss` with gradient caching (GradCache, Gao et al.
    2021, arXiv:2101.06983; :mod:`megaloss.losses.grad_cache`): the encoder keeps the
    activations of ``mini_batch_size`` rows at a time, whatever the per-rank batch, with the same
    loss and gradients.

    In training (grad enabled), ``forward`` embeds the batch without a graph and computes the
    gathered loss and its embedding gradients (the collectives run here, once); the value
    returned is the loss. Where the replays run:

    - without DeepSpeed (plain torch, DDP, ``SentenceTransformerTrainer`` / ``model.fit``): inside
      the caller's backward of the returned loss, as sentence-transformers'
      ``CachedMultipleNegativesRankingLoss`` does (``sentence_transformers/base/losses/
      gradcache.py``, ``_backward_hook``), each scaled by the upstream gradient: any factor the
      caller applies (the Trainer's ``1 / `` accumulation window, an fp16 ``GradScaler``'s loss
      scale) reaches every mini-batch, and the gradients are the non-cached loss's times it;
    - under a DeepSpeed engine: ZeRO-2 and ZeRO-3 stop on replays inside one backward
      ("Gradient computed twice for this partition"), so every replay but the last runs here as
      its own ``engine.backward`` outside the accumulation boundary
      (:mod:`megaloss.integrations.grad_cache`) at the scale the Trainer will apply
      (:func:`caller_loss_scale`: ``1 / `` the micro-batches of the current window, also in an
      epoch's shorter last one), and the last replay is returned: the Trainer's own backward
      completes the micro-step. A caller there that scales otherwise gets a ValueError from its
      backward, not a wrong gradient (DeepSpeed's own fp16 loss scale applies to every replay
      alike).

    Under ``torch.no_grad`` (evaluation) it is the non-cached loss.

    Args:
        model, scale, similarity_fct, symmetric: as
            :class:`GatheredMultipleNegativesRankingLoss`.
        gather_across_devices, group, labels_as_duplicate_ids, chunk_size: as
            :class:`GatheredMultipleNegativesRankingLoss`.
        mini_batch_size: rows per encoder pass (sentence-transformers' name and default, 32).

    Raises:
        ValueError: ``mini_batch_size`` < 1, and the base class's errors.
    """

    def __init__(self, model: nn.Module, scale: float = 20.0, similarity_fct: Any = "cosine", *,
                 mini_batch_size: int = 32, **kwargs: Any) -> None:
        super().__init__(model, scale, similarity_fct, **kwargs)
        if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) \
                or mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be an int >= 1, got {mini_batch_size!r}")
        self.mini_batch_size = mini_batch_size

    def _replay_backward(self) -> Optional[Callable[[Tensor], None]]:
        """``grad_cache_step``'s ``backward``: under DeepSpeed every replay but the last as an
        accumulation pass at the scale the caller applies to the returned loss
        (:func:`caller_loss_scale`); otherwise ``None``, the replays inside the caller's backward
        at its upstream gradient (DDP then reduces every replay: correct, as reduction is
        linear, at ``num_replays`` times the traffic; none inside ``no_sync``)."""
        if not hasattr(self.model, "set_gradient_accumulation_boundary"):  # no DeepSpeed engine
            return None
        from ..grad_cache import inner_replay_backward
        return inner_replay_backward(self.model, scale=caller_loss_scale(deepspeed=True))

    def forward(self, sentence_features: Iterable[Dict[str, Any]],
                labels: Optional[Tensor] = None, *,
                duplicate_ids: Optional[Tensor] = None) -> Tensor:
        """The global batch's MNR loss; in training, the caller's backward of it completes the
        cached gradient (class docstring)."""
        features = list(sentence_features)
        if not torch.is_grad_enabled():
            return super().forward(features, labels, duplicate_ids=duplicate_ids)
        if len(features) < 2:
            raise ValueError(f"expected at least 2 columns (anchor, positive), got {len(features)}")
        step = grad_cache_step(
            self.embed, split_rows(features, self.mini_batch_size),
            lambda columns: self.compute_loss_from_embeddings(columns, labels,
                                                              duplicate_ids=duplicate_ids),
            backward=self._replay_backward(),
            empty_embeddings=lambda: self.embed([dict(f) for f in features]),
            group=self.group)  # the engine's DP group: equal replay counts on its ranks
        return step.surrogate

    def get_config_dict(self) -> Dict[str, Any]:
        return {**super().get_config_dict(), "mini_batch_size": self.mini_batch_size}

    @property
    def citation(self) -> str:
        return CITATION + GRADCACHE_CITATION

