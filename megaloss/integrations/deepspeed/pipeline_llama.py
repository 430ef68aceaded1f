"""A ``transformers`` Llama split into DeepSpeed pipeline stages: ``deepspeed.pipe.LayerSpec``
layers (each built on its own stage only, so a stage holds only its layers' weights) for
:func:`~.pipeline.initialize_pipeline` (the LM job and ``megaloss-check-layout`` use it).

The layers, in order: the token embedding (``input_ids [B, T]`` -> ``hidden [B, T, H]``), one
per decoder layer (``hidden -> hidden``; rotary embeddings of positions ``0..T-1`` and the causal
mask are made inside, as ``LlamaModel.forward`` makes them, so only the hidden states travel
between stages), and the final norm with the lm_head and megaloss's fused / vocab-parallel CE
(:class:`~megaloss.integrations.deepspeed.pipeline.CrossEntropyHeadStage`).

Tied embeddings (``config.tie_word_embeddings``): the embedding and the lm_head are one
:class:`LlamaTiedEmbeddingHead`, placed twice with DeepSpeed's ``TiedLayerSpec`` (DeepSpeed
0.19.8, ``runtime/pipe/module.py``): first (its ``embed``) and last (the head), the final norm a
layer of its own before it. ``PipelineModule`` builds the tied module on every stage that holds
one of the two places, broadcasts its weight from the lowest of those ranks, and the pipeline
engine all-reduces (sums) the weight's gradient over them each step (``ReduceTiedGrads``,
``runtime/pipe/engine.py``), so both copies take the tied weight's gradient, the sum of the
lookup's and the head's. The tie groups are one per ``(data, model)`` coordinate
(``PipelineModule._index_tied_modules``): under TP, stage 0's TP rank ``r`` is tied with the last
stage's TP rank ``r`` only, and the weight is that rank's vocab shard
(:class:`~megaloss.VocabParallelLMHead` with a
:class:`~megaloss.VocabParallelEmbedding` on the same ``Parameter``). The modules are
``transformers``' own (``LlamaDecoderLayer``, ``LlamaRMSNorm``, ``LlamaRotaryEmbedding``,
``models/llama/modeling_llama.py``), so the stages compute what ``LlamaForCausalLM`` computes.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional

import torch
from torch import nn

from ...losses.vocab_parallel_embedding import VocabParallelEmbedding
from ...losses.vocab_parallel_head import VocabParallelLMHead
from ...ops.cross_entropy_options import CrossEntropyOptions
from ...parallel.groups import SINGLE_RANK, GroupLike
from .pipeline_loss import CrossEntropyHeadStage

__all__ = ["LlamaEmbeddingStage", "LlamaDecoderStage", "LlamaHeadStage", "LlamaNormStage",
           "LlamaTiedEmbeddingHead", "llama_pipeline_layers", "hf_parameter_name"]

TIED_KEY = "embed_tokens"  # the TiedLayerSpec key (parameters: tied_modules.<key>.…)


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


class LlamaNormStage(nn.Module):
    """The final ``LlamaRMSNorm`` (``hidden -> hidden``), a layer of its own before a tied head."""

    def __init__(self, config: Any, state: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if state is not None:
            self.load_state_dict({"norm.weight": state["model.norm.weight"]})

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden_states)


class LlamaTiedEmbeddingHead(CrossEntropyHeadStage):
    """The input embedding and the lm_head on one weight ``[V, H]`` (TP > 1: this rank's vocab
    shard, :class:`~megaloss.VocabParallelLMHead` with
    :meth:`~megaloss.VocabParallelEmbedding.tied_to` on it). :meth:`embed` is the first
    stage's layer (``input_ids [B, T]`` -> ``[B, T, H]``), ``forward`` (no norm: the identity)
    and :meth:`~.pipeline.CrossEntropyHeadStage.loss` the last stage's.

    The weight is ``state["model.embed_tokens.weight"]`` (a tied ``LlamaForCausalLM``'s), or
    drawn as the untied embedding's is, from ``seed``.
    """

    def __init__(self, config: Any, options: Optional[CrossEntropyOptions] = None,
                 tp_group: GroupLike = SINGLE_RANK,
                 state: Optional[Mapping[str, torch.Tensor]] = None,
                 seed: Optional[int] = None) -> None:
        lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if state is not None:
            with torch.no_grad():
                lm_head.weight.copy_(state["model.embed_tokens.weight"])
        else:
            _load(lm_head, None, "", config, seed)
        super().__init__(lm_head, options=options, tp_group=tp_group)
        pad = config.pad_token_id
        if isinstance(self.lm_head, VocabParallelLMHead):
            self.embed_tokens: nn.Module = VocabParallelEmbedding.tied_to(self.lm_head,
                                                                          padding_idx=pad)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, pad,
                                             _weight=self.lm_head.weight)
            self.embed_tokens.weight = self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


def _tied_embed(module: LlamaTiedEmbeddingHead, input_ids: torch.Tensor) -> torch.Tensor:
    # the first stage's TiedLayerSpec forward_fn: (tied module, input) -> output
    return module.embed(input_ids)


def llama_pipeline_layers(config: Any, *, options: Optional[CrossEntropyOptions] = None,
                          tp_group: GroupLike = SINGLE_RANK,
                          state_dict: Optional[Dict[str, torch.Tensor]] = None,
                          seed: int = 0) -> List[Any]:
    """The ``LayerSpec`` layers of a Llama of ``config`` (a ``transformers.LlamaConfig``):
    embedding, ``num_hidden_layers`` decoder layers, norm + head; with
    ``config.tie_word_embeddings`` the embedding and the head are one
    :class:`LlamaTiedEmbeddingHead` in two ``TiedLayerSpec`` places, the norm a layer between.

    Args:
        config: the model config.
        options: CE options of the head (``reduction="sum"``).
        tp_group: the tensor-parallel group (``PipelineLayout.topology.tp_group``).
        state_dict: a ``LlamaForCausalLM`` state dict to load (each stage takes its keys), or
            None: random init, layer ``k`` seeded by ``seed + k`` (the same on every replica;
            the tied weight is the embedding's, ``seed``).
        seed: see ``state_dict``.

    Pass ``partition_method="uniform"`` (the default of
    :func:`~.pipeline.initialize_pipeline`): ``"parameters"`` would count the tied weight
    twice.
    """
    # Parameter names: layer 0 ``embed_tokens.weight``, layer 1 + i ``layer.<LlamaDecoderLayer
    # names>``, the last ``norm.weight`` / ``lm_head.weight``; tied: ``tied_modules.<TIED_KEY>.
    # lm_head.weight`` and layer 1 + n ``norm.weight`` (see hf_parameter_name).
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    n = config.num_hidden_layers
    decoders = [LayerSpec(LlamaDecoderStage, config, i, state_dict, seed + 1 + i)
                for i in range(n)]
    if getattr(config, "tie_word_embeddings", False):
        tied = (TIED_KEY, LlamaTiedEmbeddingHead, config, options, tp_group, state_dict, seed)
        return ([TiedLayerSpec(*tied, forward_fn=_tied_embed, tied_weight_attr="lm_head.weight")]
                + decoders + [LayerSpec(LlamaNormStage, config, state_dict),
                              TiedLayerSpec(*tied, tied_weight_attr="lm_head.weight")])
    return ([LayerSpec(LlamaEmbeddingStage, config, state_dict, seed)] + decoders
            + [LayerSpec(LlamaHeadStage, config, options, tp_group, state_dict, seed + 1 + n)])


def hf_parameter_name(name: str, num_hidden_layers: int) -> str:
    """A ``PipelineModule`` parameter name of these layers (``"<layer index>.<name>"``) ->
    the ``LlamaForCausalLM`` one (``model.layers.<i>.…``, ``lm_head.weight``; the tied weight
    ``model.embed_tokens.weight``, the name a tied model's ``named_parameters()`` gives it)."""
    if name.startswith(f"tied_modules.{TIED_KEY}."):
        return "model.embed_tokens.weight"
    idx, rest = name.split(".", 1)
    k = int(idx)
    if k == 0:
        return "model." + rest
    if k <= num_hidden_layers:
        return f"model.layers.{k - 1}." + rest.removeprefix("layer.")
    return "model." + rest if rest.startswith("norm.") else rest
