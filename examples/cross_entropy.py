"""The chunked fused linear cross-entropy on one device, against plain torch (float64): the loss
F.cross_entropy returns, class weights included, then its parts and counts with
return_stats=True. Run: python examples/cross_entropy.py"""
import torch
import torch.nn.functional as F

import megaloss

torch.manual_seed(0)
tokens, hidden_size, vocab_size = 256, 32, 500
hidden_states = torch.randn(tokens, hidden_size, dtype=torch.float64, requires_grad=True)
weight = (0.1 * torch.randn(vocab_size, hidden_size, dtype=torch.float64)).requires_grad_()
labels = torch.randint(0, vocab_size, (tokens,))  # already shifted: labels[t] follows token t
labels[::8] = -100  # ignored positions
class_weight = torch.rand(vocab_size, dtype=torch.float64) + 0.5  # [V], torch's weight=

# never holds the [tokens, vocab] logits: matmul, softmax and gradients run chunk by chunk
loss = megaloss.linear_cross_entropy(hidden_states, weight, labels, ce_weight=class_weight,
                                     chunk_size=64)
loss.backward()

h = hidden_states.detach().requires_grad_()
logits = h @ weight.detach().T
ref = F.cross_entropy(logits, labels, weight=class_weight)  # the same the obvious way
ref.backward()
print(f"linear_cross_entropy {loss.item():.10f}  reference {ref.item():.10f}")
assert torch.allclose(loss, ref, rtol=1e-10)
assert torch.allclose(hidden_states.grad, h.grad, rtol=1e-8, atol=1e-12)

# return_stats=True: CrossEntropyOutput(loss, z_loss, num_valid_tokens, num_correct_tokens)
out = megaloss.linear_cross_entropy(hidden_states, weight, labels, z_loss=1e-4,
                                    return_stats=True)
valid = labels != -100
z = 1e-4 * (torch.logsumexp(logits.detach(), -1)[valid] ** 2).mean()
accuracy = out.num_correct_tokens / out.num_valid_tokens
print(f"loss {out.loss.item():.6f}  z-loss part {out.z_loss.item():.6f}  accuracy {accuracy:.4f}")
assert torch.allclose(out.loss, F.cross_entropy(logits.detach(), labels) + z, rtol=1e-10)
assert torch.allclose(out.z_loss, z, rtol=1e-10)
assert out.num_valid_tokens == valid.sum()
assert out.num_correct_tokens == (logits.argmax(-1) == labels)[valid].sum()
