"""DeepSeek-V3's multi-token prediction (MTP) modules for a Hugging Face decoder
(arXiv:2412.19437, sec. 2.2; Megatron-LM's ``megatron/core/transformer/
multi_token_prediction.py``, ``MultiTokenPredictionLayer``): the job-side half of
:func:`megaloss.losses.multi_token.multi_token_prediction_loss`, which takes the hidden states
this module returns through the model's shared lm_head. Not part of the megaloss package.

Depth ``k = 1..D``, at every position ``t``::

    h'_t^k = M_k [RMSNorm(h_t^{k-1}); RMSNorm(Emb(x_{t+k}))]     M_k: Linear(2H -> H, no bias)
    h^k    = RMSNorm(Block_k(h'^k))                              one decoder layer of the model

``h^0`` is the main model's last hidden state (what its lm_head reads, after its final norm);
``Emb`` is the model's own input embedding (shared, as in DeepSeek-V3); ``x_{t+k}`` is the
input token ``k`` places ahead *in the same packed sample* (``mtp_labels`` of
:mod:`megaloss.losses.multi_token` rolls the ids; the positions past a sample's end get token 0,
whose targets are ignored). The
block is a fresh layer of the model's own decoder-layer class, built from its config
(``LlamaDecoderLayer``, ``Qwen3MoeDecoderLayer``, ...), with the model's rotary embeddings and
causal mask (block-diagonal under packing, from ``position_ids``). Every depth keeps the full
length ``T`` (Megatron-LM's layout), so ``h^k`` has the main hidden states' shape.

Packed samples: run the main model with ``use_cache=False`` (with a cache, Hugging Face's
decoders skip the block-diagonal mask that ``position_ids`` restarting at 0 ask for, and attend
across samples). Small on purpose: it runs on CPU in float32 / float64 with eager or sdpa
attention, for the tiny random-init models of :mod:`launch.jobs.models`.
"""
from __future__ import annotations

import copy
from typing import List, Optional

import torch
from torch import nn

from megaloss.losses.multi_token import mtp_labels

__all__ = ["MTPDepth", "MultiTokenPrediction"]


def _decoder(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (``model.model`` of a ``*ForCausalLM``) or the stack
    itself: the module holding ``layers``, ``embed_tokens``, ``norm`` and ``rotary_emb``."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model
    for name in ("layers", "embed_tokens", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            raise TypeError(f"{type(inner).__name__} has no '{name}': MultiTokenPrediction needs "
                            f"a Llama-style decoder (layers, embed_tokens, norm, rotary_emb)")
    return inner


class MTPDepth(nn.Module):
    """One MTP depth: the two RMSNorms, the ``2H -> H`` projection, one decoder layer and its
    final RMSNorm (module docstring). ``norm`` is a module to copy for the norms (the model's
    own RMSNorm), ``block`` a fresh decoder layer."""

    def __init__(self, norm: nn.Module, block: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.hidden_norm = copy.deepcopy(norm)
        self.embed_norm = copy.deepcopy(norm)
        self.proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.final_norm = copy.deepcopy(norm)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor,
                **block_kwargs) -> torch.Tensor:
        """``hidden [B, T, H]`` (the previous depth's), ``next_embeds [B, T, H]`` (the
        embeddings of the tokens ``k`` ahead) -> ``[B, T, H]``."""
        x = self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(next_embeds)], -1))
        out = self.block(x, **block_kwargs)
        return self.final_norm(out[0] if isinstance(out, tuple) else out)


class MultiTokenPrediction(nn.Module):
    """``D`` MTP depths for ``model`` (a Hugging Face Llama-style causal LM); the model's
    embedding, rotary embeddings and lm_head stay the model's (not copied, not registered here).

    Args:
        model: the causal LM (``LlamaForCausalLM``, ``Qwen3MoeForCausalLM``, ...) or its decoder.
        depth: ``D >= 1``.

    ``forward(hidden_states [B, T, H], input_ids [B, T], *, position_ids=None,
    cu_seqlens=None)`` returns the ``D`` depths' hidden states, each ``[B, T, H]``, for
    ``depth_hidden_states=`` of the loss; ``position_ids`` (packed samples restarting at 0) is
    also what the rotary embeddings and the causal mask read; ``cu_seqlens`` only moves the
    rolled ids (pass ``position_ids`` too for the mask).

    Raises:
        ValueError: ``depth < 1``; TypeError: not a Llama-style decoder.
    """

    def __init__(self, model: nn.Module, depth: int) -> None:
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int >= 1, got {depth!r}")
        decoder = _decoder(model)
        config = decoder.config
        layer_cls = type(decoder.layers[0])
        n = config.num_hidden_layers
        self.depths = nn.ModuleList(
            MTPDepth(decoder.norm, layer_cls(config, n + k), config.hidden_size)
            for k in range(depth))
        # the model's own initialisation for the fresh layers: transformers' MoE experts are
        # torch.empty until a model's post_init initialises them
        init = getattr(decoder, "_init_weights", None)
        if init is not None:
            self.depths.apply(init)
        param = next(decoder.parameters())
        self.to(dtype=param.dtype, device=param.device)
        # plain attributes, not submodules: the model owns (and trains) them
        object.__setattr__(self, "_decoder", decoder)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, *,
                position_ids: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        from transformers.masking_utils import create_causal_mask
        decoder = self._decoder
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(
                input_ids)
        mask = create_causal_mask(config=decoder.config, inputs_embeds=hidden_states,
                                  attention_mask=None, cache=None, position_ids=position_ids)
        rotary = decoder.rotary_emb(hidden_states, position_ids=position_ids)
        boundaries = ({"cu_seqlens": cu_seqlens} if cu_seqlens is not None
                      else {"position_ids": position_ids})
        out, h = [], hidden_states
        for k, layer in enumerate(self.depths, start=1):
            ids = mtp_labels(input_ids, k, ignore_index=0, **boundaries)  # token t + k, or 0
            h = layer(h, decoder.embed_tokens(ids), attention_mask=mask,
                      position_embeddings=rotary, position_ids=position_ids)
            out.append(h)
        return out
