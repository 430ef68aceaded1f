"""What :class:`~megaloss.integrations.hf.CausalLMWithLoss` returns when given labels: a
``transformers.utils.ModelOutput``-compatible dataclass, without importing ``transformers``.

A ``ModelOutput`` (``transformers/utils/generic.py``) is an ``OrderedDict`` of its fields that
are not ``None``, read by key (``out["loss"]``), by attribute (``out.loss``) or by position over
those fields (``out[0]``, ``out.to_tuple()``), and registered as a ``torch.utils._pytree`` node
(so DDP's ``static_graph``, FSDP2's pre-backward hooks and ``torch.compile`` see the tensors
inside). :class:`DictOutput` reproduces that contract (and accelerate's
``recursively_apply``, which rebuilds a mapping as ``type(out)({key: value})``); the Hugging
Face Trainer then reads ``outputs["loss"]`` as it reads a model's own output.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, List, Mapping, NamedTuple, Optional, Tuple

import torch
import torch.utils._pytree as pytree

__all__ = ["DictOutput", "CausalLMLossOutput", "MoeDistillationOutput", "MoeLogProbsOutput"]


def _flatten(out: "DictOutput") -> Tuple[List[Any], List[str]]:
    return list(out.values()), list(out.keys())


def _unflatten(values: Any, context: List[str], output_type: type) -> "DictOutput":
    return output_type(**dict(zip(context, values)))


class DictOutput(OrderedDict):
    """The ``ModelOutput`` contract (module docstring) for a ``@dataclass`` subclass whose
    fields all default to ``None``: the dict holds the fields that are not ``None``, in field
    order; ``out[str]`` a field, ``out[int]`` / ``out[slice]`` the ``to_tuple()`` entries;
    constructed from one mapping as its only positional argument as well."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        pytree.register_pytree_node(cls, _flatten, partial(_unflatten, output_type=cls),
                                    serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")

    def __post_init__(self) -> None:
        names = [f.name for f in fields(self)]
        first = getattr(self, names[0])
        if isinstance(first, Mapping) and all(getattr(self, n) is None for n in names[1:]):
            object.__setattr__(self, names[0], None)  # rebuilt from a mapping (accelerate)
            for key, value in first.items():
                if key not in names:
                    raise TypeError(f"{type(self).__name__} has no field {key!r}")
                setattr(self, key, value)
        for name in names:
            value = getattr(self, name)
            if value is not None:
                OrderedDict.__setitem__(self, name, value)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return OrderedDict.__getitem__(self, key)
        return self.to_tuple()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        OrderedDict.__setitem__(self, key, value)
        object.__setattr__(self, key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if value is not None and name in {f.name for f in fields(self)}:
            OrderedDict.__setitem__(self, name, value)
        object.__setattr__(self, name, value)

    def __reduce__(self):
        callable_, _, *rest = super().__reduce__()
        return (callable_, tuple(getattr(self, f.name) for f in fields(self)), *rest)

    def to_tuple(self) -> tuple:
        """The values that are not ``None``, in field order."""
        return tuple(self[k] for k in self.keys())


@dataclass(eq=False)
class CausalLMLossOutput(DictOutput):
    """:class:`~megaloss.integrations.hf.CausalLMWithLoss`'s output with labels: the fields of
    ``transformers``' ``CausalLMOutputWithPast`` that a loss without logits has (``loss``;
    ``logits`` always ``None``) and megaloss's statistics of :class:`megaloss.CrossEntropyOutput`.

    Attributes:
        loss: scalar (fp32, fp64 for a fp64 model), differentiable, under the wrapper's
            reduction (z-loss included); ``[B, T]`` for ``reduction="none"``.
        logits: ``None`` (never built).
        z_loss: the z-loss part of ``loss``, same reduction, no gradient.
        num_valid_tokens: int64 scalar, shifted targets that are not ``ignore_index``.
        num_correct_tokens: int64 scalar, valid tokens whose label has the largest logit.
        aux_loss: with router logits output (a mixture-of-experts model), the model's own
            load-balancing loss (unscaled, as ``MoeCausalLMOutputWithPast.aux_loss``;
            ``loss`` includes ``router_aux_loss_coef * aux_loss``); else ``None``.
        router_logits: with router logits output, the decoder's (one ``[B * T, E]`` tensor per
            MoE layer); else ``None``.
        router: with the calibrated step's ``router_loss=`` pool, megaloss's router losses
            (a :class:`megaloss.losses.router.RouterLossOutput`; ``loss`` includes its
            ``loss``); else ``None``.
    """

    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    z_loss: Optional[torch.Tensor] = None
    num_valid_tokens: Optional[torch.Tensor] = None
    num_correct_tokens: Optional[torch.Tensor] = None
    aux_loss: Optional[torch.Tensor] = None
    router_logits: Optional[Tuple[torch.Tensor, ...]] = None
    router: Optional[Any] = None


class MoeDistillationOutput(NamedTuple):
    """:class:`~megaloss.integrations.hf.CausalLMWithDistillation`'s output when the student
    outputs router logits: :class:`megaloss.DistillationOutput`'s fields (``loss`` includes
    the student's ``router_aux_loss_coef * aux_loss``), then ``aux_loss`` (the student's own
    load-balancing loss, unscaled; ``None`` when its forward adds none) and ``router_logits``
    (the student decoder's, one ``[B * T, E]`` tensor per MoE layer); with the calibrated
    step's ``router_loss=`` pool, ``aux_loss`` is ``None`` and ``router`` holds megaloss's
    router losses (:class:`megaloss.losses.router.RouterLossOutput`, in ``loss``)."""

    loss: torch.Tensor
    divergence: torch.Tensor
    ce_loss: torch.Tensor
    num_top1_matches: torch.Tensor
    num_valid_tokens: torch.Tensor
    aux_loss: Optional[torch.Tensor]
    router_logits: Optional[Tuple[torch.Tensor, ...]]
    router: Optional[Any] = None


class MoeLogProbsOutput(NamedTuple):
    """:class:`~megaloss.integrations.hf.CausalLMWithLogProbs`'s output when the model outputs
    router logits: :class:`megaloss.LogProbsOutput`'s fields, then ``aux_loss`` (the model's
    own load-balancing loss, unscaled and differentiable; the model's loss would add
    ``router_aux_loss_coef * aux_loss``, which the caller's loss adds: the wrapper's
    ``router_aux_loss_coef``) and ``router_logits`` (one ``[B * T, E]`` tensor per MoE
    layer); with the calibrated step's ``router_loss=`` pool, ``aux_loss`` is ``None`` and
    ``router`` holds megaloss's router losses (:class:`megaloss.losses.router.RouterLossOutput`:
    the caller's loss adds its ``loss``)."""

    log_probs: torch.Tensor
    entropy: Optional[torch.Tensor]
    lse: torch.Tensor
    greedy_match: torch.Tensor
    aux_loss: Optional[torch.Tensor]
    router_logits: Optional[Tuple[torch.Tensor, ...]]
    router: Optional[Any] = None
