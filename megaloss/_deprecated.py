"""Every deprecated public function of megaloss, in one place (removed in the next release). Each
keeps its old arguments and results and emits a :class:`DeprecationWarning` naming its
replacement; ``import megaloss`` exposes them under their old names (outside ``__all__``).

- ``linear_cross_entropy_with_stats``, ``linear_distillation_loss_with_stats``,
  ``mnr_loss_with_stats`` (and the older ``mnr_loss_with_metrics``): the loss function with
  ``return_stats=True`` (the return-value rule: a loss function returns its loss tensor;
  ``return_stats=True`` its ``*Output`` NamedTuple).
- ``vocab_parallel_linear_cross_entropy[_with_stats]``: :func:`megaloss.linear_cross_entropy`
  with ``vocab_parallel_options=VocabParallelOptions(tp_group, vocab_size, sequence_parallel)``.
- ``grad_cache``: :func:`megaloss.grad_cache_step` (the old name shadowed the module
  :mod:`megaloss.losses.grad_cache`).

The deprecated methods of the loss modules (``forward_with_stats``, ``forward_with_metrics``)
are :class:`megaloss._deprecation.ReturnStatsAliases`; deprecated keywords (``gather=``) are
renamed by :func:`megaloss._deprecation.renamed_keywords` on the function that takes them.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from ._deprecation import renamed_keywords, warn_renamed
from .losses.cross_entropy import CrossEntropyOutput, linear_cross_entropy
from .losses.distillation import DistillationOutput, linear_distillation_loss
from .losses.grad_cache import grad_cache_step
from .losses.mnr import MNROutput, mnr_loss
from .losses.vocab_parallel import VocabParallelOptions
from .parallel.groups import GroupLike

__all__ = ["linear_cross_entropy_with_stats", "linear_distillation_loss_with_stats",
           "mnr_loss_with_stats", "mnr_loss_with_metrics", "vocab_parallel_linear_cross_entropy",
           "vocab_parallel_linear_cross_entropy_with_stats", "grad_cache"]


def _with_stats(func: Callable[..., Any], old: str, new: str) -> Callable[..., Any]:
    """``func(..., return_stats=True)`` under the old name ``old`` (same signature, with the
    warning)."""

    @functools.wraps(func)
    def alias(*args: Any, **kwargs: Any) -> Any:
        warn_renamed(old, new)
        return func(*args, return_stats=True, **kwargs)

    alias.__name__ = alias.__qualname__ = old
    alias.__doc__ = f"Deprecated: :func:`megaloss.{func.__name__}` with ``return_stats=True``."
    return alias


linear_cross_entropy_with_stats: Callable[..., CrossEntropyOutput] = _with_stats(
    linear_cross_entropy, "linear_cross_entropy_with_stats",
    "linear_cross_entropy(..., return_stats=True)")
linear_distillation_loss_with_stats: Callable[..., DistillationOutput] = _with_stats(
    linear_distillation_loss, "linear_distillation_loss_with_stats",
    "linear_distillation_loss(..., return_stats=True)")
mnr_loss_with_stats: Callable[..., MNROutput] = renamed_keywords(gather="gather_across_ranks")(
    _with_stats(mnr_loss, "mnr_loss_with_stats", "mnr_loss(..., return_stats=True)"))
mnr_loss_with_metrics: Callable[..., MNROutput] = renamed_keywords(gather="gather_across_ranks")(
    _with_stats(mnr_loss, "mnr_loss_with_metrics",
                "mnr_loss(..., return_stats=True) (formerly mnr_loss_with_stats)"))


def _vocab_parallel(old: str, new: str, return_stats: bool) -> Callable[..., Any]:
    """:func:`megaloss.linear_cross_entropy` under the old vocab-parallel name ``old``: the old
    ``tp_group`` / ``vocab_size`` / ``sequence_parallel`` keywords become its
    ``vocab_parallel_options``; every other argument is passed on (with the warning)."""

    def alias(hidden_states: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor, *,
              tp_group: GroupLike = None, vocab_size: Optional[int] = None,
              sequence_parallel: bool = False, **keywords: Any) -> Any:
        warn_renamed(old, new)
        parallel = VocabParallelOptions(tp_group, vocab_size, sequence_parallel)
        return linear_cross_entropy(hidden_states, weight_shard, labels,
                                    vocab_parallel_options=parallel, return_stats=return_stats,
                                    **keywords)

    alias.__name__ = alias.__qualname__ = old
    alias.__doc__ = (f"Deprecated: :func:`megaloss.linear_cross_entropy` with "
                     f"{'``return_stats=True`` and ' if return_stats else ''}"
                     "``vocab_parallel_options=VocabParallelOptions(tp_group, vocab_size, "
                     "sequence_parallel)``.")
    return alias


vocab_parallel_linear_cross_entropy_with_stats: Callable[..., CrossEntropyOutput] = (
    _vocab_parallel("vocab_parallel_linear_cross_entropy_with_stats",
                    "linear_cross_entropy(..., return_stats=True, vocab_parallel_options="
                    "VocabParallelOptions(...))", return_stats=True))
vocab_parallel_linear_cross_entropy: Callable[..., torch.Tensor] = _vocab_parallel(
    "vocab_parallel_linear_cross_entropy",
    "linear_cross_entropy(..., vocab_parallel_options=VocabParallelOptions(...))",
    return_stats=False)


@functools.wraps(grad_cache_step)
def grad_cache(*args: Any, **kwargs: Any):
    """Deprecated alias of :func:`megaloss.grad_cache_step` (same arguments and result)."""
    warn_renamed("megaloss.grad_cache", "megaloss.grad_cache_step")
    return grad_cache_step(*args, **kwargs)


grad_cache.__name__ = grad_cache.__qualname__ = "grad_cache"
grad_cache.__doc__ = ("Deprecated alias of :func:`megaloss.grad_cache_step` (same arguments and "
                      "result).")


# Names that left the top level (each serves one integration, or is a helper of a subpackage):
# still reachable as ``megaloss.<name>`` for one release, with a warning naming their home.
MOVED = {
    "CEConfig": "megaloss.integrations.deepspeed",
    "MNRConfig": "megaloss.integrations.deepspeed",
    "PolicyConfig": "megaloss.integrations.deepspeed",
    "DPOConfig": "megaloss.integrations.deepspeed",
    "DistillationConfig": "megaloss.integrations.deepspeed",
    "DeepSpeedMPU": "megaloss.integrations.deepspeed",
    "probe_deepspeed": "megaloss.integrations.deepspeed",
    "EmbeddingModelWithMNR": "megaloss.integrations.hf",
    "load_megaloss_config": "megaloss.integrations.config",
    "init_parallel_mesh": "megaloss.parallel",
    "init_dp_tp_mesh": "megaloss.parallel",
    "mark_tensor_parallel": "megaloss.parallel",
    "StepCalibration": "megaloss.calibration",
    "EngineScale": "megaloss.calibration",
    "EngineScaleError": "megaloss.calibration",
    "probe_ddp": "megaloss.calibration",
    "probe_fsdp": "megaloss.calibration",
    "probe_no_engine": "megaloss.calibration.engine_scale",
    "compute_loss_weights": "megaloss.calibration.weights",
    "PolicyLossWeights": "megaloss.losses.policy",
}


def moved(name: str) -> Any:
    """``megaloss.<name>`` of a name in :data:`MOVED`: the object from its home, with the
    warning."""
    home = MOVED[name]
    warn_renamed(f"megaloss.{name}", f"{home}.{name}")
    from importlib import import_module
    return getattr(import_module(home), name)
