"""Global loss calibration in one process: a batch split into 2 micro-batches with uneven valid
tokens (gradient accumulation) gets the loss and gradient of the whole batch at once, for
XTuner's "token" and "sample" reductions. Under DP / SP / ZeRO it is the same loop with a
Topology and the engine's measured scale (examples/deepspeed_calibration.py).
Run: python examples/calibration.py"""
import torch
import torch.nn.functional as F

import megaloss

torch.manual_seed(0)
hidden_size, vocab_size = 16, 100
weight = (0.1 * torch.randn(vocab_size, hidden_size, dtype=torch.float64)).requires_grad_()
hidden = [torch.randn(4, 8, hidden_size, dtype=torch.float64) for _ in range(2)]  # [B, T, H]
labels = [torch.randint(0, vocab_size, (4, 8)) for _ in range(2)]                # [B, T]
labels[0][:, 6:] = -100   # micro-batch 0: 24 valid tokens
labels[1][0, 1:] = -100   # micro-batch 1: 25, one sample of a single token


def whole_batch_loss(reduction):  # one device, the whole batch, the obvious way
    logits = (torch.cat(hidden) @ weight.T).flatten(0, 1)
    per_token = F.cross_entropy(logits, torch.cat(labels).flatten(), reduction="none")
    per_token = per_token.reshape(8, 8)  # ignored positions: 0
    valid = (torch.cat(labels) != -100).to(torch.float64)
    if reduction == "token":
        return (per_token * valid).sum() / valid.sum()
    return ((per_token * valid).sum(1) / valid.sum(1)).mean()  # "sample": mean of sample means


for reduction in ("token", "sample"):
    calibrator = megaloss.LossCalibrator(loss_reduction=reduction,  # one process, no engine
                                         weight_dtype=torch.float64)
    step = calibrator.begin_step(labels)  # the step's global counts (one all-reduce under DP)
    for i in range(2):
        local = megaloss.linear_cross_entropy(hidden[i], weight, step.local_labels(i),
                                              loss_weights=step.weights(i), reduction="sum")
        step.loss_for_backward(local).backward()  # / the engine's gradient factor (1 here)
    grad, weight.grad = weight.grad, None
    ref = whole_batch_loss(reduction)
    ref.backward()
    loss = step.global_loss()  # the step's loss, all ranks (one all-reduce under DP)
    print(f"{reduction}: calibrated {loss.item():.10f}  whole batch {ref.item():.10f}")
    assert torch.allclose(loss, ref.detach(), rtol=1e-10)
    assert torch.allclose(grad, weight.grad, rtol=1e-8, atol=1e-12)
    weight.grad = None
