"""Tiny float64 random-init models of every causal-LM and conditional-generation class of the
installed ``transformers`` (the auto mappings ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` and ``MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES``),
no download: each config class's defaults shrunk generically (:func:`shrink`: hidden sizes,
1-2 layers, 4 heads, vocabulary 128, experts, the sub-configs of composite configs, special
token ids moved inside the vocabulary), eager attention and eager experts (transformers 5.24's
grouped-mm experts reject float64), MoE router logits on (``output_router_logits=True``: the
model's own loss adds ``router_aux_loss_coef * aux_loss``, which the wrappers must add too;
``build(name, router_logits=False)`` turns them off), plus :data:`OVERRIDES` where the generic
shrink does not build.

:func:`build` returns the model or raises :class:`NotBuilt` with the reason; :func:`inputs`
returns a padded batch (right padding, ``-100`` labels on the padding and a prompt) and, for the
vision-language families of :data:`IMAGE_INPUTS`, the image inputs their processors would give
(``pixel_values``, ``image_grid_thw``, ...) with the image tokens in ``input_ids`` and ``-100``
as their labels (what the processors' chat templates set).

``python -m tests.helpers.hf_zoo`` prints the markdown outcome table of
``tests/integrations/test_hf_model_zoo.py`` (class | passes / refused: reason / not built:
reason).
"""
from __future__ import annotations

import re
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["NotBuilt", "zoo_classes", "build", "inputs", "shrink", "outcome", "table",
           "OVERRIDES"]

VOCAB = 128
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 8
LAYERS = 2


class NotBuilt(Exception):
    """A class that cannot be built tiny here; ``str()`` is the reason."""


def zoo_classes() -> List[str]:
    """The class names, sorted, of every ``*ForCausalLM`` and conditional-generation model of the
    installed transformers' auto mappings."""
    from transformers.models.auto import modeling_auto as auto

    names = set()
    for mapping in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                    auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                    auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES):
        for value in mapping.values():
            names.update(value if isinstance(value, (tuple, list)) else (value,))
    return sorted(names)


def _model_types() -> Dict[str, str]:
    """class name -> the model_type of the first auto-mapping entry naming it."""
    from transformers.models.auto import modeling_auto as auto

    out: Dict[str, str] = {}
    for mapping in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                    auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                    auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES):
        for model_type, value in mapping.items():
            for name in (value if isinstance(value, (tuple, list)) else (value,)):
                out.setdefault(name, model_type)
    return out


# key -> tiny value; a default already smaller is kept (min), except where marked exact
_SIZES = {
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "n_embed": HIDDEN,
    "embed_dim": HIDDEN, "word_embed_proj_dim": HIDDEN, "model_dim": HIDDEN,
    "intermediate_size": 64, "ffn_dim": 64, "n_inner": 64, "ffn_hidden_size": 64,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "mlp_dim": 64, "hidden_dim": 64,
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "num_layers": LAYERS, "n_layers": LAYERS,
    "num_attention_heads": HEADS, "n_head": HEADS, "num_heads": HEADS, "n_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "n_kv_heads": KV_HEADS, "num_kv_heads": KV_HEADS,
    "head_dim": HEAD_DIM, "attention_head_dim": HEAD_DIM, "kv_channels": HEAD_DIM,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256, "n_positions": 256, "max_seq_len": 256,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "num_shared_experts": 1,
    "moe_topk": 2, "top_k": 2, "moe_k": 2,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 8, "n_group": 1, "topk_group": 1,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
    "num_global_key_value_heads": KV_HEADS, "global_head_dim": HEAD_DIM,
    # state-space / recurrent
    "state_size": 8, "d_state": 8, "mamba_d_state": 8, "ssm_state_size": 8,
    "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_head_dim": 16, "mamba_expand": 2,
    "conv_kernel": 4, "time_step_rank": 8, "n_groups": 1, "mamba_n_groups": 1,
    "lru_width": HIDDEN, "rnn_hidden_size": HIDDEN,
    # vision towers
    "image_size": 32, "patch_size": 8, "num_channels": 3,
    "projection_dim": HIDDEN, "out_hidden_size": HIDDEN, "vision_output_dim": HIDDEN,
    "text_hidden_size": HIDDEN, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "depth": LAYERS, "num_global_layers": 1, "mm_tokens_per_image": 4,
    "rotary_dim": HEAD_DIM,
}
_EXACT = {"num_key_value_heads", "head_dim", "n_group", "topk_group", "vocab_size",
          "hidden_size", "num_attention_heads"}
# other widths, named so: shrunk to 64
_GENERIC_SIZE = re.compile(r"(ffn|intermediate|hidden|_dim$|_dims?_|channels|num_embeddings|"
                           r"expert|hash.*vocab|projector)")
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "depth")
_TOKEN_SUFFIXES = ("_token_id", "_token_index", "_token_ids")


def _shrink_dict(d: Dict[str, Any], role: str) -> Dict[str, Any]:
    old_layers = next((d[k] for k in _LAYER_COUNTS if isinstance(d.get(k), int)), None)
    out: Dict[str, Any] = {}
    for key, value in d.items():
        if key == "per_layer_config" and isinstance(value, dict):
            out[key] = {k: v for k, v in value.items() if int(k) < LAYERS}
            continue
        if isinstance(value, dict) and ("model_type" in value or key.endswith("config")):
            out[key] = _shrink_dict(value, key)
            continue
        if isinstance(value, dict) and "mrope_section" in value:
            out[key] = dict(value, mrope_section=_split(HEAD_DIM // 2, len(value["mrope_section"])))
            continue
        if key == "mrope_section" and isinstance(value, list):
            out[key] = _split(HEAD_DIM // 2, len(value))
            continue
        if key in ("image_size", "patch_size") and isinstance(value, list) and value:
            out[key] = [min(v, _SIZES[key]) for v in value]
            continue
        if key == "depths" and isinstance(value, list):
            out[key] = [1] * len(value)
            continue
        if (key not in _SIZES and "heads" in key and isinstance(value, int)
                and not isinstance(value, bool) and value > HEADS):
            out[key] = HEADS
            continue
        if key in _SIZES and isinstance(value, int) and not isinstance(value, bool):
            tiny = _SIZES[key]
            out[key] = tiny if key in _EXACT else min(value, tiny)
            continue
        if (isinstance(value, int) and not isinstance(value, bool) and value > 64
                and _GENERIC_SIZE.search(key)):
            out[key] = 64
            continue
        if (isinstance(value, list) and old_layers and len(value) == old_layers
                and old_layers > LAYERS):
            out[key] = value[:LAYERS - 1] + value[-1:]  # hybrids: keep the last kind too
            continue
        out[key] = value
    out["initializer_range"] = 0.2 if "initializer_range" in d else out.get("initializer_range")
    if out.get("initializer_range") is None:
        out.pop("initializer_range", None)
    return out


def _split(total: int, parts: int) -> List[int]:
    """``total`` as ``parts`` positive integers, the last ones larger (mrope sections)."""
    base = [max(1, total // parts)] * parts
    base[-1] += total - sum(base)
    return base


def _fix_token_ids(d: Dict[str, Any], vocab: int, taken: Optional[set] = None) -> None:
    taken = set() if taken is None else taken
    for key, value in list(d.items()):
        if not isinstance(key, str):
            continue
        if isinstance(value, dict):
            _fix_token_ids(value, vocab, taken)
        elif key.endswith(_TOKEN_SUFFIXES) and isinstance(value, int) and not isinstance(
                value, bool) and value >= vocab - 8:
            new = vocab - 1
            while new in taken:
                new -= 1
            taken.add(new)
            d[key] = new
        elif key.endswith(_TOKEN_SUFFIXES) and isinstance(value, list):
            d[key] = [v if not isinstance(v, int) or v < vocab - 8 else vocab - 1 - i
                      for i, v in enumerate(value)]


def shrink(config: Any) -> Any:
    """A tiny copy of ``config`` (a ``PretrainedConfig``): its dict shrunk (module docstring)
    and rebuilt through the config class, so that derived fields (``layer_types``, head sizes)
    are recomputed by its ``__init__``."""
    d = _shrink_dict(config.to_dict(), "config")
    _fix_token_ids(d, VOCAB)
    for key in ("transformers_version", "architectures", "_name_or_path"):
        d.pop(key, None)
    return type(config).from_dict(d)


def _set_everywhere(config: Any, name: str, value: Any, seen=None) -> None:
    seen = set() if seen is None else seen
    if id(config) in seen:
        return
    seen.add(id(config))
    if hasattr(config, name):
        try:
            setattr(config, name, value)
        except Exception:
            pass
    for key in list(getattr(config, "sub_configs", {}) or {}):
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            _set_everywhere(sub, name, value, seen)


def _mrope(config: Any) -> None:
    """The multimodal rotary sections, a default of the model code (not of the config) sized
    for 128-wide heads: resized to the tiny text config's rotary half-width."""
    text = config.get_text_config(decoder=True)
    rope = dict(getattr(text, "rope_parameters", None) or {})
    rotary = int(HIDDEN // text.num_attention_heads * rope.get("partial_rotary_factor", 1.0))
    rope["mrope_section"] = _split(rotary // 2, 3)
    text.rope_parameters = rope


# class name -> config overrides (dotted keys reach sub-configs; a callable edits the config)
# where the generic shrink does not build
OVERRIDES: Dict[str, Any] = {name: _mrope for name in (
    "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
    "Glm4vForConditionalGeneration", "Glm46VForConditionalGeneration",
    "GlmOcrForConditionalGeneration", "PaddleOCRVLForConditionalGeneration")}
# Flint's defaults make every layer dense (mlp_only_layers), so its router logits are an empty
# tuple on which its own load_balancing_loss_func fails: one MoE layer
OVERRIDES["FlintForCausalLM"] = {"mlp_only_layers": [0]}
# Doge's default is dense (is_moe=False: its forward never outputs router logits); its
# product-key experts, whose own aux function takes num_keys too
OVERRIDES["DogeForCausalLM"] = {"is_moe": True}


def _apply(config: Any, overrides: Any) -> None:
    if callable(overrides):
        overrides(config)
        return
    for key, value in overrides.items():
        target = config
        *path, leaf = key.split(".")
        for part in path:
            target = getattr(target, part)
        setattr(target, leaf, value)


def model_class(name: str):
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None:
        raise NotBuilt(f"transformers has no attribute {name}")
    return cls


# classes left out of the suite's time budget (the full suite must stay within 15 minutes)
TOO_SLOW = {
    "VibeVoiceAsrForConditionalGeneration":
        "its tiny build and forward take ~10 s (its audio tokenizer's convolution stacks): left "
        "out of the suite's time budget",
}


def build(name: str, seed: int = 0, router_logits: bool = True):
    """The tiny float64 model of class ``name`` (eval mode: dropout off), seeded; an MoE
    model's ``output_router_logits`` set to ``router_logits`` in every (sub-)config.

    Raises:
        NotBuilt: the class cannot be built tiny here (the reason).
    """
    if name in TOO_SLOW:
        raise NotBuilt(TOO_SLOW[name])
    cls = model_class(name)
    config_class = getattr(cls, "config_class", None)
    if config_class is None:
        raise NotBuilt("no config_class")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config = shrink(config_class())
        except Exception as exc:  # noqa: BLE001 - the reason is the outcome
            raise NotBuilt(f"tiny config: {type(exc).__name__}: {_first_line(exc)}") from exc
        _apply(config, OVERRIDES.get(name, {}))
        _set_everywhere(config, "output_router_logits", router_logits)
        _set_everywhere(config, "use_cache", True)
        config._attn_implementation = "eager"
        try:
            config._experts_implementation = "eager"
        except Exception:
            pass
        torch.manual_seed(seed)
        try:
            model = cls(config)
        except Exception as exc:  # noqa: BLE001
            raise NotBuilt(f"{type(exc).__name__}: {_first_line(exc)}") from exc
    return model.double().eval()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else "")[:160]


def _image_token(config) -> Optional[int]:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _pixels(model, n_images: int, g: torch.Generator) -> Dict[str, torch.Tensor]:
    """Image inputs of ``n_images`` images: Qwen-VL-style flattened patches with
    ``image_grid_thw`` (a vision config with ``temporal_patch_size``), else square
    ``pixel_values [n, C, S, S]`` at the vision config's ``image_size``."""
    vision = getattr(model.config, "vision_config", None)
    if vision is None:
        raise NotBuilt("no vision_config")
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
    patch = getattr(vision, "patch_size", 8)
    temporal = getattr(vision, "temporal_patch_size", None)
    if temporal is not None:
        merge = getattr(vision, "spatial_merge_size", 2)
        side = 2 * merge
        grid = torch.tensor([[1, side, side]] * n_images)
        pixels = torch.randn(n_images * side * side, channels * temporal * patch * patch,
                             generator=g, dtype=torch.float64)
        return {"pixel_values": pixels, "image_grid_thw": grid}
    size = getattr(vision, "image_size", 32)
    size = size[0] if isinstance(size, (list, tuple)) else size
    pixels = torch.randn(n_images, channels, size, size, generator=g, dtype=torch.float64)
    return {"pixel_values": pixels}


def _feature_counts(model, extra: Dict[str, torch.Tensor], n_images: int) -> List[int]:
    """How many image tokens each image fills: the model's own ``get_image_features``."""
    base = model.model
    with torch.no_grad():
        out = base.get_image_features(**extra)
    feats = getattr(out, "pooler_output", None)
    if feats is None:
        feats = out[0] if isinstance(out, tuple) and not torch.is_tensor(out[0]) else out
    hidden = model.get_output_embeddings().weight.shape[1]
    if isinstance(feats, (list, tuple)):
        return [f.numel() // hidden for f in feats]
    total = feats.numel() // hidden
    return [total // n_images] * n_images


def _image_batch(model, g: torch.Generator) -> Optional[Tuple[Dict[str, Any], torch.Tensor]]:
    """A batch of two rows with one image each (image tokens at positions 2.., labelled
    -100), or ``None`` when the model's images cannot be built generically here."""
    token = _image_token(model.config)
    if token is None or not hasattr(getattr(model, "model", None), "get_image_features"):
        return None
    try:
        extra = _pixels(model, 2, g)
        counts = _feature_counts(model, extra, 2)
    except Exception:  # noqa: BLE001 - text-only then
        return None
    if len(counts) != 2 or counts[0] != counts[1] or counts[0] < 1:
        return None
    n = counts[0]
    T = n + 10
    ids = torch.randint(3, VOCAB - 10, (2, T), generator=g)
    ids[:, 2:2 + n] = token
    mask = torch.ones_like(ids)
    mask[1, T - 3:] = 0
    labels = ids.clone()
    labels[:, :2 + n] = -100
    labels[mask == 0] = -100
    batch = {"input_ids": ids, "attention_mask": mask, **extra}
    names = _forward_names(model)
    for key in ("token_type_ids", "mm_token_type_ids"):  # 1: image token (Gemma 3, Qwen-VL)
        if key in names:
            batch[key] = (ids == token).long()
    return batch, labels


def _forward_names(model) -> set:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def inputs(model, seed: int = 1) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """``(batch, labels)``: ``batch`` the model's inputs (``input_ids [2, T]``, right-padded
    ``attention_mask``; for a vision-language model whose ``get_image_features`` takes the
    generic pixels of :func:`_pixels`, one image per row, its tokens in ``input_ids`` and the
    image inputs), ``labels`` with ``-100`` on the padding, a prompt and the image tokens (as
    the processors' chat templates set them)."""
    g = torch.Generator().manual_seed(seed)
    image = _image_batch(model, g)
    if image is not None:
        return image
    ids = torch.randint(3, VOCAB - 10, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.clone()
    labels[0, :3] = -100
    labels[mask == 0] = -100
    batch = {"input_ids": ids, "attention_mask": mask}
    return batch, labels


def _loss64(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
            shift_labels=None, **kwargs):
    """transformers 5.24's ``ForCausalLMLoss`` (``transformers/loss/loss_utils.py``) without its
    ``logits.float()``: the model's own loss in the model's float64, so that it is compared at
    float64 rounding (the model's forward, its label handling and logit transforms unchanged)."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return torch.nn.functional.cross_entropy(logits, shift_labels, ignore_index=ignore_index)
    loss = torch.nn.functional.cross_entropy(logits, shift_labels, ignore_index=ignore_index,
                                             reduction="sum")
    return loss / num_items_in_batch


TOL = 1e-10       # float64 against float64
TOL_FP32 = 2e-5   # a forward that casts its logits to float32 (state-space models)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    a, b = a.double(), b.double()
    return a.shape == b.shape and bool(
        ((a - b).abs() <= tol * (1 + b.abs())).all())


def extra_inputs(batch: Dict[str, Any]) -> Dict[str, Any]:
    """The inputs of ``batch`` besides ``input_ids`` and ``attention_mask`` (image inputs)."""
    return {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}


def _wrapper_loss(wrapper, batch, labels):
    """The wrapper's loss on ``batch``: its forward when it takes the extra (image) inputs,
    else (a forward without ``**kwargs``) its decoder and loss head, as its forward runs them."""
    import inspect

    from megaloss import causal_shift

    extra = extra_inputs(batch)
    takes_kwargs = any(p.kind is p.VAR_KEYWORD
                       for p in inspect.signature(wrapper.forward).parameters.values())
    if not extra or takes_kwargs:
        return wrapper(labels=labels, **batch).loss
    out = wrapper.decoder(**batch, use_cache=False)
    return wrapper.head(out.last_hidden_state, causal_shift(labels)).loss


def outcome(name: str) -> Tuple[str, str]:
    """``(kind, detail)`` of class ``name`` under ``CausalLMWithLoss``: ``("passes", note)``
    (loss, every parameter gradient, logits and greedy ``generate`` equal the model's own),
    ``("refused", reason)`` (the wrapper raised a ValueError / TypeError), ``("not built",
    reason)`` (no tiny model, or its own forward fails), ``("mismatch", what)``."""
    import copy

    from megaloss import CrossEntropyOptions
    from megaloss.integrations.hf import CausalLMWithLoss

    try:
        ref = build(name)
    except NotBuilt as exc:
        return "not built", str(exc)
    model = copy.deepcopy(ref)
    batch, labels = inputs(ref)
    ref.loss_function = _loss64
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            wrapper = CausalLMWithLoss(model, options=CrossEntropyOptions(
                reduction="mean", accum_dtype=torch.float64))
            refusal = None
        except (TypeError, ValueError) as exc:
            refusal = _first_line(exc)
        # the wrapper's logit-transform probe runs the model's forward too: a model whose own
        # forward fails on these inputs is "not built", not refused by that probe
        probe_failed = refusal is not None and (refusal.startswith("could not verify")
                                                or "a probe forward of" in refusal)
        if refusal is not None and not probe_failed:
            return "refused", refusal
        try:
            out = ref(**batch, labels=labels, use_cache=False)
            own = out.loss
            if own is None:
                return "not built", "its forward returns no loss"
            own.backward()
        except Exception as exc:  # noqa: BLE001
            return "not built", f"own forward fails: {type(exc).__name__}: {_first_line(exc)}"
        if probe_failed:
            return "refused", refusal
        tol = TOL_FP32 if out.logits.dtype != torch.float64 else TOL
        notes = []
        if "pixel_values" in batch:
            notes.append(f"with images ({int((labels[0] == -100).sum()) - 2} tokens each)")
        if tol != TOL:
            notes.append(f"float32 logits in its forward: tol {TOL_FP32:g}")
        try:
            loss = _wrapper_loss(wrapper, batch, labels)
            loss.backward()
        except Exception as exc:  # noqa: BLE001
            return "mismatch", f"wrapper fails: {type(exc).__name__}: {_first_line(exc)}"
        if not wrapper.logit_transform.shifts_labels:
            # the decoder halves of encoder-decoder families (BartForCausalLM, ...): their own
            # loss takes labels already shifted, and so does the wrapper for them
            notes.append("its own loss does not shift labels: nor does the wrapper's")
        if not _close(loss, own.detach(), tol):
            return "mismatch", f"loss {float(loss):.12g} != own {float(own):.12g}"
        got = dict(wrapper.model.named_parameters())
        for pname, p in ref.named_parameters():
            q = got.get(pname)
            if q is None:
                return "mismatch", f"parameter {pname} missing in the wrapped model"
            a = torch.zeros_like(p) if p.grad is None else p.grad
            b = torch.zeros_like(q) if q.grad is None else q.grad
            if not _close(b, a, tol):
                return "mismatch", f"gradient of {pname}: max diff {float((a - b).abs().max()):.3g}"
        with torch.no_grad():
            logits = wrapper.model(**batch, use_cache=False).logits
            if not _close(logits, out.logits, tol):
                return "mismatch", "logits without labels differ"
            cut = 2 if "pixel_values" in batch else 6  # the text before the image tokens
            prompt = {"input_ids": batch["input_ids"][:1, :cut],
                      "attention_mask": batch["attention_mask"][:1, :cut]}
            gen = dict(max_new_tokens=3, do_sample=False, min_new_tokens=3)
            try:
                want = ref.generate(**prompt, **gen)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"generate not compared (own generate fails: "
                             f"{type(exc).__name__}: {_first_line(exc)[:60]})")
                return "passes", "; ".join(notes)
            have = wrapper.model.generate(**prompt, **gen)
            if not torch.equal(want, have):
                return "mismatch", "generate differs"
    return "passes", "; ".join(notes)


def table(names: Optional[List[str]] = None) -> str:
    """The markdown table ``class | outcome`` of :func:`outcome` over ``names`` (default: every
    :func:`zoo_classes`)."""
    rows = ["| class | outcome |", "|---|---|"]
    for name in names or zoo_classes():
        kind, detail = outcome(name)
        text = kind if not detail else f"{kind}: {detail}"
        rows.append(f"| {name} | {text.replace('|', '/')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    print(table(sys.argv[1:] or None))
