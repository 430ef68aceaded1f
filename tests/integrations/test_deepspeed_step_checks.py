"""A bad micro-batch on ONE rank of a DeepSpeed training step: every rank raises the same error
before the step's first collective, instead of the others waiting in it (the calibration's
all-reduce, the engine's gradient reduction) for the rank that raised; a bad label that only the
loss's forward finds on one DP rank, before the backward's gradient reduction. 2 gloo processes,
tiny engines on CPU: ``train_step`` and ``policy_train_step`` / ``dpo_train_step`` /
``preference_train_step`` (KTO's KL rows given in part) at DP = 2 (the
first group the flag travels over, ``dp x sp``), ``policy_train_step`` at TP = 2 (the second).

Each bad case is followed by a good step on both ranks: its global loss must be the same on
both (no rank was left a collective behind) and equal the float64 single-process loss of the
global batch (to 1e-5 relative: float32 engines).
"""
import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.deepspeed, pytest.mark.distributed, pytest.mark.deepspeed_pool]

VOCAB, HIDDEN, ROWS, SEQ = 11, 6, 2, 7


class _LM(torch.nn.Module):
    """Embedding, tanh layer, fused CE (``train_step``'s contract), or the log-probs of the
    policy steps' contract, on a vocab-parallel lm_head when ``tp > 1``."""

    def __init__(self, policy: bool, tp: int = 1, tp_rank: int = 0, tp_group=None):
        from megaloss.losses.vocab_parallel import vocab_shard_range
        from megaloss.parallel import mark_tensor_parallel
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.embed.weight.data.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
        full = torch.randn(VOCAB, HIDDEN, generator=g)
        start, stop, rows = vocab_shard_range(VOCAB, tp, tp_rank)
        shard = torch.zeros(rows, HIDDEN)
        shard[:stop - start] = full[start:stop]
        self.lm_head = torch.nn.Parameter(shard)
        if tp > 1:
            mark_tensor_parallel(self.lm_head)
        self.policy, self.tp, self.tp_group = policy, tp, tp_group

    def hidden(self, input_ids):
        return torch.tanh(self.embed(input_ids))

    def forward(self, input_ids, shift_labels, loss_weights=None, **_):
        import megaloss
        vp = (megaloss.VocabParallelOptions(self.tp_group, vocab_size=VOCAB) if self.tp > 1
              else None)
        if self.policy:
            return megaloss.linear_log_probs(self.hidden(input_ids), self.lm_head, shift_labels,
                                             vocab_parallel_options=vp)
        return megaloss.linear_cross_entropy(
            self.hidden(input_ids), self.lm_head, shift_labels, loss_weights=loss_weights,
            reduction="sum", return_stats=True, vocab_parallel_options=vp)


def _batch(dp_rank: int) -> dict:
    """DP rank ``dp_rank``'s micro-batch (the global batch is DP 0's rows, then DP 1's)."""
    g = torch.Generator().manual_seed(10 + dp_rank)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels[0, :2] = -100
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[:, :2] = 0
    mask[:, -1] = 0  # the last position has no next token
    return {"input_ids": ids, "shift_labels": labels, "completion_mask": mask,
            "advantages": torch.randn(ROWS, generator=g),
            "ref_chosen_log_probs": -torch.rand(ROWS // 2, generator=g),
            "ref_rejected_log_probs": -torch.rand(ROWS // 2, generator=g)}


def _engine(policy: bool, tp: int):
    from megaloss import Topology
    from megaloss.integrations.deepspeed import initialize
    topo = Topology.build(tp)
    model = _LM(policy, tp, topo.tp_rank, topo.tp_group)
    cfg = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0,
           "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
           "megaloss": {"tensor_parallel_size": tp}}
    return initialize(model, cfg, topology=topo,
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _outcome(step, me, mb, **kw):
    """``(exception type, message)`` of the step, or ``("ok", global loss)``."""
    try:
        return "ok", step(me, [mb], log=False, **kw).loss
    except (ValueError, TypeError) as err:
        return type(err).__name__, str(err)


def _worker(rank, world):
    import deepspeed

    from megaloss import PolicyLossOptions
    from megaloss.integrations.deepspeed import (
        dpo_train_step,
        policy_train_step,
        preference_train_step,
        train_step,
    )
    from megaloss.losses import KTOOptions
    deepspeed.init_distributed()
    out = {}
    policy = PolicyLossOptions(loss_type="grpo")

    me = _engine(policy=False, tp=1)  # DP = 2
    good = _batch(rank)
    bad = dict(good, shift_labels=good["shift_labels"][:, :-1]) if rank == 1 else good
    out["train_step: shift_labels"] = _outcome(train_step, me, bad)
    bad = dict(good, teacher_topk_ids=torch.zeros(ROWS, SEQ, 2, dtype=torch.long)) \
        if rank == 1 else good
    out["train_step: top-k"] = _outcome(train_step, me, bad)
    labels = good["shift_labels"].clone()
    labels[1, 3] = VOCAB  # found only inside the loss's forward, on this DP rank alone
    bad = dict(good, shift_labels=labels) if rank == 1 else good
    out["train_step: label in the loss"] = _outcome(train_step, me, bad)
    out["train_step: good"] = _outcome(train_step, me, good)
    me.engine.destroy()

    me = _engine(policy=True, tp=1)  # DP = 2
    bad = dict(good, completion_mask=good["completion_mask"][:, :-1]) if rank == 1 else good
    out["policy DP: completion_mask"] = _outcome(policy_train_step, me, bad, options=policy)
    bad = dict(good, ref_chosen_log_probs=torch.zeros(ROWS)) if rank == 1 else good
    out["dpo DP: ref_chosen_log_probs"] = _outcome(dpo_train_step, me, bad)
    kto = dict(good, desirable=torch.tensor([True, False]), ref_log_probs=torch.zeros(ROWS))
    bad = dict(kto, kl_input_ids=good["input_ids"]) if rank == 1 else kto
    out["kto DP: KL keys"] = _outcome(preference_train_step, me, bad, options=KTOOptions())
    out["policy DP: good"] = _outcome(policy_train_step, me, good, options=policy)
    me.engine.destroy()

    me = _engine(policy=True, tp=2)  # TP = 2: both ranks hold DP rank 0's batch
    good = _batch(0)
    bad = dict(good, advantages=good["advantages"][None]) if rank == 1 else good
    out["policy TP: advantages"] = _outcome(policy_train_step, me, bad, options=policy)
    out["policy TP: good"] = _outcome(policy_train_step, me, good, options=policy)
    me.engine.destroy()
    return out


def _reference(policy: bool, dp_ranks) -> float:
    """The step's global loss in float64 on one process: the CE summed over the valid tokens
    of the global batch / their count, or GRPO's mean over sequences of the per-sequence token
    mean (``old_log_probs`` = the current ones: the ratio is 1, the loss ``-A``)."""
    import megaloss
    model = _LM(policy).double()
    batches = [_batch(d) for d in dp_ranks]
    ids = torch.cat([b["input_ids"] for b in batches])
    if not policy:
        labels = torch.cat([b["shift_labels"] for b in batches])
        logits = model.hidden(ids) @ model.lm_head.T
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).detach(),
                                                       labels.reshape(-1), ignore_index=-100))
    mask = torch.cat([b["completion_mask"] for b in batches])
    adv = torch.cat([b["advantages"] for b in batches]).double()
    labels = torch.where(mask != 0, megaloss.causal_shift(ids, -100), -100)
    lp = torch.log_softmax(model.hidden(ids) @ model.lm_head.T, -1)
    lp = lp.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (mask != 0)
    out = megaloss.policy_loss(lp, None, adv, mask, loss_type="grpo")
    return float(out.detach())


EXPECTED = {  # case: (exception type, what the message must name)
    "train_step: shift_labels": ("ValueError", "micro_batches[0]['shift_labels'] must have the "
                                 "shape of input_ids (2, 7), got (2, 6)"),
    "train_step: top-k": ("ValueError", "teacher_topk_ids and teacher_topk_log_probs go "
                          "together"),
    "train_step: label in the loss": ("ValueError", f"labels must be in [0, {VOCAB}) or "
                                      "ignore_index=-100, found 11"),
    "policy DP: completion_mask": ("ValueError", "micro_batches[0]['completion_mask'] must have "
                                   "the shape of input_ids (2, 7), got (2, 6)"),
    "dpo DP: ref_chosen_log_probs": ("ValueError", "micro_batches[0]['ref_chosen_log_probs'] "
                                     "must have shape (1,), got (2,)"),
    "kto DP: KL keys": ("ValueError", "micro_batches[0] has kl_input_ids but lacks "
                        "kl_completion_mask, ref_kl_log_probs (KTO's KL rows need all three)"),
    "policy TP: advantages": ("ValueError", "micro_batches[0]['advantages'] must have shape "
                              "(2,) or (2, 7), got (1, 2)"),
}


@pytest.mark.timeout(240)
def test_a_bad_micro_batch_on_one_rank_raises_the_same_error_on_every_rank():
    results = run_distributed(_worker, 2, timeout=200)
    for case, (kind, names) in EXPECTED.items():
        got = [r[case] for r in results]
        assert got[0] == got[1], f"{case}: the ranks raised differently: {got}"
        assert got[0][0] == kind and names in got[0][1], f"{case}: {got[0]}"
        assert got[0][1].endswith("(raised on rank(s) [1])"), f"{case}: {got[0]}"
    for case, policy, dp_ranks in (("train_step: good", False, (0, 1)),
                                   ("policy DP: good", True, (0, 1)),
                                   ("policy TP: good", True, (0,))):
        (k0, loss0), (k1, loss1) = (r[case] for r in results)
        assert k0 == k1 == "ok" and loss0 == loss1, (case, results[0][case], results[1][case])
        assert loss0 == pytest.approx(_reference(policy, dp_ranks), rel=1e-5), case
