"""A Hugging Face causal LM under PyTorch FSDP2 (fully_shard) with megaloss's chunked CE, on 2 gloo
ranks on the CPU: the loss runs inside the FSDP-managed forward of CausalLMWithLoss (built before
fully_shard), the gradient factor FSDP2 applies is measured (probe_fsdp), and one step of 2
micro-batches with uneven valid tokens per rank gives the gradients of one process on the whole
global batch (float64).
Run: python examples/fsdp2.py   (or your own loop under torchrun, from fsdp_rank's body)"""
import copy

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import megaloss
from megaloss.testing import run_distributed

VOCAB, SEQ, ROWS, GAS = 97, 16, 2, 2  # ROWS sequences per micro-batch and rank


def micro_batches(rank):
    """This rank's GAS micro-batches: input_ids and HF's unshifted labels; rank 1 masks the first
    half of its sequences (-100), so the ranks hold different numbers of valid tokens."""
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(GAS):
        input_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        labels = input_ids.clone()
        if rank == 1:
            labels[:, : SEQ // 2] = -100
        out.append((input_ids, labels))
    return out


def fsdp_rank(rank, world_size):
    torch.manual_seed(0)  # the same initial model on every rank
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
    llama = LlamaForCausalLM(config).double()
    reference = copy.deepcopy(llama)

    # wrap first, then shard: the loss then runs in the root's forward, where FSDP2 has
    # all-gathered the lm_head weight
    # reduction="sum": the calibration's weights hold the global normalisation
    model = megaloss.CausalLMWithLoss(llama,
                                      options=megaloss.CrossEntropyOptions(reduction="sum"))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in llama.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine_scale = megaloss.calibration.probe_fsdp(model, gas=GAS)  # FSDP2 averages the ranks
    calibrator = megaloss.LossCalibrator(megaloss.Topology.default(), loss_reduction="token",
                                         engine_scale=engine_scale,
                                         weight_dtype=torch.float64)  # default: float32

    batches = micro_batches(rank)
    step = calibrator.begin_step([megaloss.causal_shift(labels) for _, labels in batches])
    for i, (input_ids, _) in enumerate(batches):
        model.set_requires_gradient_sync(i == GAS - 1)  # reduce-scatter once, at the last
        out = model(input_ids, shift_labels=step.local_labels(i), loss_weights=step.weights(i))
        step.loss_for_backward(out.loss).backward()
    loss = float(step.global_loss())

    # one process, the whole global batch, the next-token CE averaged over the valid tokens (as
    # Hugging Face's own loss, but in float64: its loss casts the logits to float32)
    everything = [b for r in range(world_size) for b in micro_batches(r)]
    input_ids = torch.cat([x for x, _ in everything])
    labels = torch.cat([y for _, y in everything])
    logits = reference(input_ids=input_ids).logits
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                          ignore_index=-100)
    ref.backward()
    ref_grads = dict(reference.named_parameters())
    for name, p in llama.named_parameters():
        grad = p.grad.full_tensor()  # FSDP2's gradient: a Shard(0) DTensor
        torch.testing.assert_close(grad, ref_grads[name].grad, rtol=1e-9, atol=1e-12, msg=name)
    assert abs(loss - ref.item()) <= 1e-10 * abs(ref.item())
    return loss, ref.item()


if __name__ == "__main__":
    for rank, (loss, ref) in enumerate(run_distributed(fsdp_rank, 2)):
        print(f"rank {rank}: FSDP2 loss {loss:.10f}  one process, whole batch (reference) "
              f"{ref:.10f}")
