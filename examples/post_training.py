"""Per-token log-probs and a GRPO policy loss in one process, against plain torch: the log-probs
of sampled completions straight from the lm_head (no [tokens, vocab] logits), then the clipped
policy loss with a KL penalty to a reference model. Run: python examples/post_training.py"""
import torch
import torch.nn.functional as F

import megaloss

torch.manual_seed(0)
B, T, H, V = 4, 12, 32, 300  # a GRPO group: 4 completions of one prompt, 12 tokens each
hidden_states = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
lm_head = (0.1 * torch.randn(V, H, dtype=torch.float64)).requires_grad_()
completion_mask = torch.ones(B, T, dtype=torch.bool)
completion_mask[1, 7:] = completion_mask[3, 4:] = False  # shorter completions, then padding
tokens = torch.randint(0, V, (B, T)).masked_fill(~completion_mask, -100)  # labels, shifted

out = megaloss.linear_log_probs(hidden_states, lm_head, tokens, return_entropy=True)
log_probs = out.log_probs  # [B, T], differentiable; also out.entropy, out.lse, out.greedy_match
old_log_probs = log_probs.detach() + 0.05 * torch.randn(B, T, dtype=torch.float64)  # the sampler
ref_log_probs = log_probs.detach() - 0.1  # a frozen reference model
rewards = torch.tensor([1.0, 0.0, 0.5, 0.0], dtype=torch.float64)
advantages = (rewards - rewards.mean()) / rewards.std()  # normalised within the group

options = megaloss.PolicyLossOptions(loss_type="grpo", beta=0.04)  # PPO clip 0.2, k3 KL
loss = megaloss.policy_loss(log_probs, old_log_probs, advantages, completion_mask,
                            ref_log_probs=ref_log_probs, options=options)
loss.backward()
stats = megaloss.policy_loss(log_probs, old_log_probs, advantages, completion_mask,
                             ref_log_probs=ref_log_probs, options=options, return_stats=True)
metrics = megaloss.policy_metrics(stats.stats, options)  # TRL's names: kl, clip_ratio/...

# the same the obvious way: full logits, PPO clipping, per-sequence means, then the mean
h = hidden_states.detach().requires_grad_()
ref_lp = F.log_softmax(h @ lm_head.detach().T, -1).gather(-1, tokens.clamp(min=0)[..., None])
ref_lp = ref_lp[..., 0]
assert torch.allclose(log_probs[completion_mask], ref_lp[completion_mask], rtol=1e-10)
ratio = torch.exp(ref_lp - old_log_probs)
A = advantages[:, None]
d = ref_log_probs - ref_lp
per_token = -torch.min(ratio * A, ratio.clamp(0.8, 1.2) * A) + 0.04 * (d.exp() - d - 1)
m = completion_mask.to(torch.float64)
ref = ((per_token * m).sum(1) / m.sum(1)).mean()  # "grpo": mean over sequences of token means
ref.backward()
print(f"policy_loss {loss.item():.10f}  reference {ref.item():.10f}  kl {metrics['kl']:.6f}")
assert torch.allclose(loss, ref, rtol=1e-10) and torch.allclose(stats.loss, loss)
assert torch.allclose(hidden_states.grad, h.grad, rtol=1e-8, atol=1e-12)
