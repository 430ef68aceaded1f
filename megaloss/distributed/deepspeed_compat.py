"""Small DeepSpeed start-up fixes shared by every layer that builds a DeepSpeed engine.

It lives here, below :mod:`megaloss.calibration` (whose gradient-scale probe builds a tiny
engine) and :mod:`megaloss.integrations.deepspeed` (which builds the training engine), because
imports point down. ``deepspeed`` is imported inside the function, so importing this module is
cheap and does not need DeepSpeed installed.
"""
from __future__ import annotations

__all__ = ["skip_cpu_shm_comm_build"]


def skip_cpu_shm_comm_build() -> bool:
    """On DeepSpeed's CPU accelerator, do not JIT-compile its optional shared-memory all-reduce.

    DeepSpeed 0.19.8 builds ``deepspeed_shm_comm`` (a C++ op, ~1-3 minutes on 2 busy cores, then
    cached under ``~/.cache/torch_extensions``) the first time its comm backend starts on CPU.
    It is only a faster intra-node all-reduce; gloo does the same work. Marking the op
    incompatible in DeepSpeed's own cache of op compatibility (``deepspeed.ops.__compatible_ops__``,
    which ``deepspeed.comm.torch.build_shm_op`` consults) keeps start-up free of compilation.
    Call it before the first ``deepspeed.init_distributed`` / ``deepspeed.initialize``; a no-op on
    other accelerators, and idempotent.

    Returns:
        True when the build was disabled (CPU accelerator), False otherwise.
    """
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return True
