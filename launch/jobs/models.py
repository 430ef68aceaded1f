"""The small random-init models the jobs train (``transformers`` configs, no download): a
Llama-style causal LM (:func:`build_llama`, the LM jobs), a Qwen3-MoE mixture-of-experts LM
(:func:`build_qwen3_moe`, the MoE job) and a BERT-style encoder (:func:`build_encoder`, the
embedding jobs), each in named sizes.

``transformers`` is imported inside the builders, so importing this module is cheap.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

__all__ = ["LLAMA_SIZES", "BERT_SIZES", "build_llama", "build_qwen3_moe", "build_encoder"]

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


def build_qwen3_moe(args, vocab_size: int):
    """A ``transformers.Qwen3MoeForCausalLM`` (random init, seeded from ``args.seed``): every
    decoder layer a sparse MoE block of ``args.num_experts`` experts, ``args.top_k`` per token
    (top-k gates renormalised, as Qwen3-MoE), ``args.hidden_size`` wide with 16-wide heads
    (``hidden / 16`` query heads, half as many key-value heads), experts of
    ``args.moe_intermediate_size``, ``args.num_layers`` layers, ``args.seq_len`` positions, the
    lm_head untied.

    ``output_router_logits=False``: the model's own load-balancing term
    (``router_aux_loss_coef * load_balancing_loss_func``, added by its forward) is off, so the
    router losses trained are those megaloss's calibrated step computes (the ds_config's
    ``megaloss.router``). Experts run transformers' eager loop (the grouped-mm kernels are for
    accelerators).

    Returns:
        ``(model, config)``.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from megaloss.integrations.deepspeed.compat import freeze_imported_objects
    freeze_imported_objects()  # transformers' modules, imported just now
    heads = max(1, args.hidden_size // 16)
    cfg = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=args.hidden_size,
                         intermediate_size=args.moe_intermediate_size,
                         moe_intermediate_size=args.moe_intermediate_size,
                         num_hidden_layers=args.num_layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), head_dim=16,
                         num_experts=args.num_experts, num_experts_per_tok=args.top_k,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                         output_router_logits=False, router_aux_loss_coef=0.0,
                         max_position_embeddings=args.seq_len, tie_word_embeddings=False,
                         # as build_llama: no special tokens in the jobs' BPE ids
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._experts_implementation = "eager"
    torch.manual_seed(args.seed)
    return Qwen3MoeForCausalLM(cfg), cfg


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
