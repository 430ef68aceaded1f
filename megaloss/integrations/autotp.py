"""megaloss's cross-entropy on the lm_head shard of DeepSpeed AutoTP.

With ``"tensor_parallel": {"autotp_size": N, "vocab_parallel_lm_head": true}`` in the ds_config,
``deepspeed.initialize`` shards a Hugging Face model itself (deepspeed 0.19.8,
``deepspeed/runtime/engine.py``, ``_apply_autotp_partitioning``): the attention / MLP linears become
``LinearLayer`` / ``LinearAllreduce`` and the lm_head a
``deepspeed.module_inject.layers.VocabParallelLinear`` holding rows
``[vocab_start_index, vocab_end_index)`` of the ``vocab_size`` rows, without gathering its logits.
Its split (``deepspeed/module_inject/tp_shard.py``, ``get_shard_size`` with ``tp_grain_size``
1 by default) gives rank ``r`` ``V // N + (r < V % N)`` rows: the first ranks one row more, no
padding (37 rows over 2 ranks: 19 and 18); with a ``tp_grain_size`` above 1 the shards are whole
grains and the last rank takes the remainder. That is not megaloss's ``ceil(V / N)`` rows per rank
in general, so the shard is described to megaloss by its own range
(:class:`~megaloss.losses.vocab_parallel.VocabParallelOptions` ``shard_range``).

- :func:`autotp_lm_head`: the model's ``VocabParallelLinear``.
- :func:`autotp_topology`: megaloss's :class:`~megaloss.parallel.topology.Topology` of the
  engine: TP = DeepSpeed's tensor-model-parallel group, DP = its data-parallel group (the other
  ranks), both from ``deepspeed.utils.groups`` (the engine's ``mpu`` under AutoTP).
- :func:`autotp_vocab_parallel_options`: the options that match the head's shard.
- :func:`autotp_causal_lm_loss`: the decoder (``model.base_model``), then
  :func:`megaloss.linear_cross_entropy` of its last hidden states on the head's shard: the
  ``[tokens, V / N]`` logits of the head are never formed (DeepSpeed's own loss for this head,
  ``deepspeed/sequence/cross_entropy.py``, runs on them).
- :class:`AutoTPCausalLMWithLoss`: a ``*ForCausalLM`` whose forward is
  :func:`autotp_causal_lm_loss` (a :class:`megaloss.CrossEntropyOutput`), the module that
  :func:`megaloss.integrations.deepspeed.initialize` hands to ``deepspeed.initialize`` under AutoTP
  (AutoTP shards it there, so the head exists only after that call).
- :func:`ds_config_autotp_size`: the ``tensor_parallel.autotp_size`` of a ds_config (1 without).

The hidden states are replicated over the TP group (AutoTP's row-parallel layers all-reduce their
outputs); megaloss's vocab-parallel loss all-reduces their gradient over it (Megatron's
``copy_to_tensor_model_parallel_region``), as AutoTP's column-parallel head does, so the decoder
sees the same gradient as under DeepSpeed's own loss.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..calibration.deepspeed_scale import ds_config_autotp_size
from ..losses.cross_entropy import linear_cross_entropy
from ..losses.position_z_loss import linear_position_z_loss
from ..losses.vocab_parallel import VocabParallelOptions
from ..ops.cross_entropy_options import CrossEntropyOptions
from ..parallel.groups import GroupLike, group_size
from ..parallel.topology import Topology
from .head_config import (
    LogitTransform,
    config_logit_transform,
    model_logit_transform,
    resolve_softcapping,
    z_loss_refusal,
)
from .lm_head import linear_lm_head, shifted_targets, wrapper_options

__all__ = ["autotp_lm_head", "autotp_topology", "autotp_vocab_parallel_options",
           "autotp_causal_lm_loss", "AutoTPCausalLMWithLoss", "ds_config_autotp_size"]

_VOCAB_KEY = '"tensor_parallel": {"autotp_size": N, "vocab_parallel_lm_head": true}'


def _module(model: Any) -> nn.Module:
    """The ``nn.Module`` of a DeepSpeed engine (its ``.module``) or the module itself."""
    module = getattr(model, "module", model)
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a DeepSpeed engine or an nn.Module, got {type(model).__name__}")
    return module


def autotp_lm_head(model: Any) -> nn.Module:
    """The ``deepspeed.module_inject.layers.VocabParallelLinear`` lm_head of an AutoTP-sharded
    model (or of the engine holding it).

    Raises:
        ValueError: no such module (AutoTP not applied, or ``vocab_parallel_lm_head`` not set:
            the head is then replicated or gathers its logits), or more than one.
        TypeError: ``model`` is neither an engine nor an ``nn.Module``.
    """
    from deepspeed.module_inject.layers import VocabParallelLinear

    heads = [m for m in _module(model).modules() if isinstance(m, VocabParallelLinear)]
    if len(heads) != 1:
        raise ValueError(f"expected exactly one DeepSpeed VocabParallelLinear lm_head, found "
                         f"{len(heads)}: build the engine with {_VOCAB_KEY} in the ds_config")
    return heads[0]


def autotp_topology(model: Any = None) -> Topology:
    """megaloss's topology of an AutoTP engine: ``tp_group`` DeepSpeed's tensor-model-parallel
    group, ``dp_group`` its data-parallel group (``deepspeed.utils.groups``, set up by
    ``deepspeed.initialize``); no sequence parallelism.

    Args:
        model: the engine or its module; when given, its lm_head's TP size is checked against
            the group's.

    Raises:
        ValueError: the groups are not set up (no AutoTP engine yet), or the head's TP size
            differs from the group's.
    """
    from deepspeed.utils import groups

    try:
        tp = groups.get_tensor_model_parallel_group()
        dp = groups.get_data_parallel_group()
    except (AssertionError, AttributeError, RuntimeError) as err:
        raise ValueError("DeepSpeed's tensor-parallel groups are not set up: call "
                         f"deepspeed.initialize with {_VOCAB_KEY} first ({err})") from None
    if tp is None:
        raise ValueError("DeepSpeed has no tensor-model-parallel group: call deepspeed.initialize "
                         f"with {_VOCAB_KEY} first")
    topology = Topology(dp_group=dp, tp_group=tp)
    if model is not None:
        head = autotp_lm_head(model)
        if head.tp_world_size != topology.tp_size:
            raise ValueError(f"the lm_head is split over {head.tp_world_size} ranks, DeepSpeed's "
                             f"tensor-model-parallel group has {topology.tp_size}")
    return topology


def autotp_vocab_parallel_options(head: nn.Module, tp_group: GroupLike, *,
                                  sequence_parallel: bool = False) -> VocabParallelOptions:
    """The :class:`VocabParallelOptions` of a ``VocabParallelLinear`` shard: its
    ``vocab_size`` and ``shard_range = (vocab_start_index, vocab_end_index)`` over ``tp_group``.

    Raises:
        ValueError: the group's size differs from the head's TP size, or the head's weight does
            not have ``vocab_end_index - vocab_start_index`` rows.
    """
    if group_size(tp_group) != head.tp_world_size:
        raise ValueError(f"tp_group has {group_size(tp_group)} ranks, the lm_head is split over "
                         f"{head.tp_world_size}")
    start, stop = int(head.vocab_start_index), int(head.vocab_end_index)
    rows = head.weight.shape[0]  # ZeRO-3 (an empty placeholder here) is refused by the config
    if rows != stop - start:
        raise ValueError(f"the lm_head shard has {rows} rows, its range [{start}, {stop}) "
                         f"{stop - start}")
    return VocabParallelOptions(tp_group, int(head.vocab_size), sequence_parallel,
                                shard_range=(start, stop))


def autotp_causal_lm_loss(model: Any, input_ids: torch.Tensor,
                          labels: Optional[torch.Tensor] = None, *,
                          shift_labels: Optional[torch.Tensor] = None,
                          options: Optional[CrossEntropyOptions] = None,
                          attention_mask: Optional[torch.Tensor] = None,
                          position_ids: Optional[torch.Tensor] = None,
                          loss_weights: Optional[torch.Tensor] = None,
                          tp_group: GroupLike = None, return_stats: bool = False,
                          logit_transform: Optional[LogitTransform] = None):
    """The causal-LM cross-entropy of an AutoTP model, from its hidden states, on its lm_head
    shard: ``model.base_model(input_ids, ...)``, then :func:`megaloss.linear_cross_entropy`
    of the model's logits (the same value on every TP rank): ``logit_transform``'s scale on the
    hidden states and bias, its soft-cap as the options' (resolved as the wrappers do), its
    z-loss term (Bamba's) added under ``reduction="mean"`` without ``loss_weights``.

    Args:
        model: the engine or its module (a transformers ``*ForCausalLM`` AutoTP sharded).
        input_ids: ``[B, T]``.
        labels / shift_labels: exactly one: Hugging Face's unshifted ``labels`` or the already
            shifted targets (:func:`megaloss.integrations.lm_head.shifted_targets`).
        options: :class:`CrossEntropyOptions` (megaloss's defaults when ``None``).
        attention_mask, position_ids: passed to the decoder.
        loss_weights: per-token weights ``[B, T]`` of the shifted targets.
        tp_group: DeepSpeed's tensor-model-parallel group when ``None``
            (:func:`autotp_topology`).
        return_stats: return megaloss's ``CrossEntropyOutput`` instead of the loss tensor.
        logit_transform: the model's
            :class:`~megaloss.integrations.head_config.LogitTransform`; ``None``: declared by
            its config (:func:`~megaloss.integrations.head_config.config_logit_transform`; an
            AutoTP-sharded model is not probed, its forward would run collectives).

    Raises:
        ValueError: see :func:`autotp_lm_head`, :func:`autotp_vocab_parallel_options` and
            :func:`megaloss.linear_cross_entropy`; the options' soft-cap differing from the
            model's; a z-loss term with another reduction or with ``loss_weights``.
    """
    module = _module(model)
    head, parallel = _head_and_options(module, tp_group)
    options = CrossEntropyOptions() if options is None else options
    if logit_transform is None:
        logit_transform = config_logit_transform(module)
    options = options.replace(logit_softcapping=resolve_softcapping(
        options.logit_softcapping, logit_transform.softcapping, "logit_softcapping"))
    return _loss_on_head(module, head, parallel, input_ids, labels, shift_labels, options,
                         attention_mask, position_ids, loss_weights, return_stats,
                         logit_transform)


def _head_and_options(module: nn.Module, tp_group: GroupLike) -> tuple:
    """The ``VocabParallelLinear`` lm_head of an AutoTP-sharded ``module`` and its
    :class:`VocabParallelOptions` over ``tp_group`` (DeepSpeed's group when ``None``)."""
    head = autotp_lm_head(module)
    if tp_group is None:
        tp_group = autotp_topology().tp_group
    return head, autotp_vocab_parallel_options(head, tp_group)


def _loss_on_head(module, head, parallel, input_ids, labels, shift_labels, options,
                  attention_mask, position_ids, loss_weights, return_stats,
                  transform: LogitTransform):
    """:func:`autotp_causal_lm_loss` once the head, its options (soft-cap resolved) and the
    model's logit transform are known."""
    why = z_loss_refusal(transform, options.reduction, loss_weights)
    if why is not None:
        raise ValueError(why)
    targets = shifted_targets(input_ids, labels, shift_labels, options.ignore_index)
    out = module.base_model(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=False)
    hidden = out.last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])
    scaled, bias = transform.scale_inputs(hidden, head.bias)
    weights = None if loss_weights is None else loss_weights.reshape(-1)
    result = linear_cross_entropy(scaled, head.weight, targets.reshape(-1), bias=bias,
                                  loss_weights=weights, options=options, return_stats=True,
                                  vocab_parallel_options=parallel)
    if transform.z_loss_coefficient != 0.0:  # the model's own z-loss term (Bamba)
        z = linear_position_z_loss(
            scaled, head.weight, bias=bias, coefficient=transform.z_loss_coefficient,
            logit_softcapping=options.logit_softcapping, chunk_size=options.chunk_size,
            accum_dtype=options.accum_dtype, vocab_parallel_options=parallel)
        result = result._replace(loss=result.loss + z.to(result.loss.dtype),
                                 z_loss=result.z_loss + z.detach().to(result.z_loss.dtype))
    return result if return_stats else result.loss


class AutoTPCausalLMWithLoss(nn.Module):
    """A Hugging Face ``*ForCausalLM`` for DeepSpeed AutoTP whose forward returns megaloss's
    cross-entropy (:func:`autotp_causal_lm_loss`, a :class:`megaloss.CrossEntropyOutput`), with
    the forward signature of :class:`~megaloss.integrations.hf.CausalLMWithLoss`.

    Unlike ``CausalLMWithLoss`` it keeps the model's ``nn.Linear`` lm_head: AutoTP replaces it by
    its ``VocabParallelLinear`` inside ``deepspeed.initialize`` (it looks for an ``nn.Linear``
    named ``lm_head`` / ``embed_out``), and the forward finds that shard then. Give the wrapper,
    not the model, to ``deepspeed.initialize`` (or the model to
    :func:`megaloss.integrations.deepspeed.initialize`, which wraps it).

    The wrapper holds the model's own children under their own names (``model``, ``lm_head``
    for Llama), not the model as one child: AutoTP's split depends on the module names (deepspeed
    0.19.8 ``module_inject/tp_shard.py``, ``get_shard_size``: a layer named exactly ``lm_head``
    is split near evenly, another one by key-value heads, which with 1 kv head gives one rank
    the whole vocabulary), so the names, and the parameter names of ``state_dict``, are the
    model's. What else AutoTP reads of the model is on the wrapper too: ``config`` (its
    ``base_model_tp_plan`` and head counts), the model's ``_tp_plan``, and a ``loss_function``
    slot, where DeepSpeed installs its own vocab-parallel loss
    (``deepspeed/sequence/cross_entropy.py``, ``configure_vocab_parallel_loss``; not used). The
    model object itself is not kept: after ``deepspeed.initialize`` its lm_head would be the
    unsharded original.

    Args:
        model: a ``*ForCausalLM`` with a ``base_model`` and an ``nn.Linear`` lm_head (tied to
            the input embedding or not: with ``vocab_parallel_lm_head`` AutoTP makes a tied
            embedding a ``VocabParallelEmbedding`` on the head's own shard).
        options: :class:`CrossEntropyOptions`; ``reduction="sum"`` defaults when ``None`` (the
            calibrated training step weights tokens itself); an unset ``logit_softcapping``
            becomes the model's own and the model's logit scale and z-loss term are applied
            (``logit_transform``, found and verified on the unsharded model by
            :func:`~megaloss.integrations.head_config.model_logit_transform`), as in
            ``CausalLMWithLoss``.

    Raises:
        TypeError: no ``nn.Linear`` output embedding or no base model, or ``options`` of another
            type.
        ValueError: see :func:`~megaloss.integrations.head_config.model_logit_transform`; the
            options' soft-cap differing from the model's; a z-loss term (Bamba's) with a
            reduction other than ``"mean"``.
    """

    def __init__(self, model: nn.Module, *, options: Optional[CrossEntropyOptions] = None) -> None:
        super().__init__()
        linear_lm_head(model)  # raises TypeError without an nn.Linear lm_head
        options = wrapper_options(options, CrossEntropyOptions)
        # probed here, on the unsharded model: AutoTP shards it in deepspeed.initialize
        self.logit_transform = transform = model_logit_transform(model)
        self.options = options.replace(logit_softcapping=resolve_softcapping(
            options.logit_softcapping, transform.softcapping, "logit_softcapping"))
        why = z_loss_refusal(transform, self.options.reduction)
        if why is not None:
            raise ValueError(why)
        self.base_model_prefix = getattr(model, "base_model_prefix", "model")
        if model.base_model is model:
            raise TypeError(f"{type(model).__name__} has no base model (a *ForCausalLM holds its "
                            "decoder as a child)")
        for name, child in model.named_children():
            self.add_module(name, child)
        self.config = getattr(model, "config", None)
        plan = {**(getattr(type(model), "_tp_plan", None) or {}),
                **(model.__dict__.get("_tp_plan") or {})}
        if plan:
            self._tp_plan = plan
        self.loss_function = None

    @property
    def base_model(self) -> nn.Module:
        """The decoder (the model's ``base_model``)."""
        return getattr(self, self.base_model_prefix)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                shift_labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None,
                loss_weights: Optional[torch.Tensor] = None):
        """See :meth:`megaloss.integrations.hf.CausalLMWithLoss.forward`."""
        # AutoTP's head exists once deepspeed.initialize has run and is not re-sharded after:
        # found on the first forward (a walk over every module), kept out of the module tree
        if "_autotp_head" not in self.__dict__:
            self.__dict__["_autotp_head"] = _head_and_options(self, None)
        head, parallel = self.__dict__["_autotp_head"]
        return _loss_on_head(self, head, parallel, input_ids, labels, shift_labels, self.options,
                             attention_mask, position_ids, loss_weights, True,
                             self.logit_transform)
