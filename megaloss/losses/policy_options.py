"""The options of the policy-gradient losses (:func:`megaloss.policy_loss`, GRPO family and CISPO),
beside the loss (:mod:`.policy`); their names and defaults are those of TRL 1.16's
``GRPOConfig``."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..ops.options import (
    OptionsBase,
    bad_chunk_size,
    check_bool,
    check_choice,
    check_finite_positive,
    check_float,
)

__all__ = ["PolicyLossOptions", "POLICY_LOSS_TYPES", "IMPORTANCE_SAMPLING_LEVELS", "KL_ESTIMATORS",
           "LOSS_AGG_MODES"]


POLICY_LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# verl's kl_penalty (verl/trainer/ppo/core_algos.py) names, "k3" being TRL's unclamped k3.
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs", "k1+", "k3+", "low_var_kl+", "abs+")
# verl's agg_loss (verl/trainer/ppo/core_algos.py) modes.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")


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
        check_choice("loss_type", self.loss_type, POLICY_LOSS_TYPES)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        if self.loss_agg_mode is not None and (not isinstance(self.loss_agg_mode, str)
                                               or self.loss_agg_mode not in LOSS_AGG_MODES):
            raise ValueError(f"loss_agg_mode must be None or one of {LOSS_AGG_MODES}, got "
                             f"{self.loss_agg_mode!r}")
        check_bool("cispo_two_sided", self.cispo_two_sided)
        if self.cispo_two_sided and self.loss_type != "cispo":
            raise ValueError(f"cispo_two_sided=True needs loss_type='cispo', got loss_type="
                             f"{self.loss_type!r}")
        for name in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos",
                     "vespo_lambda_neg"):
            check_finite_positive(name, getattr(self, name))
        for name in ("vespo_k_pos", "vespo_k_neg"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")
        check_choice("importance_sampling_level", self.importance_sampling_level,
                      IMPORTANCE_SAMPLING_LEVELS)
        check_float("epsilon_low", self.epsilon_low, 0.0, 1.0)
        check_float("epsilon_high", self.epsilon_high, 0.0, float("inf"))
        if self.loss_type == "cispo" and not self.cispo_two_sided and not self.epsilon_high > 0:
            raise ValueError("epsilon_high must be > 0 for loss_type='cispo' (it caps the ratio), "
                             f"got {self.epsilon_high!r}")
        check_float("beta", self.beta, 0.0, float("inf"))
        if isinstance(self.entropy_coef, bool) or not isinstance(self.entropy_coef, (int, float)) \
                or not math.isfinite(self.entropy_coef):
            raise ValueError(f"entropy_coef must be a finite float, got {self.entropy_coef!r}")
        if self.delta is not None and self.loss_type in ("cispo", "sapo", "vespo"):
            # these never read delta (TRL clips with it in its PPO branch only): only its type.
            check_float("delta", self.delta, -float("inf"), float("inf"), none_ok=True)
        elif self.delta is not None:
            check_float("delta", self.delta, 1.0 + self.epsilon_high, float("inf"),
                         open_low=True, none_ok=True)
        mcl = self.max_completion_length
        if mcl is not None and bad_chunk_size(mcl):
            raise ValueError(f"max_completion_length must be None or an int >= 1, got {mcl!r}")
        if self.loss_type == "dr_grpo" and mcl is None and self.loss_agg_mode is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (an int >= 1): it "
                             "divides the token sum by sequences x max_completion_length")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and mcl is None:
            raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' needs max_completion_length "
                             "(an int >= 1, verl's loss_scale_factor): it divides the token sum "
                             "by it")
        check_bool("count_empty_rows", self.count_empty_rows)
        for name in ("epsilon_low", "epsilon_high", "beta", "entropy_coef",
                     "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                     "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.delta is not None:
            object.__setattr__(self, "delta", float(self.delta))

