"""megaloss: losses for large-scale training that are cheap in memory and exact under any
parallel layout, wired into DeepSpeed.

The package is a stack; each layer imports only the layers above it in this list:

- :mod:`megaloss.ops`: single-device math: the one chunk driver
  (:mod:`~megaloss.ops.chunk_driver`) and each vocabulary-level loss's chunk kernel and its
  options, the InfoNCE rows;
- :mod:`megaloss.parallel`: process groups (:class:`Topology`; ``group=None`` is torch's default
  group everywhere) and collectives;
- :mod:`megaloss.calibration`: global loss calibration and the engine-factor probes;
- :mod:`megaloss.losses`: the linear CE (:func:`linear_cross_entropy`, on one device or
  vocab-parallel), the per-token log-probabilities (:func:`linear_log_probs`), gathered MNR,
  GradCache, the policy-gradient losses (:func:`policy_loss`, normalised by the calibration),
  the preference losses (:func:`dpo_loss`, :func:`cpo_loss` / :func:`simpo_loss`,
  :func:`orpo_loss`, :func:`kto_loss`) and the linear distillation loss
  (:func:`linear_distillation_loss`), each with its options beside it;
- :mod:`megaloss.integrations`: DeepSpeed (:mod:`~megaloss.integrations.deepspeed`) and Hugging
  Face (:mod:`~megaloss.integrations.hf`) adapters;
- :mod:`megaloss.cli`: the console scripts (``megaloss-check-layout``, ``megaloss-comm-model``).

Beside the stack: :mod:`megaloss.testing` (``run_distributed``: spawned gloo processes for tests),
:mod:`megaloss.configs` (the shipped ds_configs), and the deprecated names
(:mod:`megaloss._deprecated`, which ``import megaloss`` exposes with a warning).

Return values: a loss function returns its loss tensor; ``return_stats=True`` returns its
``*Output`` NamedTuple (``loss`` first, then detached parts and counts). Per-token quantities
(:func:`linear_log_probs`) come as their Output always.

``__all__`` is what a user calls: the losses (functions, modules, options, ``*Output`` types,
step weights and metrics), :class:`Topology` and ``SINGLE_RANK``, :class:`LossCalibrator`,
:func:`causal_shift`, the ds_config section :class:`MegalossConfig` and the Hugging Face
wrappers. Everything else is imported from its subpackage or module
(:mod:`megaloss.calibration`'s probes, :mod:`megaloss.parallel`'s meshes, ...); the names that
left the top level still resolve as ``megaloss.<name>`` for one release, with a warning naming
their home (:data:`megaloss._deprecated.MOVED`).

``import megaloss`` imports torch and nothing optional: the integration names
(``MegalossConfig``, ``CausalLMWithLoss``, ...) are loaded on first use.
"""
from importlib import import_module
from typing import Any

from . import _deprecated
from .calibration import LossCalibrator
from .losses import *  # noqa: F403  (the losses' public names: megaloss.losses.__all__)
from .losses import __all__ as _LOSSES
from .ops.labels import causal_shift
from .parallel import SINGLE_RANK, Topology

# loaded on first use (they import deepspeed / transformers)
_LAZY = {
    "MegalossConfig": "megaloss.integrations.config",
    "CausalLMWithLoss": "megaloss.integrations.hf.causal_lm",
    "CausalLMWithLogProbs": "megaloss.integrations.hf.causal_lm_log_probs",
    "CausalLMWithDistillation": "megaloss.integrations.hf.distillation",
}

__all__ = [
    # process groups, calibration, labels
    "Topology", "SINGLE_RANK", "LossCalibrator", "causal_shift",
    # the losses, their options and outputs (megaloss.losses)
    *_LOSSES,
    # integrations (loaded on first use)
    *_LAZY,
]
__version__ = "0.2.0"


def __getattr__(name: str) -> Any:  # PEP 562: integration and deprecated names on first use
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _deprecated.__all__:
        return getattr(_deprecated, name)
    if name in _deprecated.MOVED:
        return _deprecated.moved(name)
    raise AttributeError(f"module 'megaloss' has no attribute {name!r}")
