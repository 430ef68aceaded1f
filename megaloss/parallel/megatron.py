"""Process groups from Megatron-core's ``parallel_state`` (or NVIDIA apex's), for code bases
that already built them with ``initialize_model_parallel``: Megatron-LM, Megatron-DeepSpeed,
NeMo and older apex-based trainers. :meth:`megaloss.Topology.from_megatron` makes them a
Topology (give it to the losses, the calibrator and
:func:`megaloss.integrations.deepspeed.initialize` as any other); :func:`megatron_groups` also
has the pipeline group.

What is taken (Megatron-core ``megatron/core/parallel_state.py``; apex
``apex/transformer/parallel_state.py`` has the same function names, without context
parallelism):

==========================  =====================================================  ============
megaloss                    ``parallel_state``                                     apex
==========================  =====================================================  ============
``tp_group``                ``get_tensor_model_parallel_group()``                  same
``dp_group``                ``get_data_parallel_group()`` (without CP)             same
``sp_group``                ``get_context_parallel_group()``                       single rank
``dp_sp_group``             ``get_data_parallel_group(with_context_parallel=True)``  = dp
``pp`` (:func:`megatron_groups`)  ``get_pipeline_model_parallel_group()``          same
==========================  =====================================================  ============

Why context parallelism is megaloss's ``sp``: a CP rank holds a slice of every sample's tokens
and computes the loss of that slice (Megatron's ring attention; DeepSpeed-Ulysses in megaloss's
terms), so token and sample counts of the calibration are summed over ``dp x cp``, and TP
replicas, which hold the same tokens, stay out of it.

What is not taken, and why: the expert-parallel groups (MoE routing; no megaloss loss reduces over
them), the embedding and position-embedding groups (Megatron's all-reduce of a tied embedding's
gradient across the first and last pipeline stage; the pipeline engine's job), the partial /
distributed-optimizer data-parallel groups and the gloo / hierarchical CP variants (gradient and
optimizer plumbing, not loss math), and the virtual pipeline rank. Megatron's
``sequence_parallel`` is a model setting, not a group: pass it as
:class:`megaloss.VocabParallelOptions` ``(sequence_parallel=True)``. Nothing of Megatron or apex
is imported by megaloss except here, on request.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, Optional

from .groups import SINGLE_RANK

__all__ = ["PARALLEL_STATE_MODULES", "import_parallel_state", "megatron_groups"]

PARALLEL_STATE_MODULES = ("megatron.core.parallel_state", "apex.transformer.parallel_state")
"""Where :func:`import_parallel_state` looks, in this order."""


def import_parallel_state() -> Any:
    """The first of :data:`PARALLEL_STATE_MODULES` that imports.

    Raises:
        ImportError: neither Megatron-core nor NVIDIA apex is installed (apex comes from NVIDIA's
            repository, not PyPI, whose ``apex`` is an unrelated package).
    """
    errors = []
    for name in PARALLEL_STATE_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as err:
            errors.append(f"{name}: {err}")
    raise ImportError("no Megatron parallel_state found (install megatron-core, or NVIDIA apex "
                      "from its repository): " + "; ".join(errors))


def _takes(fn: Any, keyword: str) -> bool:
    try:
        return keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def megatron_groups(parallel_state: Optional[Any] = None) -> Dict[str, Any]:
    """This rank's groups from an initialised ``parallel_state``: a dict with ``"tp"``, ``"dp"``,
    ``"sp"`` (context parallel), ``"dp_sp"`` (data x context parallel) and ``"pp"`` (pipeline);
    a dimension the module does not have is :data:`~megaloss.parallel.SINGLE_RANK`.

    Args:
        parallel_state: the module (or any object with its functions); ``None``:
            :func:`import_parallel_state`.

    Raises:
        ImportError: ``None`` and neither module imports.
        TypeError: ``parallel_state`` lacks ``get_data_parallel_group`` or
            ``get_tensor_model_parallel_group``.
        RuntimeError: ``initialize_model_parallel`` has not been called
            (``model_parallel_is_initialized()`` is false).
    """
    ps = import_parallel_state() if parallel_state is None else parallel_state
    for name in ("get_data_parallel_group", "get_tensor_model_parallel_group"):
        if not callable(getattr(ps, name, None)):
            raise TypeError(f"parallel_state must provide {name}() (Megatron-core's or apex's "
                            f"parallel_state), got {getattr(ps, '__name__', type(ps).__name__)}")
    initialised = getattr(ps, "model_parallel_is_initialized", None)
    if callable(initialised) and not initialised():
        raise RuntimeError("parallel_state is not initialised: call "
                           "parallel_state.initialize_model_parallel(...) first")
    dp_fn = ps.get_data_parallel_group
    groups = {"tp": ps.get_tensor_model_parallel_group(), "dp": dp_fn(), "sp": SINGLE_RANK,
              "pp": SINGLE_RANK}
    if callable(getattr(ps, "get_pipeline_model_parallel_group", None)):
        groups["pp"] = ps.get_pipeline_model_parallel_group()
    cp_fn = getattr(ps, "get_context_parallel_group", None)
    if callable(cp_fn) and _takes(dp_fn, "with_context_parallel"):
        groups["sp"] = cp_fn()
        groups["dp_sp"] = dp_fn(with_context_parallel=True)
    else:  # apex and Megatron before context parallelism: the tokens of a sample stay together
        groups["dp_sp"] = groups["dp"]
    return groups
