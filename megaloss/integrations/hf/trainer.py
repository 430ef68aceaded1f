"""``transformers.Trainer`` for a ``*ForCausalLM`` with megaloss's chunked CE and global loss
calibration: :class:`MegalossTrainer`.

What the stock Trainer does (transformers 5.x ``trainer.py``: ``get_batch_samples``,
``_get_num_items_in_batch``, ``compute_loss``, ``training_step``): it fetches the micro-batches of
an optimizer step up front, counts the valid tokens after the causal shift over them and over all
ranks (``num_items_in_batch``), lets the model divide its token sum by that count, multiplies by the
world size (undoing the data-parallel average), skips its own division by the accumulation steps
and passes ``scale_wrt_gas=False`` to DeepSpeed. Net: the global token mean, but only ``token``,
and with full ``[tokens, vocab]`` logits.

What :class:`MegalossTrainer` does instead:

- the model is wrapped in :class:`megaloss.CausalLMWithLoss` (lm_head replaced by the chunked
  linear CE head: no logits; z-loss, label smoothing, softcapping and ``loss_reduction`` from the
  ds_config's ``"megaloss"`` section, :func:`megaloss.integrations.deepspeed.load_megaloss_config`);
- ``get_batch_samples``: the step's micro-batches are calibrated together
  (:func:`megaloss.calibration.compute_loss_weights`, one all-reduce of 3 numbers over the
  data-parallel group): every batch gets ``shift_labels`` (HF's ``labels`` shifted, or the
  collator's ``shift_labels`` as they are) and ``loss_weights`` ``w_t = u_t / D`` (``u_t`` 1,
  ``1/n_s`` or ``1/sqrt(n_s)``, ``D`` the global sum of ``u_t`` over the step's micro-batches and
  ranks: XTuner v1's ``token`` / ``sample`` / ``square``);
- the data-parallel group is the one the engine accelerate built reduces over (DeepSpeed's
  sequence-data-parallel group, DDP's ``process_group``; one rank when the Trainer is not
  distributed, even with ``torch.distributed`` initialized), never assumed to be the world:
  the calibration's all-reduce and the logs' run over it;
- ``compute_loss`` returns ``M * sum_t w_t l_t`` and :attr:`loss_is_scaled_for_ga` is True, so
  the Trainer neither divides by the accumulation steps nor lets DeepSpeed do it
  (``scale_wrt_gas=False``). ``M = 1 / c`` is *measured* on the first training micro-batch
  (:mod:`megaloss.calibration.engine_scale`, as megaloss's own loop does): the engine exists only
  once ``trainer.train()`` has let accelerate build it, so the probe runs then, DeepSpeed's on a
  tiny engine from the real engine's final ds_config and groups
  (:func:`megaloss.integrations.deepspeed.probe_deepspeed`, times the probe's ``G``, which
  ``scale_wrt_gas=False`` skips), DDP's over its ``process_group``
  (:func:`megaloss.calibration.probe_ddp`); ``M`` is the data-parallel size for the engines of
  today. The engine then leaves ``sum over ranks and micro-batches of sum_t w_t grad l_t``: the
  single-device gradient of the global loss. The Trainer's logged ``loss`` (mean over ranks of
  the per-step sums) is that global loss;
- ``log``: adds ``ce_loss``, ``z_loss`` (the two parts of ``loss``) and ``num_valid_tokens``
  (global valid tokens per optimizer step), averaged over the steps since the last log (one
  all-reduce per log), so ``report_to`` (W&B, TensorBoard) shows them.

Evaluation (``evaluate`` / ``predict``): ``{prefix}_loss`` is the calibrated loss of the whole
evaluation set, with the training's ``loss_reduction`` and CE options (z-loss included):
``sum_t u_t l_t / sum_t u_t`` over every valid token of every batch on every rank (one
all-reduce of 4 numbers at the end), not the stock Trainer's mean of per-batch means; also
``{prefix}_ce_loss``, ``{prefix}_z_loss`` and ``{prefix}_num_valid_tokens``. The rows that
``accelerate`` repeats to even out the last batch across ranks (``even_batches``; the ones its
``gather_for_metrics`` drops, ``accelerate/accelerator.py``) are left out. The wrapped model
returns no logits, so evaluation gives no predictions (``compute_metrics`` is not called).

Scope: data parallelism (DDP, DeepSpeed ZeRO 0-3). Tensor and sequence parallelism are refused
with the reason: accelerate builds the engine without megaloss's ``Topology``, so the head would
not be vocab-parallel over a TP group and the Trainer's sampler gives every rank whole sequences,
not sequence-parallel slices; megaloss's own DeepSpeed loop supports both.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Union

import torch
import torch.distributed as dist

from ...calibration.weights import (
    LOSS_REDUCTIONS,
    compute_loss_weights,
    loss_weight_dtype,
    raw_token_weights,
)
from ...ops.labels import causal_shift
from ...parallel.groups import SINGLE_RANK
from ..deepspeed.config import MegalossConfig, load_megaloss_config
from ..deepspeed.probe import engine_reduce_group
from .causal_lm import CausalLMWithLoss

try:
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - transformers is the hf extra
    raise ImportError("megaloss.integrations.hf.trainer needs transformers "
                      "(pip install 'megaloss[hf]')") from err

__all__ = ["MegalossTrainer", "megaloss_config_from_args"]

_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def megaloss_config_from_args(args: Any) -> MegalossConfig:
    """The ``"megaloss"`` section of ``args.deepspeed`` (a ds_config path or dict; defaults
    without one)."""
    ds = getattr(args, "deepspeed", None)
    if isinstance(ds, (str, os.PathLike, Mapping)):
        return load_megaloss_config(ds)
    return MegalossConfig()


_USE_OWN_LOOP = ("use megaloss's own DeepSpeed loop (megaloss.integrations.deepspeed.initialize "
                 "with Topology.build(...); the launch/train_lm.py job), which builds these groups")


def _refuse_model_parallelism(cfg: MegalossConfig, args: Any) -> None:
    """Tensor and sequence parallelism are refused, each with the reason (module docstring)."""
    if cfg.tensor_parallel_size != 1:
        raise ValueError(
            "MegalossTrainer supports data parallelism only, not tensor parallelism "
            f"(megaloss.tensor_parallel_size="
            f"{cfg.tensor_parallel_size}): accelerate builds the engine without megaloss's "
            "Topology, so the lm_head would not be vocab-parallel over a TP group "
            "(CausalLMWithLoss(tp_group=...)) and the engine would average over the TP ranks as "
            f"if they held data; {_USE_OWN_LOOP}")
    if cfg.sequence_parallel_size != 1:
        raise ValueError(
            "MegalossTrainer supports data parallelism only, not sequence parallelism "
            "(sequence_parallel_size="
            f"{cfg.sequence_parallel_size}): the Trainer's sampler and collator give every rank "
            "whole sequences, not slices of one sequence per SP group, and accelerate passes "
            "DeepSpeed no mpu with a sequence-parallel group, so the calibration would count "
            f"each sequence on every SP rank; {_USE_OWN_LOOP}")
    parallelism = getattr(args, "parallelism_config", None)
    for name in ("tp_size", "cp_size", "sp_size"):
        size = getattr(parallelism, name, 1) if parallelism is not None else 1
        if isinstance(size, int) and size > 1:
            raise ValueError(
                "MegalossTrainer supports data parallelism only, not "
                f"TrainingArguments.parallelism_config.{name}="
                f"{size} (accelerate's tensor / context / sequence parallelism): the loss "
                "calibration counts the tokens of whole sequences per data-parallel rank, and "
                "the chunked head is not vocab-parallel over accelerate's TP mesh; "
                f"{_USE_OWN_LOOP}")


class MegalossTrainer(Trainer):
    """A ``transformers.Trainer`` whose causal-LM loss is megaloss's (module docstring).

    Args:
        model: a ``*ForCausalLM`` (wrapped here in :class:`megaloss.CausalLMWithLoss`) or an
            already wrapped :class:`~megaloss.CausalLMWithLoss`.
        args: ``TrainingArguments``; its ``deepspeed`` ds_config's ``"megaloss"`` section gives
            the CE options and ``loss_reduction``.
        megaloss_config: overrides the section (a :class:`MegalossConfig` or a dict of it).
        **kwargs: the rest of ``Trainer``'s arguments (datasets, collator, callbacks...).

    After ``train()``, ``trainer.model`` is the wrapper; ``trainer.model.model`` the HF model
    (its ``lm_head`` is megaloss's head, holding the same weight Parameter).

    Raises:
        ValueError: ``tensor_parallel_size > 1`` or ``sequence_parallel_size > 1`` in the section
            (or DeepSpeed's own ``sequence_parallel_size``), or ``args.parallelism_config`` with
            tensor / context / sequence parallelism: each refused with the reason (use
            megaloss's own DeepSpeed loop); an invalid section.
        megaloss.calibration.EngineScaleError: on the first training micro-batch, an engine
            whose gradient scale megaloss cannot compensate.
    """

    loss_is_scaled_for_ga = True  # compute_loss's value is already calibrated for accumulation

    def __init__(self, model: torch.nn.Module = None, args: Any = None, *,
                 megaloss_config: Union[MegalossConfig, Mapping[str, Any], None] = None,
                 **kwargs: Any) -> None:
        if megaloss_config is None:
            cfg = megaloss_config_from_args(args)
        elif isinstance(megaloss_config, MegalossConfig):
            cfg = megaloss_config
        else:
            cfg = load_megaloss_config({"megaloss": dict(megaloss_config)})
        _refuse_model_parallelism(cfg, args)
        self.megaloss_config = cfg
        self.loss_reduction = cfg.ce.loss_reduction
        assert self.loss_reduction in LOSS_REDUCTIONS
        if model is not None and not isinstance(model, CausalLMWithLoss):
            model = CausalLMWithLoss(model, options=cfg.ce.options())
        self._parts = torch.zeros(3, dtype=torch.float64)  # ce, z, tokens since the last log
        self._parts_steps = 0
        self._eval_parts = torch.zeros(4, dtype=torch.float64)  # sum u*l, sum u*z, sum u, tokens
        self._engine_scale: Optional[tuple] = None  # (id of the engine, measured 1 / c)
        super().__init__(model=model, args=args, **kwargs)

    # process groups and the engine's scale ---------------------------------------------------
    def _engine(self) -> Any:
        """The engine accelerate wrapped the model in (a DeepSpeed engine, DDP), or None."""
        wrapped = getattr(self, "model_wrapped", None)
        return None if wrapped is None or wrapped is self.model else wrapped

    def _dp_group(self):
        """The group the engine reduces gradients over (its data-parallel group): the DeepSpeed
        engine's sequence-data-parallel group, DDP's ``process_group``; one rank when the
        Trainer is not distributed (even if ``torch.distributed`` is initialized)."""
        if not (dist.is_available() and dist.is_initialized()):
            return SINGLE_RANK
        engine = self._engine()
        if engine is not None and hasattr(engine, "set_gradient_accumulation_boundary"):
            group = engine_reduce_group(engine)
            return None if group is None else group
        if engine is not None and hasattr(engine, "process_group"):  # DDP
            return engine.process_group
        acc = getattr(self, "accelerator", None)
        if acc is not None and acc.num_processes == 1:
            return SINGLE_RANK
        return None

    def _loss_multiplier(self) -> float:
        """``1 / c`` of the engine path the Trainer's backward takes (its loss is not divided by
        the accumulation steps: ``loss_is_scaled_for_ga``), measured once on the engine accelerate
        built (:mod:`megaloss.calibration.engine_scale`): DeepSpeed by a probe engine from the
        real engine's final ds_config (``engine.backward`` with ``scale_wrt_gas`` divides by its
        ``G``, the Trainer's ``scale_wrt_gas=False`` does not: ``G / c``), DDP by a probe over
        its ``process_group``, 1 without an engine. Collective on the first training
        micro-batch (every rank runs it)."""
        engine = self._engine()
        key = id(engine)
        if self._engine_scale is not None and self._engine_scale[0] == key:
            return self._engine_scale[1]
        if engine is None or self._dp_group() is SINGLE_RANK:
            multiplier = 1.0
        elif hasattr(engine, "set_gradient_accumulation_boundary"):
            from ..deepspeed.probe import probe_deepspeed
            config = getattr(getattr(engine, "_config", None), "_param_dict", None) \
                or engine.config
            scale = probe_deepspeed(config, mpu=getattr(engine, "mpu", None),
                                    group=self._dp_group())
            multiplier = scale.loss_multiplier / scale.gradient_accumulation_steps
        else:
            from ...calibration.engine_scale import probe_ddp
            device = next(self.model.parameters()).device
            scale = probe_ddp(gas=self.args.gradient_accumulation_steps,
                              process_group=self._dp_group(),
                              device=device if device.type == "cuda" else None)
            multiplier = scale.loss_multiplier
        self._engine_scale = (key, float(multiplier))
        return float(multiplier)

    def _all_reduce_cpu(self, t: torch.Tensor) -> torch.Tensor:
        """SUM over the data-parallel ranks of a small CPU tensor (itself on one rank)."""
        group = self._dp_group()
        if group is SINGLE_RANK:
            return t
        device = self.args.device if dist.get_backend(group) != "gloo" else torch.device("cpu")
        t = t.to(device)
        dist.all_reduce(t, group=group)
        return t.cpu()

    # calibration ---------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> tuple:
        """Fetch the step's micro-batches and attach ``shift_labels`` / ``loss_weights``.

        Every rank calls this once per optimizer step (also with fewer or no batches left), so
        the one all-reduce of :func:`compute_loss_weights` is matched.
        """
        batches: List[Dict[str, Any]] = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        ignore = self.megaloss_config.ce.options().ignore_index
        shifted = []
        for b in batches:
            if "shift_labels" in b:
                shifted.append(torch.as_tensor(b["shift_labels"]).to(device))
            elif "labels" in b:
                shifted.append(causal_shift(torch.as_tensor(b["labels"]).to(device), ignore))
            else:
                raise ValueError("MegalossTrainer needs 'labels' (or 'shift_labels') in every "
                                 "batch (DataCollatorForLanguageModeling(mlm=False) gives them)")
        positions = [b.get("position_ids") for b in batches]
        positions = None if all(p is None for p in positions) else [
            None if p is None else torch.as_tensor(p).to(device) for p in positions]
        labels_for_weights = shifted or [torch.full((1,), ignore, dtype=torch.long, device=device)]
        lw = compute_loss_weights(labels_for_weights, self.loss_reduction, group=self._dp_group(),
                                  ignore_index=ignore, position_ids=positions
                                  if shifted else None, dtype=loss_weight_dtype(self.model))
        for i, b in enumerate(batches):
            b.pop("labels", None)
            b["shift_labels"] = shifted[i]
            b["loss_weights"] = lw.weights[i]
        if batches:
            self._parts[2] += float(lw.num_tokens)
            self._parts_steps += 1
        return batches, lw.num_tokens

    def compute_loss(self, model: torch.nn.Module, inputs: Dict[str, Any],
                     return_outputs: bool = False,
                     num_items_in_batch: Optional[Any] = None) -> Any:
        """Training (inputs carry ``loss_weights``): ``W * sum_t w_t l_t``, its CE and z-loss
        parts accumulated for :meth:`log`. Evaluation: ``sum_t u_t l_t / sum_t u_t`` of the
        micro-batch (``u_t`` the unnormalised ``loss_reduction`` weights), the sums accumulated
        for :meth:`evaluation_loop`."""
        kwargs = {k: inputs[k] for k in _MODEL_INPUTS if inputs.get(k) is not None}
        weights = inputs.get("loss_weights")
        if "shift_labels" in inputs:
            shift_labels = inputs["shift_labels"]
        else:
            shift_labels = causal_shift(inputs["labels"], self.megaloss_config.ce.options()
                                        .ignore_index)
        if weights is None:  # evaluation: u_t unnormalised, summed over the set in _eval_parts
            shift_labels = self._without_repeated_eval_rows(shift_labels)
            positions = inputs.get("position_ids")
            raw = raw_token_weights(shift_labels, self.loss_reduction,
                                    ignore_index=self.megaloss_config.ce.options().ignore_index,
                                    position_ids=positions, dtype=loss_weight_dtype(model))
            out = model(shift_labels=shift_labels, loss_weights=raw, **kwargs)
            den = raw.detach().double().sum().cpu()
            self._eval_parts += torch.stack([out.loss.detach().double().cpu(),
                                             out.z_loss.detach().double().cpu(), den,
                                             out.num_valid_tokens.detach().double().cpu()])
            loss = out.loss / den.to(out.loss).clamp_min(torch.finfo(torch.float32).tiny)
            return (loss, {}) if return_outputs else loss
        out = model(shift_labels=shift_labels, loss_weights=weights, **kwargs)
        loss = out.loss * self._loss_multiplier()
        if model.training:
            z = out.z_loss.detach().double().cpu()
            self._parts[0] += float(out.loss.detach().double().cpu() - z)
            self._parts[1] += float(z)
        return (loss, {}) if return_outputs else loss

    # evaluation ----------------------------------------------------------------------------------
    def _without_repeated_eval_rows(self, shift_labels: torch.Tensor) -> torch.Tensor:
        """``shift_labels`` with the rows that accelerate repeated to even out the last evaluation
        batch set to ``ignore_index``: the rows ``gather_for_metrics`` drops (the gathered batch,
        rank after rank, is cut to ``gradient_state.remainder`` rows)."""
        acc = getattr(self, "accelerator", None)
        if acc is None or acc.num_processes == 1 or not acc.even_batches:
            return shift_labels
        state = acc.gradient_state
        if not state.end_of_dataloader or state.remainder <= 0:
            return shift_labels
        rows = shift_labels.shape[0]
        first = acc.process_index * rows  # even_batches: every rank's last batch has `rows` rows
        repeated = torch.arange(first, first + rows, device=shift_labels.device) >= \
            state.remainder
        if not bool(repeated.any()):
            return shift_labels
        ignore = self.megaloss_config.ce.options().ignore_index
        return shift_labels.masked_fill(repeated.view(-1, *([1] * (shift_labels.dim() - 1))),
                                        ignore)

    def prediction_step(self, model: torch.nn.Module, inputs: Dict[str, Any],
                        prediction_loss_only: bool,
                        ignore_keys: Optional[List[str]] = None) -> tuple:
        """The loss only (the wrapped model has no logits): ``(loss, None, None)``.

        Raises:
            ValueError: a batch without ``labels`` / ``shift_labels``.
        """
        if "labels" not in inputs and "shift_labels" not in inputs:
            raise ValueError("MegalossTrainer evaluates a loss: every evaluation batch needs "
                             "'labels' (or 'shift_labels')")
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def evaluation_loop(self, dataloader: Any, description: str,
                        prediction_loss_only: Optional[bool] = None,
                        ignore_keys: Optional[List[str]] = None,
                        metric_key_prefix: str = "eval") -> Any:
        """The stock loop, then ``{prefix}_loss`` replaced by the calibrated loss of the whole
        set (module docstring) and its parts added."""
        self._eval_parts = torch.zeros(4, dtype=torch.float64)
        output = super().evaluation_loop(dataloader, description,
                                         prediction_loss_only=prediction_loss_only,
                                         ignore_keys=ignore_keys,
                                         metric_key_prefix=metric_key_prefix)
        num, z, den, tokens = self._all_reduce_cpu(self._eval_parts).tolist()
        scale = 1.0 / den if den > 0 else 0.0
        output.metrics[f"{metric_key_prefix}_loss"] = num * scale
        output.metrics[f"{metric_key_prefix}_ce_loss"] = (num - z) * scale
        output.metrics[f"{metric_key_prefix}_z_loss"] = z * scale
        output.metrics[f"{metric_key_prefix}_num_valid_tokens"] = tokens
        return output

    # logging -------------------------------------------------------------------------------------
    def log(self, logs: Dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add ``ce_loss``, ``z_loss`` and ``num_valid_tokens`` (per optimizer step, averaged
        since the last log; one all-reduce) to the Trainer's training logs."""
        if "loss" in logs and self._parts_steps > 0:
            parts = self._all_reduce_cpu(self._parts[:2].clone())
            steps = self._parts_steps
            logs = dict(logs)
            logs["ce_loss"] = round(float(parts[0]) / steps, 6)
            logs["z_loss"] = round(float(parts[1]) / steps, 8)
            logs["num_valid_tokens"] = float(self._parts[2]) / steps
            self._parts.zero_()
            self._parts_steps = 0
        super().log(logs, *args, **kwargs)
