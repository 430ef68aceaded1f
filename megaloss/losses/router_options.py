"""The options of the mixture-of-experts router losses (:mod:`megaloss.losses.router`): which
terms, their coefficients, over which pool of tokens the expert load is counted (the scope) and
how the layers combine."""
from __future__ import annotations

from dataclasses import dataclass

from ..ops.options import OptionsBase, check_choice, check_float

__all__ = ["RouterLossOptions", "ROUTER_SCOPES", "ROUTER_LAYER_FORMS"]

ROUTER_SCOPES = ("micro_batch", "global", "step")
ROUTER_LAYER_FORMS = ("per_layer", "concatenated")


@dataclass(frozen=True)
class RouterLossOptions(OptionsBase):
    """Options of :func:`megaloss.losses.router.router_loss` and of the calibrated step's router
    losses (the ds_config ``megaloss.router`` section).

    Attributes:
        aux_loss: coefficient of the load-balancing loss ``E * sum_e f_e * P_e`` (Switch
            Transformer, arXiv:2101.03961 eqs. 4-6, top-k as GShard, arXiv:2006.16668), with
            Hugging Face's normalisation (``f_e``: the expert's top-k selections per counted
            token, summing to ``top_k``; ``P_e``: its mean router probability), so a balanced
            router scores ``top_k`` and this is transformers' ``router_aux_loss_coef``.
            Megatron-LM's ``moe_aux_loss_coeff`` divides by ``top_k`` and sums the layers:
            its coefficient ``c`` is ``aux_loss = c * num_layers / top_k`` here with
            ``layers="per_layer"``. ``>= 0``; 0 disables the term.
        seq_aux_loss: coefficient ``alpha`` of DeepSeek's sequence-wise balance loss
            (arXiv:2405.04434 eq. 23-25; arXiv:2412.19437 eq. 17-20): per sequence
            ``sum_e (E / (top_k T) c_e) (s_e / T)``, averaged over sequences and layers (router
            probabilities from the softmax of the logits). ``>= 0``.
        z_loss: coefficient of the router z-loss ``logsumexp(router_logits) ** 2`` per counted
            token and layer (ST-MoE, arXiv:2202.08906 eq. 5). ``>= 0``.
        scope: the pool of tokens whose expert counts ``f`` and token count are one loss:
            ``"micro_batch"``: each rank's micro-batch (its sequence-parallel group together),
            the losses then averaged over micro-batches and data-parallel ranks: what Hugging
            Face models and DeepSpeed-MoE compute (a reference); ``"global"``: every rank's
            micro-batch of one micro-step together (one all-reduce of the ``[layers, experts]``
            counts over ``dp x sp``), averaged over the micro-steps: global-batch balancing
            (arXiv:2501.11873, Qwen3-MoE), exact for one micro-batch per step;
            ``"step"``: every micro-batch of the optimizer step together (the counts from a
            routing pre-pass without gradients): one device's loss on the whole global batch,
            whatever the layout. Default ``"global"``.
        layers: ``"per_layer"`` (default: one load-balancing loss per MoE layer, averaged; a
            layer's imbalance cannot hide behind another's, as each layer has its own router)
            or ``"concatenated"`` (transformers' ``load_balancing_loss_func``: the counts and
            probabilities of every layer summed before the product).

    Raises:
        ValueError / TypeError: an option out of range or of the wrong type, naming it.
    """

    aux_loss: float = 0.0
    seq_aux_loss: float = 0.0
    z_loss: float = 0.0
    scope: str = "global"
    layers: str = "per_layer"

    def __post_init__(self) -> None:
        for name in ("aux_loss", "seq_aux_loss", "z_loss"):
            check_float(name, getattr(self, name), 0.0, float("inf"))
            object.__setattr__(self, name, float(getattr(self, name)))
        check_choice("scope", self.scope, ROUTER_SCOPES)
        check_choice("layers", self.layers, ROUTER_LAYER_FORMS)

    @property
    def enabled(self) -> bool:
        """Whether any term has a coefficient > 0."""
        return self.aux_loss > 0 or self.seq_aux_loss > 0 or self.z_loss > 0
