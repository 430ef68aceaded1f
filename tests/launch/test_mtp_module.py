"""The job's MTP module (``launch/jobs/mtp_module.py``) on a tiny random-init Llama in float64:
forward and backward through :func:`megaloss.losses.multi_token.multi_token_prediction_loss`,
gradients reach the depths, the shared embedding and the lm_head; and two samples packed in one
row (``position_ids`` restarting at 0) give every depth's hidden states of each sample alone
(tolerance 1e-10; sdpa attention, as eager's softmax runs in float32), so no depth reads across
a sample boundary. Slow tier: building and running the model takes ~1 s."""
import pytest
import torch

from launch.jobs.mtp_module import MultiTokenPrediction
from megaloss.losses.multi_token import multi_token_prediction_loss


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=23, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32, attn_implementation="sdpa")
    return LlamaForCausalLM(config).double()


@pytest.mark.slow
def test_mtp_module_forward_backward_and_packing():
    model = tiny_llama()
    mtp = MultiTokenPrediction(model, depth=2)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 23, (1, 5), generator=g), torch.randint(0, 23, (1, 4), generator=g)
    ids = torch.cat([a, b], 1)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])
    # use_cache=False: with a cache Hugging Face skips the packed-sample mask
    h = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
    depths = mtp(h, ids, position_ids=pos)
    assert [tuple(d.shape) for d in depths] == [(1, 9, 16)] * 2

    alone = []
    for x in (a, b):
        hx = model.model(input_ids=x).last_hidden_state
        alone.append(mtp(hx, x))
    for k in range(2):
        torch.testing.assert_close(depths[k], torch.cat([alone[0][k], alone[1][k]], 1),
                                   rtol=1e-10, atol=1e-10)

    labels = torch.cat([a[:, 1:], torch.tensor([[-100]]), b[:, 1:], torch.tensor([[-100]])], 1)
    out = multi_token_prediction_loss(h, model.lm_head.weight, labels, depths, position_ids=pos)
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.depth_losses.shape == (2,)
    for p in (mtp.depths[0].proj.weight, mtp.depths[1].block.mlp.up_proj.weight,
              model.model.embed_tokens.weight, model.lm_head.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
