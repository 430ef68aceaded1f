"""The vocabulary shard of an lm_head weight that is a ``torch.distributed.tensor.DTensor`` split
over the vocabulary, as PyTorch's tensor parallelism leaves it:
``parallelize_module(lm_head, tp_mesh, ColwiseParallel())``
(``torch/distributed/tensor/parallel/style.py``) makes the weight a ``Shard(0)`` DTensor over the
TP mesh dimension (torchtitan's output layer, ``torchtitan/models/llama3/infra/parallelize.py``).

DTensor splits a dimension by ``torch.chunk``'s rule (``Shard.local_shard_size_and_offset`` in
``torch/distributed/tensor/placement_types.py``): ``ceil(V / tp)`` rows per rank, the last ranks
fewer (or none), no padding: 37 rows over 2 ranks are 19 + 18. The rows of this rank are read from
torch itself (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``), not
recomputed, so they follow torch's rule wherever it goes.

:func:`dtensor_vocab_shard` returns this rank's local rows (``DTensor.to_local()``: differentiable,
the gradient of the local shard lands in the DTensor's ``.grad`` as a ``Shard(0)`` DTensor), the
process group of the mesh dimension, the full vocabulary and the rows' range.
:meth:`megaloss.VocabParallelOptions.from_dtensor` turns that into the options of the losses.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple, Union

import torch

from .groups import group_rank

__all__ = ["DTensorVocabShard", "dtensor_vocab_shard"]


class DTensorVocabShard(NamedTuple):
    """This rank's part of a ``Shard(0)`` DTensor lm_head weight (:func:`dtensor_vocab_shard`).

    Attributes:
        local: the local rows ``[stop - start, H]`` (``weight.to_local()``, differentiable).
        group: the process group of the mesh dimension the vocabulary is split over.
        vocab_size: the full vocabulary ``V`` (the DTensor's ``shape[0]``).
        shard_range: this rank's rows ``(start, stop)`` of ``[0, V)``.
    """

    local: torch.Tensor
    group: Any
    vocab_size: int
    shard_range: Tuple[int, int]


def _placement_name(p) -> str:
    return type(p).__name__ + (f"({p.dim})" if hasattr(p, "dim") else "()")


def dtensor_vocab_shard(weight, *, mesh_dim: Optional[Union[int, str]] = None,
                        name: str = "weight") -> DTensorVocabShard:
    """This rank's vocabulary rows of a DTensor lm_head ``weight [V, H]`` split over one mesh
    dimension with ``Shard(0)`` (``ColwiseParallel``), and that dimension's process group.

    Args:
        weight: the DTensor weight (or a DTensor bias ``[V]``).
        mesh_dim: the mesh dimension (index or name) the vocabulary is split over; ``None``: the
            one dimension whose placement is ``Shard(0)``. Every other dimension must be
            ``Replicate()``.
        name: the argument's name in errors.

    Raises:
        TypeError: ``weight`` is not a DTensor.
        ValueError: the placement on the vocabulary's mesh dimension is not ``Shard(0)``
            (``Replicate()``, ``Shard(1)``, ``Partial()``, FSDP2's ``_StridedShard``), another
            mesh dimension is not ``Replicate()`` (a parameter still sharded by FSDP2's
            ``fully_shard`` over a data-parallel dimension: read it inside the FSDP unit's
            forward), ``mesh_dim`` is not a dimension of the mesh, or the group's rank order
            differs from the mesh coordinate.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(weight, DTensor):
        raise TypeError(f"{name} must be a torch.distributed.tensor.DTensor, got "
                        f"{type(weight).__name__}")
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    names = tuple(mesh.mesh_dim_names or ())
    shown = f"placements ({', '.join(_placement_name(p) for p in placements)}) on a mesh of " \
            f"shape {tuple(mesh.shape)}" + (f" named {names}" if names else "")
    expected = (f"{name} must be a DTensor split over the vocabulary with Shard(0) on one mesh "
                "dimension (torch.distributed.tensor.parallel.ColwiseParallel) and Replicate() "
                "on any other")

    def is_row_shard(p) -> bool:  # exactly Shard(0): _StridedShard (FSDP2 over TP) is not a Shard
        return type(p) is Shard and p.dim == 0

    if mesh_dim is None:
        dims = [i for i, p in enumerate(placements) if is_row_shard(p)]
        if len(dims) != 1:
            why = ("" if dims else ": none is Shard(0)") if len(dims) < 2 else (
                ": more than one is Shard(0), as for a parameter still sharded by FSDP2's "
                "fully_shard over a data-parallel dimension; compute the loss inside the FSDP "
                "unit's forward (torch.distributed.fsdp.register_fsdp_forward_method), where the "
                "weight is the TP shard, or name the vocabulary's mesh_dim")
            raise ValueError(f"{expected}; got {shown}{why}")
        dim = dims[0]
    else:
        if isinstance(mesh_dim, str):
            if mesh_dim not in names:
                raise ValueError(f"mesh_dim {mesh_dim!r} is not a dimension of the mesh "
                                 f"(names {names})")
            dim = names.index(mesh_dim)
        elif isinstance(mesh_dim, int) and not isinstance(mesh_dim, bool) \
                and 0 <= mesh_dim < mesh.ndim:
            dim = mesh_dim
        else:
            raise ValueError(f"mesh_dim must be None, a dimension name or an index in "
                             f"[0, {mesh.ndim}), got {mesh_dim!r}")
        if not is_row_shard(placements[dim]):
            raise ValueError(f"{expected}; got {shown}: mesh dimension {mesh_dim!r} has "
                             f"{_placement_name(placements[dim])}, expected Shard(0)")
    others = [i for i, p in enumerate(placements) if i != dim and not isinstance(p, Replicate)]
    if others:
        raise ValueError(f"{expected}; got {shown}: mesh dimension(s) {others} are not "
                         "Replicate() (a parameter sharded by FSDP2's fully_shard is the TP "
                         "shard only inside the FSDP unit's forward: "
                         "torch.distributed.fsdp.register_fsdp_forward_method)")
    shape, offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
    local = weight.to_local()
    if tuple(local.shape) != tuple(shape):  # torch disagreeing with itself
        raise ValueError(f"{name}'s local tensor has shape {tuple(local.shape)}, its placements "
                         f"say {tuple(shape)}")
    group = mesh.get_group(dim)
    if group_rank(group) != mesh.get_local_rank(dim):
        raise ValueError(f"the process group of mesh dimension {dim} ranks this process "
                         f"{group_rank(group)}, the mesh {mesh.get_local_rank(dim)}: the losses "
                         "need the vocabulary shards in group-rank order")
    vocab = int(weight.shape[0])
    start = min(int(offset[0]), vocab)
    return DTensorVocabShard(local, group, vocab, (start, start + int(shape[0])))
