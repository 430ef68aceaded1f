"""Calibrated optimizer steps of the policy-gradient (:func:`megaloss.policy_loss`) and
preference (:func:`megaloss.dpo_loss`) losses on a :class:`~.engine.MegalossEngine`.

The module's contract: ``engine(input_ids, shift_labels=labels, **inputs)`` returns an object
with ``log_probs`` (shape of ``labels`` or flattened; e.g. a
:class:`megaloss.LogProbsOutput` of :func:`megaloss.linear_log_probs` on the decoder's hidden
states) and, for the entropy bonus or metric, ``entropy`` (same shape, or ``None``). ``labels``
are the shifted targets, ``ignore_index`` off the completion.

One step over the ``G`` micro-batches (``G`` = the ds_config's ``gradient_accumulation_steps``)
is the one engine-neutral step (:func:`megaloss.integrations.step.run_step`) with the
:mod:`~megaloss.integrations.step.policy` or :mod:`~megaloss.integrations.step.preference`
family on the :class:`~.engine.MegalossEngine`: the checks agreed on by every rank (a failure
flag all-gathered over ``dp x sp`` and TP, so a bad micro-batch raises on all ranks, not on its
own only), the completion masks of all micro-batches calibrated up front (ONE all-reduce over
``dp x sp``: global tokens, sequences and the ``loss_type``'s denominator), then each
micro-batch's forward, ``engine.backward(step.loss_for_backward(loss))`` (undoing the engine's
measured ``1 / (G x DP)``) and ``engine.step()``; at the boundary the global loss and the metrics
(TRL's names) reduced and written through ``engine.monitor`` like the CE series
(``Train/megaloss/<name>``). The result equals one device's step on the global batch for every
``loss_type``, ZeRO stage, DP x GAS and TP (tested in
``tests/integrations/test_deepspeed_policy.py``), and DP x SP under DeepSpeed-Ulysses
(``tests/integrations/test_post_training_sp.py``).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from ...losses.dpo import DPOOptions
from ...losses.policy_options import PolicyLossOptions
from ...losses.preference import PreferenceOptions
from ...losses.router_options import RouterLossOptions
from ..step.loop import run_step
from ..step.metrics import PolicyStepMetrics
from ..step.policy import PolicyStepLoss
from ..step.preference import PreferenceStepLoss
from .engine import MegalossEngine

__all__ = ["PolicyStepMetrics", "policy_train_step", "dpo_train_step", "preference_train_step",
           "PreferenceOptions"]


def policy_train_step(me: MegalossEngine, micro_batches: Sequence[Mapping[str, Any]], *,
                      options: Optional[PolicyLossOptions] = None,
                      log: bool = True) -> PolicyStepMetrics:
    """One calibrated optimizer step of :func:`megaloss.policy_loss`.

    Args:
        me: from :func:`~.engine.initialize` (its module follows this module's contract).
        micro_batches: ``gradient_accumulation_steps`` dicts with ``input_ids [B, T]``,
            ``completion_mask [B, T]`` (1 where the *next* token is a completion token, aligned
            with the shifted targets), ``advantages [B]`` or ``[B, T]``; optional
            ``old_log_probs [B, T]`` (default: the current log-probs, detached),
            ``ref_log_probs [B, T]`` (required when ``beta > 0``), ``attention_mask``,
            ``position_ids``. TP ranks of one DP rank pass the same batches; a rank may have
            no completion at all (an all-zero mask). Under sequence parallelism (``sp > 1``,
            the module's attention routed through
            :func:`megaloss.integrations.hf.ulysses.enable_ulysses_attention`) every SP rank of
            a DP rank passes the same *full* micro-batches; each forwards its contiguous slice
            of the tokens (:func:`megaloss.calibration.weights.split_for_sequence_parallel`, global
            ``position_ids``), the sequence-level sums are added over the SP group
            (``policy_loss(..., sp_group=...)``) and each sequence counts once; an
            ``attention_mask`` must then be all ones (right padding).
        options: default ``me.config.policy.options()`` (the ds_config's
            ``"megaloss": {"policy": {...}}``); its ``count_empty_rows`` decides whether rows
            without a completion token count as sequences (the calibration's
            ``count_empty_samples``, via :func:`megaloss.policy_calibrator`).
        log: write the loss and metrics through ``engine.monitor``.

    Returns:
        :class:`PolicyStepMetrics` (``metrics``: ``kl``, ``entropy``, ``clip_ratio/*`` or
        ``cispo_clip_ratio``).

    Raises:
        ValueError: a wrong number of micro-batches, a missing key, a mask of another shape
            than ``input_ids``, ``advantages`` / ``old_log_probs`` / ``ref_log_probs`` of a
            wrong shape, no ``ref_log_probs`` with ``beta > 0``, an ``attention_mask`` with
            zeros under sequence parallelism; see
            :func:`megaloss.policy_loss`. The micro-batch checks are agreed on by every rank
            before the step's first collective (:mod:`megaloss.integrations.step.checks`): the
            same error on every rank, naming the failed ranks.
        TypeError: non-integer ``input_ids``, non-floating ``advantages`` or log-probs (agreed
            on likewise); ``options`` not a ``PolicyLossOptions``.
    """
    opts = me.config.policy.options() if options is None else options
    return run_step(me, PolicyStepLoss(opts, router=_router(me)), micro_batches, log=log)


def _router(me: MegalossEngine) -> Optional[RouterLossOptions]:
    """The ds_config's ``megaloss.router`` options (a mixture-of-experts policy's router
    losses, :mod:`megaloss.integrations.step.router`), or ``None``."""
    return None if me.config.router is None else me.config.router.options()


def dpo_train_step(me: MegalossEngine, micro_batches: Sequence[Mapping[str, Any]], *,
                   options: Optional[DPOOptions] = None, log: bool = True) -> PolicyStepMetrics:
    """One calibrated optimizer step of :func:`megaloss.dpo_loss`:
    :func:`preference_train_step` with DPO options only.

    Args:
        me: from :func:`~.engine.initialize` (its module follows this module's contract).
        micro_batches: ``gradient_accumulation_steps`` dicts with ``input_ids [2P, T]`` (the
            ``P`` chosen rows, then their ``P`` rejected rows: TRL's layout),
            ``completion_mask [2P, T]`` (aligned with the shifted targets),
            ``ref_chosen_log_probs [P]`` and ``ref_rejected_log_probs [P]`` (sequence sums
            under the reference, whole sequences); optional ``attention_mask``,
            ``position_ids``. Under sequence parallelism (``sp > 1``, the module's attention
            routed through :func:`megaloss.integrations.hf.ulysses.enable_ulysses_attention`)
            every SP rank of a DP rank passes the same *full* micro-batches, as for
            :func:`policy_train_step`: each forwards its contiguous slice of the tokens, the
            sequence log-probs and completion lengths are the slices' sums added over the SP
            group (``sequence_log_probs(..., sp_group=...)``: one autograd all-reduce per
            micro-batch), and each pair counts once (its weight on SP rank 0,
            :func:`megaloss.dpo_pair_weights`); a slice may hold no completion token. An
            ``attention_mask`` must then be all ones (right padding).
        options: default ``me.config.dpo.options()`` (the ds_config's
            ``"megaloss": {"dpo": {...}}``).
        log: write the loss and metrics through ``engine.monitor``.

    Returns:
        :class:`PolicyStepMetrics` (``metrics``: ``rewards/*``, ``logps/*``;
        ``num_tokens``: global chosen completion tokens; ``num_sequences``: global pairs with a
        chosen completion token).

    Raises:
        ValueError / TypeError: as :func:`policy_train_step`; an odd number of rows; reference
            log-probs not floating ``[P]`` (agreed on by every rank likewise); ``options`` not
            a ``DPOOptions`` (TypeError).
    """
    opts = me.config.dpo.options() if options is None else options
    if not isinstance(opts, DPOOptions):
        raise TypeError(f"options must be a DPOOptions, got {type(opts).__name__}")
    return preference_train_step(me, micro_batches, options=opts, log=log)


def preference_train_step(me: MegalossEngine, micro_batches: Sequence[Mapping[str, Any]], *,
                          options: Optional[PreferenceOptions] = None,
                          log: bool = True) -> PolicyStepMetrics:
    """One calibrated optimizer step of a preference loss on sequence log-probs, chosen by the
    type of ``options`` (:func:`megaloss.losses.sequence_preference_loss`):
    :class:`~megaloss.DPOOptions` -> :func:`megaloss.dpo_loss` (DPO, IPO and TRL's other pairwise
    types), :class:`~megaloss.losses.CPOOptions` -> :func:`megaloss.losses.cpo_loss` (CPO, and
    SimPO with ``loss_type="simpo"``),
    :class:`~megaloss.losses.ORPOOptions` -> :func:`megaloss.losses.orpo_loss`,
    :class:`~megaloss.losses.KTOOptions` -> :func:`megaloss.losses.kto_loss` (the math and its
    sources in those functions' modules: arXiv:2305.18290, 2401.08417, 2405.14734,
    2403.07691, 2402.01306).

    The step: the micro-batch checks agreed on by every rank; ONE all-reduce calibrating the
    step on the chosen completions' labels (KTO: every row's), whose counts give each pair
    ``1 / N_pairs`` and each NLL token ``1 / N_tokens`` of the whole step
    (:func:`megaloss.losses.preference_weights`); for KTO with KL rows, their forward under
    ``no_grad`` and one more all-reduce (the step's ``z0``,
    :func:`megaloss.losses.kto_kl_baseline`); per micro-batch forward, loss,
    ``engine.backward(step.loss_for_backward(loss))``,
    ``engine.step()``; the metrics (TRL's names) reduced and written through
    ``engine.monitor``. The result equals one device's step on the global batch for any
    DP x GAS x SP split (``tests/integrations/test_post_training_sp.py``).

    Args:
        me: from :func:`~.engine.initialize` (its module follows this module's contract).
        micro_batches: ``gradient_accumulation_steps`` dicts. DPO: as
            :func:`dpo_train_step`. CPO / SimPO / ORPO: ``input_ids [2P, T]`` (chosen rows,
            then rejected) and ``completion_mask [2P, T]`` (no reference; the NLL term is on
            the chosen completions' tokens). KTO: ``input_ids [B, T]`` (one example a row),
            ``completion_mask [B, T]``, ``desirable [B]`` (bool or 0 / 1), ``ref_log_probs
            [B]`` (the reference's sequence sums), and optionally the KL rows
            ``kl_input_ids [K, T']``, ``kl_completion_mask [K, T']`` (mismatched prompt /
            completion pairs, TRL's ``KL_completion``) with ``ref_kl_log_probs [K]``; without
            them ``z0 = 0`` (TRL's ``calculate_kl=False``). Optional ``attention_mask``,
            ``position_ids``; under sequence parallelism as :func:`dpo_train_step` (full
            micro-batches on every SP rank, slices forwarded, sequence sums added over the SP
            group, each pair or example counted once).
        options: one of the four options classes; default
            ``me.config.preference_options()``: the preference section the ds_config gives
            (``"megaloss": {"dpo" | "cpo" | "simpo" | "orpo" | "kto": {...}}``, at most one),
            DPO's defaults when it gives none.
        log: write the loss and metrics through ``engine.monitor``.

    Returns:
        :class:`PolicyStepMetrics`: ``metrics`` the loss's (:func:`megaloss.dpo_metrics`,
        ``cpo_metrics``, ``orpo_metrics``, ``kto_metrics``); ``num_sequences`` the global pairs
        with a chosen completion token (KTO: examples with a completion token);
        ``num_tokens`` their chosen (KTO: all) completion tokens.

    Raises:
        TypeError: ``options`` of none of the four classes; non-integer ids, non-floating
            reference log-probs (agreed on by every rank).
        ValueError: a wrong number of micro-batches, a missing key, an odd number of rows for
            a paired loss, shapes that do not match ``input_ids``, KTO's KL keys given in part,
            an ``attention_mask`` with zeros under sequence parallelism (agreed on by every
            rank: the same error everywhere, naming the failed ranks).
    """
    opts = me.config.preference_options() if options is None else options
    return run_step(me, PreferenceStepLoss(opts, router=_router(me)), micro_batches, log=log)
