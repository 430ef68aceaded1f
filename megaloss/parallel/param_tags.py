"""Tags that mark a parameter as a tensor-parallel shard, as DeepSpeed and Megatron read them.

``tensor_model_parallel=True`` makes DeepSpeed's gradient norm (``deepspeed.runtime.utils.
is_model_parallel_parameter``) count the shard on every TP rank; a replicated parameter is
counted on TP rank 0 only. ``partition_dim`` / ``partition_stride`` are Megatron-core's
checkpoint-merging attributes (``megatron/core/tensor_parallel/layers.py``).
"""
from __future__ import annotations

import torch

__all__ = ["mark_tensor_parallel", "is_tensor_parallel"]


def mark_tensor_parallel(param: torch.nn.Parameter, partition_dim: int = 0) -> torch.nn.Parameter:
    """Tag ``param`` as a TP shard split along ``partition_dim``; returns it.

    Raises:
        TypeError: ``param`` is not an ``nn.Parameter``.
    """
    if not isinstance(param, torch.nn.Parameter):
        raise TypeError(f"param must be an nn.Parameter, got {type(param).__name__}")
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1
    return param


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True when ``param`` is tagged as a TP shard (``tensor_model_parallel`` or Megatron's
    older ``model_parallel``)."""
    return bool(getattr(param, "tensor_model_parallel", False)
                or getattr(param, "model_parallel", False))
