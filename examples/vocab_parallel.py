"""Vocab-parallel cross-entropy: the lm_head split over the vocabulary across 2 tensor-parallel
ranks (gloo processes on the CPU), the same loss and gradients as one device, no logits gathered.
Run: python examples/vocab_parallel.py"""
import torch
import torch.nn.functional as F

import megaloss
from megaloss.losses.vocab_parallel import vocab_shard_range
from megaloss.testing import run_distributed

TOKENS, HIDDEN, VOCAB = 128, 32, 1001  # V need not divide by the TP size


def tp_rank(rank, world_size):
    torch.manual_seed(0)  # the same full tensors on every rank
    hidden_states = torch.randn(TOKENS, HIDDEN, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.float64) * 0.1
    labels = torch.randint(0, VOCAB, (TOKENS,))
    start, stop, rows = vocab_shard_range(VOCAB, world_size, rank)
    shard = torch.zeros(rows, HIDDEN, dtype=torch.float64)  # the last shard is padded
    shard[:stop - start] = weight[start:stop]
    shard.requires_grad_(True)
    options = megaloss.VocabParallelOptions(tp_group=None, vocab_size=VOCAB)  # None: all ranks
    loss = megaloss.linear_cross_entropy(hidden_states, shard, labels, chunk_size=32,
                                         vocab_parallel_options=options)
    loss.backward()

    h, w = hidden_states.detach().requires_grad_(True), weight.requires_grad_(True)
    ref = F.cross_entropy(h @ w.T, labels)  # one device, the full [tokens, vocab] logits
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-10)
    assert torch.allclose(hidden_states.grad, h.grad, rtol=1e-8, atol=1e-12)
    assert torch.allclose(shard.grad[:stop - start], w.grad[start:stop], rtol=1e-8, atol=1e-12)
    return loss.item(), ref.item()


if __name__ == "__main__":
    for rank, (loss, ref) in enumerate(run_distributed(tp_rank, 2)):
        print(f"rank {rank}: vocab-parallel loss {loss:.10f}  one device {ref:.10f}")
