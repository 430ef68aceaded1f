r"""What a Hugging Face mixture-of-experts causal LM adds to its own loss from its router: the
loss wrappers run the model's decoder and compute the loss themselves, so the router term the
model's ``forward`` adds must be added by them too, or it is silently dropped.

A ``transformers`` 5.24 MoE ``*ForCausalLM`` / ``*ForConditionalGeneration`` (Mixtral,
Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, Qwen3-VL-MoE, OLMoE, FlexOlmo, GPT-OSS,
GraniteMoE and its variants, Jamba, JetMoE, PhiMoE, MiniMax, DeepSeek-V4, Ernie-4.5-MoE, DBRX,
Doge, ...; e.g. ``transformers/models/mixtral/modeling_mixtral.py``, ``MixtralForCausalLM.forward``)
does, when router logits are output (the call's ``output_router_logits``, else its config's)::

    aux_loss = load_balancing_loss_func(outputs.router_logits, num_experts, top_k, attention_mask)
    loss += router_aux_loss_coef * aux_loss      # only with labels

``load_balancing_loss_func`` is the Switch Transformer's load-balancing loss (arXiv:2101.03961,
eqs. 4-6) as the model's own modeling module writes it (the routing counts and probability sums
of all layers together, padding masked by the 2-D ``attention_mask``), and returns
``MoeCausalLMOutputWithPast(aux_loss=aux_loss, router_logits=...)``. :func:`model_router_loss`
reads that term in two steps, as :mod:`megaloss.integrations.head_config` reads the logit
transform.

**1. Declared**: the coefficient is the model's attribute ``router_aux_loss_coef`` (what the
forward reads; DBRX sets it from ``ffn_config.moe_loss_weight``) or ``aux_loss_coef`` (JetMoE),
else the config's or its text config's (``config.text_config.router_aux_loss_coef``, the
vision-language forwards); ``num_experts`` and ``top_k`` the model's attributes ``num_experts``
/ ``num_experts_per_tok``, else the configs' (``num_experts``, ``num_local_experts``,
``moe_num_experts``; ``num_experts_per_tok``, ``moe_k``); the aux function is
``load_balancing_loss_func`` of the model class's own module (``sys.modules[cls.__module__]``,
along the class's MRO for a subclass defined elsewhere), called with its parameters by name
(Doge's also takes ``num_keys = floor(sqrt(num_experts))``, ``doge/modeling_doge.py``).
Whether router logits are output by default is ``output_router_logits`` of the config (the
text config for the vision-language forwards).

**2. Verified** (:func:`verify_router_loss`): a probe of the model itself on two rows of a few
tokens, one right-padded (eval mode, no gradient, each module's mode put back): the model's
loss with ``output_router_logits=True`` minus its loss with ``False`` must equal
``coefficient * aux`` with ``aux`` the declared function on the returned ``router_logits`` and
the probe's mask, and the returned ``aux_loss`` must equal ``aux`` (float32 rounding: the
model's own loss and aux function compute in float32). Whatever the model adds that this does
not reproduce (another coefficient, a router z-loss, a differently masked term) is a refusal,
stated in :attr:`RouterLoss.refusal`. The probe is skipped when the parameters are not
materialised (:func:`~megaloss.integrations.head_config.materialised`).

Router z-loss (ST-MoE, arXiv:2202.08906): in transformers 5.24 only the encoder-decoder Switch
Transformers and NLLB-MoE add one (``router_z_loss_coef``), and the wrappers refuse
encoder-decoder models; a decoder-only model with ``router_z_loss_coef > 0`` is refused here.

The term is a mean over the micro-batch's tokens (the mask's), added next to the
cross-entropy's token mean: right for a wrapper's ``reduction="mean"`` (and for Hugging Face's
``sum / num_items_in_batch``, where the model adds it unscaled), not for a sum or the
calibrated step's token weights (:func:`router_loss_refusal`).
"""
from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from .head_config import (
    _number,
    _probe_ids,
    _probing,
    materialised,
    model_configs,
    unplaced_mean,
)

__all__ = ["RouterLoss", "AUX_FUNCTION", "COEFFICIENT_FIELDS", "model_router_loss",
           "verify_router_loss", "router_loss_refusal", "accepts_router_logits"]

AUX_FUNCTION = "load_balancing_loss_func"
# the attribute a forward multiplies its aux loss by: router_aux_loss_coef, JetMoE's aux_loss_coef
COEFFICIENT_FIELDS = ("router_aux_loss_coef", "aux_loss_coef")
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "moe_num_experts")
_TOP_K_FIELDS = ("num_experts_per_tok", "moe_k")
_Z_LOSS_FIELDS = ("router_z_loss_coef",)


@dataclass(frozen=True)
class RouterLoss:
    """A model's own router term: ``coefficient * aux_function(router_logits, num_experts,
    top_k, attention_mask)`` added to its loss when router logits are output.

    Attributes:
        coefficient: the model's ``router_aux_loss_coef`` (0 when it adds no term).
        num_experts, top_k: what the model passes its aux function (``None`` when unknown).
        aux_function: the model's own ``load_balancing_loss_func``, or ``None`` when its forward
            adds no router term (AFMoE, Zaya: router logits returned, nothing added).
        output_router_logits: the config's default (the call's ``output_router_logits``
            overrides it, :meth:`requested`).
        refusal: why the model's router term cannot be reproduced (then a wrapper refuses
            router logits), or ``None``.
        verified: whether the probe of :func:`verify_router_loss` confirmed the term.
        is_moe: the config's ``is_moe`` (``True`` without the field).
        probe_decides: the refusal is the declared one of a coefficient without an aux
            function (Llama 4's config has ``router_aux_loss_coef``, its forward adds nothing):
            the probe lifts it when the model's loss is the same with and without router
            logits.
    """

    coefficient: float = 0.0
    num_experts: Optional[int] = None
    top_k: Optional[int] = None
    aux_function: Optional[Callable[..., Any]] = field(default=None, compare=False)
    output_router_logits: bool = False
    refusal: Optional[str] = None
    verified: bool = False
    is_moe: bool = True
    probe_decides: bool = False

    def requested(self, output_router_logits: Optional[bool]) -> bool:
        """Whether router logits are output: the call's value, else the config's, and never
        when the config says the model has no expert layer (``is_moe=False``: Doge's forward
        ands it in, ``doge/modeling_doge.py``), as the model's forward decides."""
        if not self.is_moe:
            return False
        if output_router_logits is None:
            return self.output_router_logits
        return bool(output_router_logits)

    def aux_loss(self, router_logits: Any, attention_mask: Optional[torch.Tensor]
                 ) -> Optional[torch.Tensor]:
        """The model's own aux loss on ``router_logits`` (the decoder's tuple of one
        ``[B * T, E]`` tensor per MoE layer) and the call's 2-D ``attention_mask`` (``[B, T]``,
        0 on padding; ``None``: every row counts), differentiable (float32, the model's
        function computes in float32); a zero tensor where the function returns 0 (no router
        logits); ``None`` without an aux function.

        Raises:
            ValueError: :attr:`refusal` is set.
        """
        if self.refusal is not None:
            raise ValueError(self.refusal)
        if self.aux_function is None:
            return None
        if isinstance(router_logits, (tuple, list)) and len(router_logits) == 0:
            router_logits = None  # no MoE layer recorded: the model's forward sees None there
        kwargs: Dict[str, Any] = {}
        names = list(inspect.signature(self.aux_function).parameters)
        for name in names[1:]:
            if name == "num_experts":
                kwargs[name] = self.num_experts
            elif name == "top_k":
                kwargs[name] = self.top_k
            elif name == "attention_mask":
                kwargs[name] = attention_mask
            elif name == "num_keys":  # Doge's product-key router: floor(sqrt(num_experts))
                kwargs[name] = math.floor(math.sqrt(self.num_experts))
        out = self.aux_function(router_logits, **kwargs)
        if not isinstance(out, torch.Tensor):
            device = _device(router_logits, attention_mask)
            out = torch.tensor(float(out), dtype=torch.float32, device=device)
        return out

    def describe(self) -> str:
        """``"router_aux_loss_coef=... * load_balancing_loss_func(...)"`` for messages."""
        if self.aux_function is None:
            return "no router term"
        return (f"router_aux_loss_coef={self.coefficient:g} * "
                f"{getattr(self.aux_function, '__module__', '?')}.{AUX_FUNCTION}(router_logits, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, attention_mask)")


def _device(router_logits: Any, attention_mask: Optional[torch.Tensor]) -> Optional[torch.device]:
    if isinstance(router_logits, (tuple, list)) and router_logits:
        first = router_logits[0]
        if isinstance(first, torch.Tensor):
            return first.device
    return None if attention_mask is None else attention_mask.device


def accepts_router_logits(model: nn.Module) -> bool:
    """Whether ``model``'s class forward takes ``output_router_logits`` (or its configs have
    the field): a model that can output router logits."""
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        params = {}
    return "output_router_logits" in params or any(
        hasattr(c, "output_router_logits") for c in model_configs(model))


def _aux_function(model: nn.Module) -> Optional[Callable[..., Any]]:
    for cls in type(model).__mro__:
        module = sys.modules.get(getattr(cls, "__module__", ""), None)
        fn = getattr(module, AUX_FUNCTION, None)
        if callable(fn):
            return fn
    return None


def _first(model: nn.Module, names) -> Any:
    """The first of ``names`` found as a number on the model's instance (what its forward
    reads), else on its configs (the config, then its decoder text config)."""
    attrs = vars(model)
    for name in names:
        if _number(attrs.get(name)):
            return attrs[name]
    for config in model_configs(model):
        for name in names:
            value = getattr(config, name, None)
            if _number(value):
                return value
    return None


def _config_default(model: nn.Module) -> bool:
    """``output_router_logits`` as the forward reads it: ``config.output_router_logits``, or
    the text config's for a composite config without the field."""
    for config in model_configs(model):
        if hasattr(config, "output_router_logits"):
            return bool(config.output_router_logits)
    return False


def _declared(model: nn.Module) -> RouterLoss:
    name = type(model).__name__
    default = _config_default(model)
    for config in model_configs(model):
        for zname in _Z_LOSS_FIELDS:
            z = getattr(config, zname, None)
            if _number(z) and z > 0:
                return RouterLoss(output_router_logits=default, refusal=(
                    f"{name}'s own loss adds a router z-loss ({zname}={z:g}) that megaloss's "
                    f"wrappers do not compute (they reproduce the load-balancing term only): "
                    f"set {zname}=0 or output_router_logits=False"))
    coef = _first(model, COEFFICIENT_FIELDS)
    fn = _aux_function(model)
    experts = _first(model, _EXPERT_FIELDS)
    top_k = _first(model, _TOP_K_FIELDS)
    coef = 0.0 if coef is None else float(coef)
    if not math.isfinite(coef) or coef < 0:
        return RouterLoss(output_router_logits=default, refusal=(
            f"{name}'s router_aux_loss_coef={coef!r}: expected a finite number >= 0"))
    if fn is None:
        if coef > 0:
            return RouterLoss(
                coefficient=coef, num_experts=experts, top_k=top_k,
                output_router_logits=default, probe_decides=True, refusal=(
                    f"{name} has router_aux_loss_coef={coef:g} but its modeling module has no "
                    f"{AUX_FUNCTION}: megaloss cannot tell which router loss its forward adds. "
                    f"Pass output_router_logits=False (or set config.output_router_logits="
                    f"False) to train without it"))
        return RouterLoss(output_router_logits=default)
    known = {"num_experts", "top_k", "attention_mask", "num_keys"}
    params = list(inspect.signature(fn).parameters.values())[1:]
    unknown = [p.name for p in params if p.name not in known and p.default is p.empty]
    if unknown or experts is None or top_k is None:
        what = (f"parameters {unknown} megaloss does not know" if unknown
                else "num_experts / top_k it cannot find on the model or its config")
        return RouterLoss(coefficient=coef, output_router_logits=default, refusal=(
            f"{name}'s {AUX_FUNCTION} needs {what}: megaloss cannot reproduce its router "
            f"loss. Pass output_router_logits=False (or set config.output_router_logits=False) "
            f"to train without it"))
    return RouterLoss(coefficient=coef, num_experts=int(experts), top_k=int(top_k),
                      aux_function=fn, output_router_logits=default)


def _probe_batch(model: nn.Module):
    head = model.get_output_embeddings()
    rows = head.weight.shape[0] if head is not None else 8
    device = head.weight.device if head is not None else None
    ids = _probe_ids(model, rows, device).repeat(2, 1)
    ids[1] = ids[1].flip(0)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return ids, mask


def verify_router_loss(model: nn.Module, router: RouterLoss) -> RouterLoss:
    """``router`` checked against ``model``'s own forward (module docstring, step 2): on
    ``[2, 6]`` token ids, the second row right-padded by 2 (eval mode, no gradient, modes put
    back), ``loss(output_router_logits=True) - loss(output_router_logits=False)`` must equal
    ``router.coefficient * router.aux_loss(router_logits, attention_mask)`` within
    ``1e-5 * (1 + |loss|)`` and the returned ``aux_loss`` that ``aux`` within ``1e-5 * (1 +
    |aux|)`` (float32 rounding of the model's own loss). Four forwards of a few tokens at most.

    Returns:
        ``router`` with ``verified=True``; with :attr:`RouterLoss.refusal` set on a mismatch or
        when the probe's forward raised; ``router`` itself when the parameters are not
        materialised or ``router`` is already a refusal (but one the probe decides: a
        coefficient without an aux function passes when the forward adds nothing).
    """
    if materialised(model) is not None:
        return router
    if router.refusal is not None:
        if not router.probe_decides:
            return router
        router = replace(router, refusal=None, coefficient=0.0)  # adds nothing, if the probe agrees
    name = type(model).__name__
    ids, mask = _probe_batch(model)
    try:
        with _probing(model):
            on = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False,
                       output_router_logits=True)
            off = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False,
                        output_router_logits=False)
            aux = router.aux_loss(getattr(on, "router_logits", None), mask)
    except Exception as err:  # noqa: BLE001 - the reason is the refusal
        return _refused(router, f"a probe forward of {name} with output_router_logits=True "
                                f"raised {type(err).__name__}: {str(err)[:200]}")
    loss_on, loss_off = getattr(on, "loss", None), getattr(off, "loss", None)
    if not isinstance(loss_on, torch.Tensor) or not isinstance(loss_off, torch.Tensor):
        return _refused(router, f"{name}'s forward returned no loss with labels")
    term = 0.0 if aux is None else router.coefficient * float(aux)
    added = float(loss_on.double() - loss_off.double())
    tol = 1e-5 * (1.0 + abs(float(loss_on)))
    if not abs(added - term) <= tol:
        return _refused(router, (
            f"{name}'s own loss adds {added:.6g} with output_router_logits=True, megaloss "
            f"reproduces {term:.6g} ({router.describe()}; tolerance {tol:.2g}): its router term "
            f"is one megaloss does not know"))
    own = getattr(on, "aux_loss", None)
    fn = router.aux_function
    if own is None and router.coefficient == 0.0:
        fn = None  # the module has the function, the forward neither calls nor adds it
    elif aux is not None and isinstance(own, torch.Tensor):
        if not abs(float(own) - float(aux)) <= 1e-5 * (1.0 + abs(float(aux))):
            return _refused(router, (
                f"{name}'s aux_loss {float(own):.6g} differs from megaloss's {float(aux):.6g} "
                f"({router.describe()})"))
    return replace(router, aux_function=fn, verified=True)


def _refused(router: RouterLoss, why: str) -> RouterLoss:
    return replace(router, aux_function=None, refusal=(
        f"megaloss cannot reproduce the model's router loss: {why}. Pass "
        f"output_router_logits=False (or set config.output_router_logits=False) to train "
        f"without it"))


def _is_moe(model: nn.Module) -> bool:
    for config in model_configs(model):
        value = getattr(config, "is_moe", None)
        if isinstance(value, bool):
            return value
    return True


def model_router_loss(model: nn.Module) -> Optional[RouterLoss]:
    """The :class:`RouterLoss` of ``model`` (module docstring: declared, then verified by a
    probe when its parameters are materialised), or ``None`` for a model that outputs no
    router logits (no ``output_router_logits`` in its forward or configs).

    Args:
        model: a ``transformers`` ``*ForCausalLM`` / ``*ForConditionalGeneration``, its lm_head
            not yet replaced (the probe runs its own forward).

    Returns:
        The term; its :attr:`RouterLoss.refusal` says why it cannot be reproduced (the
        wrappers then refuse router logits with that reason).
    """
    if not accepts_router_logits(model):
        return None
    router = replace(_declared(model), is_moe=_is_moe(model))
    if not router.is_moe:
        return router  # router logits are never output: nothing to verify
    return verify_router_loss(model, router)


def router_loss_refusal(router: Optional[RouterLoss], requested: bool, reduction: str,
                        loss_weights: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why a wrapper cannot add the model's router term to a loss of this ``reduction`` /
    ``loss_weights`` when router logits are ``requested``, or ``None``: no router, logits not
    requested, a coefficient of 0, or ``reduction="mean"`` without weights (the term is the
    model's per-micro-batch mean, placed next to the token mean; a sum, per-token losses or
    the calibrated step's token weights have no place for it); the router's own
    :attr:`RouterLoss.refusal` when requested."""
    if router is None or not requested:
        return None
    if router.refusal is not None:
        return router.refusal
    if router.coefficient == 0.0 or router.aux_function is None:
        return None
    why = unplaced_mean(reduction, loss_weights)
    if why is None:
        return None
    return (f"the model's own loss adds router_aux_loss_coef={router.coefficient:g} * its "
            f"load-balancing loss, a mean over the micro-batch's tokens that {why} cannot place "
            f"exactly (adding it would weight it by the step's cut into micro-batches, dropping "
            f"it would train without it). Use megaloss's calibrated router loss (router_loss= "
            f"of the calibrated step, megaloss.losses.router) or reduction=\"mean\" without "
            f"loss_weights (the model's own loss), or pass output_router_logits=False (or set "
            f"router_aux_loss_coef=0) to train without it")
