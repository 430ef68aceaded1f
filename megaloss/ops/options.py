"""The options of the losses, each validated once and carried as one frozen object from the
ds_config section (:class:`megaloss.integrations.deepspeed.CEConfig` / ``MNRConfig``, whose fields
are built from these dataclasses) or the functional API's keyword arguments down to the kernels.

- :class:`CrossEntropyOptions`: the linear cross-entropy (single-device and vocab-parallel).
- :class:`MNROptions`: the gathered Multiple Negatives Ranking (InfoNCE) loss.
- :class:`LogProbsOptions`: the per-token log-probabilities of :func:`megaloss.linear_log_probs`.
- :class:`PolicyLossOptions`: the policy-gradient losses (GRPO family, CISPO) of
  :func:`megaloss.policy_loss`.
- :class:`DPOOptions`: the pairwise preference losses (DPO, IPO and TRL's other pairwise
  loss types) of :func:`megaloss.dpo_loss`.
- :class:`DistillationOptions`: the linear distillation loss (single-device and vocab-parallel).
- :func:`resolve_options`: ``options=`` or the option keywords of an entry point, not both.

Every options class (and :class:`megaloss.VocabParallelOptions`) is a frozen dataclass on
:class:`OptionsBase`: ``replace(**changes)`` (a validated copy) and ``as_dict()``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Dict, Optional, Type, TypeVar

import torch

__all__ = ["OptionsBase", "CrossEntropyOptions", "CE_REDUCTIONS", "CE_IMPLS", "MNROptions",
           "SIMILARITIES", "LogProbsOptions", "mnr_option_error", "resolve_options",
           "module_options", "PolicyLossOptions", "POLICY_LOSS_TYPES",
           "KL_ESTIMATORS", "LOSS_AGG_MODES",
           "IMPORTANCE_SAMPLING_LEVELS", "DPOOptions", "DPO_LOSS_TYPES", "DistillationOptions",
           "DISTILLATION_KINDS"]

OptionsT = TypeVar("OptionsT", bound="OptionsBase")


class OptionsBase:
    """What every frozen options dataclass of megaloss shares."""

    def replace(self: OptionsT, **changes: Any) -> OptionsT:
        """A copy with ``changes`` applied (validated again).

        Raises:
            ValueError / TypeError: a changed field out of range or of the wrong type.
        """
        return replace(self, **changes)

    def as_dict(self) -> Dict[str, Any]:
        """``{field name: value}`` in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


CE_REDUCTIONS = ("mean", "sum", "none")
CE_IMPLS = ("auto", "torch", "triton")
SIMILARITIES = ("cosine", "dot")


@dataclass(frozen=True)
class CrossEntropyOptions(OptionsBase):
    """Options of :func:`megaloss.linear_cross_entropy` and its vocab-parallel form.

    Attributes:
        ignore_index: label value that contributes neither loss nor gradient (int).
        reduction: ``"mean"`` over valid tokens (with ``loss_weights``: ``sum(w*l)/sum(w)``; 0.0
            when no token is valid), ``"sum"`` (of ``w*l``) or ``"none"`` (per token, 0 at
            ignored positions). torch's ``F.cross_entropy`` meanings.
        label_smoothing: torch's definition (uniform over all ``V`` classes), in ``[0, 1]``.
        z_loss: coefficient of the PaLM z-loss ``logsumexp(logits)**2`` per valid token
            (Chowdhery et al. 2022, arXiv:2204.02311); ``>= 0``, 0 disables it.
        logit_softcapping: ``c`` in Gemma 2's ``c * tanh(logits / c)`` (arXiv:2408.00118);
            ``None`` disables it, else ``> 0``.
        chunk_size: tokens per chunk (``>= 1``), or ``None`` (default): the chunk whose fp32
            logits are about the size of the hidden states,
            :func:`~megaloss.ops.chunk_driver.auto_chunk_size`. The working set is
            ``chunk_size x V`` logits in fp32 (``x V/tp`` under tensor parallelism).
        accum_dtype: floating dtype of the weight/bias gradient accumulation across chunks (fp32
            by default: half-precision accumulation made training diverge in Liger-Kernel).
        impl: the chunk epilogue (everything after the chunk's lm_head GEMM: row statistics,
            loss, and the logit gradient), see :mod:`megaloss.ops.cross_entropy_chunk`.
            ``"torch"``: eager torch ops on an fp32 copy of the logits (any device; the
            reference). ``"triton"``: the fused Triton kernels of
            :mod:`megaloss.ops.triton_epilogue` (two passes, the gradient written in place into
            the logits buffer in the compute dtype); needs the ``triton`` package and CUDA
            tensors, or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, slow,
            for tests); float64 inputs are refused. ``"auto"`` (default): ``"triton"`` for
            CUDA tensors of fp32/bf16/fp16 when ``triton`` imports, ``"torch"`` otherwise.
            Both give the same losses and gradients up to floating-point rounding.

    Raises:
        ValueError / TypeError: an option out of range or of the wrong type, naming it.
    """

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    logit_softcapping: Optional[float] = None
    chunk_size: Optional[int] = None
    accum_dtype: torch.dtype = torch.float32
    impl: str = "auto"

    def __post_init__(self) -> None:
        _check_choice("reduction", self.reduction, CE_REDUCTIONS)
        _check_choice("impl", self.impl, CE_IMPLS)
        _check_float("label_smoothing", self.label_smoothing, 0.0, 1.0)
        _check_float("z_loss", self.z_loss, 0.0, float("inf"))
        _check_softcapping(self, "logit_softcapping")
        _check_chunk_fields(self)
        # Python floats whatever numeric type came in (ints, numpy scalars).
        object.__setattr__(self, "label_smoothing", float(self.label_smoothing))
        object.__setattr__(self, "z_loss", float(self.z_loss))


def _check_float(name: str, value: Any, low: float, high: float, *, open_low: bool = False,
                 none_ok: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > low if open_low else value >= low) and value <= high
    if not ok:
        rng = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        extra = "None or " if none_ok else ""
        raise ValueError(f"{name} must be {extra}a float in {rng}, got {value!r}")


def _bad_chunk_size(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < 1


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def _finite_positive_error(name: str, value: Any) -> Optional[ValueError]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or math.isinf(value):
        return ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return None


def _check_finite_positive(name: str, value: Any) -> None:
    error = _finite_positive_error(name, value)
    if error is not None:
        raise error


def _check_softcapping(options: Any, name: str) -> None:
    """A soft-capping field of a frozen options object: ``None``, or made a float ``> 0``."""
    value = getattr(options, name)
    if value is not None:
        _check_float(name, value, 0.0, float("inf"), open_low=True, none_ok=True)
        object.__setattr__(options, name, float(value))


def _check_chunk_fields(options: Any) -> None:
    """The fields every chunked lm_head loss has: ``chunk_size``, ``accum_dtype``,
    ``ignore_index``."""
    if options.chunk_size is not None and _bad_chunk_size(options.chunk_size):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {options.chunk_size!r}")
    dtype = options.accum_dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"accum_dtype must be a floating torch.dtype, got {dtype!r}")
    if isinstance(options.ignore_index, bool) or not isinstance(options.ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {options.ignore_index!r}")


@dataclass(frozen=True)
class MNROptions(OptionsBase):
    """Options of :func:`megaloss.mnr_loss` and :class:`megaloss.MultipleNegativesRankingLoss`.

    Attributes:
        temperature: ``T > 0`` (finite): scores are ``sim / T``; sentence-transformers'
            ``scale=20`` is ``T=0.05``. (:func:`~megaloss.mnr_loss` also takes a 0-dim tensor,
            e.g. a learnable temperature, outside these options.)
        similarity: ``"cosine"`` (embeddings L2-normalised first) or ``"dot"``.
        symmetric: also average in the document -> query direction (CLIP-style).
        gather_across_ranks: use every rank's documents as candidates (``False``: this rank's
            batch only).
        local_loss: score only this rank's rows and all-reduce the loss share (open_clip's
            ``local_loss``); ``False`` scores every row on every rank (same value and gradients).
        chunk_size: score rows per block (``>= 1``); memory ``chunk_size x C``, the same result
            for any value up to summation order.

    Raises:
        ValueError / TypeError: an option out of range or of the wrong type, naming it.
    """

    temperature: float = 0.05
    similarity: str = "cosine"
    symmetric: bool = False
    gather_across_ranks: bool = True
    local_loss: bool = True
    chunk_size: int = 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            error = mnr_option_error(f.name, getattr(self, f.name))
            if error is not None:
                raise error
        object.__setattr__(self, "temperature", float(self.temperature))


def mnr_option_error(name: str, value: Any) -> Optional[Exception]:
    """The error for MNR option ``name`` set to ``value``, or ``None`` when it is valid (one
    message per bound, shared by :class:`MNROptions` and :func:`megaloss.mnr_loss`'s checks,
    which raise it on every rank)."""
    if name == "temperature":
        return _finite_positive_error(name, value)
    elif name == "similarity":
        if not isinstance(value, str) or value not in SIMILARITIES:
            return ValueError(f"similarity must be one of {SIMILARITIES}, got {value!r}")
    elif name == "chunk_size":
        if _bad_chunk_size(value):
            return ValueError(f"chunk_size must be an int >= 1, got {value!r}")
    elif not isinstance(value, bool):  # symmetric, gather_across_ranks, local_loss
        return TypeError(f"{name} must be a bool, got {value!r}")
    return None


@dataclass(frozen=True)
class LogProbsOptions(OptionsBase):
    """Options of :func:`megaloss.linear_log_probs` and :class:`megaloss.LinearLogProbs`.

    The scaled logits are ``y = softcap(z) / temperature``: soft-capping acts on the raw lm_head
    logits (as Gemma 2's ``final_logit_softcapping`` does inside the model,
    ``transformers``' ``Gemma2ForCausalLM.forward``), and the temperature divides what the model
    returns (as TRL's trainers do, ``logits / temperature`` before ``selective_log_softmax``).

    Attributes:
        ignore_index: label value whose token gets ``log_probs = 0``, ``entropy = 0``,
            ``greedy_match = False`` and no gradient (int).
        temperature: ``T > 0`` (finite), the divisor of the (soft-capped) logits.
        logit_softcapping: ``c`` in Gemma 2's ``c * tanh(logits / c)`` (arXiv:2408.00118);
            ``None`` disables it, else ``> 0``.
        return_entropy: also compute the per-token entropy of ``softmax(y)`` (one more
            ``[tokens]`` statistic in the vocab-parallel all-reduce, one more pass per chunk).
        chunk_size: tokens per chunk (``>= 1``), or ``None`` (default):
            :func:`~megaloss.ops.chunk_driver.auto_chunk_size`. The working set is a few
            ``chunk_size x V`` fp32 buffers (``x V/tp`` under tensor parallelism).
        accum_dtype: floating dtype of the weight/bias gradient accumulation across chunks.
        impl: the chunk epilogue, as :class:`CrossEntropyOptions`'s: ``"torch"``, ``"triton"``
            or ``"auto"``.

    Raises:
        ValueError / TypeError: an option out of range or of the wrong type, naming it.
    """

    ignore_index: int = -100
    temperature: float = 1.0
    logit_softcapping: Optional[float] = None
    return_entropy: bool = False
    chunk_size: Optional[int] = None
    accum_dtype: torch.dtype = torch.float32
    impl: str = "auto"

    def __post_init__(self) -> None:
        _check_finite_positive("temperature", self.temperature)
        _check_softcapping(self, "logit_softcapping")
        _check_bool("return_entropy", self.return_entropy)
        _check_choice("impl", self.impl, CE_IMPLS)
        _check_chunk_fields(self)
        object.__setattr__(self, "temperature", float(self.temperature))


# --- policy-gradient and preference losses ---------------------------------------------------

POLICY_LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# verl's kl_penalty (verl/trainer/ppo/core_algos.py) names, "k3" being TRL's unclamped k3.
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs", "k1+", "k3+", "low_var_kl+", "abs+")
# verl's agg_loss (verl/trainer/ppo/core_algos.py) modes.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
                  "sppo_hard", "apo_zero", "apo_down", "discopop", "sigmoid_norm", "aot",
                  "aot_unpaired")


@dataclass(frozen=True)
class PolicyLossOptions(OptionsBase):
    """Options of :func:`megaloss.policy_loss` (names and defaults of TRL 1.16's ``GRPOConfig``,
    ``trl/trainer/grpo_config.py``).

    Attributes:
        loss_type: how the per-token losses of one optimizer step are normalised, always over
            the *global* batch (every DP / SP rank and accumulation step):
            ``"grpo"``: each sequence's token mean, then the mean over sequences (Shao et al.
            2024, arXiv:2402.03300); ``"bnpo"`` and ``"dapo"``: the token mean (DAPO, Yu et
            al. 2025, arXiv:2503.14476); ``"dr_grpo"``: the token sum divided by
            ``sequences x max_completion_length`` (Dr. GRPO, Liu et al. 2025,
            arXiv:2503.20783); ``"cispo"``: the token mean of CISPO's clipped-weight policy
            gradient (MiniMax-M1, arXiv:2506.13585); ``"sapo"``: ``grpo``'s normalisation of
            SAPO's soft-gated ratio (arXiv:2511.20347); ``"luspo"``: the PPO loss summed over
            each sequence's tokens, then the mean over sequences (LUSPO, arXiv:2602.05261; TRL
            recommends ``importance_sampling_level="sequence"``); ``"vespo"``: the token mean of
            ``-phi(w) * A * logp`` with VESPO's Gamma weight ``phi`` of the sequence ratio ``w``
            (arXiv:2602.10693). Formulas: :mod:`megaloss.losses.policy`.
        epsilon_low, epsilon_high: PPO clipping of the ratio to ``[1 - epsilon_low,
            1 + epsilon_high]`` (Schulman et al. 2017, arXiv:1707.06347; DAPO's decoupled
            ``epsilon_high``). For ``"cispo"``, ``epsilon_high`` is the cap of the ratio itself
            (TRL's convention: ``clamp(ratio, max=epsilon_high)``), e.g. 5.0.
            With ``cispo_two_sided=True`` the ratio is clamped to ``[1 - epsilon_low,
            1 + epsilon_high]`` instead (verl's ``compute_policy_loss_cispo``).
        delta: optional upper bound of the unclipped ratio (two-sided clipping, TRL's
            ``delta``, verl's dual-clip ``clip_ratio_c``); ``None`` disables it, else ``> 1 +
            epsilon_high``. ``"cispo"``, ``"sapo"`` and ``"vespo"`` ignore it (as TRL, which
            clips with ``delta`` only in its PPO-style branch), so any value is accepted there.
        beta: coefficient of the KL penalty to the reference policy (the ``kl_estimator``
            per token); 0 disables it (no reference log-probs needed).
        kl_estimator: the per-token KL estimate (Schulman 2020, "Approximating KL divergence",
            http://joschu.net/blog/kl-approx.html; verl's ``kl_penalty``,
            ``verl/trainer/ppo/core_algos.py``), with ``x = logp - ref``: ``"k1"``: ``x``;
            ``"k2"``: ``x^2 / 2``; ``"k3"`` (default, TRL's): ``exp(-x) + x - 1``;
            ``"low_var_kl"``: k3 of ``clamp(-x, -20, 20)``, clamped to ``[-10, 10]`` (verl's
            ``"low_var_kl"`` and ``"k3"``); ``"abs"``: ``|x|``. A trailing ``"+"`` (``"k1+"``,
            ``"k3+"``, ``"low_var_kl+"``, ``"abs+"``) is verl's straight-through form: the value
            of the estimator with the gradient of ``"k2"``.
        cispo_two_sided: ``loss_type="cispo"`` only: clamp the ratio (under stop-gradient) to
            ``[1 - epsilon_low, 1 + epsilon_high]`` as verl's ``compute_policy_loss_cispo``
            (its log-ratio clamped to ``[-20, 20]`` first), instead of TRL's ``min(ratio,
            epsilon_high)``.
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures for tokens with
            positive / non-positive advantage (TRL's names and defaults), finite ``> 0``.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's Gamma weight
            ``phi(w) = exp(lambda) * w^k * exp(-lambda * w)`` for advantages ``>= 0`` / ``< 0``
            (TRL's names and defaults); ``k`` finite ``>= 0``, ``lambda`` finite ``> 0``.
        loss_agg_mode: ``None`` (default): the normalisation of the ``loss_type``. Else one of
            verl's ``agg_loss`` modes, replacing it (for the policy term, the KL and the
            entropy bonus alike, as verl's actor aggregates all three with it), over the global
            batch: ``"token-mean"`` (``1 / N_tokens``), ``"seq-mean-token-sum"``
            (``1 / N_sequences``), ``"seq-mean-token-mean"`` (``1 / (n_s * N_sequences)``),
            ``"seq-mean-token-sum-norm"`` (``1 / max_completion_length``: verl's token sum
            divided by its ``loss_scale_factor``, which defaults to the padded response
            length; required here).
        entropy_coef: coefficient of the entropy bonus: ``loss - entropy_coef * H`` with ``H``
            the global token mean of the per-token entropy; 0 disables it.
        importance_sampling_level: ``"token"`` (PPO's per-token ratio) or ``"sequence"`` (GSPO,
            Zheng et al. 2025, arXiv:2507.18071: ``exp`` of the sequence's mean log-ratio).
        max_completion_length: the generation length bound ``dr_grpo`` divides by (int
            ``>= 1``); required for ``"dr_grpo"``, else unused.
        count_empty_rows: whether a row without any completion token counts as a sequence in
            ``N_sequences`` (the ``grpo`` and ``dr_grpo`` denominators). ``False`` (default):
            only rows with a completion token count, so padding rows, all-padding
            micro-batches and ranks without completions change nothing. ``True``: every row
            counts, TRL's convention (its ``grpo`` takes the mean over all ``B`` rows and
            ``dr_grpo`` divides by ``B x max_completion_length``, also for rows that
            ``mask_truncated_completions`` emptied), what ``MegalossGRPOMixin``
            (``megaloss/integrations/hf/trl_policy.py``) uses.

    Raises:
        ValueError / TypeError: an option out of range or of the wrong type, naming it.
    """

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: Optional[float] = None
    beta: float = 0.0
    entropy_coef: float = 0.0
    importance_sampling_level: str = "token"
    max_completion_length: Optional[int] = None
    count_empty_rows: bool = False
    kl_estimator: str = "k3"
    cispo_two_sided: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    loss_agg_mode: Optional[str] = None

    def __post_init__(self) -> None:
        _check_choice("loss_type", self.loss_type, POLICY_LOSS_TYPES)
        _check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.loss_agg_mode is not None and (not isinstance(self.loss_agg_mode, str)
                                               or self.loss_agg_mode not in LOSS_AGG_MODES):
            raise ValueError(f"loss_agg_mode must be None or one of {LOSS_AGG_MODES}, got "
                             f"{self.loss_agg_mode!r}")
        _check_bool("cispo_two_sided", self.cispo_two_sided)
        if self.cispo_two_sided and self.loss_type != "cispo":
            raise ValueError(f"cispo_two_sided=True needs loss_type='cispo', got loss_type="
                             f"{self.loss_type!r}")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos",
                     "vespo_lambda_neg"):
            _check_finite_positive(name, getattr(self, name))
        for name in ("vespo_k_pos", "vespo_k_neg"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")
        _check_choice("importance_sampling_level", self.importance_sampling_level,
                      IMPORTANCE_SAMPLING_LEVELS)
        _check_float("epsilon_low", self.epsilon_low, 0.0, 1.0)
        _check_float("epsilon_high", self.epsilon_high, 0.0, float("inf"))
        if self.loss_type == "cispo" and not self.cispo_two_sided and not self.epsilon_high > 0:
            raise ValueError("epsilon_high must be > 0 for loss_type='cispo' (it caps the ratio), "
                             f"got {self.epsilon_high!r}")
        _check_float("beta", self.beta, 0.0, float("inf"))
        if isinstance(self.entropy_coef, bool) or not isinstance(self.entropy_coef, (int, float)) \
                or not math.isfinite(self.entropy_coef):
            raise ValueError(f"entropy_coef must be a finite float, got {self.entropy_coef!r}")
        if self.delta is not None and self.loss_type in ("cispo", "sapo", "vespo"):
            # these never read delta (TRL clips with it in its PPO branch only): only its type.
            _check_float("delta", self.delta, -float("inf"), float("inf"), none_ok=True)
        elif self.delta is not None:
            _check_float("delta", self.delta, 1.0 + self.epsilon_high, float("inf"),
                         open_low=True, none_ok=True)
        mcl = self.max_completion_length
        if mcl is not None and _bad_chunk_size(mcl):
            raise ValueError(f"max_completion_length must be None or an int >= 1, got {mcl!r}")
        if self.loss_type == "dr_grpo" and mcl is None and self.loss_agg_mode is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (an int >= 1): it "
                             "divides the token sum by sequences x max_completion_length")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and mcl is None:
            raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs max_completion_length "
                             "(an int >= 1, verl's loss_scale_factor): it divides the token sum "
                             "by it")
        _check_bool("count_empty_rows", self.count_empty_rows)
        for name in ("epsilon_low", "epsilon_high", "beta", "entropy_coef",
                     "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                     "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.delta is not None:
            object.__setattr__(self, "delta", float(self.delta))


@dataclass(frozen=True)
class DPOOptions(OptionsBase):
    """Options of :func:`megaloss.dpo_loss` (names and defaults of TRL 1.16's ``DPOConfig``,
    ``trl/trainer/dpo_config.py``).

    Attributes:
        loss_type: the pairwise loss of TRL 1.16's ``DPOTrainer._compute_loss``
            (``trl/trainer/dpo_trainer.py``), one of :data:`DPO_LOSS_TYPES`; the formulas and
            their sources are in :mod:`megaloss.losses.dpo`. ``"sigmoid"`` (DPO, arXiv:2305.18290),
            ``"hinge"`` (RSO / SLiC, arXiv:2309.06657, arXiv:2305.10425), ``"ipo"`` (IPO,
            arXiv:2310.12036), ``"exo_pair"`` (EXO, arXiv:2402.00856), ``"nca_pair"`` (NCA,
            arXiv:2402.05369), ``"robust"`` (Robust DPO, arXiv:2403.00409), ``"bco_pair"``
            (BCO, arXiv:2404.04656), ``"sppo_hard"`` (SPPO, arXiv:2405.00675), ``"apo_zero"`` /
            ``"apo_down"`` (APO, arXiv:2408.06266), ``"discopop"`` (DiscoPOP,
            arXiv:2406.08414), ``"sigmoid_norm"`` (length-normalised DPO, as SimPO,
            arXiv:2405.14734), ``"aot"`` / ``"aot_unpaired"`` (AOT, arXiv:2406.05882: on the
            log-ratios sorted over the call's pairs). ``"ipo"`` and ``"sigmoid_norm"`` divide
            each log-ratio by the completion's token count.
        beta: the inverse temperature (DPO) / regularisation ``tau`` (IPO), finite ``> 0``.
        label_smoothing: ``epsilon`` of ``"robust"`` (the label-flip probability, in
            ``[0, 0.5)``), of ``"exo_pair"`` (the target ``[1 - epsilon, epsilon]``, in
            ``(0, 1)``; EXO recommends 1e-3) and of ``"aot"`` / ``"aot_unpaired"`` (the
            conservative smoothing of the sorted margin); a float in ``[0, 1)``, read by no
            other type.
        discopop_tau: the temperature of ``"discopop"``'s log-ratio modulation, finite ``> 0``
            (DiscoPOP recommends the default 0.05); read by no other type.

    Raises:
        ValueError / TypeError: an option out of range or of the wrong type, naming it.
    """

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05

    def __post_init__(self) -> None:
        _check_choice("loss_type", self.loss_type, DPO_LOSS_TYPES)
        _check_finite_positive("beta", self.beta)
        eps = self.label_smoothing
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 <= eps < 1.0:
            raise ValueError(f"label_smoothing must be a float in [0, 1), got {eps!r}")
        if self.loss_type == "robust" and not eps < 0.5:
            raise ValueError("label_smoothing must be in [0, 0.5) for loss_type='robust' (the "
                             f"label-flip probability; it divides by 1 - 2 * it), got {eps!r}")
        if self.loss_type == "exo_pair" and not eps > 0.0:
            raise ValueError("label_smoothing must be in (0, 1) for loss_type='exo_pair' (its "
                             f"log is taken; EXO recommends 1e-3), got {eps!r}")
        _check_finite_positive("discopop_tau", self.discopop_tau)
        for name in ("beta", "label_smoothing", "discopop_tau"):
            object.__setattr__(self, name, float(getattr(self, name)))

# --- end of policy-gradient and preference losses --------------------------------------------


# --- distillation ------------------------------------------------------------------------------
DISTILLATION_KINDS = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class DistillationOptions(OptionsBase):
    """Options of :func:`megaloss.linear_distillation_loss` and its vocab-parallel form.

    With ``P`` the teacher's and ``Q`` the student's distribution at ``temperature`` (softmax of
    the soft-capped logits divided by ``T``), per valid token (label != ``ignore_index``)::

        loss = (1 - alpha) * T2 * D(P, Q) + alpha * CE(student logits at T=1, label)

    with ``T2 = T**2`` when ``temperature_squared`` (Hinton et al. 2015, arXiv:1503.02531: it
    keeps the soft term's gradient scale independent of ``T``), else 1.

    Attributes:
        kind: ``D``: ``"forward_kl"`` ``KL(P || Q)``, ``"reverse_kl"`` ``KL(Q || P)``, or
            ``"jsd"``, the generalised Jensen-Shannon divergence of Liger-Kernel
            (linkedin/Liger-Kernel, ``src/liger_kernel/ops/jsd.py``):
            ``beta * KL(P || M) + (1 - beta) * KL(Q || M)``, ``M = beta * P + (1 - beta) * Q``,
            where, as there, ``beta = 0`` is forward KL and ``beta = 1`` reverse KL (the
            formula itself is 0 at both ends; Liger switches to the KLs there, and so does this).
        beta: the JSD's ``beta`` in ``[0, 1]`` (read only for ``kind="jsd"``).
        temperature: ``T > 0`` (finite), applied to both models' (soft-capped) logits; with a
            top-k teacher the stored log-probs are taken as the teacher's distribution at ``T``.
        temperature_squared: multiply the divergence by ``T**2`` (bool).
        alpha: weight of the hard-label cross-entropy in ``[0, 1]``; 0 (default) is pure
            distillation.
        ignore_index: label of positions with neither loss nor gradient (int).
        reduction: ``"mean"`` over valid tokens (with ``loss_weights``: ``sum(w*l)/sum(w)``),
            ``"sum"`` (of ``w*l``) or ``"none"`` (per token, 0 at ignored positions).
        logit_softcapping: Gemma 2's ``c * tanh(z / c)`` on the student's logits
            (arXiv:2408.00118), ``None`` or ``> 0``.
        teacher_logit_softcapping: the same for the teacher's logits.
        chunk_size: tokens per chunk (``>= 1``), or ``None`` (default):
            :func:`~megaloss.ops.chunk_driver.auto_chunk_size`. The working set is a few
            ``chunk_size x V`` fp32 buffers (``x V/tp`` under tensor parallelism).
        accum_dtype: floating dtype of the student weight/bias gradient accumulation.

    Raises:
        ValueError / TypeError: an option out of range or of the wrong type, naming it.
    """

    kind: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    temperature_squared: bool = True
    alpha: float = 0.0
    ignore_index: int = -100
    reduction: str = "mean"
    logit_softcapping: Optional[float] = None
    teacher_logit_softcapping: Optional[float] = None
    chunk_size: Optional[int] = None
    accum_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        _check_choice("kind", self.kind, DISTILLATION_KINDS)
        _check_choice("reduction", self.reduction, CE_REDUCTIONS)
        _check_float("beta", self.beta, 0.0, 1.0)
        _check_float("alpha", self.alpha, 0.0, 1.0)
        _check_finite_positive("temperature", self.temperature)
        _check_bool("temperature_squared", self.temperature_squared)
        _check_softcapping(self, "logit_softcapping")
        _check_softcapping(self, "teacher_logit_softcapping")
        _check_chunk_fields(self)
        for name in ("beta", "alpha", "temperature"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def divergence(self) -> str:
        """The divergence computed: ``kind``, with ``"jsd"`` at ``beta`` 0 / 1 resolved to
        ``"forward_kl"`` / ``"reverse_kl"`` (Liger-Kernel's convention)."""
        if self.kind == "jsd" and self.beta in (0.0, 1.0):
            return "forward_kl" if self.beta == 0.0 else "reverse_kl"
        return self.kind

    @property
    def soft_scale(self) -> float:
        """``(1 - alpha) * T2``: the divergence's factor in the loss."""
        t2 = self.temperature ** 2 if self.temperature_squared else 1.0
        return (1.0 - self.alpha) * t2
# --- end distillation --------------------------------------------------------------------------


Options = TypeVar("Options", CrossEntropyOptions, MNROptions, LogProbsOptions,
                  DistillationOptions)


def resolve_options(cls: Type[Options], options: Optional[Options],
                    keywords: Dict[str, Any]) -> Options:
    """The options of a call that takes ``options=`` *or* the option fields as keywords.

    Args:
        cls: :class:`CrossEntropyOptions`, :class:`MNROptions`, :class:`LogProbsOptions` or
            :class:`DistillationOptions`.
        options: the ``options=`` argument (``None``: build the options from ``keywords``).
        keywords: every option keyword of the call, ``{field name: value}``.

    Raises:
        TypeError: ``options`` is not a ``cls``; or ``options`` given together with keywords
            that are not at their default, naming them.
        ValueError: an option out of range (from ``cls``).
    """
    if options is None:
        return cls(**keywords)
    if not isinstance(options, cls):
        raise TypeError(f"options must be a {cls.__name__}, got {type(options).__name__}")
    defaults = {f.name: f.default for f in fields(cls)}
    clash = [k for k, v in keywords.items() if not _is_default(v, defaults[k])]
    if clash:
        raise TypeError(f"pass either options= or the option keywords, not both: got options= "
                        f"and {', '.join(clash)}")
    return options


def module_options(cls: Type[Options], options: Optional[Options],
                   option_fields: Dict[str, Any]) -> Options:
    """The options of a loss module built with ``options=`` *or* the option fields as keyword
    arguments (only those given).

    Raises:
        TypeError: both given, or ``options`` not a ``cls``.
        ValueError: an option out of range (from ``cls``).
    """
    if options is None:
        return cls(**option_fields)
    if option_fields:
        raise TypeError("pass either options or its fields as keyword arguments, not both")
    if not isinstance(options, cls):
        raise TypeError(f"options must be a {cls.__name__}, got {type(options).__name__}")
    return options


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if isinstance(value, torch.Tensor) or isinstance(value, bool) != isinstance(default, bool):
        return False
    try:
        return bool(value == default)
    except Exception:  # a value without a plain comparison is not the default
        return False
