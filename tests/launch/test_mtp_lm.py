"""The MoE job's MTP module (launch/jobs/mtp_lm.py) under the multi-token prediction family's
call (per-depth ``loss_weights`` and ``mtp_labels`` from
``megaloss.losses.multi_token.mtp_loss_weights``): its loss is ``multi_token_prediction_loss`` of
its decoder's and depths' hidden states on those weights plus the router pool's share, its
depth losses that function's; outside that call it is the wrapper's own forward (the main CE),
and its fresh MoE depths are initialised (transformers leaves their experts ``torch.empty``)."""
import argparse

import pytest
import torch

from launch.jobs.models import build_qwen3_moe
from launch.jobs.mtp_lm import CausalLMWithMTP
from megaloss import CausalLMWithLoss, CrossEntropyOptions
from megaloss.losses.multi_token import mtp_loss_weights, multi_token_prediction_loss
from megaloss.losses.router import RouterLossOptions, RouterPool
from megaloss.parallel.groups import SINGLE_RANK

pytestmark = pytest.mark.slow  # builds a transformers MoE and probes it (seconds)

T, V, DEPTH = 12, 64, 2


@pytest.fixture(scope="module")
def module():
    args = argparse.Namespace(hidden_size=16, num_layers=1, num_experts=4, top_k=2,
                              moe_intermediate_size=16, seq_len=T, seed=0)
    model, _ = build_qwen3_moe(args, V)
    lm = CausalLMWithLoss(model, options=CrossEntropyOptions(reduction="sum"))
    return CausalLMWithMTP(lm, DEPTH, 0.3).train()


def test_the_family_call_is_the_mtp_loss_plus_the_router_share(module):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, T + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:].clone()
    y[0, :3] = -100  # uneven valid tokens: each depth has its own count
    calibrated = mtp_loss_weights([y], DEPTH, group=SINGLE_RANK)
    pool = RouterPool(RouterLossOptions(aux_loss=0.1))
    out = module(x, shift_labels=y, loss_weights=calibrated.weights(0),
                 mtp_labels=calibrated.depth_labels(0), router_loss=pool)
    with torch.no_grad():
        dec = module.decoder(input_ids=x, use_cache=False)
        ref = multi_token_prediction_loss(
            dec.last_hidden_state, module.lm.head.weight, y,
            module.mtp(dec.last_hidden_state, x), scaling_factor=0.3,
            loss_weights=calibrated.weights(0), options=module.lm.head.options)
    torch.testing.assert_close(out.depth_losses, ref.depth_losses)
    torch.testing.assert_close(out.loss.detach(), ref.loss + out.router.loss.detach())
    assert out.router.aux_loss > 0 and int(out.num_valid_tokens) == 2 * T - 3
    for name, p in module.mtp.named_parameters():
        assert torch.isfinite(p).all() and p.abs().max() < 1.5, name  # initialised, not empty


def test_outside_the_family_call_it_is_the_wrapper(module):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (1, T + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    module.eval()
    try:
        with torch.no_grad():
            plain = module(x, shift_labels=y)
            own = module.lm(x, shift_labels=y)
    finally:
        module.train()
    assert not hasattr(plain, "depth_losses")
    torch.testing.assert_close(plain.loss, own.loss)
    stats = module(x, router_loss=RouterPool(RouterLossOptions(aux_loss=0.1),
                                             statistics_only=True))
    assert stats.counts.shape == (1, 4) and float(stats.counts.sum()) == 2 * T
