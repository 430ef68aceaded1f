"""DeepSpeed-Ulysses sequence parallelism for Hugging Face models, over a Topology's ``sp`` group.

Each rank of an SP group holds a contiguous slice of every sample's tokens (the inputs cut as
:func:`megaloss.calibration.weights.split_for_sequence_parallel` cuts the labels). Attention needs
the whole sequence: DeepSpeed's ``UlyssesSPAttentionHF``
(``deepspeed/runtime/sequence_parallel/ulysses_sp.py``, DeepSpeed 0.19; Jacobs et al. 2023,
arXiv:2309.14509, and the Arctic Long Sequence Training recipe, arXiv:2506.13996) all-to-alls the
query/key/value heads so that each rank attends over the full sequence for ``heads / sp`` heads,
then all-to-alls back. Everything else (MLP, norms, the lm_head and megaloss's loss) runs on the
rank's token slice.

DeepSpeed's own ``UlyssesSPAttentionHF.register_with_transformers`` builds its SP groups itself
from consecutive ranks (``parallel_state_sp.py``) and aliases model parallelism to SP, so it
cannot be combined with a tensor-parallel group. :func:`enable_ulysses_attention` does what that
registration does — the same attention module, the same "replace the core attention function of
``transformers``" hook — with the topology's own SP group, so ``dp x sp x tp`` layouts work.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ...parallel.topology import Topology

__all__ = ["enable_ulysses_attention"]


def enable_ulysses_attention(model: Any, topology: Topology, *, micro_batch_size: int,
                             attn_implementation: str = "sdpa",
                             teacher: Any = None) -> Callable[[], None]:
    """Route ``model``'s attention through DeepSpeed's Ulysses all-to-all over
    ``topology.sp_group``. Collective over the SP group at every attention call.

    Args:
        model: a ``transformers`` ``PreTrainedModel`` (or a wrapper with ``.config``) loaded with
            ``attn_implementation=attn_implementation``.
        topology: the process groups; nothing happens when ``topology.sp_size == 1``.
        micro_batch_size: rows per micro-batch (Ulysses checks the shapes it exchanges; a
            batch with other rows, e.g. for evaluation, is followed).
        attn_implementation: the core attention ``transformers`` runs after the all-to-all
            (``"sdpa"`` on CPU; flash-attention variants on GPU). ``"eager"`` is refused by
            DeepSpeed (it needs a 4D mask).
        teacher: a frozen distillation teacher (``transformers`` model) run on the same token
            slices (:class:`~megaloss.integrations.hf.distillation.CausalLMWithDistillation`):
            its attention goes through the same hook (an all-to-all per attention call, under
            ``no_grad``), with its own head geometry; checked like ``model`` and marked for
            :func:`megaloss.integrations.deepspeed.train_step`, which refuses an unmarked
            teacher under sequence parallelism.

    Returns:
        A function that restores ``transformers``' original attention function (the hook is
        process-global, as DeepSpeed's is).

    Raises:
        ValueError: the model's (or teacher's) attention implementation differs from
            ``attn_implementation``, or its head counts are not divisible as Ulysses needs
            (``heads % sp``).
    """
    if topology.sp_size == 1:
        return lambda: None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sp = topology.sp_size
    text = _checked_text_config(model, "model", attn_implementation, sp)
    if teacher is not None:
        teacher_text = _checked_text_config(teacher, "teacher", attn_implementation, sp)
    original = ALL_ATTENTION_FUNCTIONS[attn_implementation]
    # one Ulysses module per head geometry (q heads, kv heads, head size): a student and a
    # teacher of other shapes exchange their own heads
    modules = {}

    def ulysses_for(heads: int, kv_heads: int, head_size: int, layers: int):
        uattn = modules.get((heads, kv_heads, head_size))
        if uattn is None:
            uattn = UlyssesSPAttentionHF(
                attn=original, batch_size=micro_batch_size, attn_head_count=heads,
                attn_head_size=head_size, kv_head_count=kv_heads, num_hidden_layers=layers,
                process_group=topology.sp_group, seq_length_is_variable=True)
            uattn.core_attn_implementation = attn_implementation
            modules[(heads, kv_heads, head_size)] = uattn
        return uattn

    configs = [text] + ([teacher_text] if teacher is not None else [])
    for c in configs:
        ulysses_for(*_geometry(c))

    def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
        # HF hands [B, heads, T_local, head_size]: pick the module of this geometry
        uattn = ulysses_for(query.shape[1], key.shape[1], query.shape[-1],
                            text.num_hidden_layers)
        # UlyssesSPAttentionHF checks every exchanged shape against a batch size fixed at
        # construction (its sequence length follows the input when seq_length_is_variable);
        # an evaluation batch or a last partial batch has fewer rows, so follow the input here.
        rows = query.shape[0]
        if rows != uattn.batch_size:
            uattn.batch_size = rows
            for name in ("required_query_shape", "required_key_value_shape",
                         "required_context_shape"):
                shape = list(getattr(uattn, name))
                shape[1] = rows
                setattr(uattn, name, torch.Size(shape))
        # The mask transformers builds covers the local slice only; Ulysses attends over the
        # gathered sequence with causal masking from the gathered position_ids instead.
        return uattn(module, query, key, value, None, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[attn_implementation] = ulysses_attention
    if teacher is not None:
        teacher._megaloss_ulysses_sp = sp  # read by the DeepSpeed train_step's check

    def restore() -> None:
        ALL_ATTENTION_FUNCTIONS[attn_implementation] = original
        if teacher is not None:
            teacher.__dict__.pop("_megaloss_ulysses_sp", None)

    return restore


def _checked_text_config(model: Any, name: str, attn_implementation: str, sp: int) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{name} must be a transformers model with a .config")
    actual = getattr(config, "_attn_implementation", None)
    if actual is not None and actual != attn_implementation:
        raise ValueError(f"the {name} runs attn_implementation={actual!r} but "
                         f"attn_implementation={attn_implementation!r} was asked for; load the "
                         f"{name} with the same value")
    text = config.get_text_config()
    heads = text.num_attention_heads
    if heads % sp:
        raise ValueError(f"num_attention_heads={heads} of the {name} must be divisible by "
                         f"sp={sp} (Ulysses gives each SP rank heads / sp heads)")
    return text


def _geometry(text: Any):
    heads = text.num_attention_heads
    return (heads, text.num_key_value_heads,
            getattr(text, "head_dim", None) or text.hidden_size // heads, text.num_hidden_layers)
