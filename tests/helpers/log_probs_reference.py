"""The float64 full-logits reference of ``megaloss.linear_log_probs``: TRL's
``selective_log_softmax`` formula (``trl/trainer/utils.py``) on ``softcap(z) / temperature``."""
import torch


def reference(hidden, weight, labels, bias=None, *, temperature=1.0, cap=None, ignore_index=-100):
    """float64, full logits: TRL's formula on ``softcap(z) / T``."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    y = z / temperature
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0).long()
    logp = y.log_softmax(-1)
    lp = torch.where(valid, logp.gather(-1, safe[..., None])[..., 0], 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    greedy = valid & (y.argmax(-1) == safe)
    return lp, ent, torch.logsumexp(y, -1), greedy
