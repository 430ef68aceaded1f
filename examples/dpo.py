"""DPO in one process, against plain torch: sequence log-probs of chosen and rejected completions
under the policy and a frozen reference (chunked, no logits), then the sigmoid DPO loss.
Run: python examples/dpo.py"""
import torch
import torch.nn.functional as F

import megaloss

torch.manual_seed(0)
P, T, H, V, beta = 3, 10, 32, 300, 0.1  # 3 pairs; rows 0-2 chosen, rows 3-5 rejected
hidden_states = torch.randn(2 * P, T, H, dtype=torch.float64, requires_grad=True)
policy_head = (0.1 * torch.randn(V, H, dtype=torch.float64)).requires_grad_()
reference_head = policy_head.detach() + 0.01 * torch.randn(V, H, dtype=torch.float64)
completion_mask = torch.ones(2 * P, T, dtype=torch.bool)
completion_mask[:, :3] = False  # the prompt's tokens carry no loss
labels = torch.randint(0, V, (2 * P, T)).masked_fill(~completion_mask, -100)


def completion_log_probs(head, h):  # [2P] sums of the completion tokens' log-probs
    log_probs = megaloss.linear_log_probs(h, head, labels).log_probs
    return megaloss.sequence_log_probs(log_probs, completion_mask)


policy = completion_log_probs(policy_head, hidden_states)
with torch.no_grad():
    reference = completion_log_probs(reference_head, hidden_states)
loss = megaloss.dpo_loss(policy[:P], policy[P:], reference[:P], reference[P:], beta=beta)
loss.backward()
out = megaloss.dpo_loss(policy[:P], policy[P:], reference[:P], reference[P:], beta=beta,
                        return_stats=True)
metrics = megaloss.dpo_metrics(out.stats)  # TRL's names: rewards/accuracies, rewards/margins...


def reference_sequence_log_probs(head, h):  # the obvious way: full logits
    lp = F.log_softmax(h @ head.T, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return (lp * completion_mask).sum(-1)


h = hidden_states.detach().requires_grad_()
pol, ref_pol = reference_sequence_log_probs(policy_head.detach(), h), reference
ref = -F.logsigmoid(beta * ((pol[:P] - ref_pol[:P]) - (pol[P:] - ref_pol[P:]))).mean()
ref.backward()
print(f"dpo_loss {loss.item():.10f}  reference {ref.item():.10f}  "
      f"margin {metrics['rewards/margins']:.6f}")
assert torch.allclose(loss, ref, rtol=1e-10)
assert torch.allclose(hidden_states.grad, h.grad, rtol=1e-8, atol=1e-12)
