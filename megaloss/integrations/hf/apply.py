"""One call, no wrapper: :func:`apply` patches a Hugging Face ``*ForCausalLM`` in place so that
its own ``model(**batch)`` with labels computes megaloss's chunked cross-entropy from the
decoder's last hidden states (the ``[tokens, vocab]`` logits are never built) and returns the
model's usual ``CausalLMOutputWithPast`` with that loss. Code that only reads
``model(**batch).loss`` (the Hugging Face Trainer, accelerate loops, TRL) trains through megaloss
unchanged.

The machinery is :class:`~megaloss.integrations.hf.CausalLMWithLoss`'s (the same loss head
replaces the lm_head, the same options, the same logit transforms read from the config); the
wrapper is kept by the patched forward, not registered as a module, so the model's parameters,
state-dict keys, ``save_pretrained`` folder and ``generate`` are those of the model.

TRL (1.16) adds its own fused lm_head to the model (``trl.trainer.utils.add_fused_lm_head``):
``SFTTrainer`` / ``DPOTrainer`` call ``model(..., labels=, fused_lm_head=True)`` and read the
per-token ``log_probs`` (``entropy`` and ``is_top1`` for the ``entropy`` and
``mean_token_accuracy`` metrics, ``mean_logits`` for ``DPOTrainer``'s ``logits/chosen`` /
``logits/rejected``) of a ``FusedCausalLMOutput``. A patched model answers that call with
megaloss's chunked log-probs (:func:`megaloss.linear_log_probs`, entropy and greedy match
included; the mean logit without gradient, :func:`_mean_logits`), whichever of :func:`apply`
and the trainer patched the forward last (a forward pre-hook routes TRL's call to this
module's forward). The policy and the reference model of ``DPOTrainer`` are patched each by
its own call. ``DPOTrainer``'s WPO weights (``use_weighting=True``: ``log_sum_sq_probs``) are
refused.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Dict, Optional

import torch
from torch import nn

from ...losses.log_probs import linear_log_probs
from ...ops.chunk_driver import auto_chunk_size
from ...ops.cross_entropy_options import CrossEntropyOptions
from ...ops.log_probs_options import LogProbsOptions
from ...parallel.groups import SINGLE_RANK, GroupLike
from ..lm_head import shifted_targets
from .causal_lm import CausalLMWithLoss, token_grid

__all__ = ["apply", "MegalossForward"]

# TRL's flag and the private key this module's pre-hook turns it into (module docstring)
_TRL_FLAG = "fused_lm_head"
_ROUTED = "_megaloss_fused_lm_head"
_APPLIED = "_megaloss_apply"  # the model's attribute holding its MegalossForward


def _trl_settings(forward: Any, depth: int = 0) -> Optional[Dict[str, Any]]:
    """The settings TRL's ``add_fused_lm_head`` closed over (``temperature``, ``outputs``,
    ``cast_lm_head_to_fp32``), read from its forward's closure, or ``None`` when TRL's forward
    is not found in ``forward`` or what it wraps (``__wrapped__``, accelerate's
    ``convert_outputs_to_fp32`` / autocast wrappers and their closures, a few levels)."""
    if forward is None or depth > 8 or isinstance(forward, (nn.Module, MegalossForward)):
        return None
    fn = getattr(forward, "__func__", forward)
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is not None and code.co_name == "_fused_forward" and cells:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    inner = [getattr(fn, "__wrapped__", None), getattr(fn, "model_forward", None)]
    for cell in cells:
        try:
            inner.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    for candidate in inner:
        if callable(candidate):
            found = _trl_settings(candidate, depth + 1)
            if found is not None:
                return found
    return None


def _mean_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 options: LogProbsOptions) -> torch.Tensor:
    """TRL's ``mean_logits`` field: the mean over the vocabulary of the scaled logits
    ``softcap(z) / temperature``, ``z = hidden @ weight.T + bias``, per token, without gradient
    (``trl/kernels/chunked_logprob.py``, ``z_sum / vocab``).

    Without a soft-cap the mean is linear in ``z``: ``(hidden @ mean_v(weight) + mean(bias)) /
    T``, one matrix-vector product. With one, the logits are formed ``chunk_size`` tokens at a
    time (``[chunk, V]``, never ``[tokens, V]``).

    Args:
        hidden: ``[..., H]`` (already multiplied by the model's logit scale); weight: ``[V, H]``;
            bias: ``[V]`` or ``None``; options: the soft-cap, temperature and chunk size.

    Returns:
        ``[...]``, ``hidden``'s dtype.
    """
    with torch.no_grad():
        cap, temperature = options.logit_softcapping, options.temperature
        if cap is None:
            z = hidden @ weight.mean(0)
            return (z if bias is None else z + bias.mean()) / temperature
        flat = hidden.reshape(-1, hidden.shape[-1])
        chunk = options.chunk_size or auto_chunk_size(flat.shape[0], weight.shape[0],
                                                      weight.shape[1])
        out = flat.new_empty(flat.shape[0])
        for start in range(0, flat.shape[0], chunk):
            z = flat[start:start + chunk] @ weight.t()
            if bias is not None:
                z = z + bias
            out[start:start + chunk] = (torch.tanh(z / cap) * cap).mean(-1) / temperature
        return out.reshape(hidden.shape[:-1])


class MegalossForward:
    """The forward :func:`apply` installs (``model.forward``): with labels in training
    megaloss's loss (:meth:`__call__`), otherwise the forward it replaced. Its signature is
    the model's own (``generate`` validates its keyword arguments against it; the Hugging Face
    Trainer passes ``num_items_in_batch`` because it takes ``**kwargs``).

    Attributes:
        model: the patched model.
        wrapper: the :class:`~megaloss.integrations.hf.CausalLMWithLoss` whose head the model
            now has (not a submodule of ``model``).
        inner: the forward replaced (an instance attribute, e.g. TRL's), or ``None`` for the
            class's own.
    """

    def __init__(self, model: nn.Module, wrapper: CausalLMWithLoss, inner: Any) -> None:
        self.model = model
        self.wrapper = wrapper
        self.inner = inner
        own = type(model).forward.__get__(model)
        self.__signature__ = inspect.signature(own)
        self.__name__ = "forward"
        self.__doc__ = own.__doc__

    def _inner(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.model).forward(self.model, *args, **kwargs)

    def _arguments(self, args: tuple, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """The call's arguments by name (positional ones bound to the model's signature)."""
        if not args:
            return dict(kwargs)
        bound = self.__signature__.bind_partial(*args, **kwargs).arguments
        out: Dict[str, Any] = {}
        for name, value in bound.items():
            kind = self.__signature__.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                raise TypeError(f"{type(self.model).__name__}.forward got extra positional "
                                f"arguments {value!r}")
            else:
                out[name] = value
        return out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``model(**batch)``. With ``labels`` (or ``shift_labels``) and the model in training
        mode (or ``skip_logits=True``): the decoder, then megaloss's loss head on its last
        hidden states, returned as ``CausalLMOutputWithPast(loss=..., logits=None, cache=,
        hidden_states=, attentions=)`` of the decoder (a tuple with ``return_dict=False``); for
        a mixture-of-experts model ``MoeCausalLMOutputWithPast`` with, when router logits are
        output (the call's ``output_router_logits``, else the config's), the model's own
        ``aux_loss`` and ``router_logits``, and ``router_aux_loss_coef * aux_loss`` added to
        the loss as the model's forward adds it. The
        loss is the wrapper's reduction: by default Hugging Face's token mean,
        ``sum / num_items_in_batch`` when the Trainer passes ``num_items_in_batch`` (the
        router term then added unscaled, as the model adds it). In eval
        mode (or with ``skip_logits=False``) and without labels: the model's own forward (its
        logits, and its own loss from them), as Liger-Kernel's ``skip_logits`` does.

        Raises:
            ValueError: router logits output with a router coefficient > 0 under options
                whose reduction is not ``"mean"``, or a router term megaloss cannot reproduce
                (:mod:`megaloss.integrations.router_config`);
                ``logits_to_keep`` with labels; an ``ignore_index`` other than the options'.
        """
        arguments = self._arguments(args, kwargs)
        if arguments.pop(_ROUTED, False) or arguments.get(_TRL_FLAG, False):
            arguments.pop(_TRL_FLAG, None)
            return self._fused(arguments)
        arguments.pop(_TRL_FLAG, None)
        labels, shift = arguments.get("labels"), arguments.get("shift_labels")
        skip = arguments.pop("skip_logits", None)
        if skip is None:
            skip = self.model.training
        if (labels is None and shift is None) or not skip:
            return self._inner(**arguments)
        return self._loss(arguments)

    def _decoder(self, arguments: Dict[str, Any], reduction: Optional[str] = None):
        """Pop the label keys, check what the loss cannot honour, run the decoder (with router
        logits when the call or the config outputs them); returns ``(decoder output, shifted
        targets, num_items_in_batch, whether router logits are output, attention_mask)``."""
        wrapper = self.wrapper
        labels, shift = arguments.pop("labels", None), arguments.pop("shift_labels", None)
        num_items = arguments.pop("num_items_in_batch", None)
        ignore = arguments.pop("ignore_index", wrapper.ignore_index)
        if ignore != wrapper.ignore_index:
            raise ValueError(f"ignore_index={ignore} differs from the options' "
                             f"{wrapper.ignore_index} (megaloss.integrations.hf.apply(options=))")
        keep = arguments.pop("logits_to_keep", 0)
        if not (isinstance(keep, int) and keep == 0):
            raise ValueError("logits_to_keep with labels: the loss covers every position; call "
                             "without labels for the kept logits")
        asked = arguments.pop("output_router_logits", None)
        routed = wrapper.router_logits_requested(asked)
        wrapper.check_router_loss(routed, reduction or wrapper.options.reduction)
        wrapper.decoder_router_kwargs(routed, asked, arguments)
        input_ids = arguments.pop("input_ids", None)
        targets = shifted_targets(token_grid(input_ids, arguments), labels, shift,
                                  wrapper.ignore_index, wrapper.logit_transform.shifts_labels)
        out = wrapper.decoder(input_ids=input_ids, **arguments)
        return out, targets, num_items, routed, arguments.get("attention_mask")

    def _loss(self, arguments: Dict[str, Any]) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

        return_dict = arguments.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.model.config, "return_dict", True)
        out, targets, num_items, routed, mask = self._decoder(arguments)
        wrapper = self.wrapper
        loss = wrapper.head_loss(out.last_hidden_state, targets,
                                 num_items_in_batch=num_items).loss
        moe = wrapper.router is not None
        output_type = MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast
        names = {f.name for f in dataclasses.fields(output_type)}
        rest = {k: out.get(k) for k in ("cache", "past_key_values", "hidden_states",
                                        "attentions") if k in names}
        if routed:
            # the model's own: loss += router_aux_loss_coef * aux_loss, also onto
            # sum / num_items_in_batch (unscaled)
            rest["router_logits"] = out.get("router_logits")
            loss, term = wrapper.add_router_loss(loss, rest["router_logits"], mask)
            rest["aux_loss"] = term.aux_loss
        result = output_type(loss=loss, logits=None, **rest)
        return result if return_dict else result.to_tuple()

    def _fused(self, arguments: Dict[str, Any]) -> Any:
        """TRL's ``fused_lm_head=True`` call (module docstring): its ``FusedCausalLMOutput``
        from megaloss's chunked log-probs at TRL's temperature.

        Raises:
            ValueError: TRL's settings unreadable, or asking for what megaloss does not compute
                (``log_sum_sq_probs``; an fp32 cast of the head); tensor
                parallelism.
        """
        from trl.trainer.utils import FusedCausalLMOutput

        wrapper = self.wrapper
        settings = None
        for candidate in (self.model.__dict__.get("forward"),
                          self.model.__dict__.get("_original_forward"), self.inner):
            settings = settings or _trl_settings(candidate)
        if settings is None or "temperature" not in settings:
            raise ValueError("fused_lm_head=True is TRL's add_fused_lm_head call, but the "
                             "model's forward is not TRL's: call megaloss.integrations.hf.apply "
                             "on a model TRL has patched, or before the TRL trainer is built")
        wanted = set(settings.get("outputs", ()))
        extra = wanted - {"log_probs", "entropy", "is_top1", "mean_logits"}
        if extra or settings.get("cast_lm_head_to_fp32"):
            raise ValueError(f"TRL asks the fused lm_head for {sorted(extra)} (or an fp32 cast "
                             f"of the head), which megaloss's log-probs do not compute")
        if wrapper.tp_size > 1:
            raise ValueError("TRL's fused_lm_head call under tensor parallelism is not supported")
        arguments.pop("return_dict", None)
        arguments["use_cache"] = False
        unshifted = arguments.get("labels") is not None
        out, targets, num_items, routed, attention_mask = self._decoder(arguments, "mean")
        shared = {f.name for f in dataclasses.fields(LogProbsOptions)} & {
            f.name for f in dataclasses.fields(CrossEntropyOptions)}
        options = LogProbsOptions(**{k: getattr(wrapper.options, k) for k in shared},
                                  temperature=float(settings["temperature"]),
                                  return_entropy=True)
        head = wrapper.head
        hidden, bias = head.scaled_inputs(out.last_hidden_state)  # the model's logit scale
        lp = linear_log_probs(hidden, head.weight, targets, bias=bias, options=options)
        mask = targets != wrapper.ignore_index
        count = mask.sum().clamp(min=1) if num_items is None else num_items
        fields = dict(log_probs=lp.log_probs, entropy=lp.entropy * mask,
                      is_top1=lp.greedy_match & mask, label_mask=mask)
        if "mean_logits" in wanted:
            fields["mean_logits"] = _mean_logits(hidden, head.weight, bias, options) * mask
        if unshifted:  # TRL's shapes: [B, T - 1] for unshifted labels
            fields = {k: v[:, :-1] for k, v in fields.items()}
        loss = -lp.log_probs.sum() / count
        if routed:  # TRL's fused loss adds the router term as the model's own loss does
            loss, term = wrapper.add_router_loss(loss, out.get("router_logits"), attention_mask)
            fields["aux_loss"] = term.aux_loss
        return FusedCausalLMOutput(loss=loss, **fields)


def _route_trl(model: nn.Module, args: tuple, kwargs: Dict[str, Any]):
    """Forward pre-hook: TRL's ``fused_lm_head=True`` reaches :class:`MegalossForward` even
    when TRL's forward was installed after it (TRL's forward passes unknown keywords on)."""
    if kwargs.get(_TRL_FLAG) and not isinstance(model.__dict__.get("forward"), MegalossForward):
        kwargs = {**kwargs, _TRL_FLAG: False, _ROUTED: True}
        return args, kwargs
    return None


def apply(model: nn.Module, *, options: Optional[CrossEntropyOptions] = None,
          tp_group: GroupLike = SINGLE_RANK) -> nn.Module:
    """Make ``model``'s own forward compute megaloss's loss when given labels (module
    docstring); returns ``model``, patched in place.

    Args:
        model: a ``transformers`` ``*ForCausalLM`` or vision-language
            ``*ForConditionalGeneration`` (a decoder module and an ``nn.Linear`` lm_head, as
            :class:`~megaloss.integrations.hf.CausalLMWithLoss` takes).
        options: :class:`~megaloss.CrossEntropyOptions`; default ``reduction="mean"``, Hugging
            Face's token mean with ``num_items_in_batch`` honoured (so the Trainer's
            gradient-accumulation-correct loss is kept). The model's logit transform (scale,
            soft-cap, z-loss term, label convention:
            :func:`~megaloss.integrations.head_config.model_logit_transform`) is applied as in
            the wrapper.
        tp_group: tensor-parallel group (default: none), as in the wrapper.

    After the call ``model(**batch)`` with labels in training mode returns
    ``CausalLMOutputWithPast(loss=megaloss's loss, logits=None, ...)`` (pass
    ``skip_logits=False``, or call in eval mode, for the model's own logits and loss);
    without labels, ``model.generate``, ``save_pretrained`` (same state-dict keys) and the
    parameters are unchanged. Apply before wrapping the model with PEFT, DDP or FSDP.

    A mixture-of-experts model keeps its router term: with router logits output (the call's
    ``output_router_logits``, else the config's) the patched forward returns the model's
    ``MoeCausalLMOutputWithPast`` with its own ``aux_loss`` and ``router_logits``, and adds
    ``router_aux_loss_coef * aux_loss`` to the loss as the model does
    (:mod:`megaloss.integrations.router_config`). Under the Hugging Face Trainer's
    ``num_items_in_batch`` that is the model's own semantics too: the term is added unscaled
    to ``sum / num_items_in_batch`` (so gradient accumulation adds it once per micro-batch),
    and the Trainer's ``average_tokens_across_devices`` multiplies the whole loss, this term
    included, by the world size (``transformers/trainer.py``, ``compute_loss``) — the model's
    behaviour reproduced, not a calibration; megaloss's calibrated router loss comes from its
    step.

    Returns:
        ``model``.

    Raises:
        ValueError: ``model`` already patched with other options (with none or the same, the
            call returns ``model`` unchanged); what
            :class:`~megaloss.integrations.hf.CausalLMWithLoss` refuses (a router term the
            config outputs that megaloss cannot reproduce, among others).
        TypeError: as the wrapper (no base model, no ``nn.Linear`` lm_head).
    """
    done = model.__dict__.get(_APPLIED)
    if done is not None:
        if options is None or options == done.given_options:
            return model
        raise ValueError(f"model is already patched by megaloss.integrations.hf.apply with "
                         f"{done.given_options!r}; apply once")
    wrapper = CausalLMWithLoss(model, options=options, tp_group=tp_group)
    forward = MegalossForward(model, wrapper, model.__dict__.get("forward"))
    forward.given_options = options
    model.forward = forward
    model.__dict__[_APPLIED] = forward
    model.register_forward_pre_hook(_route_trl, with_kwargs=True)
    return model
