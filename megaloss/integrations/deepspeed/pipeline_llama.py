"""A ``transformers`` Llama split into DeepSpeed pipeline stages: ``deepspeed.pipe.LayerSpec``
layers (each built on its own stage only, so a stage holds only its layers' weights) for
:func:`~.pipeline.initialize_pipeline` (the LM job and ``megaloss-check-layout`` use it).

The layers, in order: the token embedding (``input_ids [B, T]`` -> ``hidden [B, T, H]``), one
per decoder layer (``hidden -> hidden``; rotary embeddings of positions ``0..T-1`` and the causal
mask are made inside, as ``LlamaModel.forward`` makes them, so only the hidden states travel
between stages), and the final norm with the lm_head and megaloss's fused / vocab-parallel CE
(:class:`~megaloss.integrations.deepspeed.pipeline.CrossEntropyHeadStage`). The modules are
``transformers``' own (``LlamaDecoderLayer``, ``LlamaRMSNorm``, ``LlamaRotaryEmbedding``,
``models/llama/modeling_llama.py``), so the stages compute what ``LlamaForCausalLM`` computes.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional

import torch
from torch import nn

from ...ops.options import CrossEntropyOptions
from ...parallel.groups import SINGLE_RANK, GroupLike
from .pipeline import CrossEntropyHeadStage

__all__ = ["LlamaEmbeddingStage", "LlamaDecoderStage", "LlamaHeadStage", "llama_pipeline_layers",
           "hf_parameter_name"]


def _load(module: nn.Module, state: Optional[Mapping[str, torch.Tensor]], prefix: str,
          config: Any, seed: Optional[int]) -> None:
    """Weights from ``state`` (keys of a ``LlamaForCausalLM`` state dict under ``prefix``), or
    ``LlamaPreTrainedModel._init_weights``' normal(0, initializer_range) init seeded by
    ``seed`` (every replica of the layer draws the same)."""
    if state is not None:
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        module.load_state_dict(own, strict=True)
        return
    gen = torch.Generator().manual_seed(int(seed or 0))
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            with torch.no_grad():
                m.weight.copy_(torch.empty_like(m.weight).normal_(
                    0.0, config.initializer_range, generator=gen))
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()


class LlamaEmbeddingStage(nn.Module):
    """``input_ids [B, T]`` -> the token embeddings ``[B, T, H]``."""

    def __init__(self, config: Any, state: Optional[Mapping[str, torch.Tensor]] = None,
                 seed: Optional[int] = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         config.pad_token_id)
        _load(self, None if state is None else {"embed_tokens.weight":
                                                 state["model.embed_tokens.weight"]},
              "", config, seed)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


def _causal_mask(hidden: torch.Tensor) -> torch.Tensor:
    """``[1, 1, T, T]`` additive causal mask in the hidden states' dtype (eager and sdpa
    attention both add it)."""
    t = hidden.shape[1]
    future = torch.ones(t, t, dtype=torch.bool, device=hidden.device).triu(1)
    mask = torch.zeros(t, t, dtype=hidden.dtype, device=hidden.device)
    return mask.masked_fill(future, torch.finfo(hidden.dtype).min)[None, None]


class LlamaDecoderStage(nn.Module):
    """Decoder layer ``layer_idx``: ``hidden [B, T, H]`` -> ``hidden``, full causal rows."""

    def __init__(self, config: Any, layer_idx: int,
                 state: Optional[Mapping[str, torch.Tensor]] = None,
                 seed: Optional[int] = None) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import (
            LlamaDecoderLayer,
            LlamaRotaryEmbedding,
        )

        if getattr(config, "_attn_implementation", None) is None:
            # a bare LlamaConfig names no attention kernel; the model would pick sdpa
            config = copy.copy(config)
            config._attn_implementation = "sdpa"
        self.layer = LlamaDecoderLayer(config, layer_idx)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        _load(self.layer, state, f"model.layers.{layer_idx}.", config, seed)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, t = hidden_states.shape[:2]
        position_ids = torch.arange(t, device=hidden_states.device)[None].expand(b, t)
        rotary = self.rotary_emb(hidden_states, position_ids=position_ids)
        return self.layer(hidden_states, attention_mask=_causal_mask(hidden_states),
                          position_ids=position_ids, position_embeddings=rotary)


class LlamaHeadStage(CrossEntropyHeadStage):
    """The final ``LlamaRMSNorm`` and the lm_head with megaloss's CE (vocab-parallel over
    ``tp_group``)."""

    def __init__(self, config: Any, options: Optional[CrossEntropyOptions] = None,
                 tp_group: GroupLike = SINGLE_RANK,
                 state: Optional[Mapping[str, torch.Tensor]] = None,
                 seed: Optional[int] = None) -> None:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        holder = nn.Module()
        holder.norm, holder.lm_head = norm, lm_head
        if state is not None:
            holder.load_state_dict({"norm.weight": state["model.norm.weight"],
                                    "lm_head.weight": state["lm_head.weight"]})
        else:
            _load(holder, None, "", config, seed)
        super().__init__(lm_head, options=options, tp_group=tp_group, norm=norm)


def llama_pipeline_layers(config: Any, *, options: Optional[CrossEntropyOptions] = None,
                          tp_group: GroupLike = SINGLE_RANK,
                          state_dict: Optional[Dict[str, torch.Tensor]] = None,
                          seed: int = 0) -> List[Any]:
    """The ``LayerSpec`` layers of a Llama of ``config`` (a ``transformers.LlamaConfig`` with
    untied embeddings): embedding, ``num_hidden_layers`` decoder layers, norm + head.

    Args:
        config: the model config.
        options: CE options of the head (``reduction="sum"``).
        tp_group: the tensor-parallel group (``PipelineLayout.topology.tp_group``).
        state_dict: a ``LlamaForCausalLM`` state dict to load (each stage takes its keys), or
            None: random init, layer ``k`` seeded by ``seed + k`` (the same on every replica).
        seed: see ``state_dict``.

    Raises:
        ValueError: ``config.tie_word_embeddings`` (the head and the embedding would sit on
            different stages).
    """
    # Parameter names: layer 0 ``embed_tokens.weight``, layer 1 + i ``layer.<LlamaDecoderLayer
    # names>``, the last ``norm.weight`` / ``lm_head.weight`` (see hf_parameter_name).
    from deepspeed.pipe import LayerSpec

    if getattr(config, "tie_word_embeddings", False):
        raise ValueError("llama_pipeline_layers needs tie_word_embeddings=False (the embedding "
                         "and the lm_head sit on different stages)")
    n = config.num_hidden_layers
    layers = [LayerSpec(LlamaEmbeddingStage, config, state_dict, seed)]
    layers += [LayerSpec(LlamaDecoderStage, config, i, state_dict, seed + 1 + i)
               for i in range(n)]
    layers.append(LayerSpec(LlamaHeadStage, config, options, tp_group, state_dict, seed + 1 + n))
    return layers


def hf_parameter_name(name: str, num_hidden_layers: int) -> str:
    """A ``PipelineModule`` parameter name of these layers (``"<layer index>.<name>"``) ->
    the ``LlamaForCausalLM`` one (``model.layers.<i>.…``, ``lm_head.weight``)."""
    idx, rest = name.split(".", 1)
    k = int(idx)
    if k == 0:
        return "model." + rest
    if k <= num_hidden_layers:
        return f"model.layers.{k - 1}." + rest.removeprefix("layer.")
    return "model." + rest if rest.startswith("norm.") else rest
