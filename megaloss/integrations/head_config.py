r"""What a Hugging Face causal LM does to its logits after the lm_head, for the loss wrappers:
they compute their loss from ``lm_head(hidden_states)`` themselves, so every transform the
model's own ``forward`` applies there must be applied by the loss as well, or the wrapper trains
a different loss than the model defines.

A :class:`LogitTransform` ``(scale, softcapping, z_loss_coefficient)`` says: the model's logits
are ``softcap(scale * (h @ W.T + b))`` with ``softcap(y) = c * tanh(y / c)`` (none without
``c``), and the model's own loss adds ``z_loss_coefficient * mean(logsumexp(logits) ** 2)`` over
every position of the batch. :func:`model_logit_transform` finds it in two steps.

**1. Declared** (:func:`config_logit_transform`): the config fields and module attributes that
``transformers`` 5.24's ``*ForCausalLM`` / ``*ForConditionalGeneration`` forwards read after (or
just before) ``self.lm_head(``, from ``model.config`` and its decoder text config
(``config.get_text_config(decoder=True)``); a module attribute of the model or its base model
(what the forward actually reads: ``self.logit_scale``, ``self.model.lm_head_multiplier``) wins
over the config. Files under ``transformers/models/``:

- multiply: ``logit_scale`` (Cohere, Cohere2, Cohere2-MoE, Cohere-Compass:
  ``logits * self.logit_scale``, ``cohere/modeling_cohere.py``, ``cohere2/modeling_cohere2.py``,
  ``cohere2_moe/modeling_cohere2_moe.py``, ``cohere_compass/modeling_cohere_compass.py``; MPT's
  config has the field but its forward ignores it); ``lm_head_multiplier`` (Falcon-H1:
  ``self.lm_head(h) * self.model.lm_head_multiplier``, ``falcon_h1/modeling_falcon_h1.py``);
  ``output_multiplier`` (MuseSpark, MuseGlimmer: ``logits * output_multiplier`` before the
  soft-cap, ``muse_spark/modeling_muse_spark.py``, ``muse_glimmer/modeling_muse_glimmer.py``);
  ``logits_scaling`` of HyperCLOVA X (``self.lm_head(h) * logits_scaling``,
  ``hyperclovax/modeling_hyperclovax.py``, ``hyperclovax_vision_v2/``);
- divide: ``logits_scaling`` of Granite, Granite-SWA, GraniteMoE, GraniteMoE-SWA,
  GraniteMoE-Hybrid, GraniteMoE-Shared, Granite4-Vision, Granite-Docling (``logits /
  logits_scaling``, ``granite/modeling_granite.py`` and the others) and MiniCPM3 (the hidden
  states divided before a bias-free lm_head, ``minicpm3/modeling_minicpm3.py``; its
  ``logits_scaling`` is ``hidden_size / dim_model_base``). The field name is shared, so the
  ``model_type`` decides; ``logits_mup_width_multiplier`` (Inkling: the hidden states divided
  before its bias-free lm_head, ``inkling/modeling_inkling.py``; found by the probe below, whose
  ratio 1/24 no field of the first table explained);
- soft-cap ``c * tanh(z / c)``: ``final_logit_softcapping`` (Gemma 2, 3, 3n, 4, VaultGemma,
  NanoChat, Mistral-Large-4, Inkling2, PaliGemma, MuseSpark; ``gemma2/modeling_gemma2.py``,
  arXiv:2408.00118), ``logits_soft_cap`` (RecurrentGemma,
  ``recurrent_gemma/modeling_recurrent_gemma.py``), ``output_logit_soft_cap`` (xLSTM,
  ``xlstm/modeling_xlstm.py``);
- z-loss: ``z_loss_coefficient`` (Bamba: ``loss + z_loss_coefficient *
  logits.logsumexp(-1).pow(2).mean()`` over every position, padding and ignored labels
  included, ``bamba/modeling_bamba.py``);
- refused: ``unpadded_vocab_size`` below the lm_head's rows (Inkling cuts the logits to it,
  ``inkling/modeling_inkling.py``: the softmax would cover the padding rows), and an lm_head
  that is a subclass of ``nn.Linear`` with its own ``forward`` (Dory's ``DoryLMHead`` multiplies
  by a learned per-token ``logit_scale`` Parameter, ``dory/modeling_dory.py``): megaloss replaces
  the head by a plain ``h @ W.T + b``.

**2. Verified** (:func:`verify_logit_transform`): a probe of the model itself on a few tokens
(eval mode and no gradient, each module's mode restored after): the logits of its own forward
must equal the declared transform of ``F.linear(last_hidden_state, W, b)``, the hidden state
taken from the model's decoder (:func:`~megaloss.integrations.text_decoder.text_decoder`)
called as the wrappers call it, to the model dtype's rounding.
This checks the wrappers' whole path, not only what follows the lm_head: MiniCPM3's division
of the hidden states shows as its scale, and a layer the forward runs between the decoder and
the lm_head (BERT's prediction-head transform in ``BertLMHeadModel``,
``bert/modeling_bert.py``) as a mismatch. A mismatch is a transform megaloss does not know
(Chameleon's image-token mask, ``chameleon/modeling_chameleon.py``; an extra bias; such a
layer) and is refused with a ValueError naming the model class and the largest difference.
A constant ratio that no field explains is refused too, with the ratio in the message, not adopted
as a scale: a forward that multiplies by something the table does not name may multiply by a learned
or input-dependent factor that is constant only on the probe (Dory's per-token scale is exactly 1 at
initialisation), and the wrapper would then train the wrong loss silently as soon as it drifts; a
refusal names what to add to the table instead.

The probe is skipped when the parameters are not materialised: a parameter on the ``meta``
device, a DeepSpeed ZeRO-3 placeholder (``ds_id``, or ``numel() == 0``), or a DTensor (FSDP2 /
DTensor TP shards). Then the declared transform alone decides, and a scale field on a
``model_type`` the table does not list is refused (its direction cannot be told). The z-loss is
a term of the model's loss, not of its logits: it is read from the model and not probed.
"""
from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Real
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .text_decoder import text_decoder

__all__ = ["LogitTransform", "SOFTCAP_FIELDS", "SCALE_FIELDS", "config_logit_transform",
           "materialised", "verify_logit_transform", "model_logit_transform",
           "resolve_softcapping", "z_loss_refusal", "unplaced_mean", "model_configs"]

SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")

_GRANITE_DIVIDES = frozenset({
    "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid",
    "granitemoeshared", "granite4_vision", "granite4_vision_text", "granite_docling",
    "granite_docling_text", "minicpm3"})

# field -> (model_type -> "*", "/" or None (the forward ignores the field)), the direction for a
# model_type not listed (then only accepted when the probe confirms it), the source for messages
SCALE_FIELDS: Dict[str, Tuple[Dict[str, Optional[str]], str, str]] = {
    "logit_scale": (
        {t: "*" for t in ("cohere", "cohere2", "cohere2_moe", "cohere_compass",
                          "cohere_compass_text")}
        # their text config is Cohere 2's, but the vision-language forward does not scale
        # (transformers/models/aya_vision/modeling_aya_vision.py, cohere2_vision)
        | {t: None for t in ("mpt", "aya_vision", "cohere2_vision")},
        "*", "Cohere: logits * logit_scale"),
    "lm_head_multiplier": ({"falcon_h1": "*"}, "*",
                           "Falcon-H1: lm_head(h) * model.lm_head_multiplier"),
    "output_multiplier": (
        {t: "*" for t in ("muse_spark", "muse_spark_text", "muse_glimmer",
                          "muse_glimmer_text")},
        "*", "MuseSpark: logits * output_multiplier before the soft-cap"),
    "logits_mup_width_multiplier": (
        {t: "/" for t in ("inkling_text", "inkling_mm_model")}, "/",
        "Inkling: last_hidden_state / logits_mup_width_multiplier before the lm_head"),
    "logits_scaling": (
        {t: "/" for t in _GRANITE_DIVIDES} | {t: "*" for t in ("hyperclovax",
                                                               "hyperclovax_vision_v2")},
        "/", "Granite, MiniCPM3: logits / logits_scaling; HyperCLOVA X: logits * "
             "logits_scaling"),
}
_Z_LOSS_TYPES = frozenset({"bamba"})


@dataclass(frozen=True)
class LogitTransform:
    """What a model's forward does to its lm_head output ``z = h @ W.T + b``: its logits are
    ``softcap(scale * z)`` (``softcap(y) = softcapping * tanh(y / softcapping)``, none when
    ``None``), and its own loss adds ``z_loss_coefficient * mean over every position of
    logsumexp(logits) ** 2``; ``shifts_labels`` false when its own loss takes ``labels[t]`` as
    the target of position ``t`` (the decoder halves of encoder-decoder families:
    ``BartForCausalLM``, ``WhisperForCausalLM``, ...), not of ``t + 1`` as Hugging Face's
    ``*ForCausalLM`` loss (``transformers/loss/loss_utils.py``, ``ForCausalLMLoss``) does.

    The loss heads apply ``scale`` by multiplying the hidden states and the bias (exact:
    ``scale * (h W^T + b) = (scale h) W^T + scale b``, so the chunked and vocab-parallel paths
    need nothing new), the soft-cap through their options' ``logit_softcapping``.

    Raises:
        ValueError: ``scale`` not a finite number > 0; ``softcapping`` neither ``None`` nor a
            finite number > 0; ``z_loss_coefficient`` not a finite number >= 0.
    """

    scale: float = 1.0
    softcapping: Optional[float] = None
    z_loss_coefficient: float = 0.0
    shifts_labels: bool = True

    def __post_init__(self) -> None:
        if not _number(self.scale) or not math.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"scale must be a finite number > 0, got {self.scale!r}")
        if self.softcapping is not None and (
                not _number(self.softcapping) or not math.isfinite(self.softcapping)
                or self.softcapping <= 0):
            raise ValueError(f"softcapping must be None or a finite number > 0, got "
                             f"{self.softcapping!r}")
        if (not _number(self.z_loss_coefficient) or not math.isfinite(self.z_loss_coefficient)
                or self.z_loss_coefficient < 0):
            raise ValueError(f"z_loss_coefficient must be a finite number >= 0, got "
                             f"{self.z_loss_coefficient!r}")
        object.__setattr__(self, "scale", float(self.scale))
        object.__setattr__(self, "z_loss_coefficient", float(self.z_loss_coefficient))
        if self.softcapping is not None:
            object.__setattr__(self, "softcapping", float(self.softcapping))

    def scale_inputs(self, hidden_states: torch.Tensor, bias: Optional[torch.Tensor]
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(scale * hidden_states, scale * bias)``, the inputs whose raw lm_head logits are
        ``scale * z`` (the tensors themselves when ``scale`` is 1); differentiable."""
        if self.scale == 1.0:
            return hidden_states, bias
        return hidden_states * self.scale, None if bias is None else bias * self.scale

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``softcap(scale * logits)``: the model's logits from the raw lm_head output (the
        full ``[..., V]`` form, for references and the probe)."""
        y = logits * self.scale if self.scale != 1.0 else logits
        if self.softcapping is not None:
            y = torch.tanh(y / self.softcapping) * self.softcapping
        return y


def _number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def model_configs(model: Any) -> List[Any]:
    """``model.config`` and, where it differs, its decoder text config
    (``config.get_text_config(decoder=True)``, where composite models keep their text fields);
    ``[]`` without a ``config``."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        text = get_text(decoder=True)
        if text is not None and text is not config:
            configs.append(text)
    return configs


def _model_types(model: Any) -> List[str]:
    return [t for t in (getattr(c, "model_type", None) for c in model_configs(model)) if t]


def _attribute(module: Any, name: str) -> Any:
    """A plain (non-Parameter, non-module) attribute ``name`` of ``module``'s instance, or
    ``None``."""
    value = vars(module).get(name) if hasattr(module, "__dict__") else None
    return value if _number(value) else None


def _read(model: Any, name: str) -> Tuple[Any, str]:
    """``(value, where)`` of field ``name``: the model's or its base model's instance attribute
    (what the forward reads), else the first config holding it not ``None``; ``(None, "")``."""
    base = getattr(model, "base_model", None)
    for owner, where in ((model, "model"), (base, "base model")):
        if owner is not None:
            value = _attribute(owner, name)
            if value is not None:
                return value, f"{where} attribute {name}"
    for config in model_configs(model):
        value = getattr(config, name, None)
        if value is not None:
            return value, f"config's {name}"
    return None, ""


def _check_vocab_cut(model: Any, role: str) -> None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    rows = getattr(getattr(head, "weight", None), "shape", (None,))[0]
    for config in model_configs(model):
        kept = getattr(config, "unpadded_vocab_size", None)
        if kept is not None and rows is not None and kept < rows:
            raise ValueError(
                f"the {role}'s config has unpadded_vocab_size={kept!r} below its lm_head's "
                f"{rows} rows: its forward cuts the logits to the first {kept}, which "
                f"megaloss's chunked losses do not; the wrapper would train a softmax over the "
                f"padding rows too")


def _check_head_forward(model: Any, role: str) -> None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Linear) and type(head).forward is not nn.Linear.forward:
        raise ValueError(
            f"the {role}'s lm_head is a {type(head).__name__}, an nn.Linear with its own "
            f"forward (e.g. Dory's learned per-token logit scale): megaloss replaces the "
            f"lm_head by h @ W.T + b and would drop what that forward adds")


def _declared(model: Any, role: str) -> Tuple[LogitTransform, List[str]]:
    """The declared transform and the fields read on a ``model_type`` the table does not list
    (whose direction is a guess until probed)."""
    _check_vocab_cut(model, role)
    _check_head_forward(model, role)
    types = _model_types(model)
    scale, unlisted = 1.0, []
    for name, (directions, default, how) in SCALE_FIELDS.items():
        value, where = _read(model, name)
        if value is None:
            continue
        if not _number(value) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"the {role}'s {where}={value!r} ({how}): expected a finite "
                             f"number > 0")
        known = [directions[t] for t in types if t in directions]
        if known and known[0] is None:  # the forward of this model_type ignores the field
            continue
        if float(value) == 1.0:
            continue
        op = known[0] if known else default
        if not known:
            unlisted.append(f"{where}={value!r} (model_type {', '.join(types) or 'unknown'}, "
                            f"not in megaloss's table; taken as logits {op} {value!r})")
        scale = scale * float(value) if op == "*" else scale / float(value)
    caps = set()
    for name in SOFTCAP_FIELDS:
        for config in model_configs(model):
            value = getattr(config, name, None)
            if value is None:
                continue
            if not _number(value):
                raise ValueError(f"the {role}'s config has {name}={value!r}: expected None or "
                                 f"a number > 0")
            caps.add(float(value))
    if len(caps) > 1:
        raise ValueError(f"the {role}'s config has two final soft-caps {sorted(caps)}: expected "
                         f"one")
    z = _attribute(model, "z_loss_coefficient")
    if z is None and any(t in _Z_LOSS_TYPES for t in types):
        z, _ = _read(model, "z_loss_coefficient")
    try:
        transform = LogitTransform(scale, caps.pop() if caps else None,
                                   0.0 if z is None else z)
    except ValueError as err:
        raise ValueError(f"the {role}'s logit transform: {err}") from None
    return transform, unlisted


def config_logit_transform(model: Any, role: str = "model") -> LogitTransform:
    """The :class:`LogitTransform` ``model``'s config fields and module attributes declare
    (module docstring, step 1), without running the model; the identity for a model without a
    ``config``.

    Args:
        model: a ``transformers`` ``PreTrainedModel`` (duck-typed: ``config``,
            ``base_model``, ``get_output_embeddings``).
        role: how the error messages name the model (``"model"``, ``"student"``,
            ``"teacher"``).

    Raises:
        ValueError: ``unpadded_vocab_size`` below the lm_head's rows; an lm_head subclass with
            its own forward; a scale or soft-cap that is not a number > 0; two different
            soft-caps; a negative z-loss coefficient.
    """
    return _declared(model, role)[0]


def materialised(model: nn.Module) -> Optional[str]:
    """``None`` when every parameter of ``model`` holds its values here, else why not (the
    probe is then skipped): a ``meta`` parameter, a DeepSpeed ZeRO-3 placeholder (``ds_id``
    or ``numel() == 0``), a DTensor shard."""
    from ..ops.validation import is_dtensor

    for name, p in model.named_parameters():
        if p.device.type == "meta":
            return f"{name} is on the meta device"
        if hasattr(p, "ds_id") or p.numel() == 0:
            return f"{name} is a DeepSpeed ZeRO-3 partition"
        if is_dtensor(p):
            return f"{name} is a DTensor shard"
    return None


def _special_ids(model: Any) -> set:
    ids = set()
    for config in model_configs(model):
        for key, value in vars(config).items():
            if key.endswith(("token_id", "token_index", "token_ids")):
                for v in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(v, int):
                        ids.add(v)
    return ids


def _probe_ids(model: nn.Module, rows: int, device: torch.device) -> torch.Tensor:
    """``[1, 6]`` token ids below the input vocabulary that are no special token of the config
    (an image token would need pixels)."""
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    n = getattr(getattr(inp, "weight", None), "shape", (rows,))[0]
    n = min(int(n), int(rows))
    special = _special_ids(model)
    ids = [i for i in range(3, n) if i not in special][:6] or list(range(min(n, 6)))
    return torch.tensor([ids], dtype=torch.long, device=device)


def _last_hidden(output: Any) -> Optional[torch.Tensor]:
    h = getattr(output, "last_hidden_state", None)
    if h is None and isinstance(output, (tuple, list)) and output:
        h = output[0]
    return h if isinstance(h, torch.Tensor) else None


@contextmanager
def _probing(model: nn.Module) -> Iterator[None]:
    """A probe forward's context: eval mode (dropout off) and no gradient, each module's
    training mode put back after, whatever the forward raised."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad():
            yield
    finally:
        for module, mode in modes:
            module.training = mode


def _probe(model: nn.Module, role: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(raw, logits)`` on a few tokens: ``F.linear(h, W, b)`` with ``h`` the last hidden
    state of the model's decoder (:func:`~megaloss.integrations.text_decoder.text_decoder`)
    called as the wrappers call it, and the model's own logits."""
    head = model.get_output_embeddings()
    ids = _probe_ids(model, head.weight.shape[0], head.weight.device)
    name = type(model).__name__
    try:
        with _probing(model):
            out = model(input_ids=ids, use_cache=False)
            hidden = _last_hidden(text_decoder(model)(input_ids=ids, attention_mask=None,
                                                      position_ids=None, use_cache=False))
    except Exception as err:  # the message names the model; the cause stays chained
        raise ValueError(f"could not verify the {role}'s logit transform: a probe forward of "
                         f"{name} on input_ids {tuple(ids.shape)} raised "
                         f"{type(err).__name__}: {err}") from err
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)) and out:
        logits = out[0]
    if hidden is None or not isinstance(logits, torch.Tensor):
        raise ValueError(f"could not verify the {role}'s logit transform: {name}'s base model "
                         f"returned no last hidden state, or its forward no logits")
    if hidden.shape[-1] != head.weight.shape[1]:
        raise ValueError(f"{name}'s base model returns hidden states of size {hidden.shape[-1]}, "
                         f"its lm_head takes {head.weight.shape[1]}: its forward runs a layer "
                         f"between them that megaloss's wrappers would skip")
    with torch.no_grad():
        raw = F.linear(hidden.to(head.weight.dtype), head.weight, head.bias)
    return raw, logits


def verify_logit_transform(model: nn.Module, transform: LogitTransform,
                           role: str = "model") -> bool:
    """Check ``transform`` against ``model``'s own forward (module docstring, step 2): on
    ``[1, 6]`` token ids (eval mode, no gradient; each module's training mode put back), the
    model's logits must equal ``transform.apply(F.linear(h, W, b))`` with ``h`` the last hidden
    state of the model's decoder on ``input_ids`` (``use_cache=False``), the decoder call the
    wrappers make (so a layer the model runs between its decoder and the lm_head, BERT's prediction
    transform, is a mismatch too), within ``8 * eps * max|logits|`` (``eps`` of the lm_head's
    and the logits' dtypes, the coarser). Two forwards of a few tokens.

    Args:
        model: a ``*ForCausalLM`` with a base model and an ``nn.Linear`` output embedding.
        transform: the declared transform.
        role: how the error messages name the model.

    Returns:
        ``True`` when verified; ``False`` when skipped (parameters not materialised,
        :func:`materialised`).

    Raises:
        ValueError: a probe forward raised or returned no logits / hidden states; hidden states
            of another size than the lm_head takes; logits of another shape than the lm_head's
            output (a cut); the
            logits differ from the transform (the model class, the largest difference and, when
            the logits are a constant multiple of the expected ones, that ratio).
    """
    if materialised(model) is not None:
        return False
    raw, logits = _probe(model, role)
    name = type(model).__name__
    if logits.shape != raw.shape:
        raise ValueError(f"{name}'s logits have shape {tuple(logits.shape)}, its lm_head's output "
                         f"{tuple(raw.shape)}: its forward cuts or reshapes them, which "
                         f"megaloss's losses do not")
    eps = max(torch.finfo(raw.dtype).eps, torch.finfo(logits.dtype).eps)
    got = logits.detach().double()
    want = transform.apply(raw.double())
    size = float(want.abs().max()) if want.numel() else 0.0
    tol = 8 * eps * max(size, 1e-30)
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    if diff <= tol and bool(torch.isfinite(got).all()):
        return True
    hint = ""
    denom = float((want * want).sum())
    if denom > 0 and bool(torch.isfinite(got).all()):
        ratio = float((got * want).sum()) / denom
        if float((got - ratio * want).abs().max()) <= 8 * eps * max(size * abs(ratio), 1e-30):
            hint = (f"; they are {ratio:.6g} times those logits, a scale no config field of the "
                    f"table explains (refused, not adopted: it may be learned or depend on the "
                    f"input)")
    raise ValueError(
        f"{name}'s forward (the {role}) transforms its lm_head logits in a way megaloss does "
        f"not reproduce: "
        f"its logits differ from {transform} applied to lm_head(decoder(...))."
        f"last_hidden_state) by up to {diff:.3g} (tolerance {tol:.3g}){hint}. The wrapper "
        f"would train a different loss than the {role} defines (a mask such as Chameleon's "
        f"image tokens, a bias added after the lm_head, a layer between the decoder and the "
        f"lm_head such as BERT's prediction transform, or a scale megaloss does not know)")


def _own_loss_shifts_labels(model: nn.Module) -> bool:
    """Whether ``model``'s own loss on ``labels = input_ids`` is the cross-entropy of the
    logits at ``t`` against the label at ``t + 1`` (Hugging Face's causal-LM convention): false
    only when it equals the unshifted one instead (a probe of a few tokens, no gradient, modes
    restored); true when the labelled forward fails or its loss adds terms (a z-loss, a router
    loss) so that neither matches."""
    head = model.get_output_embeddings()
    ids = _probe_ids(model, head.weight.shape[0], head.weight.device)
    try:
        with _probing(model):
            out = model(input_ids=ids, labels=ids, use_cache=False)
    except Exception:  # noqa: BLE001 - a model that cannot take labels here keeps the default
        return True
    loss, logits = getattr(out, "loss", None), getattr(out, "logits", None)
    if not isinstance(loss, torch.Tensor) or not isinstance(logits, torch.Tensor):
        return True
    logits = logits.detach().double()[0]
    shifted = float(F.cross_entropy(logits[:-1], ids[0, 1:]))
    unshifted = float(F.cross_entropy(logits, ids[0]))
    own = float(loss)
    tol = 1e-4 * max(abs(own), 1.0)
    return not (abs(own - unshifted) <= tol < abs(own - shifted))


def model_logit_transform(model: nn.Module, role: str = "model") -> LogitTransform:
    """The :class:`LogitTransform` of ``model``: declared by its config and attributes
    (:func:`config_logit_transform`), verified by a probe forward of the model itself
    (:func:`verify_logit_transform`) when its parameters are materialised.

    Args:
        model: a ``*ForCausalLM`` (or conditional-generation model) with a base model and an
            ``nn.Linear`` output embedding, its lm_head not yet replaced.
        role: how the error messages name the model.

    Returns:
        The transform the loss heads apply (scale and soft-cap to the logits, the z-loss term
        to the CE wrapper's loss).

    Raises:
        ValueError: see :func:`config_logit_transform` and :func:`verify_logit_transform`; a
            scale field on a ``model_type`` the table does not list, when the probe is skipped
            (its direction, multiply or divide, cannot be told).
    """
    transform, unlisted = _declared(model, role)
    if getattr(model, "config", None) is None and transform == LogitTransform():
        return transform  # not a transformers model: nothing declared, nothing to verify
    try:
        verified = verify_logit_transform(model, transform, role)
    except ValueError as err:
        if not unlisted:
            raise
        raise ValueError(f"the {role}'s {'; '.join(unlisted)}: its forward does not apply it so "
                         f"({err})") from None
    if verified and not _own_loss_shifts_labels(model):
        transform = dataclasses.replace(transform, shifts_labels=False)
    if not verified and unlisted:
        raise ValueError(
            f"the {role} ({type(model).__name__}) has {'; '.join(unlisted)}, a logit scale "
            f"field on a model_type megaloss's table does not list, and its parameters are not "
            f"materialised ({materialised(model)}), so the probe forward that would tell "
            f"multiply from divide cannot run: build the wrapper on the materialised model")
    return transform


def resolve_softcapping(given: Optional[float], model_cap: Optional[float], option: str,
                        role: str = "model") -> Optional[float]:
    """The soft-cap a wrapper's loss uses: the model's own ``model_cap`` when the options leave
    it ``None`` (or give the same value), the options' ``given`` when the model has no cap (an
    explicit choice of the loss, as ``z_loss`` or ``label_smoothing`` are).

    Raises:
        ValueError: ``given`` and ``model_cap`` are both set and differ (``option`` names the
            options field).
    """
    if model_cap is None:
        return given
    if given is None or float(given) == model_cap:
        return model_cap
    raise ValueError(f"options {option}={given} differs from the {role}'s own final soft-cap "
                     f"{model_cap} (from its config): leave {option} None to take the config's, "
                     f"or give the same value")


def unplaced_mean(reduction: str, loss_weights: Optional[torch.Tensor]) -> Optional[str]:
    """What cannot place a model's own per-micro-batch mean term (its z-loss, its router loss)
    next to the CE: ``reduction`` other than ``"mean"``, or the calibrated step's
    ``loss_weights``; ``None`` for the wrapper's plain token mean."""
    if reduction != "mean":
        return f'reduction="{reduction}"'
    if loss_weights is not None:
        return "loss_weights (the calibrated step's token weights)"
    return None


def z_loss_refusal(transform: LogitTransform, reduction: str,
                   loss_weights: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why the model's own z-loss term (``transform.z_loss_coefficient``, Bamba's) cannot be
    added to a CE of this ``reduction`` / ``loss_weights``, or ``None`` (no term, or
    ``reduction="mean"`` without weights). The term is a mean over every position of the
    micro-batch, as the model's own loss takes it: right next to the token mean, not
    calibrated for a sum or per-token weights (the calibrated step would scale it by its token
    weights and count it once per micro-batch), and a per-token loss has no place for it."""
    if transform.z_loss_coefficient == 0.0:
        return None
    why = unplaced_mean(reduction, loss_weights)
    if why is None:
        return None
    return (f"the model's own loss adds z_loss_coefficient={transform.z_loss_coefficient:g} "
            f"* mean(logsumexp(logits) ** 2) over every position of the micro-batch (Bamba), a "
            f"normalisation that {why} does not calibrate: use reduction=\"mean\" without "
            f"loss_weights (the model's own loss), or a model whose z_loss_coefficient is 0")
