"""Held-out retrieval of the embedding jobs: MRR@k and recall@1 of finding document i for query
i among all held-out documents (cosine), with the embeddings computed across ranks, either by a
DeepSpeed engine around ``megaloss.integrations.hf.EmbeddingModelWithMNR`` (``train_embed.py``)
or by a ``SentenceTransformer`` (``train_embed_hf.py``). Every rank encodes a shard, all run the
same number of forwards (ZeRO-3 gathers parameters collectively), then one all-gather.

MRR: Voorhees, "The TREC-8 Question Answering Track Report" (TREC 1999).
"""
from __future__ import annotations

import math
from typing import Dict, List

import torch
import torch.distributed as dist

from megaloss.parallel.comm import all_gather_dim0, all_gather_sizes

__all__ = ["retrieval_metrics", "embed_all", "evaluate_engine", "embed_texts",
           "evaluate_sentence_transformer"]


def retrieval_metrics(q: torch.Tensor, d: torch.Tensor, k: int = 10) -> Dict[str, float]:
    """MRR@k and recall@1 of retrieving document ``d[i]`` for query ``q[i]`` among all documents
    by cosine similarity (``q``, ``d``: ``[N, H]`` embeddings, any float dtype; scored in
    float64). A document scoring the same as the right one does not outrank it.

    Returns:
        ``{"mrr@k": float, "recall@1": float}``, each in ``[0, 1]``.
    """
    q = torch.nn.functional.normalize(q.double(), dim=-1)
    d = torch.nn.functional.normalize(d.double(), dim=-1)
    scores = q @ d.T
    target = scores.diagonal().unsqueeze(1)
    # rank = 1 + number of documents scoring strictly higher (ties resolved in the query's favour)
    rank = 1 + (scores > target).sum(1)
    rr = torch.where(rank <= k, 1.0 / rank.double(), torch.zeros_like(rank, dtype=torch.float64))
    return {f"mrr@{k}": rr.mean().item(), "recall@1": (rank == 1).double().mean().item()}


@torch.no_grad()
def embed_all(engine, ids: torch.Tensor, mask: torch.Tensor, batch_size: int,
              group) -> torch.Tensor:
    """Embeddings ``[N, H]`` of all ``N`` sequences on every rank. Each rank encodes a contiguous
    shard; all ranks run the same number of forwards (ZeRO-3 gathers parameters collectively), a
    rank with nothing left encodes the first sequence again and drops it."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    per = math.ceil(len(ids) / world)
    first = ids[:1], mask[:1]
    ids, mask = ids[rank * per: (rank + 1) * per], mask[rank * per: (rank + 1) * per]
    rounds = max(1, math.ceil(per / batch_size))
    module = engine.module
    outs = []
    for r in range(rounds):
        rows = slice(r * batch_size, (r + 1) * batch_size)
        n = len(ids[rows])
        chunk_ids, chunk_mask = (ids[rows], mask[rows]) if n else first
        emb = module.encode(chunk_ids.to(engine.device), chunk_mask.to(engine.device)).float()
        outs.append(emb[:n])
    local = torch.cat(outs)
    # no gradient here: pad to the largest shard, gather, trim
    sizes = all_gather_sizes(local.shape[0], group, local.device)
    padded = torch.cat([local, local.new_zeros((max(sizes) - local.shape[0],) + local.shape[1:])])
    gathered = all_gather_dim0(padded, group)
    return torch.cat([gathered[r * max(sizes): r * max(sizes) + n] for r, n in enumerate(sizes)])


def evaluate_engine(engine, pairs: Dict[str, torch.Tensor], batch_size: int,
                    group) -> Dict[str, float]:
    """Held-out retrieval metrics of ``pairs`` (:func:`launch.jobs.pair_data.encode_pairs`) by
    the encoder of ``engine`` (``module.encode``) over ``group``, the same on every rank."""
    was_training = engine.module.training
    engine.module.eval()
    q = embed_all(engine, pairs["query_input_ids"], pairs["query_attention_mask"], batch_size,
                  group)
    d = embed_all(engine, pairs["document_input_ids"], pairs["document_attention_mask"],
                  batch_size, group)
    engine.module.train(was_training)
    return retrieval_metrics(q, d)


@torch.no_grad()
def embed_texts(model, texts: List[str], batch_size: int) -> torch.Tensor:
    """Embeddings ``[N, D]`` (float32, CPU) of all ``N`` texts, the same on every rank. Each rank
    encodes a contiguous shard of ``ceil(N / world)`` texts (the last ones padded with the first
    text, so every rank runs the same number of forwards, as ZeRO-3's collective parameter
    gathers need), then one all-gather."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    per = math.ceil(len(texts) / world)
    mine = texts[rank * per:(rank + 1) * per]
    emb = model.encode(mine + [texts[0]] * (per - len(mine)), batch_size=batch_size,
                       convert_to_tensor=True, show_progress_bar=False).float()
    if world == 1:
        return emb[:len(texts)].cpu()
    parts = [torch.empty_like(emb) for _ in range(world)]
    dist.all_gather(parts, emb.contiguous())
    return torch.cat(parts)[:len(texts)].cpu()


def evaluate_sentence_transformer(model, queries: List[str], documents: List[str],
             batch_size: int) -> Dict[str, float]:
    """Held-out ``mrr@10`` and ``recall@1`` of retrieving document i for query i among all
    held-out documents (:func:`retrieval_metrics`: cosine); collective."""
    was_training = model.training
    q = embed_texts(model, queries, batch_size)
    d = embed_texts(model, documents, batch_size)
    model.train(was_training)
    return retrieval_metrics(q, d)
