"""A tiny token-wise mixture-of-experts LM for the router-loss tests, and float64 references of
the router losses written from the papers' formulas (one-hot counts, autograd through the
softmax), independent of megaloss.losses.router.

Token-wise (no attention), so each token's output depends on its own input only: a sequence
cut over sequence-parallel ranks is computed exactly as whole, which lets the step's SP layout
be tested without Ulysses attention.
"""
from __future__ import annotations

from typing import Any, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, EXPERTS, LAYERS, TOP_K = 29, 8, 4, 2, 2


class ToyOutput(NamedTuple):
    loss: torch.Tensor
    z_loss: torch.Tensor
    num_valid_tokens: torch.Tensor
    router: Any


class ToyMoE(nn.Module):
    """Embedding, ``LAYERS`` residual MoE layers (softmax router, top-k experts with
    renormalised gates, ``tanh(W_e h)``), lm_head. ``forward`` is the calibrated step's module
    call: ``(input_ids, shift_labels=, loss_weights=, router_loss=, attention_mask=)``, the
    weighted CE sum plus the router pool's share."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def p(*shape, scale=1.0):
            return nn.Parameter(torch.randn(*shape, generator=g, dtype=dtype) * scale)

        self.embed = p(VOCAB, HIDDEN)
        self.routers = p(LAYERS, EXPERTS, HIDDEN)
        self.experts = p(LAYERS, EXPERTS, HIDDEN, HIDDEN, scale=0.4)
        self.head = p(VOCAB, HIDDEN, scale=0.5)

    def hidden(self, input_ids: torch.Tensor):
        h = self.embed[input_ids.reshape(-1)]
        logits: List[torch.Tensor] = []
        for layer in range(LAYERS):
            x = h @ self.routers[layer].T
            logits.append(x)
            top = torch.softmax(x, -1).topk(TOP_K, dim=-1)
            gates = top.values / top.values.sum(-1, keepdim=True)
            w = self.experts[layer][top.indices]  # [N, k, H, H]
            h = h + (gates[..., None] * torch.tanh(torch.einsum("nkij,nj->nki", w, h))).sum(1)
        return h, logits

    def forward(self, input_ids, shift_labels=None, loss_weights=None, router_loss=None,
                attention_mask=None, position_ids=None):
        h, logits = self.hidden(input_ids)
        if router_loss is not None and router_loss.statistics_only:
            return router_loss(logits, TOP_K, mask=attention_mask)
        labels = shift_labels.reshape(-1)
        ce = F.cross_entropy(h @ self.head.T, labels, ignore_index=-100, reduction="none")
        loss = (ce * loss_weights.reshape(-1)).sum()
        router = None
        if router_loss is not None:
            router = router_loss(logits, TOP_K, mask=attention_mask)
            loss = loss + router.loss
        return ToyOutput(loss, torch.zeros((), dtype=loss.dtype), (labels != -100).sum(), router)


class ToyLogProbs(NamedTuple):
    log_probs: torch.Tensor
    entropy: Any
    router: Any


class ToyMoELogProbs(ToyMoE):
    """:class:`ToyMoE` as a log-probs module (the policy and preference steps' contract):
    ``forward(input_ids, shift_labels=, router_loss=, attention_mask=)`` returns the labels'
    log-probs (0 where ignored) and the router pool's share as ``router``."""

    def forward(self, input_ids, shift_labels=None, router_loss=None, attention_mask=None,
                position_ids=None, **_):
        h, logits = self.hidden(input_ids)
        if router_loss is not None and router_loss.statistics_only:
            return router_loss(logits, TOP_K, mask=attention_mask)
        labels = shift_labels.reshape(-1)
        lp = torch.log_softmax(h @ self.head.T, -1)
        lp = lp.gather(1, labels.clamp_min(0)[:, None])[:, 0] * (labels != -100)
        router = None if router_loss is None else router_loss(logits, TOP_K, mask=attention_mask)
        return ToyLogProbs(lp.reshape(shift_labels.shape), None, router)


def reference_router(logits: Sequence[torch.Tensor], mask: torch.Tensor, *, aux: float,
                     z: float, layers: str = "per_layer") -> torch.Tensor:
    """``aux * load-balancing + z * router z-loss`` of one pool, float64, from the formulas."""
    x = torch.stack(list(logits))  # [L, N, E]
    p = torch.softmax(x, dim=-1)
    sel = F.one_hot(x.topk(TOP_K, dim=-1).indices, x.shape[-1]).sum(-2).to(x.dtype)
    m = mask.reshape(1, -1, 1).to(x.dtype)
    n, num_layers = m.sum(), x.shape[0]
    if layers == "per_layer":
        lb = (x.shape[-1] * ((sel * m).sum(1) / n) * ((p * m).sum(1) / n)).sum(-1).mean()
    else:
        f = (sel * m).sum((0, 1)) / (num_layers * n)
        lb = x.shape[-1] * (f * (p * m).sum((0, 1)) / (num_layers * n)).sum()
    zl = (torch.logsumexp(x, -1) ** 2 * m[..., 0]).sum() / (num_layers * n)
    return aux * lb + z * zl


def reference_scope(pieces: Mapping[Tuple[int, int], Tuple[Sequence[torch.Tensor], torch.Tensor]],
                    *, scope: str, aux: float, z: float,
                    layers: str = "per_layer") -> torch.Tensor:
    """One device's router losses of a step under ``scope``: ``pieces[(r, m)]`` is data-parallel
    rank ``r``'s micro-batch ``m`` as ``(per-layer router logits [N, E], mask [N])``; ``step``:
    one pool; ``global``: a pool per micro-step ``m`` over the ranks, averaged; ``micro_batch``: a
    pool per piece, averaged."""
    def pool(keys):
        num_layers = len(pieces[keys[0]][0])
        logits = [torch.cat([pieces[k][0][i] for k in keys]) for i in range(num_layers)]
        mask = torch.cat([pieces[k][1] for k in keys])
        return reference_router(logits, mask, aux=aux, z=z, layers=layers)

    keys = sorted(pieces)
    if scope == "step":
        return pool(keys)
    if scope == "global":
        steps = sorted({m for _, m in keys})
        return sum(pool([k for k in keys if k[1] == m]) for m in steps) / len(steps)
    return sum(pool([k]) for k in keys) / len(keys)


def reference_router_step(model: ToyMoE, micro_batches: Sequence[Sequence[dict]], *,
                          scope: str, aux: float, z: float,
                          layers: str = "per_layer") -> torch.Tensor:
    """:func:`reference_scope` of the toy model: ``micro_batches[r][m]`` is data-parallel rank
    ``r``'s micro-batch ``m`` (``input_ids``, optional ``attention_mask``)."""
    pieces = {}
    for r, rank_batches in enumerate(micro_batches):
        for m, mb in enumerate(rank_batches):
            _, logits = model.hidden(mb["input_ids"])
            mask = mb.get("attention_mask")
            mask = torch.ones(mb["input_ids"].numel()) if mask is None else mask.reshape(-1)
            pieces[r, m] = (logits, mask)
    return reference_scope(pieces, scope=scope, aux=aux, z=z, layers=layers)


def tiny_qwen3_moe(vocab: int = 41) -> nn.Module:
    """A seeded 2-layer Qwen3-MoE (4 experts, top-2), its own router term off, eager experts
    (float64 capable)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=16, intermediate_size=16,
                            moe_intermediate_size=8, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                            num_experts_per_tok=2, head_dim=8, output_router_logits=False,
                            router_aux_loss_coef=0.001)
    config._experts_implementation = "eager"
    return Qwen3MoeForCausalLM(config)


def padded_samples(vocab: int = 41, seq: int = 6) -> List[dict]:
    """4 samples of ``seq`` tokens, 1 to 3 of them padding (attention mask 0, label -100)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(4):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        mask = torch.ones(seq, dtype=torch.long)
        mask[seq - 1 - i % 3:] = 0
        out.append({"input_ids": ids, "labels": ids.masked_fill(mask == 0, -100),
                    "attention_mask": mask})
    return out


def reference_hf_step(model: nn.Module, micro_batches: Sequence[Sequence[dict]], *, scope: str,
                      aux: float, z: float) -> torch.Tensor:
    """One device's loss of a Hugging Face MoE model's step under ``scope``: the token-mean CE of
    the model's own logits over every valid shifted label, plus :func:`reference_scope` of its
    own ``router_logits``; ``micro_batches[r][m]`` holds ``input_ids``, unshifted ``labels`` and
    ``attention_mask`` ``[B, T]``."""
    ce, valid, pieces = 0.0, 0, {}
    for r, rank_batches in enumerate(micro_batches):
        for m, mb in enumerate(rank_batches):
            o = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                      output_router_logits=True)
            labels = mb["labels"][:, 1:].reshape(-1)
            ce = ce + F.cross_entropy(o.logits[:, :-1].reshape(labels.numel(), -1), labels,
                                      ignore_index=-100, reduction="sum")
            valid += int((labels != -100).sum())
            pieces[r, m] = (o.router_logits, mb["attention_mask"].reshape(-1))
    return ce / valid + reference_scope(pieces, scope=scope, aux=aux, z=z)


def reference_step(model: ToyMoE, micro_batches: Sequence[Sequence[dict]], *, scope: str,
                   aux: float, z: float, layers: str = "per_layer") -> torch.Tensor:
    """One device's loss of the step under ``scope``: the CE (``shift_labels``) as the token
    mean over every valid target, plus :func:`reference_router_step`."""
    ce_sum, valid = 0.0, 0
    for rank_batches in micro_batches:
        for mb in rank_batches:
            h, _ = model.hidden(mb["input_ids"])
            labels = mb["shift_labels"].reshape(-1)
            ce_sum = ce_sum + F.cross_entropy(h @ model.head.T, labels, ignore_index=-100,
                                              reduction="sum")
            valid += int((labels != -100).sum())
    return ce_sum / valid + reference_router_step(model, micro_batches, scope=scope, aux=aux,
                                                  z=z, layers=layers)


def micro_batches(rank: int, gas: int = 2, rows: Optional[int] = None, seq: int = 8,
                  padding: bool = True) -> List[dict]:
    """Rank ``rank``'s micro-batches: uneven rows and valid tokens; with ``padding`` the last
    tokens of row 0 are padding (attention_mask 0, label -100)."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for m in range(gas):
        b = rows or (1 + (rank + m) % 2)
        ids = torch.randint(0, VOCAB, (b, seq), generator=g)
        labels = torch.randint(0, VOCAB, (b, seq), generator=g)
        mb = {"input_ids": ids, "shift_labels": labels}
        if padding:
            mask = torch.ones(b, seq, dtype=torch.long)
            mask[0, seq - 2 - rank - m:] = 0
            labels[mask == 0] = -100
            mb["attention_mask"] = mask
        out.append(mb)
    return out
