"""Which module of a Hugging Face causal or vision-language model produces the hidden states
its lm_head reads (:func:`text_decoder`): what the loss wrappers, and the logit-transform probe
of :mod:`megaloss.integrations.head_config`, run before their head. Duck-typed on the
``transformers`` model API (``base_model``, ``get_output_embeddings``,
``get_input_embeddings``); ``transformers`` is not imported.
"""
from __future__ import annotations

from torch import nn

__all__ = ["UNREPRODUCIBLE", "text_decoder"]


# what a forward does that its structure does not show: class name -> why it is refused
# (transformers 5.24)
UNREPRODUCIBLE = {
    "ProphetNetForCausalLM": (
        "its lm_head reads the decoder's n-gram predicting streams, not its last hidden state, "
        "and its own loss is the n-gram loss with eps smoothing "
        "(transformers/models/prophetnet/modeling_prophetnet.py)"),
}


def text_decoder(model: nn.Module) -> nn.Module:
    """The module of ``model`` whose output's ``last_hidden_state`` its lm_head reads: what a
    loss wrapper runs before its loss head, with the inputs ``model`` itself takes (the image
    inputs of a vision-language model included).

    Read from the model's structure, not from a per-class table: ``model.base_model`` (the
    module named by ``base_model_prefix``: ``model.model`` for Llama, Qwen, Mistral, and for the
    vision-language ``*ForConditionalGeneration`` of transformers >= 4.52 the multimodal base
    model that merges the image features into the embeddings: Qwen2-VL, LLaVA, Gemma 3,
    Idefics3, Mllama, ...); where ``base_model_prefix`` names a module the model does not have
    (``Llama4ForCausalLM``, ``MllamaForCausalLM``: ``"language_model"``), the one child module
    other than the lm_head that has input embeddings (``get_input_embeddings``).

    Raises:
        TypeError: ``model``'s class is in :data:`UNREPRODUCIBLE` (a forward whose loss or
            logits do not come from ``lm_head(last_hidden_state)``: ProphetNet's n-gram
            streams); ``model`` is an encoder-decoder model (``config.is_encoder_decoder``: Bart,
            T5, Whisper...: its lm_head reads the decoder's states, which need the encoder's
            run first; not a causal LM's forward); no such module, or several (named).
    """
    name = type(model).__name__
    if name in UNREPRODUCIBLE:
        raise TypeError(f"{name} is not reproduced by the loss wrappers: {UNREPRODUCIBLE[name]}")
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise TypeError(f"{name} is an encoder-decoder model (config.is_encoder_decoder): the "
                        f"loss wrappers run a decoder-only model's base model then its lm_head; "
                        f"an encoder-decoder forward is not reproduced")
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not model:
        return base
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = [(n, m) for n, m in model.named_children()
             if m is not head and callable(getattr(m, "get_input_embeddings", None))]
    if len(found) == 1:
        return found[0][1]
    prefix = getattr(model, "base_model_prefix", None)
    raise TypeError(f"model must be a *ForCausalLM or *ForConditionalGeneration with a decoder "
                    f"module: {name} has no base model (base_model_prefix={prefix!r}) and "
                    f"{len(found)} child modules with input embeddings "
                    f"({', '.join(n for n, _ in found) or 'none'}), expected one")
