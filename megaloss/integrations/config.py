"""The ``"megaloss"`` section of a DeepSpeed ``ds_config`` JSON, validated with pydantic v2.

DeepSpeed keeps unknown top-level keys (``engine._config._param_dict["megaloss"]``), so one JSON
file drives both the engine and megaloss::

    {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
     "megaloss": {"tensor_parallel_size": 2,
                  "ce": {"chunk_size": 1024, "z_loss": 1e-4, "label_smoothing": 0.0,
                         "logit_softcapping": null, "accum_dtype": "float32", "impl": "auto",
                         "loss_reduction": "token"},
                  "mnr": {"temperature": 0.05, "symmetric": true}}}

The ``ce`` and ``mnr`` sections are built from the options dataclasses
(:class:`~megaloss.CrossEntropyOptions`, :class:`~megaloss.MNROptions`):
every option is settable here, with the dataclass's defaults, bounds and messages. A
``distillation`` section (:class:`DistillationConfig`, from
:class:`~megaloss.DistillationOptions`) selects the distillation loss instead of the
cross-entropy: ``"distillation": {"kind": "jsd", "beta": 0.5, "temperature": 2.0,
"loss_reduction": "token"}``; the ``ce`` section must then be left out (its keys would have no
effect).

Every model forbids unknown keys, so a typo (``"chunksize"``) is an error instead of a silently
ignored option. Errors are re-raised as :class:`ValueError` whose message names the full key path
(``megaloss.ce.chunk_size: Input should be greater than 0``).

DeepSpeed keeps *any* unknown top-level key, so a misspelled section name would run silently with
defaults. :func:`check_top_level_keys` (called by :func:`load_megaloss_config`) compares every
top-level key with DeepSpeed's and megaloss's own (``difflib``): a key close to ``"megaloss"``
(``"megalos"``, ``"mega_loss"``) is an error, one close to a DeepSpeed key
(``"gradient_clippin"``) a warning naming that key; keys close to none are left alone (a
ds_config may carry keys of its own).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import typing
import warnings
from typing import Any, ClassVar, Dict, Literal, Mapping, Optional, Union

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..calibration.deepspeed_scale import ds_config_autotp_size
from ..losses.dpo import DPO_LOSS_TYPES, DPOOptions
from ..losses.kto import KTOOptions
from ..losses.mnr import MNROptions
from ..losses.orpo import ORPOOptions
from ..losses.policy_options import PolicyLossOptions
from ..losses.router_options import RouterLossOptions
from ..losses.simpo import CPOOptions
from ..ops.cross_entropy_options import CrossEntropyOptions
from ..ops.distillation_options import DistillationOptions

__all__ = ["CEConfig", "MNRConfig", "PolicyConfig", "DPOConfig", "CPOConfig", "SimPOConfig",
           "ORPOConfig", "KTOConfig", "PREFERENCE_SECTIONS", "DistillationConfig",
           "MegalossConfig",
           "load_megaloss_config", "SECTION", "DEEPSPEED_TOP_LEVEL_KEYS", "check_top_level_keys"]

SECTION = "megaloss"

# The top-level keys DeepSpeed 0.19.8 reads (recorded from ``DeepSpeedConfig`` reading a config,
# plus the sections other components read: flops profiler, activation checkpointing, autotuning,
# aio). A key outside this set and not close to one of them is left alone.
DEEPSPEED_TOP_LEVEL_KEYS = frozenset({
    "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "bfloat16", "checkpoint",
    "comet", "comms_logger", "communication_data_type", "compile", "compression_training",
    "csv_monitor", "curriculum_learning", "data_efficiency", "data_types",
    "dataloader_drop_last", "datastates_ckpt", "disable_allgather", "disable_python_gc",
    "dump_state", "eigenvalue", "elasticity", "expert_parallel", "flops_profiler", "fp16",
    "gradient_accumulation_steps", "gradient_allreduce_op", "gradient_clipping",
    "gradient_predivide_factor", "graph_harvesting", "hybrid_engine", "log_level",
    "managed_gradient_accumulation", "memory_breakdown", "nebula", "optimizer", "pipeline",
    "prescale_gradients", "progressive_layer_drop", "quantize_training", "scheduler",
    "seq_parallel_communication_data_type", "sequence_parallel_size", "sparse_attention",
    "sparse_gradients", "steps_per_print", "tensor_parallel", "tensorboard", "timers",
    "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu",
    "use_data_before_expert_parallelism", "vocabulary_size", "wall_clock_breakdown", "wandb",
    "weight_quantization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "zero_optimization",
})


def _closest(key: str, known) -> Optional[str]:
    norm = {k.lower(): k for k in known}
    match = difflib.get_close_matches(key.strip().lower(), list(norm), n=1, cutoff=0.8)
    return norm[match[0]] if match else None


def check_top_level_keys(ds_config: Mapping[str, Any]) -> None:
    """Catch misspelled top-level ds_config keys, which DeepSpeed keeps without a word.

    Raises:
        ValueError: a key that is not ``"megaloss"`` but close to it (``"megalos"``): the run
            would otherwise use megaloss's defaults (TP=1, no z-loss) silently.

    Warns:
        UserWarning: a key that DeepSpeed does not read but that is close to one it does, naming
            that key (``"gradient_clippin"``: did you mean ``"gradient_clipping"``?).
    """
    for key in ds_config:
        if not isinstance(key, str) or key == SECTION or key in DEEPSPEED_TOP_LEVEL_KEYS:
            continue
        if _closest(key, [SECTION]) is not None:
            raise ValueError(f"ds_config key {key!r} is not a known key; did you mean {SECTION!r}? "
                             f"(DeepSpeed ignores unknown keys, so the {SECTION!r} section's "
                             "defaults would be used: TP=1, no z-loss)")
        near = _closest(key, DEEPSPEED_TOP_LEVEL_KEYS)
        if near is not None:
            warnings.warn(f"ds_config key {key!r} is not read by DeepSpeed or megaloss; did you "
                          f"mean {near!r}? (DeepSpeed ignores unknown keys)", UserWarning,
                          stacklevel=3)


class _Strict(BaseModel):
    # extra="forbid": unknown keys are errors; validate_assignment keeps later edits checked too.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _option_value(name: str, value: Any) -> Any:
    """A ds_config (JSON) value as the dataclass field takes it: dtype names become dtypes."""
    if name != "accum_dtype":
        return value
    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"accum_dtype must be the name of a floating torch dtype ('float32', "
                         f"'bfloat16', 'float64', ...), got {value!r}")
    return dtype


def _config_fields(options_cls: type, skip: tuple = ()) -> Dict[str, Any]:
    """``{name: (type, default)}`` of a pydantic model mirroring the options dataclass's fields
    (dtypes by name, as JSON spells them)."""
    hints = typing.get_type_hints(options_cls)
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(options_cls):
        if f.name in skip:
            continue
        if hints[f.name] is torch.dtype:
            out[f.name] = (str, _dtype_name(f.default))
        else:
            out[f.name] = (hints[f.name], f.default)
    return out


class _OptionsSection(_Strict):
    """A section whose fields are those of an options dataclass (``_options_cls``), validated by
    the dataclass itself (one bound and one message per option; the error names the key)."""

    _options_cls: ClassVar[type]

    @field_validator("*", mode="before")
    @classmethod
    def _validated_by_the_dataclass(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        if name not in {f.name for f in dataclasses.fields(cls._options_cls)}:
            return value
        try:
            checked = getattr(cls._options_cls(**{name: _option_value(name, value)}), name)
        except (ValueError, TypeError) as err:
            raise PydanticCustomError("megaloss_option", str(err)) from None
        return _dtype_name(checked) if isinstance(checked, torch.dtype) else checked

    def _option_fields(self) -> Dict[str, Any]:
        names = {f.name for f in dataclasses.fields(self._options_cls)}
        return {k: _option_value(k, v) for k, v in self.model_dump().items() if k in names}

    def _summed_options(self, ignore_index: Optional[int]) -> Any:
        """The options of a calibrated step's call: ``reduction="sum"`` (the calibration weights
        the tokens), ``ignore_index`` (when given) overriding the section's."""
        fields = self._option_fields()
        if ignore_index is not None:
            fields["ignore_index"] = ignore_index
        return self._options_cls(reduction="sum", **fields)


class _CESection(_OptionsSection):
    _options_cls: ClassVar[type] = CrossEntropyOptions

    loss_reduction: Literal["token", "sample", "square"] = "token"

    @model_validator(mode="before")
    @classmethod
    def _renamed_reduction(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "reduction" in data:
            raise ValueError("'reduction' is now 'loss_reduction' (XTuner's name; 'reduction' "
                             "means mean/sum/none in torch's losses)")
        return data

    def options(self, ignore_index: Optional[int] = None) -> CrossEntropyOptions:
        """The per-call CE options (``reduction="sum"``: the calibration weights the tokens);
        ``ignore_index`` overrides the section's."""
        return self._summed_options(ignore_index)


CEConfig = create_model(
    "CEConfig", __base__=_CESection, __module__=__name__,
    __doc__="""Options of the causal-LM cross-entropy (chunked or vocab-parallel linear CE).

    Fields: every field of :class:`~megaloss.CrossEntropyOptions` (``ignore_index``,
    ``label_smoothing``, ``z_loss``, ``logit_softcapping``, ``chunk_size``, ``accum_dtype`` by
    name as ``"float32"`` / ``"bfloat16"`` / ``"float64"``, ``impl``; same defaults, validated
    by the dataclass, so the bounds and messages are its own) except ``reduction``, which the
    calibration fixes to ``"sum"``; plus

    Attributes:
        loss_reduction: global loss calibration across DP x SP x gradient accumulation
            (XTuner v1's ``loss_reduction``, :mod:`megaloss.calibration.weights`): ``"token"``
            (global token mean), ``"sample"`` (mean of per-sample means) or ``"square"``
            (weights ``1/sqrt(n_s)``).

    :meth:`options` gives the :class:`~megaloss.CrossEntropyOptions` of a call.
    """,
    **_config_fields(CrossEntropyOptions, skip=("reduction",)))


class _MNRSection(_OptionsSection):
    _options_cls: ClassVar[type] = MNROptions

    mini_batch_size: Optional[int] = Field(None, ge=1, strict=True)

    def options(self) -> MNROptions:
        """The :class:`~megaloss.MNROptions` of the loss."""
        return MNROptions(**self._option_fields())


MNRConfig = create_model(
    "MNRConfig", __base__=_MNRSection, __module__=__name__,
    __doc__="""Options of the gathered multiple-negatives-ranking (InfoNCE) loss of the embedding
    job.

    Fields: every field of :class:`~megaloss.MNROptions` (``temperature``,
    ``similarity``, ``symmetric``, ``gather_across_ranks``, ``local_loss``, ``chunk_size``; same
    defaults, validated by the dataclass); plus

    Attributes:
        mini_batch_size: GradCache (Gao et al. 2021, arXiv:2101.06983): encode this many rows at
            a time, same loss and gradients, encoder activation memory of one mini-batch
            (``None``: the whole micro-batch in one graph).

    :meth:`options` gives the :class:`~megaloss.MNROptions` of the loss.
    """,
    **_config_fields(MNROptions))


class _CheckedWhole(_OptionsSection):
    """A section whose options depend on each other: after its keys, the dataclass checks the
    section as a whole (its ``ValueError`` / ``TypeError`` becomes the section's error)."""

    @model_validator(mode="after")
    def _validated_whole(self) -> "_CheckedWhole":
        try:
            self.options()
        except (ValueError, TypeError) as err:
            raise PydanticCustomError("megaloss_option", str(err)) from None
        return self

    def options(self) -> Any:
        """The section's options: its ``_options_cls`` dataclass built from its keys."""
        return self._options_cls(**self._option_fields())


def _section(name: str, doc: str, options_cls: type, base: type = _CheckedWhole,
             skip: tuple = (), **fields: Any) -> type:
    """The section model ``name``: every field of ``options_cls`` (but ``skip``; ``fields``
    override or add), checked as ``base`` checks (by default key by key, then the dataclass on
    the whole section)."""
    if getattr(base, "_options_cls", None) is not options_cls:
        base = type(f"_{name}Section", (base,), {
            "__annotations__": {"_options_cls": ClassVar[type]}, "_options_cls": options_cls,
            "__module__": __name__})
    return create_model(name, __base__=base, __module__=__name__, __doc__=doc,
                        **{**_config_fields(options_cls, skip=skip), **fields})


class _PolicySection(_CheckedWhole):
    _options_cls: ClassVar[type] = PolicyLossOptions

    # The policy options depend on each other (dr_grpo needs max_completion_length, delta is
    # bounded by epsilon_high), so the dataclass checks the whole section, not field by field.
    @field_validator("*", mode="before")
    @classmethod
    def _validated_by_the_dataclass(cls, value: Any, info: ValidationInfo) -> Any:
        return value


PolicyConfig = _section(
    "PolicyConfig", """Options of the policy-gradient loss (:func:`megaloss.policy_loss`, trained by
    :func:`megaloss.integrations.deepspeed.policy_train_step`).

    Fields: every field of :class:`~megaloss.PolicyLossOptions` (``loss_type``
    ``"grpo"`` / ``"bnpo"`` / ``"dapo"`` / ``"dr_grpo"`` / ``"cispo"`` / ``"sapo"`` /
    ``"luspo"`` / ``"vespo"``, ``epsilon_low``, ``epsilon_high``, ``delta``, ``beta``,
    ``entropy_coef``, ``importance_sampling_level``, ``max_completion_length``,
    ``count_empty_rows``, ``kl_estimator``, ``cispo_two_sided``, ``sapo_temperature_pos`` /
    ``_neg``, ``vespo_k_pos`` / ``vespo_lambda_pos`` / ``vespo_k_neg`` / ``vespo_lambda_neg``,
    ``loss_agg_mode``; same defaults, validated together by the dataclass).

    :meth:`options` gives the :class:`~megaloss.PolicyLossOptions`.
    """,
    PolicyLossOptions, _PolicySection)


class _DPOSection(_CheckedWhole):
    _options_cls: ClassVar[type] = DPOOptions

    # label_smoothing's range depends on loss_type (robust: [0, 0.5); exo_pair: (0, 1)): each key
    # is checked alone (the error names it; loss_type only against the list, its pairing with
    # label_smoothing being the section's), then the dataclass checks the whole section.
    @field_validator("*", mode="before")
    @classmethod
    def _validated_by_the_dataclass(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name == "loss_type":
            if not isinstance(value, str) or value not in DPO_LOSS_TYPES:
                raise PydanticCustomError(
                    "megaloss_option", f"loss_type must be one of {DPO_LOSS_TYPES}, got {value!r}")
            return value
        return super()._validated_by_the_dataclass(value, info)


DPOConfig = _section(
    "DPOConfig", """Options of the preference loss (:func:`megaloss.dpo_loss`, trained by
    :func:`megaloss.integrations.deepspeed.dpo_train_step`).

    Fields: every field of :class:`~megaloss.DPOOptions` (``loss_type``, one of
    :data:`~megaloss.losses.dpo.DPO_LOSS_TYPES`, ``beta``, ``label_smoothing``,
    ``discopop_tau``; same defaults, validated by the dataclass, key by key and then together).

    :meth:`options` gives the :class:`~megaloss.DPOOptions`.
    """,
    DPOOptions, _DPOSection)


CPOConfig = _section(
    "CPOConfig", """Options of CPO (:func:`megaloss.losses.cpo_loss`, Xu et al. 2024,
    arXiv:2401.08417; trained by
    :func:`megaloss.integrations.deepspeed.preference_train_step`).

    Fields: every field of :class:`~megaloss.losses.CPOOptions` (``loss_type``, one of
    ``"sigmoid"`` / ``"hinge"`` / ``"ipo"`` / ``"simpo"``, ``beta``, ``label_smoothing``,
    ``cpo_alpha``, ``simpo_gamma``; TRL 1.16's ``CPOConfig`` names and defaults, validated by
    the dataclass, key by key and then together).

    :meth:`options` gives the :class:`~megaloss.losses.CPOOptions`.
    """,
    CPOOptions)


class _SimPOSection(_CheckedWhole):
    _options_cls: ClassVar[type] = CPOOptions

    def options(self) -> CPOOptions:
        """The :class:`~megaloss.losses.CPOOptions` of the loss (``loss_type="simpo"``)."""
        return CPOOptions(loss_type="simpo", **self._option_fields())


SimPOConfig = _section(
    "SimPOConfig", """Options of SimPO (:func:`megaloss.losses.simpo_loss`, Meng et al. 2024,
    arXiv:2405.14734: :func:`megaloss.losses.cpo_loss` with ``loss_type="simpo"``; trained by
    :func:`megaloss.integrations.deepspeed.preference_train_step`).

    Fields: the fields of :class:`~megaloss.losses.CPOOptions` but ``loss_type`` (``beta``,
    ``label_smoothing``, ``simpo_gamma``, and ``cpo_alpha`` defaulting to 0 as in
    :func:`~megaloss.losses.simpo_loss`: pure SimPO, no NLL term; > 0 is CPO-SimPO).

    :meth:`options` gives the :class:`~megaloss.losses.CPOOptions`.
    """,
    CPOOptions, _SimPOSection, skip=("loss_type",), cpo_alpha=(float, 0.0))


ORPOConfig = _section(
    "ORPOConfig", """Options of ORPO (:func:`megaloss.losses.orpo_loss`, Hong et al. 2024,
    arXiv:2403.07691; trained by
    :func:`megaloss.integrations.deepspeed.preference_train_step`).

    Fields: every field of :class:`~megaloss.losses.ORPOOptions` (``beta``, the paper's
    ``lambda``; validated by the dataclass).

    :meth:`options` gives the :class:`~megaloss.losses.ORPOOptions`.
    """,
    ORPOOptions)


KTOConfig = _section(
    "KTOConfig", """Options of KTO (:func:`megaloss.losses.kto_loss`, Ethayarajh et al. 2024,
    arXiv:2402.01306; trained by
    :func:`megaloss.integrations.deepspeed.preference_train_step`).

    Fields: every field of :class:`~megaloss.losses.KTOOptions` (``loss_type``, ``"kto"`` or
    ``"apo_zero_unpaired"``, ``beta``, ``desirable_weight``, ``undesirable_weight``; TRL 1.16's
    ``KTOConfig`` names and defaults, validated by the dataclass).

    :meth:`options` gives the :class:`~megaloss.losses.KTOOptions`.
    """,
    KTOOptions)

RouterConfig = _section(
    "RouterConfig", """The router losses of a mixture-of-experts model
    (:mod:`megaloss.losses.router`), trained by
    :func:`megaloss.integrations.deepspeed.train_step`,
    :func:`~megaloss.integrations.deepspeed.policy_train_step` and
    :func:`~megaloss.integrations.deepspeed.preference_train_step` (the module's forward takes
    ``router_loss=``: :class:`~megaloss.integrations.hf.CausalLMWithLoss`,
    :class:`~megaloss.integrations.hf.CausalLMWithLogProbs`).

    Fields: every field of :class:`~megaloss.losses.router_options.RouterLossOptions`
    (``aux_loss``, ``seq_aux_loss``, ``z_loss`` coefficients; ``scope``: ``"micro_batch"``,
    ``"global"`` or ``"step"``; ``layers``: ``"per_layer"`` or ``"concatenated"``).

    :meth:`options` gives the :class:`~megaloss.losses.router_options.RouterLossOptions`.
    """,
    RouterLossOptions)

# the preference sections, each trained by preference_train_step (at most one in a ds_config)
PREFERENCE_SECTIONS = ("dpo", "cpo", "simpo", "orpo", "kto")


class _DistillationSection(_OptionsSection):
    _options_cls: ClassVar[type] = DistillationOptions

    loss_reduction: Literal["token", "sample", "square"] = "token"

    def options(self, ignore_index: Optional[int] = None) -> DistillationOptions:
        """The per-call distillation options (``reduction="sum"``: the calibration weights the
        tokens); ``ignore_index`` overrides the section's."""
        return self._summed_options(ignore_index)


DistillationConfig = create_model(
    "DistillationConfig", __base__=_DistillationSection, __module__=__name__,
    __doc__="""Options of the linear distillation loss (:func:`megaloss.linear_distillation_loss`);
    its presence in the ``"megaloss"`` section selects distillation instead of the
    cross-entropy.

    Fields: every field of :class:`~megaloss.DistillationOptions` (``kind``,
    ``beta``, ``temperature``, ``temperature_squared``, ``alpha``, ``ignore_index``,
    ``logit_softcapping``, ``teacher_logit_softcapping``, ``chunk_size``, ``accum_dtype`` by
    name; same defaults, validated by the dataclass) except ``reduction``, which the calibration
    fixes to ``"sum"``; plus

    Attributes:
        loss_reduction: the global calibration across DP x SP x gradient accumulation, as in
            :class:`CEConfig`: ``"token"``, ``"sample"`` or ``"square"``.

    :meth:`options` gives the :class:`~megaloss.DistillationOptions` of a call.
    """,
    **_config_fields(DistillationOptions, skip=("reduction",)))


class MegalossConfig(_Strict):
    """The whole ``"megaloss"`` section.

    Attributes:
        tensor_parallel_size: ranks sharing one model replica (vocab-parallel lm_head); must
            divide the world size. 1 disables tensor parallelism.
        sequence_parallel_size: DeepSpeed-Ulysses sequence parallelism: ranks holding slices
            of the same samples (attention through DeepSpeed's ``UlyssesSPAttentionHF``, the
            calibration counting split samples whole). ``tp * sp`` must divide the world size.
            Not Megatron's ``sequence_parallel`` flag inside the TP group.
        pipeline_parallel_size: stages of DeepSpeed's pipeline engine (``PipelineModule``);
            > 1 needs :func:`~megaloss.integrations.deepspeed.pipeline.initialize_pipeline`
            (ZeRO 0 or 1, no sequence parallelism). ``pp * tp`` must divide the world size.
        ce: :class:`CEConfig`.
        mnr: :class:`MNRConfig`.
        policy: :class:`PolicyConfig` (the policy-gradient losses).
        dpo: :class:`DPOConfig` (DPO, IPO and TRL's other pairwise loss types).
        cpo, simpo, orpo, kto: :class:`CPOConfig`, :class:`SimPOConfig`, :class:`ORPOConfig`,
            :class:`KTOConfig`: the other preference losses. At most one of the preference
            sections (:data:`PREFERENCE_SECTIONS`) may be given: it is the loss
            :func:`~megaloss.integrations.deepspeed.preference_train_step` trains by default
            (:meth:`preference_options`).
        distillation: :class:`DistillationConfig`, or ``None`` (default): the causal-LM loss
            is the cross-entropy. Given, the loss is the distillation loss and ``ce`` must not
            be given (refused: its keys would be ignored).
        router: :class:`RouterConfig`, or ``None`` (default): no router losses beyond what the
            module computes itself. Given, :func:`~megaloss.integrations.deepspeed.train_step`
            adds the calibrated router losses of a mixture-of-experts module, as do the
            policy and preference steps.
    """

    tensor_parallel_size: int = Field(1, ge=1, strict=True)
    sequence_parallel_size: int = Field(1, ge=1, strict=True)
    pipeline_parallel_size: int = Field(1, ge=1, strict=True)
    ce: CEConfig = Field(default_factory=CEConfig)
    mnr: MNRConfig = Field(default_factory=MNRConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    cpo: CPOConfig = Field(default_factory=CPOConfig)
    simpo: SimPOConfig = Field(default_factory=SimPOConfig)
    orpo: ORPOConfig = Field(default_factory=ORPOConfig)
    kto: KTOConfig = Field(default_factory=KTOConfig)
    distillation: Optional[DistillationConfig] = None
    router: Optional[RouterConfig] = None

    @model_validator(mode="after")
    def _one_preference_loss(self) -> "MegalossConfig":
        given = [name for name in PREFERENCE_SECTIONS if name in self.model_fields_set]
        if len(given) > 1:
            raise ValueError(f"give at most one preference section of {PREFERENCE_SECTIONS}, "
                             f"got {given}: preference_train_step trains one loss")
        return self

    def preference_section(self) -> str:
        """The name of the preference section given (at most one of
        :data:`PREFERENCE_SECTIONS`), ``"dpo"`` when none is."""
        given = [name for name in PREFERENCE_SECTIONS if name in self.model_fields_set]
        return given[0] if given else "dpo"

    def preference_options(self) -> Any:
        """The options of :meth:`preference_section` (DPO's defaults when no section is given):
        a ``DPOOptions``, ``CPOOptions`` (``cpo`` and ``simpo``), ``ORPOOptions`` or
        ``KTOOptions``."""
        return getattr(self, self.preference_section()).options()

    @model_validator(mode="after")
    def _one_causal_lm_loss(self) -> "MegalossConfig":
        if self.distillation is not None and "ce" in self.model_fields_set:
            raise ValueError("give either 'ce' (cross-entropy) or 'distillation', not both: with "
                             "'distillation' the ce keys would have no effect (the hard-label "
                             "part is distillation.alpha)")
        return self

    @property
    def loss_reduction(self) -> str:
        """The calibration of the causal-LM loss: ``distillation.loss_reduction`` when
        distilling, else ``ce.loss_reduction``."""
        section = self.distillation if self.distillation is not None else self.ce
        return section.loss_reduction


def _section_keys(loc: tuple) -> list:
    """The keys the section at ``loc`` (a pydantic error location without its last key) takes."""
    model: Any = MegalossConfig
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = next((a for a in typing.get_args(field.annotation) if isinstance(a, type)
                      and issubclass(a, BaseModel)), field.annotation)
    return list(getattr(model, "model_fields", {}))


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join([SECTION] + [str(p) for p in e["loc"]])
        line = f"{path}: {e['msg']}" + (f" (got {e['input']!r})" if "input" in e
                                        and e["type"] != "missing" and not
                                        isinstance(e["input"], dict) else "")
        if e["type"] == "extra_forbidden" and e["loc"]:
            near = _closest(str(e["loc"][-1]), _section_keys(tuple(e["loc"][:-1])))
            if near is not None:
                line += f"; did you mean {'.'.join([SECTION, *map(str, e['loc'][:-1]), near])!r}?"
        lines.append(line)
    return "invalid ds_config section: " + "; ".join(lines)


def load_megaloss_config(ds_config: Union[str, os.PathLike, Mapping[str, Any], None]
                         ) -> MegalossConfig:
    """Read and validate the ``"megaloss"`` section of a ds_config.

    Args:
        ds_config: path to a ds_config JSON file, the parsed dict, or ``None``. A config without a
            ``"megaloss"`` key gives the defaults.

    Returns:
        A validated :class:`MegalossConfig`.

    Raises:
        ValueError: unknown key or bad value; the message names the key path, e.g.
            ``megaloss.ce.reduction``; or a top-level key close to ``"megaloss"`` (a misspelled
            section, :func:`check_top_level_keys`, which also warns about keys close to
            DeepSpeed's).
        TypeError: ``ds_config`` is not a path, mapping or None, or the section is not an object.
        FileNotFoundError: the path does not exist.
    """
    if ds_config is None:
        return MegalossConfig()
    if isinstance(ds_config, (str, os.PathLike)):
        with open(ds_config, encoding="utf-8") as f:
            ds_config = json.load(f)
    if not isinstance(ds_config, Mapping):
        raise TypeError(f"ds_config must be a path, a dict or None, got {type(ds_config).__name__}")
    check_top_level_keys(ds_config)
    section = ds_config.get(SECTION, {})
    if not isinstance(section, Mapping):
        raise TypeError(f"ds_config[{SECTION!r}] must be a JSON object, got "
                        f"{type(section).__name__}")
    try:
        ml = MegalossConfig.model_validate(dict(section))
    except ValidationError as err:
        raise ValueError(_format_errors(err)) from None
    return _with_deepspeed_keys(ds_config, section, ml)


def _with_deepspeed_keys(ds_config: Mapping[str, Any], section: Mapping[str, Any],
                         ml: MegalossConfig) -> MegalossConfig:
    """Honour or refuse the DeepSpeed keys that mean what a ``"megaloss"`` key means.

    - ``"sequence_parallel_size"`` (top level) is DeepSpeed-Ulysses' own key: it sets
      ``megaloss.sequence_parallel_size`` when the section does not; two different values are an
      error (DeepSpeed's batch arithmetic would divide by one, megaloss's groups by the other).
    - ``"tensor_parallel": {"autotp_size": N > 1}`` makes DeepSpeed shard the model's linear
      layers itself (AutoTP, deepspeed 0.19.8 ``deepspeed/runtime/engine.py``). megaloss
      computes its loss on AutoTP's lm_head shard
      (:mod:`megaloss.integrations.autotp`) when that head is a
      ``VocabParallelLinear``: ``"vocab_parallel_lm_head": true`` is required (DeepSpeed's
      ``null`` default makes it one only for a tied head under a Hugging Face
      ``embedding_rowwise`` plan, and ``false`` keeps full-vocabulary logits). Refused, with the
      reason: ``vocab_parallel_lm_head`` not ``true``; ``megaloss.tensor_parallel_size > 1`` too
      (megaloss's own vocab-parallel lm_head and its groups; one TP scheme at a time); ZeRO-3
      (DeepSpeed accepts it, but gathers the head's shard only inside the head's own forward,
      which megaloss's loss does not call: the weight it reads is ZeRO-3's empty placeholder);
      ``sequence_parallel_size > 1`` (not composed with AutoTP's groups yet);
      ``vocab_parallel_ce_backend`` other than ``"torch"`` (the kernel of DeepSpeed's own loss
      on the logits, ``"liger"``: megaloss's loss replaces that loss, so the key would be
      ignored).
    """
    if "sequence_parallel_size" in ds_config:
        sp = ds_config["sequence_parallel_size"]
        if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
            raise ValueError(f"ds_config sequence_parallel_size must be an int >= 1, got {sp!r}")
        if "sequence_parallel_size" not in section:
            ml.sequence_parallel_size = sp
        elif sp != ml.sequence_parallel_size:
            raise ValueError(
                f"ds_config sequence_parallel_size={sp} (DeepSpeed's key) differs from "
                f"{SECTION}.sequence_parallel_size={ml.sequence_parallel_size}: give one of them, "
                "or the same value in both")
    autotp = ds_config_autotp_size(ds_config)
    if autotp > 1:
        _check_autotp(ds_config, ds_config["tensor_parallel"], autotp, ml)
    return ml


def _check_autotp(ds_config: Mapping[str, Any], tp_section: Mapping[str, Any], autotp: int,
                  ml: MegalossConfig) -> None:
    """Refuse what megaloss's loss on DeepSpeed AutoTP's lm_head shard does not compose with
    (see :func:`_with_deepspeed_keys`)."""
    where = f"ds_config tensor_parallel.autotp_size={autotp}"
    if tp_section.get("vocab_parallel_lm_head") is not True:
        raise ValueError(
            f"{where} needs tensor_parallel.vocab_parallel_lm_head=true: megaloss computes the "
            "loss on the lm_head's vocabulary shard (DeepSpeed's VocabParallelLinear); without "
            "it AutoTP keeps full-vocabulary logits; or set "
            f"{SECTION}.tensor_parallel_size={autotp} instead of AutoTP (and remove "
            "tensor_parallel)")
    if ml.tensor_parallel_size > 1:
        raise ValueError(
            f"{where} and {SECTION}.tensor_parallel_size={ml.tensor_parallel_size}: give one "
            "tensor-parallel scheme (AutoTP's shards and groups, or megaloss's vocab-parallel "
            "lm_head and its own groups), not both")
    backend = tp_section.get("vocab_parallel_ce_backend", "torch")
    if backend != "torch":
        raise ValueError(
            f"{where} with tensor_parallel.vocab_parallel_ce_backend={backend!r}: that is the "
            "kernel of DeepSpeed's own loss on the head's logits, which megaloss's loss "
            "replaces (it computes the cross-entropy from the hidden states and the head's "
            "shard, without logits); remove the key or set it to \"torch\"")
    zero = ds_config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    if stage == 3:
        raise ValueError(
            f"{where} with ZeRO-3: DeepSpeed accepts it, but ZeRO-3 gathers the lm_head's shard "
            "only inside the head's own forward, which megaloss's loss does not call (it reads "
            "the weight from the hidden states' side, without logits); use ZeRO 0, 1 or 2")
    others = [name for name in ("distillation", "policy") + PREFERENCE_SECTIONS
              if name in ml.model_fields_set]
    if others:
        raise ValueError(
            f"{where} with {SECTION}.{others[0]}: under AutoTP megaloss trains the causal-LM "
            "cross-entropy on the lm_head's shard (the 'ce' section) only, so that section "
            f"would be ignored; for {others[0]} use megaloss's own tensor parallelism "
            f"({SECTION}.tensor_parallel_size, without tensor_parallel)")
    if ml.sequence_parallel_size > 1:
        raise ValueError(
            f"{where} with sequence_parallel_size={ml.sequence_parallel_size}: megaloss's loss "
            "on AutoTP's lm_head is not composed with sequence parallelism yet")
