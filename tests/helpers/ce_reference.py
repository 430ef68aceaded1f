"""Float64 eager-torch reference for the cross-entropy losses (materialises the logits)."""
import torch
import torch.nn.functional as F


def reference_linear_ce(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean",
                        label_smoothing=0.0, z_loss=0.0, logit_softcapping=None,
                        loss_weights=None):
    """Same contract as megaloss.linear_cross_entropy, written the obvious way."""
    logits = F.linear(hidden, weight, bias)
    if logit_softcapping is not None:
        logits = logit_softcapping * torch.tanh(logits / logit_softcapping)
    flat = logits.reshape(-1, logits.shape[-1])
    y = labels.reshape(-1).long()
    valid = y != ignore_index
    per_tok = F.cross_entropy(flat, y, ignore_index=ignore_index, label_smoothing=label_smoothing,
                              reduction="none")
    if z_loss:
        per_tok = per_tok + z_loss * torch.logsumexp(flat, dim=-1) ** 2 * valid
    per_tok = per_tok * valid
    w = valid.to(per_tok.dtype)
    if loss_weights is not None:
        w = w * loss_weights.reshape(-1).to(per_tok.dtype)
    per_tok = per_tok * w if loss_weights is not None else per_tok
    if reduction == "none":
        return per_tok.view(labels.shape)
    if reduction == "sum":
        return per_tok.sum()
    return per_tok.sum() / w.sum().clamp_min(torch.finfo(w.dtype).tiny)
