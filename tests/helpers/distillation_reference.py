"""The float64 full-logits reference of megaloss.linear_distillation_loss: both models' logits
materialised, torch's log_softmax, the divergences written out from their definitions (the JSD as
in Liger-Kernel's ``src/liger_kernel/ops/jsd.py``), and the top-k teacher as the divergence over
the k ids plus one tail outcome."""
import torch
import torch.nn.functional as F


def _divergence(kind, beta, log_p, log_q):
    if kind == "jsd" and beta in (0.0, 1.0):
        kind = "forward_kl" if beta == 0.0 else "reverse_kl"
    p, q = log_p.exp(), log_q.exp()
    if kind == "forward_kl":
        return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
    if kind == "reverse_kl":
        return torch.where(q > 0, q * (log_q - log_p), 0.0).sum(-1)
    log_m = (beta * p + (1 - beta) * q).log()
    return (beta * torch.where(p > 0, p * (log_p - log_m), 0.0).sum(-1)
            + (1 - beta) * torch.where(q > 0, q * (log_q - log_m), 0.0).sum(-1))


def softcap(z, cap):
    return z if cap is None else cap * torch.tanh(z / cap)


def teacher_topk(teacher_hidden, teacher_weight, k, temperature=1.0, teacher_bias=None):
    """The top-k ids and log-probs (at ``temperature``) of a full teacher, as a pipeline stores
    them."""
    logits = F.linear(teacher_hidden.double(), teacher_weight.double(),
                      None if teacher_bias is None else teacher_bias.double())
    log_p = F.log_softmax(logits / temperature, dim=-1)
    values, ids = log_p.topk(k, dim=-1)
    return ids, values


def reference_distillation(hidden, weight, labels, *, teacher_hidden_states=None,
                           teacher_weight=None, teacher_topk_ids=None,
                           teacher_topk_log_probs=None, bias=None, teacher_bias=None,
                           loss_weights=None, kind="forward_kl", beta=0.5, temperature=1.0,
                           temperature_squared=True, alpha=0.0, ignore_index=-100,
                           reduction="mean", logit_softcapping=None,
                           teacher_logit_softcapping=None, parts=False):
    """Per-token ``(1-alpha) T2 D + alpha CE`` on materialised logits, reduced like torch (with
    ``loss_weights``: sum(w l) / sum(w) for "mean"). ``parts=True`` also returns the reduced
    divergence and CE and the number of top-1 matches."""
    v = weight.shape[0]
    y = softcap(F.linear(hidden, weight, bias), logit_softcapping)
    log_q = F.log_softmax(y / temperature, dim=-1)
    if teacher_topk_ids is None:
        yt = softcap(F.linear(teacher_hidden_states, teacher_weight, teacher_bias),
                     teacher_logit_softcapping)
        log_p = F.log_softmax(yt / temperature, dim=-1)
        teacher_top = yt.argmax(-1)
    else:
        ids, lp = teacher_topk_ids.long(), teacher_topk_log_probs.to(log_q.dtype)
        used = torch.isfinite(lp)  # an unused slot is no outcome: its id stays in the tail
        ids = torch.where(used, ids, 0)
        in_k = torch.zeros(*ids.shape[:-1], v, dtype=torch.float64).scatter_add(
            -1, ids, used.double()) > 0
        q_tail = torch.logsumexp(log_q.masked_fill(in_k, float("-inf")), -1, keepdim=True)
        tiny = torch.finfo(log_q.dtype).tiny
        p_tail = torch.log((1 - lp.exp().sum(-1, keepdim=True)).clamp_min(tiny))
        p_tail = p_tail.masked_fill(used.sum(-1, keepdim=True) >= v, float("-inf"))
        log_p = torch.cat([lp, p_tail], -1)
        log_q = torch.cat([torch.where(used, log_q.gather(-1, ids), float("-inf")), q_tail], -1)
        teacher_top = ids.gather(-1, lp.argmax(-1, keepdim=True)).squeeze(-1)
    d = _divergence(kind, beta, log_p, log_q)
    valid = labels != ignore_index
    ce = F.cross_entropy(y.reshape(-1, v), labels.reshape(-1).long().clamp(0, v - 1),
                         reduction="none").view(labels.shape)
    t2 = temperature ** 2 if temperature_squared else 1.0
    per_token = torch.where(valid, (1 - alpha) * t2 * d + alpha * ce, 0.0)
    w = valid.to(per_token.dtype)
    if loss_weights is not None:
        w = w * loss_weights.to(per_token.dtype)

    def reduce(x):
        x = torch.where(valid, x, 0.0) * w
        if reduction == "none":
            return x
        return x.sum() / w.sum().clamp_min(1e-300) if reduction == "mean" else x.sum()

    loss = reduce(per_token)
    if not parts:
        return loss
    matches = ((y.argmax(-1) == teacher_top) & valid).sum()
    return loss, reduce(d).detach(), reduce(ce).detach(), matches
