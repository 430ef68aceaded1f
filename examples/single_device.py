"""megaloss on one device: the chunked fused linear CE and the gathered MNR loss, checked
against plain torch (float64) on the same inputs. Run: python examples/single_device.py"""
import torch
import torch.nn.functional as F

import megaloss

torch.manual_seed(0)
tokens, hidden_size, vocab_size = 512, 64, 1000
hidden_states = torch.randn(tokens, hidden_size, dtype=torch.float64, requires_grad=True)
lm_head = torch.nn.Linear(hidden_size, vocab_size, bias=False, dtype=torch.float64)
labels = torch.randint(0, vocab_size, (tokens,))  # already shifted: labels[t] follows token t
labels[::10] = -100                                # ignored positions

# chunked fused linear cross-entropy: no [tokens, vocab] logits are ever held
loss = megaloss.linear_cross_entropy(hidden_states, lm_head.weight, labels,
                                     z_loss=1e-4, chunk_size=128)
loss.backward()

# the same loss the obvious way
h = hidden_states.detach().requires_grad_(True)
logits = F.linear(h, lm_head.weight.detach())
valid = labels != -100
ref = (F.cross_entropy(logits, labels, reduction="none")
       + 1e-4 * torch.logsumexp(logits, -1) ** 2 * valid).sum() / valid.sum()
ref.backward()
print(f"linear_cross_entropy {loss.item():.10f}  reference {ref.item():.10f}")
assert torch.allclose(loss, ref, rtol=1e-10) and torch.allclose(hidden_states.grad, h.grad,
                                                                 rtol=1e-8, atol=1e-12)

# contrastive: query [B, D], positive [B, D]; in-batch negatives (all ranks' under DP)
query, positive = torch.randn(32, 16), torch.randn(32, 16)
mnr = megaloss.mnr_loss(query, positive, temperature=0.05)
scores = F.normalize(query, dim=-1) @ F.normalize(positive, dim=-1).T / 0.05
mnr_ref = F.cross_entropy(scores, torch.arange(32))
print(f"mnr_loss {mnr.item():.6f}  reference {mnr_ref.item():.6f}")
assert torch.allclose(mnr, mnr_ref, rtol=1e-5)
