"""Distillation through both lm_heads in one process, against plain torch: the student's chunked
logits against the frozen teacher's, neither model's [tokens, vocab] logits ever held; forward
KL at temperature 2 mixed with the hard-label CE. Run: python examples/distillation.py"""
import torch
import torch.nn.functional as F

import megaloss

torch.manual_seed(0)
tokens, vocab_size, T, alpha = 256, 500, 2.0, 0.5
student_h = torch.randn(tokens, 32, dtype=torch.float64, requires_grad=True)
student_w = (0.1 * torch.randn(vocab_size, 32, dtype=torch.float64)).requires_grad_()
teacher_h = torch.randn(tokens, 64, dtype=torch.float64)  # another hidden size is fine
teacher_w = 0.1 * torch.randn(vocab_size, 64, dtype=torch.float64)
labels = torch.randint(0, vocab_size, (tokens,))
labels[::8] = -100

loss = megaloss.linear_distillation_loss(
    student_h, student_w, labels, teacher_hidden_states=teacher_h, teacher_weight=teacher_w,
    kind="forward_kl", temperature=T, alpha=alpha, chunk_size=64)
loss.backward()

# the same loss the obvious way: (1 - alpha) T^2 KL(teacher || student) + alpha CE, token mean
valid = labels != -100
h = student_h.detach().requires_grad_()
s, t = h @ student_w.detach().T, teacher_h @ teacher_w.T
kl = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True,
              reduction="none").sum(-1)
ref = ((1 - alpha) * T**2 * kl[valid]).mean() + alpha * F.cross_entropy(s, labels)
ref.backward()
print(f"linear_distillation_loss {loss.item():.10f}  reference {ref.item():.10f}")
assert torch.allclose(loss, ref, rtol=1e-10)
assert torch.allclose(student_h.grad, h.grad, rtol=1e-8, atol=1e-12)
