"""What megaloss reads of a causal language model's output head, whatever the engine: the
``nn.Linear`` lm_head a loss wrapper replaces (:func:`linear_lm_head`; a model already under
FSDP2's ``fully_shard`` refused, :func:`refuse_fully_sharded`), what every replacing loss head
shares (:class:`LinearHead`; :class:`GatheredLogits` for a vocab-parallel shard), a wrapper's
default options (:func:`wrapper_options`) and its forward's shifted targets
(:func:`shifted_targets`). Duck-typed on the Hugging Face ``*ForCausalLM`` API
(``base_model``, ``get_output_embeddings``; the decoder that feeds the lm_head,
:func:`text_decoder`, also of a vision-language model); ``transformers`` is not imported.

Used by the Hugging Face wrappers (:mod:`megaloss.integrations.hf`) and by the AutoTP wrapper
(:mod:`megaloss.integrations.autotp`), which both the DeepSpeed loop and the Hugging Face
Trainer build.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.labels import causal_shift
from ..ops.validation import check_not_dtensor, is_dtensor
from .head_config import LogitTransform
from .text_decoder import text_decoder

__all__ = ["LossHead", "LinearHead", "GatheredLogits", "is_loss_head",
           "linear_lm_head", "first_dtensor_parameter", "refuse_fully_sharded",
           "wrapper_options", "refuse_unsummed", "summing_options", "head_loss_weights",
           "shifted_targets"]


class LossHead:
    """The call of every loss head: ``head(hidden_states [..., H])`` without labels returns the
    raw logits (:meth:`logits`, as the ``nn.Linear`` it replaces: the model's own forward,
    ``model(input_ids).logits``, applies its own logit transform after it, and
    ``model.generate`` keeps working on the very weights being trained);
    ``head(hidden_states, labels, **kwargs)`` with *shifted* labels returns the loss head's own
    :meth:`loss`, computed on the model's logits: ``logit_transform``
    (:class:`~megaloss.integrations.head_config.LogitTransform`, the identity unless the
    wrapper sets the model's) scales the hidden states and the bias first
    (:meth:`scaled_inputs`), its soft-cap is in the loss's options."""

    logit_transform: LogitTransform = LogitTransform()

    def forward(self, hidden_states: torch.Tensor, labels: Optional[torch.Tensor] = None,
                **kwargs: Any) -> Any:
        if labels is None:
            return self.logits(hidden_states)
        return self.loss(hidden_states, labels, **kwargs)

    def loss(self, hidden_states: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} (a loss head) must define loss()")

    def scaled_inputs(self, hidden_states: torch.Tensor
                      ) -> "tuple[torch.Tensor, Optional[torch.Tensor]]":
        """``(scale * hidden_states, scale * bias)`` of :attr:`logit_transform`: the inputs whose
        raw lm_head logits are the model's scaled ones (``hidden_states`` and ``self.bias``
        themselves at scale 1)."""
        return self.logit_transform.scale_inputs(hidden_states, self.bias)


class LinearHead(LossHead, nn.Module):
    """What every loss head that replaces an unsharded ``nn.Linear`` lm_head shares: the
    original ``weight [V, H]`` (and ``bias [V]``) Parameter objects, so tied input embeddings
    stay tied and the state-dict names stay ``lm_head.weight``; the loss's ``options`` (when the
    head has fixed ones); the model's ``logit_transform`` (identity when ``None``); the call of
    :class:`LossHead`.

    Raises:
        TypeError: ``linear`` is not an ``nn.Linear``; ``logit_transform`` not a
            :class:`~megaloss.integrations.head_config.LogitTransform`.
    """

    def __init__(self, linear: nn.Linear, options: Any = None,
                 logit_transform: Optional[LogitTransform] = None) -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear lm_head, got {type(linear).__name__}")
        if logit_transform is not None and not isinstance(logit_transform, LogitTransform):
            raise TypeError(f"logit_transform must be a LogitTransform, got "
                            f"{type(logit_transform).__name__}")
        self.weight = linear.weight
        self.bias = linear.bias
        if options is not None:
            self.options = options
        if logit_transform is not None:
            self.logit_transform = logit_transform

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states [..., H] @ W.T + b`` -> ``[..., V]``, in the weight's dtype.

        Raises:
            TypeError: the weight is a DTensor (FSDP2's shard, read outside the forward of the
                unit that owns it; :func:`megaloss.ops.validation.check_not_dtensor`).
        """
        check_not_dtensor("lm_head.weight", self.weight)
        return F.linear(hidden_states, self.weight, self.bias)

    def extra_repr(self) -> str:
        v, h = self.weight.shape
        return f"vocab_size={v}, hidden_size={h}"


class GatheredLogits(LossHead):
    """For the loss heads over a :class:`megaloss.VocabParallelLMHead` shard: called without
    labels, the full ``[..., V]`` logits gathered over the TP group (no gradient: for
    ``generate`` and evaluation), so the model's own forward keeps working under TP."""

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad):
            raise RuntimeError(
                f"the full logits of a vocab-parallel lm_head (tp={self.tp_size}) are gathered "
                "without gradient (generate, evaluation): run under torch.no_grad(), or train "
                "through the megaloss wrapper's forward(input_ids, labels=...)")
        local = F.linear(hidden_states, self.weight, self.bias).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local, group=self.tp_group)
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


def is_loss_head(module: object) -> bool:
    """Whether ``module`` is one of megaloss's loss heads (it replaced an ``nn.Linear`` lm_head:
    a :class:`LinearHead`, or a head over a vocab-parallel shard, :class:`GatheredLogits`)."""
    return isinstance(module, (LinearHead, GatheredLogits))


def linear_lm_head(model: nn.Module) -> nn.Linear:
    """``model``'s output embedding, the lm_head a loss wrapper replaces (after
    :func:`text_decoder` found the decoder that feeds it).

    Raises:
        TypeError: ``model`` has no decoder module (:func:`text_decoder`: none found, or an
            encoder-decoder model); its output embedding is not an ``nn.Linear``, or not a
            child of ``model`` itself and inside a module with other parameters (BERT-style
            ``cls.predictions.decoder``, behind a transform of the hidden states the wrappers
            would skip; a parameter-free holder such as XLM's ``pred_layer`` is accepted);
            ``model`` has other child modules with parameters besides the decoder and the
            lm_head.
        ValueError: ``model`` is already sharded by FSDP2 (:func:`refuse_fully_sharded`).
    """
    decoder = text_decoder(model)
    lm_head = model.get_output_embeddings()
    if not isinstance(lm_head, nn.Linear):
        raise TypeError(f"model's output embedding must be an nn.Linear, got "
                        f"{type(lm_head).__name__} ({type(model).__name__})")
    path = next((n for n, m in model.named_modules() if m is lm_head), "")
    parent = model.get_submodule(path.partition(".")[0]) if "." in path else None
    own = {id(p) for p in lm_head.parameters()}
    if parent is not None and any(id(p) not in own for p in parent.parameters()):
        raise TypeError(
            f"{type(model).__name__}'s output embedding {path} sits inside "
            f"{type(parent).__name__}, a prediction head whose forward transforms the decoder's "
            f"hidden states before it (BERT-style: dense, activation, norm): the loss wrappers "
            f"run the decoder then the lm_head alone, and would skip that transform")
    extra = [n for n, child in model.named_children() if child is not decoder
             and child is not lm_head and child is not parent
             and next(child.parameters(), None) is not None]
    if extra:
        raise TypeError(
            f"{type(model).__name__} has modules with parameters besides its decoder and its "
            f"lm_head ({', '.join(extra)}), which its forward applies between the two (ELECTRA's "
            f"generator_predictions, ModernBERT-decoder's lm_head transform) or beside them: the "
            f"loss wrappers run the decoder then the lm_head alone")
    refuse_fully_sharded(model, "model")
    return lm_head


def first_dtensor_parameter(model: nn.Module) -> Optional[str]:
    """The name of ``model``'s first DTensor parameter (FSDP2's or DTensor TP's shard), or
    ``None``."""
    return next((n for n, p in model.named_parameters() if is_dtensor(p)), None)


_WRAP_FIRST = ("wrap it first, then apply fully_shard to the wrapper's modules (each decoder "
               "layer, optionally the wrapper's lm_head head module, then the wrapper itself as "
               "the root), so the loss runs inside an FSDP-managed forward")


def refuse_fully_sharded(model: nn.Module, what: str, why: str = _WRAP_FIRST) -> None:
    """Refuse a ``model`` already under FSDP2's ``fully_shard`` (a DTensor parameter): a loss
    wrapper calls ``model.base_model`` and its new head directly, so the hooks of a
    ``fully_shard(model)`` or ``fully_shard(model.lm_head)`` applied *before* wrapping never run
    and those parameters would reach the decoder and the loss as shards. ``why``: the message's
    reason and remedy (default: wrap first, then shard).

    Raises:
        ValueError: a parameter of ``model`` is a DTensor.
    """
    name = first_dtensor_parameter(model)
    if name is not None:
        raise ValueError(f"{what} is already sharded by FSDP2's fully_shard ({name} is a "
                         f"DTensor): {why}")


def wrapper_options(options, cls: type, reduction: str = "sum"):
    """A wrapper's loss options: ``options``, or ``cls(reduction=reduction)`` when ``None``
    (``"sum"`` for a module a calibrated training step drives, which weights the tokens itself;
    ``"mean"``, Hugging Face's token mean, for a module called as a Hugging Face model).

    Raises:
        TypeError: ``options`` is not a ``cls``.
    """
    options = options if options is not None else cls(reduction=reduction)
    if not isinstance(options, cls):
        raise TypeError(f"options must be a {cls.__name__}, got {type(options).__name__}")
    return options


def refuse_unsummed(module: nn.Module, what: str) -> None:
    """Refuse a loss module whose options average (``reduction`` other than ``"sum"``) where a
    calibrated step drives it: the step's per-token weights already hold the global
    normalisation, so a mean would divide the loss once more. A module wrapped by DDP /
    DeepSpeed (``module.module``) is looked through; a module without ``options.reduction``
    (log-probs, embeddings) passes.

    Raises:
        ValueError: ``options.reduction`` is not ``"sum"``.
    """
    inner = getattr(module, "module", module)
    reduction = getattr(getattr(inner, "options", None), "reduction", "sum")
    if reduction != "sum":
        raise ValueError(
            f"{what}: the module's options have reduction={reduction!r}, but the calibrated step "
            f"weights the tokens itself and needs reduction='sum' (build the wrapper with "
            f"options=MegalossConfig.ce.options(), or CrossEntropyOptions(reduction='sum'); the "
            f"wrappers default to Hugging Face's token mean)")


def shifted_targets(input_ids: torch.Tensor, labels: Optional[torch.Tensor],
                   shift_labels: Optional[torch.Tensor], ignore_index: int,
                   model_shifts_labels: bool = True) -> torch.Tensor:
    """The ``[B, T]`` shifted targets of a wrapper's forward: ``causal_shift(labels)`` (Hugging
    Face's unshifted labels) or ``shift_labels`` as given; exactly one of the two. A model whose
    own loss takes ``labels[t]`` as the target of position ``t`` (``model_shifts_labels``
    false, :class:`~megaloss.integrations.head_config.LogitTransform`'s ``shifts_labels``:
    ``BartForCausalLM``, ``WhisperForCausalLM``, ...) has its ``labels`` taken as they are, so
    the loss is the one its own forward computes.

    Raises:
        ValueError: neither or both given; a shape other than that of ``input_ids``.
    """
    if (labels is None) == (shift_labels is None):
        raise ValueError("pass exactly one of labels (unshifted, Hugging Face convention) and "
                         "shift_labels (already shifted)")
    if shift_labels is None:
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids "
                             f"{tuple(input_ids.shape)}")
        return causal_shift(labels, ignore_index) if model_shifts_labels else labels
    if shift_labels.shape != input_ids.shape:
        raise ValueError(f"shift_labels {tuple(shift_labels.shape)} must have the shape of "
                         f"input_ids {tuple(input_ids.shape)}")
    return shift_labels




def summing_options(options: Any) -> Any:
    """The options of a wrapper's *summing* loss head: the wrapper's ``options``, a
    ``reduction="mean"`` replaced by ``"sum"`` (the mean is then the head's weights,
    :func:`head_loss_weights`, so that one head serves the token mean and Hugging Face's
    ``num_items_in_batch``); any other reduction as it is."""
    return options.replace(reduction="sum") if options.reduction == "mean" else options


def head_loss_weights(targets: torch.Tensor, ignore_index: int, reduction: str,
                      loss_weights: Optional[torch.Tensor], num_items_in_batch: Any,
                      dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The ``loss_weights`` a wrapper hands its *summing* loss head so that the sum is the
    wrapper's ``reduction``: ``"mean"`` is megaloss's token mean (``sum_t w_t l_t / sum_t w_t``
    over the valid targets, :func:`megaloss.losses.token_coefficients.token_coefficients`), or,
    with ``num_items_in_batch``, ``sum_t w_t l_t / num_items_in_batch`` as ``transformers``'
    ``ForCausalLMLoss`` divides its sum (``transformers/loss/loss_utils.py``,
    ``fixed_cross_entropy``: the Hugging Face Trainer's token count over the whole
    gradient-accumulation step); ``"sum"`` / ``"none"``: ``loss_weights`` as given.

    Args:
        targets: ``[B, T]`` shifted targets (``ignore_index`` where none).
        loss_weights: ``[B, T]`` per-token weights or ``None`` (1).
        num_items_in_batch: ``None``, an int or a scalar tensor (moved to ``targets``' device).
        dtype: the loss's statistics dtype (fp64 for a fp64 model, else fp32).

    Returns:
        ``[B, T]`` weights in ``dtype`` (``"mean"``), or ``loss_weights``.

    Raises:
        ValueError: ``num_items_in_batch`` with a ``reduction`` other than ``"mean"``;
            ``loss_weights`` of another shape than ``targets``.
    """
    if loss_weights is not None and tuple(loss_weights.shape) != tuple(targets.shape):
        raise ValueError(f"loss_weights {tuple(loss_weights.shape)} must have the shape of the "
                         f"shifted labels {tuple(targets.shape)}")
    if reduction != "mean":
        if num_items_in_batch is not None:
            raise ValueError(f"num_items_in_batch is the divisor of Hugging Face's token mean, "
                             f"but the wrapper's options have reduction={reduction!r}: build it "
                             f"with reduction='mean' (the default) to be trained as a Hugging "
                             f"Face model, or call it without num_items_in_batch")
        return loss_weights
    from ..losses.token_coefficients import token_coefficients

    if num_items_in_batch is None:
        flat = None if loss_weights is None else loss_weights.reshape(-1)
        return token_coefficients(targets.reshape(-1), ignore_index, "mean", flat,
                                  dtype).coef.view(targets.shape)
    weights = (targets != ignore_index).to(dtype)
    if loss_weights is not None:
        weights = weights * loss_weights.to(dtype)
    count = torch.as_tensor(num_items_in_batch, device=targets.device, dtype=dtype)
    return weights / count
