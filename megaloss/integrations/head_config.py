"""What a Hugging Face causal LM's config does to its logits after the lm_head, for the loss
wrappers: they compute their loss from ``lm_head(hidden_states)`` themselves, so every transform
the model's own ``forward`` applies there must be applied by the loss as well, or the wrapper
trains a different loss than the model defines.

Read from ``model.config`` and its decoder text config (``config.get_text_config(decoder=True)``,
where composite models keep these fields), as ``transformers`` 5.24's ``*ForCausalLM.forward``
uses them:

- soft-capping ``c * tanh(z / c)``: ``final_logit_softcapping`` (Gemma 2, 3, 3n, 4, VaultGemma,
  NanoChat; ``transformers/models/gemma2/modeling_gemma2.py``, ``Gemma2ForCausalLM.forward``;
  arXiv:2408.00118), ``logits_soft_cap`` (RecurrentGemma,
  ``models/recurrent_gemma/modeling_recurrent_gemma.py``) and ``output_logit_soft_cap`` (xLSTM,
  ``models/xlstm/modeling_xlstm.py``): megaloss's ``logit_softcapping``;
- a scale of the logits, which megaloss's chunked losses do not take, refused unless it is 1:
  ``logit_scale`` (Cohere: ``logits * logit_scale``, ``models/cohere/modeling_cohere.py``;
  MPT's config has the field but its forward ignores it), ``logits_scaling`` (Granite:
  ``logits / logits_scaling``, ``models/granite/modeling_granite.py``; HyperCLOVA X multiplies),
  ``output_multiplier`` (MuseSpark: ``logits * output_multiplier`` before the soft-cap,
  ``models/muse_spark/modeling_muse_spark.py``);
- ``unpadded_vocab_size`` below the lm_head's rows (Inkling: the logits are cut to it,
  ``models/inkling/modeling_inkling.py``), refused: the softmax would cover the padding rows.

Model-specific masks written in a forward (Chameleon's image tokens) are not config fields and
are not detected.
"""
from __future__ import annotations

from numbers import Real
from typing import Any, List, Optional

__all__ = ["SOFTCAP_FIELDS", "SCALE_FIELDS", "config_logit_softcapping", "resolve_softcapping",
           "model_softcapping"]

SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")

# field -> how the forwards that read it scale the logits (the error message's words)
SCALE_FIELDS = {
    "logit_scale": "Cohere: logits * logit_scale",
    "logits_scaling": "Granite: logits / logits_scaling; HyperCLOVA X: logits * logits_scaling",
    "output_multiplier": "MuseSpark: logits * output_multiplier before the soft-cap",
}
# (model_type, field) whose forward does not read the field
_UNUSED = {("mpt", "logit_scale")}


def _configs(model: Any) -> List[Any]:
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


def _number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_vocab_cut(model: Any, config: Any, role: str) -> None:
    kept = getattr(config, "unpadded_vocab_size", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    rows = getattr(getattr(head, "weight", None), "shape", (None,))[0]
    if kept is not None and rows is not None and kept < rows:
        raise ValueError(f"the {role}'s config has unpadded_vocab_size={kept!r} below its "
                         f"lm_head's {rows} rows: its forward cuts the logits to the first {kept}, "
                         f"which megaloss's chunked losses do not; the wrapper would train a "
                         f"softmax over the padding rows too")


def config_logit_softcapping(model: Any, role: str = "model") -> Optional[float]:
    """The soft-cap ``c`` that ``model``'s forward applies to its lm_head logits (module
    docstring), or ``None`` (no cap, or no ``config`` at all).

    Args:
        model: a ``transformers`` ``PreTrainedModel`` (anything with a ``config``).
        role: how the error messages name the model (``"model"``, ``"teacher"``).

    Raises:
        ValueError: the config scales the logits (``logit_scale``, ``logits_scaling``,
            ``output_multiplier`` other than ``None`` / 1) or cuts them
            (``unpadded_vocab_size``), which the losses cannot reproduce; a soft-cap that is not
            a number; two different soft-caps in the config.
    """
    caps = set()
    for config in _configs(model):
        for name, how in SCALE_FIELDS.items():
            value = getattr(config, name, None)
            if value is None or (_number(value) and float(value) == 1.0) or (
                    getattr(config, "model_type", None), name) in _UNUSED:
                continue
            raise ValueError(
                f"the {role}'s config has {name}={value!r}, a scale of the logits after the "
                f"lm_head ({how}), which megaloss's chunked losses do not reproduce: the wrapper "
                f"would train a different loss than the model defines; use a model whose config "
                f"has {name} None or 1")
        _check_vocab_cut(model, config, role)
        for name in SOFTCAP_FIELDS:
            value = getattr(config, name, None)
            if value is None:
                continue
            if not _number(value):
                raise ValueError(f"the {role}'s config has {name}={value!r}: expected None or a "
                                 f"number > 0")
            caps.add(float(value))
    if len(caps) > 1:
        raise ValueError(f"the {role}'s config has two final soft-caps {sorted(caps)}: expected "
                         f"one")
    return caps.pop() if caps else None


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


def model_softcapping(options: Any, model: Any, option: str = "logit_softcapping",
                      role: str = "model") -> Optional[float]:
    """The soft-cap a wrapper's loss uses for ``model``: :func:`resolve_softcapping` of the
    options' field ``option`` and :func:`config_logit_softcapping` of ``model`` (errors named
    after ``role``).

    Raises:
        ValueError: see both.
    """
    return resolve_softcapping(getattr(options, option), config_logit_softcapping(model, role),
                               option, role)
