"""Contrastive MNR (InfoNCE) in one process, against plain torch: in-batch and hard negatives,
then GradCache, the same loss and gradients with the encoder run 16 rows at a time. Under data
parallelism add group=<the DP group>: every rank's documents become negatives, exactly.
Run: python examples/mnr.py"""
import torch
import torch.nn.functional as F

import megaloss

torch.manual_seed(0)
encoder = torch.nn.Linear(32, 16, dtype=torch.float64)
batch = torch.randn(3, 64, 32, dtype=torch.float64).unbind(0)  # queries, documents, negatives


def encode(rows):  # rows of the batch -> their embeddings: query, positive, [B, K=1, D] negatives
    query, positive, negative = rows
    return [encoder(query), encoder(positive), encoder(negative)[:, None]]


def loss_fn(columns):
    return megaloss.mnr_loss(*columns, temperature=0.05)  # cosine similarity / temperature


loss = loss_fn(encode(batch))
loss.backward()
grads = [p.grad.clone() for p in encoder.parameters()]

# the same loss the obvious way: every positive and hard negative is a candidate for each query
encoder.zero_grad()
q, p, n = (F.normalize(x, dim=-1) for x in encode(batch))
ref = F.cross_entropy(q @ torch.cat([p, n[:, 0]]).T / 0.05, torch.arange(64))
print(f"mnr_loss {loss.item():.10f}  reference {ref.item():.10f}")
assert torch.allclose(loss, ref, rtol=1e-10)

# GradCache (arXiv:2101.06983): embeddings without a graph, one loss, then a replay per mini-batch
encoder.zero_grad()
step = megaloss.grad_cache_step(encode, megaloss.split_rows(batch, 16), loss_fn)
step.surrogate.backward()
print(f"GradCache over {step.num_replays} mini-batches: {step.loss.item():.10f}")
assert torch.allclose(step.loss, ref.detach(), rtol=1e-10)
assert all(torch.allclose(g, p.grad, rtol=1e-8, atol=1e-12)
           for g, p in zip(grads, encoder.parameters()))
