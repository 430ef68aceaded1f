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
  ds_config's ``"megaloss"`` section, :func:`megaloss.integrations.config.load_megaloss_config`);
- the Trainer's micro-batch loop runs megaloss's one calibrated step in two halves
  (:class:`megaloss.integrations.step.CalibratedStep`, the LM family of
  :mod:`megaloss.integrations.step.lm`); the Trainer keeps its own backward and optimizer step;
- ``get_batch_samples``: the step's micro-batches are checked (agreed on by every rank) and
  calibrated together (one all-reduce of 3 numbers over the data-parallel group): every batch
  gets ``shift_labels`` (HF's ``labels`` shifted, or the
  collator's ``shift_labels`` as they are) and ``loss_weights`` ``w_t = u_t / D`` (``u_t`` 1,
  ``1/n_s`` or ``1/sqrt(n_s)``, ``D`` the global sum of ``u_t`` over the step's micro-batches and
  ranks: XTuner v1's ``token`` / ``sample`` / ``square``);
- the data-parallel group is the one the engine accelerate built reduces over (DeepSpeed's
  sequence-data-parallel group, DDP's ``process_group``; one rank when the Trainer is not
  distributed, even with ``torch.distributed`` initialized), never assumed to be the world:
  the calibration's all-reduce and the logs' run over it;
- ``compute_loss`` returns ``M * sum_t w_t l_t`` (the step's
  :meth:`~megaloss.integrations.step.CalibratedStep.micro_batch_loss`) and
  :attr:`loss_is_scaled_for_ga` is True, so the Trainer neither divides by the accumulation
  steps nor lets DeepSpeed do it (``scale_wrt_gas=False``). ``M = 1 / c`` is *measured* before
  the first training step (:mod:`megaloss.calibration.engine_scale`, as megaloss's own loop
  does): the engine exists only once ``trainer.train()`` has let accelerate build it, so the
  probe runs then, DeepSpeed's on a tiny engine from the real engine's final ds_config and
  groups (:func:`megaloss.calibration.deepspeed_scale.probe_deepspeed`, times the probe's ``G``,
  which ``scale_wrt_gas=False`` skips), DDP's over its ``process_group``
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

Scope: data parallelism (DDP, DeepSpeed ZeRO 0-3), and DeepSpeed AutoTP. megaloss's own
tensor parallelism and sequence parallelism are refused with the reason: accelerate builds the
engine without megaloss's ``Topology``, so the head would not be vocab-parallel over a TP group
and the Trainer's sampler gives every rank whole sequences, not sequence-parallel slices;
megaloss's own DeepSpeed loop supports both.

DeepSpeed AutoTP (``"tensor_parallel": {"autotp_size": N, "vocab_parallel_lm_head": true}`` in the
ds_config, ZeRO 0-2): what transformers 5.x and accelerate 1.x do with that section is
everything AutoTP needs: transformers' ``deepspeed_init``
(``transformers/integrations/deepspeed.py``) calls ``deepspeed.tp_model_init``, which in
deepspeed 0.19.8 only records the TP size (the sharding happens inside ``deepspeed.initialize``,
``_apply_autotp_partitioning``); accelerate's ``_prepare_deepspeed``
(``accelerate/accelerator.py``) makes a ``("tp",)`` device mesh, with which its data loaders
give the ranks of one TP group the same batches (``accelerate/data_loader.py``, process index
``// tp``); transformers' ``get_tp_size`` reads ``autotp_size`` (used by the stock
``num_items_in_batch`` / loss scale, which this class replaces). The stock loss would run on
AutoTP's vocab-parallel head without gathering its logits; here the model is wrapped in
:class:`~megaloss.integrations.autotp.AutoTPCausalLMWithLoss` instead (its
``nn.Linear`` lm_head is what AutoTP shards into a ``VocabParallelLinear``; megaloss's CE then
runs on that shard), the calibration's all-reduce runs over the engine's data-parallel group
(AutoTP's, without the TP peers, which hold the same batch), and the engine scale is measured
on a probe engine of the same ds_config, as above. A tied input embedding stays tied: AutoTP
makes it a ``VocabParallelEmbedding`` on the head's own shard (see ``AutoTPCausalLMWithLoss``).

PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``), two ways in:

- accelerate's FSDP2 (``TrainingArguments(fsdp=True, fsdp_config={"version": 2, ...})``, an
  accelerate ``FullyShardedDataParallelPlugin(fsdp_version=2)``, or an accelerate config file
  with ``fsdp_version: 2`` given to ``accelerate launch --config_file``: the launcher sets
  ``ACCELERATE_USE_FSDP=true``, ``FSDP_VERSION=2``, ... and ``Accelerator`` builds the plugin
  from that environment): ``Accelerator.prepare`` shards
  the wrapper with ``fsdp2_prepare_model`` (``accelerate/utils/fsdp_utils.py``): ``fully_shard``
  on each module its auto-wrap policy picks (the transformer policy reads
  ``_no_split_modules``), on the input embedding, on ``[final norm, get_output_embeddings()]``
  (``[final norm, input embedding, output embedding]`` when tied) with
  ``reshard_after_forward=False``, then on the model as the root. The wrapper exposes the
  wrapped model's ``_no_split_modules`` and ``get_output_embeddings`` (the loss head) to it, so
  it gets the layout accelerate gives the plain ``*ForCausalLM``: decoder layers in their own
  units, the loss head in the output-embedding unit (with the input embedding when tied; without
  ``get_output_embeddings`` the tied weight would sit in the embedding's unit and also be read by
  the root's head: torch's duplicate-parameter error at the first forward). The loss head's
  forward is a module call inside that unit, which unshards its weight first.
  accelerate 1.15 enables FSDP only for accelerator-backed distributed types
  (``accelerate/state.py``: ``MULTI_GPU``, ``MULTI_XPU``, ...): on CPU (``MULTI_CPU``, gloo) it
  drops the plugin and wraps the model in DDP, so :class:`MegalossTrainer` refuses
  ``args.fsdp`` (or ``ACCELERATE_USE_FSDP=true``) there with the way below;
- a model already ``fully_shard``-ed (any device, ``args.fsdp`` unset): the
  :class:`~megaloss.CausalLMWithLoss` sharded after wrapping, with the wrapper itself as the root
  FSDP unit (every trainable parameter a DTensor). accelerate's DDP would refuse its DTensor
  parameters (``prepare_model``: "incompatible with DDP"), so the Trainer is told that the model
  owns its placement and gradient reduction (transformers' flag for models sharded at load time,
  ``is_distributed_loading_by_transformers``: ``prepare_model(evaluation_mode=True)``, no DDP, no
  second sharding), and its ``_run_epoch`` turns FSDP2's gradient sync off on the non-final
  micro-batches of a step (``_defer_fsdp_gradient_reduction``, here
  ``set_requires_gradient_sync(False)``, as accelerate's ``no_sync`` does under FSDP2).

Either way the calibration's all-reduce runs over the ranks of the model's mesh (which must be
the Trainer's processes: its data loaders give each a different batch), and ``M = 1 / c`` is
measured by :func:`megaloss.calibration.probe_fsdp` on the sharded model (its mesh, reduce dtype,
``set_gradient_divide_factor`` and sum-only flag) with the Trainer's accumulation (``no_sync``,
or ``sync`` with ``sync_each_batch``), before the first training forward; not assumed to be
DDP's (FSDP2's default average gives the mesh size, a divide factor ``f`` gives ``f``). FSDP1
(``fsdp_version`` 1) is refused: no probe measures its flat-parameter reduction.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Union

import torch
import torch.distributed as dist

from ...calibration.calibrator import LossCalibrator, StepCalibration
from ...calibration.deepspeed_scale import engine_reduce_group
from ...calibration.engine_scale import EngineScale
from ...calibration.weights import LOSS_REDUCTIONS, loss_weight_dtype, raw_token_weights
from ...losses.router_options import RouterLossOptions
from ...ops.labels import causal_shift
from ...ops.validation import is_dtensor
from ...parallel.comm import all_reduce_max_
from ...parallel.groups import SINGLE_RANK, group_ranks, group_size
from ...parallel.topology import Topology
from ..config import MegalossConfig, ds_config_autotp_size, load_megaloss_config
from ..lm_head import refuse_unsummed
from ..step.lm import LanguageModelLoss
from ..step.loop import CalibratedStep
from .causal_lm import CausalLMWithLoss

try:
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - transformers is the hf extra
    raise ImportError("megaloss.integrations.hf.trainer needs transformers "
                      "(pip install 'megaloss[hf]')") from err

__all__ = ["MegalossTrainer", "megaloss_config_from_args"]

_MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")
# where get_batch_samples marks a batch with its index in the step (compute_loss reads it)
MICRO_BATCH_KEY = "megaloss_micro_batch"


class TrainerCausalLMLoss(LanguageModelLoss):
    """The Trainer's batches as the calibrated step's LM family
    (:class:`megaloss.integrations.step.lm.LanguageModelLoss`): labels as collators give them
    (Hugging Face's unshifted ``labels`` or ``shift_labels``, tensors or lists), moved to the
    Trainer's ``device``; ``position_ids`` mark packed samples; a step with no batch left on
    this rank still calibrated (its all-reduce entered with one ignored label); a micro-batch's
    stats are its CE and z-loss parts (float64, CPU) for the Trainer's logs. ``router``: the
    router losses of a mixture-of-experts model (the ``megaloss.router`` section), every rank
    of the step then holding the same number of micro-batches (checked with the calibration's
    collective: a pool's all-reduce inside the forward must be entered by every rank)."""

    def __init__(self, device: torch.device,
                 router: Optional[RouterLossOptions] = None) -> None:
        super().__init__(router=router)
        self.device = device

    def check(self, i: int, mb: Mapping[str, Any], topology: Topology) -> None:
        if "shift_labels" not in mb and "labels" not in mb:
            raise ValueError("MegalossTrainer needs 'labels' (or 'shift_labels') in every "
                             "batch (DataCollatorForLanguageModeling(mlm=False) gives them)")

    def calibrate(self, calibrator: LossCalibrator,
                  micro_batches: List[Mapping[str, Any]]) -> StepCalibration:
        ignore, device = calibrator.ignore_index, self.device
        shifted = [torch.as_tensor(b["shift_labels"]).to(device) if "shift_labels" in b else
                   causal_shift(torch.as_tensor(b["labels"]).to(device), ignore)
                   for b in micro_batches]
        if self.router:
            _same_count_on_every_rank(len(micro_batches), calibrator.topology, device)
        if not shifted:
            return calibrator.begin_step([torch.full((1,), ignore, dtype=torch.long,
                                                     device=device)])
        positions = [b.get("position_ids") for b in micro_batches]
        positions = None if all(p is None for p in positions) else [
            None if p is None else torch.as_tensor(p).to(device) for p in positions]
        return calibrator.begin_step(shifted, position_ids=positions)

    def loss(self, forward, step: StepCalibration, i: int, mb: Mapping[str, Any]):
        # z: the z-loss part, float64 [1]; router: the router losses' figures (their part of
        # the loss last), which the CE part excludes
        loss, (z, router) = super().loss(forward, step, i, mb)
        ce = loss.detach().double().reshape(1) - z
        if router is not None:
            ce = ce - router[0][3]
        return loss, torch.cat([ce, z]).cpu()


def _same_count_on_every_rank(count: int, topology: Topology, device: torch.device) -> None:
    """Router losses all-reduce inside each micro-batch's forward: every rank must hold the
    same number of micro-batches (the Trainer's last window may not).

    Raises:
        ValueError: on every rank alike, when the counts differ.
    """
    counts = torch.tensor([count, -count], dtype=torch.float64, device=device)
    all_reduce_max_(counts, topology.dp_sp_group)
    if int(counts[0]) != -int(counts[1]):
        raise ValueError(f"the ranks hold between {-int(counts[1])} and {int(counts[0])} "
                         f"micro-batches in this step: router losses need the same number on "
                         f"every rank (drop the last incomplete window: dataloader_drop_last="
                         f"True)")


def megaloss_config_from_args(args: Any) -> MegalossConfig:
    """The ``"megaloss"`` section of ``args.deepspeed`` (a ds_config path or dict; defaults
    without one)."""
    ds = getattr(args, "deepspeed", None)
    if isinstance(ds, (str, os.PathLike, Mapping)):
        return load_megaloss_config(ds)
    return MegalossConfig()


def _ds_config_dict(args: Any) -> Dict[str, Any]:
    """The ds_config of ``args`` as a dict (``{}`` without one): the one ``TrainingArguments``
    parsed (``hf_deepspeed_config.config``), else ``args.deepspeed`` read."""
    hf = getattr(args, "hf_deepspeed_config", None)
    if isinstance(getattr(hf, "config", None), Mapping):
        return dict(hf.config)
    ds = getattr(args, "deepspeed", None)
    if isinstance(ds, Mapping):
        return dict(ds)
    if isinstance(ds, (str, os.PathLike)):
        with open(ds, encoding="utf-8") as f:
            return json.load(f)
    return {}


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
            f"if they held data; {_USE_OWN_LOOP}; or DeepSpeed AutoTP in the ds_config "
            "(tensor_parallel.autotp_size with vocab_parallel_lm_head=true, "
            "megaloss.tensor_parallel_size 1), which MegalossTrainer runs")
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


def _fsdp2_units(model: Optional[torch.nn.Module]) -> List[torch.nn.Module]:
    """The FSDP2 (``fully_shard``) modules under ``model`` (none without torch's FSDP2)."""
    if model is None:
        return []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _check_presharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a loss wrapper) is already ``fully_shard``-ed, checked to be usable
    as it is: the wrapper itself the root FSDP unit, every trainable parameter a DTensor.

    Raises:
        ValueError: some parameters sharded, but the wrapper is not a ``fully_shard`` root or a
            trainable parameter is not sharded (accelerate would neither reduce it nor wrap it).
    """
    sharded = [n for n, p in model.named_parameters() if is_dtensor(p)]
    if not sharded and not _fsdp2_units(model):
        return False
    from torch.distributed.fsdp import FSDPModule
    plain = [n for n, p in model.named_parameters() if p.requires_grad and not is_dtensor(p)]
    if not isinstance(model, FSDPModule) or plain:
        what = (f"{type(model).__name__} itself is not fully_shard-ed" if
                not isinstance(model, FSDPModule) else f"{plain[0]} is not sharded")
        raise ValueError(
            f"MegalossTrainer got a partly FSDP2-sharded model ({what}): apply fully_shard to "
            "the wrapper's modules (each decoder layer, optionally the input embedding and the "
            "loss head) and then to the CausalLMWithLoss wrapper itself as the root, so every "
            "parameter is sharded and reduced by FSDP2 and the loss head runs inside an "
            "FSDP-managed forward")
    return True


def _expose_to_accelerate_fsdp2(wrapper: torch.nn.Module) -> None:
    """Let accelerate's ``fsdp2_prepare_model`` lay ``wrapper`` out as it does the wrapped
    ``*ForCausalLM`` (module docstring): its ``_no_split_modules`` (the transformer auto-wrap
    policy's default classes) and ``get_output_embeddings`` (the loss head; tied, it joins the
    input embedding's unit)."""
    inner = getattr(wrapper, "model", None)
    if inner is None:
        return
    no_split = getattr(inner, "_no_split_modules", None)
    if no_split is not None and "_no_split_modules" not in wrapper.__dict__:
        wrapper._no_split_modules = list(no_split)
    if callable(getattr(inner, "get_output_embeddings", None)):
        wrapper.get_output_embeddings = inner.get_output_embeddings


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

    Under DeepSpeed AutoTP (the ds_config's ``tensor_parallel.autotp_size > 1``) the model is
    wrapped in ``AutoTPCausalLMWithLoss`` instead, and ``trainer.model.model`` is the decoder
    (module docstring).

    Under FSDP2 (module docstring): accelerate's (``args.fsdp`` with ``fsdp_config`` version 2,
    on an accelerator), or a :class:`~megaloss.CausalLMWithLoss` already ``fully_shard``-ed with
    the wrapper as the root (then without ``args.fsdp``; the way on CPU / gloo). Its parameters
    stay DTensors: read them with ``full_tensor()``.

    Raises:
        ValueError: ``tensor_parallel_size > 1`` or ``sequence_parallel_size > 1`` in the section
            (or DeepSpeed's own ``sequence_parallel_size``), or ``args.parallelism_config`` with
            tensor / context / sequence parallelism: each refused with the reason (use
            megaloss's own DeepSpeed loop); an invalid section; under AutoTP what megaloss
            refuses there (``vocab_parallel_lm_head`` unset, ZeRO-3).
        TypeError: under AutoTP a ``CausalLMWithLoss`` (its lm_head is no ``nn.Linear``).
        ValueError (FSDP): ``args.fsdp`` or ``ACCELERATE_USE_FSDP=true`` (an FSDP config file
            given to ``accelerate launch``) where accelerate does not enable FSDP (CPU: it would
            train DDP) and the model is not pre-sharded, naming the pre-sharded way; accelerate's
            FSDP1; a partly sharded wrapper (the root not ``fully_shard``-ed, a trainable
            parameter not sharded); a ``*ForCausalLM`` sharded before wrapping
            (``CausalLMWithLoss``'s refusal); a mesh whose ranks are not the Trainer's processes
            (before the first training step).
        megaloss.calibration.EngineScaleError: before the first training step, an engine
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
        ds_dict = _ds_config_dict(args)
        self.autotp_size = ds_config_autotp_size(ds_dict)
        if self.autotp_size > 1:  # module docstring; what megaloss refuses under AutoTP, here
            load_megaloss_config(ds_dict)  # vocab_parallel_lm_head, ZeRO-3, both TP schemes
            model = self._autotp_model(model, cfg)
        elif model is not None and not isinstance(model, CausalLMWithLoss):
            model = CausalLMWithLoss(model, options=cfg.ce.options())
        else:
            refuse_unsummed(model, "MegalossTrainer")
        presharded = model is not None and _check_presharded(model)
        self._parts = torch.zeros(3, dtype=torch.float64)  # ce, z, tokens since the last log
        self._parts_steps = 0
        self._eval_parts = torch.zeros(4, dtype=torch.float64)  # sum u*l, sum u*z, sum u, tokens
        self._engine_scale: Optional[tuple] = None  # (id of the engine, measured 1 / c)
        self._step: Optional[CalibratedStep] = None  # the optimizer step being trained
        self._fsdp_group_cache: Optional[tuple] = None  # (id of the model, its mesh's group)
        super().__init__(model=model, args=args, **kwargs)
        self._setup_fsdp2(presharded)

    def _setup_fsdp2(self, presharded: bool) -> None:
        """Accelerate's FSDP2 or a pre-sharded model (module docstring); the refusals."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if self.is_fsdp_enabled and getattr(plugin, "fsdp_version", 1) != 2:
            raise ValueError(
                "MegalossTrainer supports accelerate's FSDP2 (fsdp_config={'version': 2}), not "
                "FSDP1: megaloss measures FSDP2's gradient factor (probe_fsdp), not FSDP1's "
                "flat-parameter reduction")
        if self.is_fsdp_enabled:
            if not presharded:
                _expose_to_accelerate_fsdp2(self.model)
            return
        requested = ("TrainingArguments.fsdp is set" if getattr(self.args, "fsdp", None) else
                     "ACCELERATE_USE_FSDP=true (accelerate launch with an FSDP config file)"
                     if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
                     else None)
        if requested and not presharded:
            raise ValueError(
                f"{requested}, but accelerate did not enable FSDP "
                f"(distributed type {self.accelerator.distributed_type}): accelerate 1.x enables "
                "it only on accelerators (accelerate/state.py), and on CPU would train plain DDP. "
                "For FSDP2 on CPU / gloo, shard the model before the Trainer: wrap it "
                "(megaloss.CausalLMWithLoss(model, options=...)), apply "
                "torch.distributed.fsdp.fully_shard to each decoder layer and then to the wrapper "
                "as the root, and pass the wrapper without args.fsdp or an FSDP accelerate config")
        if presharded:
            # transformers' path for a model that owns its sharding (no DDP, no second
            # fully_shard: Trainer._prepare_for_training; no_sync: below)
            self.is_distributed_loading_by_transformers = True

    @staticmethod
    def _autotp_model(model: Optional[torch.nn.Module], cfg: MegalossConfig):
        """The model under DeepSpeed AutoTP: ``AutoTPCausalLMWithLoss`` of the ``*ForCausalLM``
        (AutoTP shards its ``nn.Linear`` lm_head inside ``deepspeed.initialize``)."""
        from ..autotp import AutoTPCausalLMWithLoss

        if model is None or isinstance(model, AutoTPCausalLMWithLoss):
            return model
        if isinstance(model, CausalLMWithLoss):
            raise TypeError("under DeepSpeed AutoTP (ds_config tensor_parallel.autotp_size > 1) "
                            "pass the *ForCausalLM itself (or AutoTPCausalLMWithLoss): "
                            "CausalLMWithLoss replaced its nn.Linear lm_head, which AutoTP "
                            "shards")
        return AutoTPCausalLMWithLoss(model, options=cfg.ce.options())

    # process groups and the engine's scale ---------------------------------------------------
    def _fsdp2_model(self) -> Optional[torch.nn.Module]:
        """The trained model when it is ``fully_shard``-ed (accelerate's FSDP2 after
        ``prepare``, or pre-sharded), else None."""
        model = getattr(self, "model", None)
        return model if _fsdp2_units(model) else None

    def _fsdp2_accumulation(self) -> str:
        """How the Trainer accumulates under FSDP2 (:func:`~megaloss.calibration.probe_fsdp`'s
        ``accumulation``): ``no_sync`` (accelerate's ``no_sync`` / the Trainer's
        ``_defer_fsdp_gradient_reduction`` turn the sync off on non-final micro-batches),
        ``sync`` with ``sync_each_batch``."""
        kwargs = self.accelerator.gradient_state.plugin_kwargs
        return "sync" if kwargs.get("sync_each_batch", False) else "no_sync"

    def _fsdp2_group(self, model: torch.nn.Module):
        """The process group over the ranks of ``model``'s FSDP2 mesh (both dimensions for
        HSDP), checked to be the Trainer's processes.

        Raises:
            ValueError: the mesh's ranks are not all of accelerate's processes.
        """
        if self._fsdp_group_cache is not None and self._fsdp_group_cache[0] == id(model):
            return self._fsdp_group_cache[1]
        from ...calibration.fsdp_scale import fsdp_meshes, mesh_group

        meshes = fsdp_meshes(model)
        ranks_of = {tuple(m.mesh.reshape(-1).tolist()) for m in meshes}
        ranks = sorted(next(iter(ranks_of))) if meshes else []
        processes = list(range(self.accelerator.num_processes))
        if len(ranks_of) != 1 or ranks != processes:
            raise ValueError(
                f"MegalossTrainer under FSDP2 needs one mesh over the Trainer's processes "
                f"{processes}, got meshes {sorted(ranks_of)}: accelerate's data loaders give "
                "every process its own batch, so the calibration and the gradient reduction must "
                "span them all")
        group = mesh_group(meshes[0])
        self._fsdp_group_cache = (id(model), group)
        return group

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
        fsdp = self._fsdp2_model()
        if fsdp is not None:  # FSDP2: its mesh's ranks
            return self._fsdp2_group(fsdp)
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
        its ``process_group``, FSDP2 by :func:`~megaloss.calibration.probe_fsdp` on the sharded
        model, 1 without an engine. Collective before the first training step (every rank
        runs it)."""
        fsdp = self._fsdp2_model()
        engine = self._engine() if fsdp is None else fsdp
        key = id(engine)
        if self._engine_scale is not None and self._engine_scale[0] == key:
            return self._engine_scale[1]
        if fsdp is not None:
            from ...calibration.fsdp_scale import probe_fsdp
            self._fsdp2_group(fsdp)  # the mesh is the Trainer's processes
            scale = probe_fsdp(fsdp, gas=self.args.gradient_accumulation_steps,
                               accumulation=self._fsdp2_accumulation())
            multiplier = scale.loss_multiplier
        elif engine is None or self._dp_group() is SINGLE_RANK:
            multiplier = 1.0
        elif hasattr(engine, "set_gradient_accumulation_boundary"):
            from ...calibration.deepspeed_scale import probe_deepspeed
            config = getattr(getattr(engine, "_config", None), "_param_dict", None) \
                or engine.config
            # under AutoTP the engine's mpu is deepspeed.utils.groups, made by the engine from
            # the config: the probe builds its own from the config, as initialize's AutoTP path
            # (its batch size counts every rank, as DeepSpeed's and transformers' "auto" do)
            mpu = None if self.autotp_size > 1 else getattr(engine, "mpu", None)
            scale = probe_deepspeed(config, mpu=mpu, group=self._dp_group())
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
    def _calibrator(self) -> LossCalibrator:
        """The step's :class:`~megaloss.LossCalibrator`: over the engine's data-parallel group,
        with the measured loss multiplier (:meth:`_loss_multiplier`, collective on the first
        call)."""
        group = self._dp_group()
        multiplier = float(self._loss_multiplier())
        size = group_size(group)
        scale = EngineScale("transformers.Trainer", 1.0 / multiplier, multiplier, 1, size,
                            1.0 / multiplier, tuple(group_ranks(group)))
        return LossCalibrator(Topology(dp_group=group, dp_sp_group=group),
                              loss_reduction=self.loss_reduction, engine_scale=scale,
                              ignore_index=self.megaloss_config.ce.options().ignore_index,
                              weight_dtype=loss_weight_dtype(self.model))

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> tuple:
        """Fetch the step's micro-batches and calibrate them: the one calibrated step's first
        half (:class:`megaloss.integrations.step.CalibratedStep`; :meth:`compute_loss` runs its
        per-micro-batch half). Every batch gets ``shift_labels`` and ``loss_weights``.

        Every rank calls this once per optimizer step (also with fewer or no batches left), so
        the checks' all-gather and the calibration's one all-reduce are matched.

        Raises:
            ValueError: a batch without ``labels`` / ``shift_labels`` (on every rank alike).
        """
        batches: List[Dict[str, Any]] = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        router = self.megaloss_config.router
        router = None if router is None else router.options()
        self._step = CalibratedStep(TrainerCausalLMLoss(device, router), self._calibrator(),
                                    batches,
                                    allow_empty=True)
        calibration = self._step.calibration
        for i, b in enumerate(batches):
            b.pop("labels", None)
            b["shift_labels"] = calibration.local_labels(i)
            b["loss_weights"] = calibration.weights(i)
            b[MICRO_BATCH_KEY] = i
        if batches:
            self._parts[2] += float(calibration.num_tokens)
            self._parts_steps += 1
        return batches, calibration.num_tokens

    def compute_loss(self, model: torch.nn.Module, inputs: Dict[str, Any],
                     return_outputs: bool = False,
                     num_items_in_batch: Optional[Any] = None) -> Any:
        """Training (a batch of :meth:`get_batch_samples`): the calibrated step's micro-batch
        loss, ``M * sum_t w_t l_t`` (:meth:`CalibratedStep.micro_batch_loss
        <megaloss.integrations.step.CalibratedStep.micro_batch_loss>`), its CE and z-loss parts
        accumulated for :meth:`log`. Evaluation: ``sum_t u_t l_t / sum_t u_t`` of the
        micro-batch (``u_t`` the unnormalised ``loss_reduction`` weights), the sums accumulated
        for :meth:`evaluation_loop`."""
        if MICRO_BATCH_KEY in inputs:
            def forward(input_ids: torch.Tensor, **kwargs: Any) -> Any:
                return model(input_ids=input_ids, **kwargs)

            loss = self._step.micro_batch_loss(int(inputs[MICRO_BATCH_KEY]), forward,
                                               micro_batch=inputs)
            if model.training:
                ce, z = self._step.stats[-1].tolist()
                self._parts[0] += ce
                self._parts[1] += z
            return (loss, {}) if return_outputs else loss
        kwargs = {k: inputs[k] for k in _MODEL_INPUTS if inputs.get(k) is not None}
        ignore = self.megaloss_config.ce.options().ignore_index
        if "shift_labels" in inputs:
            shift_labels = inputs["shift_labels"]
        else:
            shift_labels = causal_shift(inputs["labels"], ignore)
        # evaluation: u_t unnormalised, summed over the set in _eval_parts
        shift_labels = self._without_repeated_eval_rows(shift_labels)
        raw = raw_token_weights(shift_labels, self.loss_reduction, ignore_index=ignore,
                                position_ids=inputs.get("position_ids"),
                                dtype=loss_weight_dtype(model))
        out = model(shift_labels=shift_labels, loss_weights=raw, **kwargs)
        den = raw.detach().double().sum().cpu()
        self._eval_parts += torch.stack([out.loss.detach().double().cpu(),
                                         out.z_loss.detach().double().cpu(), den,
                                         out.num_valid_tokens.detach().double().cpu()])
        loss = out.loss / den.to(out.loss).clamp_min(torch.finfo(torch.float32).tiny)
        return (loss, {}) if return_outputs else loss

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self) -> Iterator[None]:
        """The Trainer's ``no_sync`` for a model that owns its FSDP2 sharding (its
        ``_run_epoch`` enters it on the non-final micro-batches of a step when the model is
        ``fully_shard``-ed and flagged as such; transformers' own version reads its
        ``DistributedConfig``, which a model sharded by hand has not): no gradient reduction
        until the step's last backward, as accelerate's ``no_sync`` under FSDP2."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    # evaluation ----------------------------------------------------------------------------------
    def _without_repeated_eval_rows(self, shift_labels: torch.Tensor) -> torch.Tensor:
        """``shift_labels`` with the rows that accelerate repeated to even out the last evaluation
        batch set to ``ignore_index``: the rows ``gather_for_metrics`` drops (the gathered batch,
        rank after rank, is cut to ``gradient_state.remainder`` rows)."""
        acc = getattr(self, "accelerator", None)
        tp = max(1, self.autotp_size)  # the ranks of one AutoTP group read the same batches
        if acc is None or acc.num_processes // tp == 1 or not acc.even_batches:
            return shift_labels
        state = acc.gradient_state
        if not state.end_of_dataloader or state.remainder <= 0:
            return shift_labels
        rows = shift_labels.shape[0]
        # even_batches: every data-parallel rank's last batch has `rows` rows
        first = (acc.process_index // tp) * rows
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
        set (module docstring) and its parts added. Under FSDP2 the model is resharded after it
        (units with ``reshard_after_forward=False``, the root's default, keep their parameters
        unsharded after a forward without backward)."""
        self._eval_parts = torch.zeros(4, dtype=torch.float64)
        output = super().evaluation_loop(dataloader, description,
                                         prediction_loss_only=prediction_loss_only,
                                         ignore_keys=ignore_keys,
                                         metric_key_prefix=metric_key_prefix)
        for unit in _fsdp2_units(getattr(self, "model", None)):
            unit.reshard()
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
        since the last log; one all-reduce) to the Trainer's training logs. Under FSDP2 the
        Trainer's ``loss`` (the mean over ranks of ``M * sum_t w_t l_t``) is rescaled by
        ``ranks / M``: the global loss also when ``M`` is not the rank count (a
        ``set_gradient_divide_factor``)."""
        if "loss" in logs and self._parts_steps > 0:
            parts = self._all_reduce_cpu(self._parts[:2].clone())
            steps = self._parts_steps
            logs = dict(logs)
            fsdp = self._fsdp2_model()
            if (fsdp is not None and self._engine_scale is not None
                    and self._engine_scale[0] == id(fsdp)):
                ranks = dist.get_world_size(self._dp_group())
                logs["loss"] = round(float(logs["loss"]) * ranks / self._engine_scale[1], 4)
            logs["ce_loss"] = round(float(parts[0]) / steps, 6)
            logs["z_loss"] = round(float(parts[1]) / steps, 8)
            logs["num_valid_tokens"] = float(self._parts[2]) / steps
            self._parts.zero_()
            self._parts_steps = 0
        super().log(logs, *args, **kwargs)
