"""DeepSpeed's own mixture-of-experts layer (``deepspeed.moe.layer.MoE``, expert parallel over
its ``ep_size`` ranks) with megaloss's router losses.

DeepSpeed's gate (``deepspeed/moe/sharded_moe.py: TopKGate.forward``) computes its router
logits ``F.linear(input.float(), wg.weight.float())`` inside its forward and returns only its
own load-balancing term ``l_aux`` (GShard's, per micro-batch and per expert-parallel group, which
a model adds with its own coefficient). :class:`RouterLogitsRecorder` hooks every ``TopKGate``
of a module and records the same logits, differentiable (the gate's matmul on the gate's input,
recomputed: ``[tokens, experts]`` per layer, the cheapest tensor of the layer), so a module's
forward can hand them to the calibrated step's pool (``router_loss=``,
:class:`megaloss.losses.router.RouterPool`) instead of adding ``l_aux``::

    recorder = RouterLogitsRecorder(model)          # once
    ...
    def forward(self, input_ids, shift_labels=None, loss_weights=None, router_loss=None):
        recorder.clear()
        hidden = ...                                # the MoE layers run, logits recorded
        if router_loss is not None and router_loss.statistics_only:
            return router_loss(recorder.logits, recorder.top_k)   # the "step" pre-pass
        loss = ce(hidden, shift_labels, loss_weights)
        if router_loss is not None:
            router = router_loss(recorder.logits, recorder.top_k)
            loss = loss + router.loss                # and return router as the output's .router

The counts are the top-k of the logits: with ``top2_2nd_expert_sampling`` (DeepSpeed's default
for ``k=2``), the gate itself picks the second expert after Gumbel noise, so its routing and the
counts differ for the tokens where the noise changes the choice; a ``noisy_gate_policy`` of
``"Jitter"`` (noise on the gate's input) is refused: the recorded logits would not be the
gate's.
"""
from __future__ import annotations

from typing import Any, List

import torch
from torch import nn

__all__ = ["RouterLogitsRecorder"]


class RouterLogitsRecorder:
    """Records the router logits of every DeepSpeed ``TopKGate`` in ``module``, in forward
    order (module docstring).

    Attributes:
        logits: the recorded ``[tokens, experts]`` fp32 tensors since :meth:`clear`.
        top_k: the gates' ``k`` (every gate the same).

    Raises:
        ValueError: ``module`` has no ``TopKGate``; gates of different ``k`` or expert counts;
            a gate with ``noisy_gate_policy="Jitter"``.
    """

    def __init__(self, module: nn.Module) -> None:
        from deepspeed.moe.sharded_moe import TopKGate

        gates = [m for m in module.modules() if isinstance(m, TopKGate)]
        if not gates:
            raise ValueError(f"{type(module).__name__} has no DeepSpeed TopKGate "
                             f"(deepspeed.moe.layer.MoE): no router logits to record")
        ks = {g.k for g in gates}
        experts = {g.wg.weight.shape[0] for g in gates}
        if len(ks) != 1 or len(experts) != 1:
            raise ValueError(f"the MoE layers' gates differ (k {sorted(ks)}, experts "
                             f"{sorted(experts)}): one router loss needs one top_k and one "
                             f"expert count")
        jitter = [g for g in gates if g.noisy_gate_policy == "Jitter"]
        if jitter:
            raise ValueError("a TopKGate with noisy_gate_policy='Jitter' multiplies its input by "
                             "noise before the router: the recorded logits would not be the "
                             "gate's; use noisy_gate_policy=None or 'RSample'")
        self.top_k: int = ks.pop()
        self.logits: List[torch.Tensor] = []
        self._handles = [g.register_forward_hook(self._record) for g in gates]

    def _record(self, gate: nn.Module, inputs: Any, output: Any) -> None:
        x = inputs[0]
        self.logits.append(torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).float(),
                                                      gate.wg.weight.float()))

    def clear(self) -> None:
        """Forget the recorded logits (call at the start of each forward)."""
        self.logits = []

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
