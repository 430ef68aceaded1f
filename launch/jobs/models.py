"""The small random-init models the jobs train (``transformers`` configs, no download): a
Llama-style causal LM (:func:`build_llama`, the LM jobs) and a BERT-style encoder
(:func:`build_encoder`, the embedding jobs), each in named sizes.

``transformers`` is imported inside the builders, so importing this module is cheap.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

__all__ = ["LLAMA_SIZES", "BERT_SIZES", "build_llama", "build_encoder"]

# hidden, layers, heads, kv heads, feed-forward
LLAMA_SIZES: Dict[str, Tuple[int, int, int, int, int]] = {
    "tiny": (32, 1, 2, 1, 64),
    "mini": (64, 2, 2, 1, 192),  # the distillation job's student
    "small": (128, 4, 4, 2, 352),
    "base": (256, 6, 8, 4, 704),
}
# hidden, layers, heads, feed-forward
BERT_SIZES: Dict[str, Tuple[int, int, int, int]] = {
    "tiny": (64, 1, 2, 128),
    "small": (128, 2, 4, 512),
    "base": (256, 4, 4, 1024),
}


def build_llama(args, vocab_size: int, attn_implementation: Optional[str] = None):
    """A ``transformers.LlamaForCausalLM`` of ``args.model_size`` (:data:`LLAMA_SIZES`), with
    ``args.hidden_size`` / ``num_layers`` / ``num_heads`` overriding it (a given hidden size
    also sets 32-wide heads and a SwiGLU feed-forward of ``8 / 3 x hidden`` rounded up to 64),
    ``args.seq_len`` positions, the input embedding tied to the lm_head when
    ``args.tie_word_embeddings`` (untied otherwise), seeded from ``args.seed``.

    Every rank builds the same weights: TP ranks must hold the same replicated decoder
    (DeepSpeed broadcasts from DP rank 0 only within the DP group).

    Returns:
        ``(model, config)``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from megaloss.integrations.deepspeed.compat import freeze_imported_objects
    freeze_imported_objects()  # transformers' modules, imported just now
    hidden, layers, heads, kv, ffn = LLAMA_SIZES[args.model_size]
    hidden = args.hidden_size or hidden
    layers = args.num_layers or layers
    heads = args.num_heads or heads
    if args.hidden_size and not args.num_heads:
        heads = max(1, hidden // 32)
    kv = heads if heads % kv else kv
    if args.hidden_size:
        ffn = 64 * math.ceil(8 * hidden / 3 / 64)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, max_position_embeddings=args.seq_len,
                      tie_word_embeddings=bool(getattr(args, "tie_word_embeddings", False)),
                      # no special tokens: in the jobs' BPE ids 1 and 2 are ordinary tokens, and
                      # LlamaConfig's bos 1 / eos 2 would reach model.generation_config, whose eos
                      # transformers masks or stops at in every rollout
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if attn_implementation is not None:  # Ulysses wraps transformers' sdpa attention
        cfg._attn_implementation = attn_implementation
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg), cfg


def build_encoder(size: str, vocab_size: int, max_len: int, pad_id: int,
                  dropout: float = 0.1) -> torch.nn.Module:
    """A ``transformers.BertModel`` of ``size`` (:data:`BERT_SIZES`) without the pooler, with
    ``dropout`` on hidden states and attention probabilities (the caller seeds torch)."""
    from transformers import BertConfig, BertModel

    from megaloss.integrations.deepspeed.compat import freeze_imported_objects
    freeze_imported_objects()  # transformers' modules, imported just now
    hidden, layers, heads, ffn = BERT_SIZES[size]
    config = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=ffn,
                        max_position_embeddings=max_len, pad_token_id=pad_id,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertModel(config, add_pooling_layer=False)
