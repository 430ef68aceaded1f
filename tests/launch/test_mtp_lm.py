"""The MoE job's MTP module (launch/jobs/mtp_lm.py): its depth weights for full blocks (the
main loss's x ``T / (T - k)``) are the global per-depth calibration of
``megaloss.losses.multi_token.mtp_loss_weights``, so its training loss is
``multi_token_prediction_loss`` on those weights plus the router pool's share; outside
training it is the wrapper's own forward."""
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


def test_depth_weights_are_the_global_calibration(module):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, T + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    main = torch.full((2, T), 1.0 / (2 * T))  # one micro-batch, the step's token mean
    pool = RouterPool(RouterLossOptions(aux_loss=0.1))
    out = module(x, shift_labels=y, loss_weights=main, router_loss=pool)
    calibrated = mtp_loss_weights([y], DEPTH, group=SINGLE_RANK)
    with torch.no_grad():
        dec = module.decoder(input_ids=x, use_cache=False)
        ref = multi_token_prediction_loss(
            dec.last_hidden_state, module.lm.head.weight, y,
            module.mtp(dec.last_hidden_state, x), scaling_factor=0.3,
            loss_weights=calibrated.weights(0), options=module.lm.head.options)
    torch.testing.assert_close(out.depth_losses, ref.depth_losses.double())
    torch.testing.assert_close(out.loss.detach(), ref.loss + out.router.loss.detach())
    assert torch.equal(module.take_depth_sums(), out.depth_losses)
    assert torch.equal(module.depth_sums, torch.zeros(DEPTH, dtype=torch.float64))
    # evaluation: the wrapper's main CE (sum), no depths
    module.eval()
    try:
        plain = module(x, shift_labels=y)
        assert not hasattr(plain, "depth_losses")
        torch.testing.assert_close(plain.loss, ref.main_loss * (2 * T), rtol=1e-5, atol=1e-5)
    finally:
        module.train()


def test_an_ignored_target_is_refused(module):
    x = torch.zeros(1, T, dtype=torch.long)
    y = torch.full((1, T), -100)
    with pytest.raises(ValueError, match="ignore_index=-100"):
        module(x, shift_labels=y, loss_weights=torch.ones(1, T),
               router_loss=RouterPool(RouterLossOptions(aux_loss=0.1)))
