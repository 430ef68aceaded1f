"""``train_step`` on packed rows: samples marked only by ``position_ids`` restarting at 0 (Hugging
Face's flattening convention, ``DataCollatorWithFlattening``), ``sample`` and ``square``
calibration. One SGD step (lr 1) through a real DeepSpeed engine must equal the float64
single-device gradient of the per-sample loss.

The fault this catches: the calibration counted each *row* as one sample (``train_step`` did not
pass ``position_ids`` on). Tolerance: 1e-4 relative on the update (float32 parameters, the
update read back as after - before; a row-as-sample calibration is off by tens of percent).
(DeepSpeed reduces no float64 gradients, so the float64 weights are checked where float64
models train: ``tests/integrations/test_hf_trainer_float64.py``.)
"""
import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = pytest.mark.deepspeed_pool  # its DeepSpeed test runs on shared ranks: conftest.py

VOCAB, HIDDEN, SEQ, MICRO, GAS = 40, 8, 12, 2, 2


class PackedLM(torch.nn.Module):
    """Embedding + position embedding (so ``position_ids`` reach the model) + fused CE."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.pos = torch.nn.Embedding(SEQ, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def hidden(self, input_ids, position_ids):
        return torch.tanh(self.embed(input_ids) + self.pos(position_ids))

    def forward(self, input_ids, shift_labels=None, loss_weights=None, position_ids=None,
                attention_mask=None):
        import megaloss
        return megaloss.linear_cross_entropy_with_stats(
            self.hidden(input_ids, position_ids), self.lm_head.weight, shift_labels,
            loss_weights=loss_weights, options=megaloss.CrossEntropyOptions(reduction="sum"))


def _micro_batches():
    """GAS micro-batches of MICRO rows, each row 2-3 packed samples of uneven lengths; the first
    target of each sample is ignored, as the flattening collator does."""
    g = torch.Generator().manual_seed(0)
    cuts = [[0, 5, 12], [0, 3, 7, 12], [0, 8, 12], [0, 2, 6, 12]]
    mbs, samples = [], []
    for m in range(GAS):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        pos = torch.zeros(MICRO, SEQ, dtype=torch.long)
        for r in range(MICRO):
            bounds = cuts[(m * MICRO + r) % len(cuts)]
            for a, b in zip(bounds[:-1], bounds[1:]):
                pos[r, a:b] = torch.arange(b - a)
                if a > 0:
                    labels[r, a - 1] = -100  # no target across a sample boundary
                samples.append((m, r, a, b))
        labels[0, -3:] = -100
        mbs.append({"input_ids": ids, "shift_labels": labels, "position_ids": pos})
    return mbs, samples


def _reference_grads(model, mbs, samples, loss_reduction):
    """Float64, one process: mean over samples of (token mean) / (sum / sqrt(n)) per sample."""
    model.zero_grad()
    terms, norm = [], 0.0
    for m, r, a, b in samples:
        mb = mbs[m]
        h = model.hidden(mb["input_ids"][r:r + 1, a:b], mb["position_ids"][r:r + 1, a:b])
        y = mb["shift_labels"][r, a:b]
        valid = y != -100
        n = int(valid.sum())
        if n == 0:
            continue
        logits = h[0] @ model.lm_head.weight.T
        nll = torch.nn.functional.cross_entropy(logits[valid], y[valid], reduction="sum")
        w = 1.0 / n if loss_reduction == "sample" else n ** -0.5
        terms.append(w * nll)
        norm += w * n
    loss = sum(terms) / norm
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in model.named_parameters()}


REDUCTIONS = ("sample", "square")


def _worker(rank, world_size, reductions):
    """One process, one engine per calibration in turn (one spawn and one deepspeed import for
    all): ``{loss_reduction: (loss, reference loss, relative update errors, weight dtype)}``."""
    import deepspeed

    from megaloss import Topology
    from megaloss.integrations.deepspeed import initialize, train_step
    from megaloss.integrations.deepspeed.compat import configure_launched_process
    configure_launched_process()
    deepspeed.init_distributed()
    out = {}
    for loss_reduction in reductions:
        torch.manual_seed(0)
        model = PackedLM()
        initial = {k: v.detach().double().clone() for k, v in model.state_dict().items()}
        cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
               "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0,
               "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
               "megaloss": {"ce": {"loss_reduction": loss_reduction}}}
        me = initialize(model, cfg, topology=Topology.build(1),
                        optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        mbs, samples = _micro_batches()
        metrics = train_step(me, mbs, log=False)
        ref = PackedLM().double()
        ref.load_state_dict(initial)
        ref_loss, grads = _reference_grads(ref, mbs, samples, loss_reduction)
        errors = {k: float(((p.detach().double() - initial[k]) + grads[k]).norm()
                           / grads[k].norm())
                  for k, p in me.engine.module.named_parameters()}
        out[loss_reduction] = (metrics.loss, ref_loss, errors, me.calibrator.weight_dtype)
        me.engine.destroy()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 1, REDUCTIONS, timeout=280)[0]


@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("loss_reduction", REDUCTIONS)
def test_packed_samples_by_position_ids(results, loss_reduction):
    loss, ref_loss, errors, dtype = results[loss_reduction]
    assert dtype == torch.float32
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=0)
    assert max(errors.values()) < 1e-4, errors
