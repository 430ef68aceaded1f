"""The post-training losses under DeepSpeed-Ulysses sequence parallelism against one device on
the global batch, float64: :func:`~megaloss.integrations.deepspeed.policy_train_step` (the
GRPO family's token-level ``loss_type`` s, GSPO's sequence-level ratio, VESPO's summed
log-ratio), :func:`~megaloss.integrations.deepspeed.dpo_train_step` /
:func:`~megaloss.integrations.deepspeed.preference_train_step` (DPO sigmoid and IPO, ORPO from
the ds_config's ``"megaloss": {"orpo": {...}}`` section, CPO with its NLL term, SimPO, KTO with
its KL baseline: sequence log-prob sums and completion lengths added over the SP slices, each
pair or example counted once) and distillation in
:func:`~megaloss.integrations.deepspeed.train_step` (a teacher module of another head geometry
than the student, and a stored top-k teacher), for DP x SP = 2 x 1 and 1 x 2 (2 processes, one
spawn) and 2 x 2 (4 processes), GAS 2, ZeRO-0; and, in the same 4-process spawn, DP x SP x TP =
1 x 2 x 2: megaloss's own tensor parallelism (``"megaloss": {"tensor_parallel_size": 2}``,
``Topology.build(2, sequence_parallel_size=2)``: the wrappers' ``tp_group=`` splits the student's
lm_head, and the teacher module's, over the vocabulary) for GRPO, GSPO, DPO sigmoid, KTO and both
distillation teachers (:data:`TP_CASES`).

A tiny Llama (sdpa) whose attention is DeepSpeed's ``UlyssesSPAttentionHF``
(:func:`megaloss.integrations.hf.ulysses.enable_ulysses_attention`); SEQ = 9 is no multiple of
SP = 2, so the slices are 5 + 4 tokens plus one padding place. The completion lengths are
uneven over the SP slices: sequences whose completion lies wholly on SP rank 0 (empty on rank 1)
or wholly on rank 1, one across the cut, a row without completion, and a micro-batch with no
completion token on SP rank 1 at all. The paired losses pair rows p (chosen) and p + 4
(rejected): a pair wholly on SP rank 0 (a DP 2 x GAS 2 micro-batch without a token on SP rank
1), a chosen on rank 1 with its rejected on rank 0, a pair without chosen token (not counted),
one across the cut; KTO takes every row as an example (rows 0-4 desirable) and other ids under
the same mask as its KL rows. Old / reference log-probs are the reference's current ones plus
noise, so the clipping bites (and KTO's ``z0`` is positive).

The reference: the same Llama on one process, plain causal attention over the whole rows, full
logits (``log_softmax``), one :func:`megaloss.policy_loss` / :func:`megaloss.dpo_loss` /
``cpo_loss`` / ``orpo_loss`` / ``kto_loss`` call on the whole global batch (or the
distillation wrapper on the whole batch with the one-device calibration). Every step's logged
loss, every parameter's gradient (read at the boundary, before the optimizer step, whose
learning rate is 0) and every metric within 1e-12 (relative, Frobenius norm for the gradients,
metrics relative to max(1, |value|)); under TP the lm_head's gradient is its vocab shards
gathered over the TP group, the padding rows dropped.
"""
import contextlib

import pytest
import torch

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.slow,
              pytest.mark.deepspeed_pool]  # shared ranks: see conftest.py

VOCAB, HIDDEN, SEQ, ROWS, GAS = 23, 16, 9, 8, 2
TOL = 1e-12
# (start, length) of each row's completion in the shifted targets; SP = 2 cuts SEQ = 9 at 5:
# rows 0, 4, 5 lie on SP rank 0 only (rows 4, 5 form one micro-batch of the DP 2 x GAS 2
# split: nothing of it on SP rank 1), rows 1, 7 on SP rank 1 only, rows 3, 6 across the cut,
# row 2 without completion
COMPLETIONS = [(1, 3), (5, 3), (0, 0), (2, 6), (0, 4), (3, 2), (4, 2), (6, 1)]


def _cases():
    from megaloss import PolicyLossOptions
    P = PolicyLossOptions
    return {
        "grpo": P(loss_type="grpo", beta=0.05, entropy_coef=0.01),
        "bnpo": P(loss_type="bnpo", epsilon_high=0.28),
        "dapo": P(loss_type="dapo", beta=0.02, kl_estimator="low_var_kl"),
        "dr_grpo": P(loss_type="dr_grpo", max_completion_length=SEQ, count_empty_rows=True),
        "luspo": P(loss_type="luspo"),
        "cispo": P(loss_type="cispo", epsilon_high=1.05, entropy_coef=0.02),
        "sapo": P(loss_type="sapo"),
        "vespo": P(loss_type="vespo"),
        "seq-mean-token-mean": P(loss_type="grpo", loss_agg_mode="seq-mean-token-mean",
                                 entropy_coef=0.01),
        "gspo": P(loss_type="grpo", importance_sampling_level="sequence", epsilon_low=3e-4,
                  epsilon_high=4e-4),
        "gspo dapo rows": P(loss_type="dapo", importance_sampling_level="sequence",
                            epsilon_low=0.02, epsilon_high=0.02, count_empty_rows=True,
                            beta=0.05),
    }


# the cases trained under SP x TP: a token-level and a sequence-level policy loss, a paired and
# an unpaired preference loss, both distillation teachers
TP_CASES = ("grpo", "gspo", "dpo sigmoid", "kto", "distill teacher", "distill top-k")

ORPO_SECTION = {"beta": 0.3}  # the policy engine's ds_config "megaloss": {"orpo": {...}}


def _dpo_cases():
    """The preference losses of :func:`preference_train_step`; ``orpo (ds_config)`` trains with
    ``options=None``: the ds_config's ``orpo`` section."""
    from megaloss import DPOOptions
    from megaloss.losses import CPOOptions, KTOOptions, ORPOOptions
    return {"dpo sigmoid": DPOOptions(beta=0.1),
            "dpo ipo": DPOOptions(loss_type="ipo", beta=0.1),
            "orpo (ds_config)": ORPOOptions(**ORPO_SECTION),
            "cpo": CPOOptions(loss_type="sigmoid", beta=0.2, label_smoothing=0.1,
                              cpo_alpha=0.7),
            "simpo": CPOOptions(loss_type="simpo", beta=2.0, simpo_gamma=0.4, cpo_alpha=0.0),
            "kto": KTOOptions(beta=0.2, desirable_weight=1.3)}


# KTO: every row one example, rows 0-4 desirable (row 2 has no completion: not counted); the KL
# rows: other ids under the same mask
KTO_DESIRABLE = torch.arange(ROWS) < 5


PAIRS = ROWS // 2  # DPO: rows p (chosen) and p + PAIRS (rejected)


def _config(heads=4, kv_heads=2, hidden=HIDDEN):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=16,
                       tie_word_embeddings=False, attn_implementation="sdpa")


def _llama(seed, **geometry):
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(_config(**geometry)).double()


def _student():
    return _llama(0)


def _teacher():  # another head geometry than the student's: 2 heads of 12 (1 per SP rank)
    return _llama(1, heads=2, kv_heads=2, hidden=24)


def _data():
    g = torch.Generator().manual_seed(7)
    mask = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for r, (start, n) in enumerate(COMPLETIONS):
        mask[r, start:start + n] = 1
    assert not mask[:, -1].any()  # the last place has no next token
    cases = {}
    for name in _cases():
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        adv = torch.randn(ROWS, generator=g, dtype=torch.float64)
        noise = torch.randn(2, ROWS, SEQ, generator=g, dtype=torch.float64)
        cases[name] = (ids, adv, noise)
    for name in _dpo_cases():
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        noise = torch.randn(2, ROWS, generator=g, dtype=torch.float64)
        kl_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        cases[name] = (ids, kl_ids, noise)
    distill_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return mask, cases, distill_ids


def _distill_labels(ids, mask):
    from megaloss import causal_shift
    return causal_shift(ids).masked_fill(mask == 0, -100)


def _full_log_probs(model, ids):
    from megaloss import causal_shift
    logp = torch.log_softmax(model(input_ids=ids).logits, -1)
    target = causal_shift(ids, 0).clamp(min=0)
    return logp.gather(-1, target.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _grads(module, wrapped=True):
    """``{name: gradient}`` under the plain model's names (a wrapper's ``model.`` dropped)."""
    return {(n.removeprefix("model.") if wrapped else n): p.grad.detach().clone()
            for n, p in module.named_parameters() if p.grad is not None}


def _topk(ids, k=3):
    with torch.no_grad():
        logp = torch.log_softmax(_teacher()(input_ids=ids).logits, -1)
    vals, idx = logp.topk(k, dim=-1)
    return idx, vals


def _distill_options():
    from megaloss import DistillationOptions
    return DistillationOptions(kind="jsd", beta=0.3, temperature=1.5, alpha=0.25,
                               reduction="sum", chunk_size=7, accum_dtype=torch.float64)


def _side(mask, cases):
    """The old and reference log-probs of every case (the reference's own plus noise)."""
    model, side = _student(), {}
    with torch.no_grad():
        for name in _cases():
            ids, _, noise = cases[name]
            lp = _full_log_probs(model, ids)[0]
            side[name] = (lp + 0.15 * noise[0], lp + 0.1 * noise[1])
        for name in _dpo_cases():  # the reference's sequence sums: the policy's own plus noise
            ids, kl_ids, noise = cases[name]
            seq = _full_log_probs(model, ids)[0].masked_fill(mask == 0, 0.0).sum(-1)
            kl_seq = _full_log_probs(model, kl_ids)[0].masked_fill(mask == 0, 0.0).sum(-1)
            side[name] = (seq + 0.5 * noise[0], kl_seq - 0.3 * noise[1].abs())
    return side


def _preference_reference(model, opts, mask, case, side):
    """One preference case on one process, float64, the whole global batch: each pair (KTO:
    example) with a chosen (KTO: any) completion token weighted 1 / their count, the NLL
    tokens 1 / the chosen tokens, KTO's z0 the mean over the KL rows."""
    from megaloss import SINGLE_RANK, DPOOptions, dpo_loss, dpo_metrics, sequence_log_probs
    from megaloss.losses import (
        CPOOptions,
        ORPOOptions,
        cpo_loss,
        cpo_metrics,
        kto_kl_baseline,
        kto_loss,
        kto_metrics,
        orpo_loss,
        orpo_metrics,
    )
    ids, kl_ids, _ = case
    ref, ref_kl = side
    model.zero_grad()
    seq, n = sequence_log_probs(_full_log_probs(model, ids)[0], mask, return_lengths=True)
    if not isinstance(opts, (DPOOptions, CPOOptions, ORPOOptions)):  # KTO
        counted = mask.any(-1)
        with torch.no_grad():
            kl_seq = sequence_log_probs(_full_log_probs(model, kl_ids)[0], mask)
        z0 = kto_kl_baseline(kl_seq, ref_kl, kl_lengths=mask.sum(-1), group=SINGLE_RANK)
        res = kto_loss(seq, ref, KTO_DESIRABLE, kl=z0,
                       sample_weights=counted.double() / counted.sum(), options=opts,
                       return_stats=True)
        metrics, tokens = kto_metrics(res.stats, group=SINGLE_RANK), mask.sum()
    else:
        counted = mask[:PAIRS].any(-1)
        pair = dict(chosen_lengths=n[:PAIRS], rejected_lengths=n[PAIRS:],
                    pair_weights=counted.double() / counted.sum(), options=opts,
                    return_stats=True)
        c, r, tokens = seq[:PAIRS], seq[PAIRS:], mask[:PAIRS].sum()
        if isinstance(opts, DPOOptions):
            res = dpo_loss(c, r, ref[:PAIRS], ref[PAIRS:], **pair)
            metrics = dpo_metrics(res.stats, group=SINGLE_RANK)
        elif isinstance(opts, CPOOptions):
            res = cpo_loss(c, r, nll_weight=1.0 / float(tokens), **pair)
            metrics = cpo_metrics(res.stats, group=SINGLE_RANK)
        else:
            res = orpo_loss(c, r, nll_weight=1.0 / float(tokens), **pair)
            metrics = orpo_metrics(res.stats, group=SINGLE_RANK)
    res.loss.backward()
    counts = {"num_tokens": float(tokens), "num_sequences": float(counted.sum())}
    return float(res.loss.detach()), _grads(model, wrapped=False), {**metrics, **counts}


def _reference(mask, cases, distill_ids):
    """One process, float64, the whole global batch: per case (loss, grads)."""
    from megaloss import SINGLE_RANK, LossCalibrator, Topology, policy_loss, policy_metrics
    from megaloss.integrations.hf import CausalLMWithDistillation
    model = _student()
    out, side = {}, _side(mask, cases)
    for name, opts in _cases().items():
        ids, adv, _ = cases[name]
        old, ref = side[name]
        model.zero_grad()
        lp, ent = _full_log_probs(model, ids)
        res = policy_loss(lp, old, adv, mask, ref_log_probs=ref, entropy=ent, options=opts,
                          return_stats=True)
        res.loss.backward()
        counts = {"num_tokens": float(mask.sum()),
                  "num_sequences": float(ROWS if opts.count_empty_rows else mask.any(-1).sum())}
        out[name] = (float(res.loss.detach()), _grads(model, wrapped=False),
                     {**policy_metrics(res.stats, opts, group=SINGLE_RANK), **counts})
    for name, opts in _dpo_cases().items():
        out[name] = _preference_reference(model, opts, mask, cases[name], side[name])
    labels = _distill_labels(distill_ids, mask)
    for name, topk in (("distill teacher", False), ("distill top-k", True)):
        wrapper = CausalLMWithDistillation(_student(), None if topk else _teacher(),
                                           options=_distill_options())
        step = LossCalibrator(Topology(), weight_dtype=torch.float64).begin_step([labels])
        extra = {}
        if topk:
            extra = dict(zip(("teacher_topk_ids", "teacher_topk_log_probs"),
                             _topk(distill_ids)))
        res = wrapper(distill_ids, shift_labels=labels, loss_weights=step.weights(0), **extra)
        res.loss.backward()
        out[name] = (float(res.loss.detach()), _grads(wrapper), {
            "divergence": float(res.divergence), "ce_loss": float(res.ce_loss),
            "top1_agreement": float(res.num_top1_matches) / float(res.num_valid_tokens),
            "num_tokens": float(res.num_valid_tokens)})
    return out


def _capture_boundary_grads(engine, into):
    """Wrap ``engine.step`` to keep the gradients it is about to apply (the last call of a step
    is the boundary: the DP-averaged, calibrated gradients). And reduce them in float64: the
    engine's ``communication_data_type`` is float32 unless fp16 / bf16 is on
    (``deepspeed/runtime/engine.py``), which would round the float64 gradients."""
    engine.communication_data_type = torch.float64
    original = engine.step

    def step(*args, **kwargs):
        into.clear()
        into.update(_grads(engine.module))
        return original(*args, **kwargs)

    engine.step = step


def _ds_config(micro, sp, tp=1, **sections):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": GAS,
            "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
            "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 0},
            "megaloss": {"sequence_parallel_size": sp, "tensor_parallel_size": tp,
                         **sections}}


def _micro_batches(topo, micro, **tensors):
    """This DP rank's GAS micro-batches (rows j * micro ... of piece j = i * dp + dp_rank)."""
    rows = torch.arange(ROWS).split(micro)
    return [{k: v[rows[i * topo.dp_size + topo.dp_rank]] for k, v in tensors.items()}
            for i in range(GAS)]


def _preference_micro_batches(topo, opts, mask, case, side):
    """This DP rank's GAS micro-batches of a preference case: pairs of piece j = i * dp +
    dp_rank, their chosen rows then their rejected rows (KTO: rows of piece j, with their KL
    rows)."""
    from megaloss import DPOOptions
    from megaloss.losses import KTOOptions
    ids, kl_ids, _ = case
    ref, ref_kl = side
    if isinstance(opts, KTOOptions):
        return _micro_batches(topo, ROWS // (GAS * topo.dp_size), input_ids=ids,
                              completion_mask=mask, desirable=KTO_DESIRABLE, ref_log_probs=ref,
                              kl_input_ids=kl_ids, kl_completion_mask=mask,
                              ref_kl_log_probs=ref_kl)
    mbs, pairs = [], PAIRS // (GAS * topo.dp_size)
    for i in range(GAS):
        j = i * topo.dp_size + topo.dp_rank
        c = torch.arange(j * pairs, (j + 1) * pairs)
        rows = torch.cat([c, c + PAIRS])
        mb = {"input_ids": ids[rows], "completion_mask": mask[rows]}
        if isinstance(opts, DPOOptions):
            mb.update(ref_chosen_log_probs=ref[c], ref_rejected_log_probs=ref[c + PAIRS])
        mbs.append(mb)
    return mbs


def _gathered(grads, topo):
    """``grads`` with the lm_head's vocab shard (TP > 1) replaced by the whole weight's
    gradient: the shards gathered over the TP group, the padding rows dropped."""
    import torch.distributed as dist
    if topo.tp_size == 1:
        return dict(grads)
    shard = grads["lm_head.weight"]
    parts = [torch.empty_like(shard) for _ in range(topo.tp_size)]
    dist.all_gather(parts, shard.contiguous(), group=topo.tp_group)
    return {**grads, "lm_head.weight": torch.cat(parts)[:VOCAB]}


def _train(sp, tp, mask, cases, distill_ids, side):
    from megaloss import DPOOptions, LogProbsOptions, Topology
    from megaloss.integrations.deepspeed import (
        dpo_train_step,
        initialize,
        policy_train_step,
        preference_train_step,
        train_step,
    )
    from megaloss.integrations.hf import CausalLMWithDistillation, CausalLMWithLogProbs
    from megaloss.integrations.hf.ulysses import enable_ulysses_attention

    topo = Topology.build(tp, sequence_parallel_size=sp)
    assert (topo.sp_size, topo.tp_size) == (sp, tp)
    micro = ROWS // (GAS * topo.dp_size)
    out, grads = {}, {}
    chosen = (lambda name: name in TP_CASES) if tp > 1 else (lambda name: True)
    policy = CausalLMWithLogProbs(_student(), options=LogProbsOptions(
        return_entropy=True, chunk_size=5, accum_dtype=torch.float64), tp_group=topo.tp_group)
    restore = enable_ulysses_attention(policy.model, topo, micro_batch_size=micro)
    me = initialize(policy, _ds_config(micro, sp, tp, orpo=ORPO_SECTION), topology=topo,
                    optimizer=torch.optim.SGD(policy.parameters(), lr=0.0))
    _capture_boundary_grads(me.engine, grads)
    for name, opts in _cases().items():
        if not chosen(name):
            continue
        ids, adv, _ = cases[name]
        old, ref = side[name]
        mbs = _micro_batches(topo, micro, input_ids=ids, completion_mask=mask, advantages=adv,
                             old_log_probs=old, ref_log_probs=ref)
        m = policy_train_step(me, mbs, options=opts, log=False)
        out[name] = (m.loss, _gathered(grads, topo), {**m.metrics, "num_tokens": m.num_tokens,
                                                      "num_sequences": m.num_sequences})
    for name, opts in _dpo_cases().items():
        if not chosen(name):
            continue
        mbs = _preference_micro_batches(topo, opts, mask, cases[name], side[name])
        if isinstance(opts, DPOOptions):
            m = dpo_train_step(me, mbs, options=opts, log=False)
        else:  # ORPO from the ds_config's section
            m = preference_train_step(me, mbs, options=None if name.startswith("orpo") else opts,
                                      log=False)
        out[name] = (m.loss, _gathered(grads, topo), {**m.metrics, "num_tokens": m.num_tokens,
                                                      "num_sequences": m.num_sequences})
    me.engine.destroy()
    restore()
    labels = _distill_labels(distill_ids, mask)
    top = dict(zip(("teacher_topk_ids", "teacher_topk_log_probs"), _topk(distill_ids)))
    for name, topk in (("distill teacher", False), ("distill top-k", True)):
        if not chosen(name):
            continue
        teacher = None if topk else _teacher()
        wrapper = CausalLMWithDistillation(_student(), teacher, options=_distill_options(),
                                           tp_group=topo.tp_group)
        restore = enable_ulysses_attention(wrapper.model, topo, micro_batch_size=micro,
                                           teacher=teacher)
        me = initialize(wrapper, _ds_config(micro, sp, tp), topology=topo,
                        optimizer=torch.optim.SGD(wrapper.parameters(), lr=0.0))
        _capture_boundary_grads(me.engine, grads)
        extra = top if topk else {}
        mbs = _micro_batches(topo, micro, input_ids=distill_ids, shift_labels=labels, **extra)
        if sp > 1 and teacher is not None:  # an unmarked teacher would see its slice only
            teacher.__dict__.pop("_megaloss_ulysses_sp")
            with pytest.raises(ValueError, match="pass teacher=<the teacher> to"):
                train_step(me, mbs, log=False)
            teacher._megaloss_ulysses_sp = sp
        m = train_step(me, mbs, log=False)
        out[name] = (m.loss, _gathered(grads, topo), {
            "divergence": m.divergence, "ce_loss": m.ce_loss,
            "top1_agreement": m.top1_agreement, "num_tokens": m.num_tokens})
        me.engine.destroy()
        restore()
    return out


@contextlib.contextmanager
def _float64_gradient_reduce():
    """Let DeepSpeed's ZeRO-0 gradient all-reduce take float64 gradients: its bucketing
    (``split_half_float_double_sparse``, ``deepspeed/runtime/engine.py``) accepts only the
    accelerator's ``supported_dtypes()``, float32 and bfloat16 on CPU; gloo reduces float64
    fine. Restored on exit (the ranks are shared with other tests)."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    original = accelerator.supported_dtypes
    accelerator.supported_dtypes = lambda: original() + [torch.float64]
    try:
        yield
    finally:
        del accelerator.supported_dtypes  # back to the class's method


def _worker(rank, world, layouts):
    import deepspeed

    from megaloss.integrations.deepspeed.compat import skip_cpu_shm_comm_build
    skip_cpu_shm_comm_build()
    deepspeed.init_distributed()
    mask, cases, distill_ids = _data()
    side = _side(mask, cases)
    with _float64_gradient_reduce():
        trained = {(sp, tp): _train(sp, tp, mask, cases, distill_ids, side)
                   for sp, tp in layouts}
    # the hook is restored: rank 0 computes the one-device reference (plain attention)
    return _reference(mask, cases, distill_ids) if rank == 0 else None, trained


def _errors(results, world):
    """{(layout, case): worst relative error over ranks of the loss, the gradients and the
    metrics (these relative to max(1, |value|))}."""
    reference = results[0][0]
    worst = {}
    for rank, (_, per_layout) in enumerate(results):
        for (sp, tp), per_case in per_layout.items():
            layout = f"{world // (sp * tp)} x {sp} x {tp}"
            for name, (loss, grads, metrics) in per_case.items():
                ref_loss, ref_grads, ref_metrics = reference[name]
                errs = [abs(loss - ref_loss) / max(abs(ref_loss), 1e-300)]
                assert set(metrics) == set(ref_metrics), (layout, name, metrics, ref_metrics)
                errs += [abs(metrics[k] - v) / max(1.0, abs(v)) for k, v in ref_metrics.items()]
                assert set(grads) == set(ref_grads), (layout, name, rank)
                for n, ref in ref_grads.items():
                    errs.append(float((grads[n] - ref).norm() / ref.norm().clamp_min(1e-300)))
                key = (layout, name)
                worst[key] = max(worst.get(key, 0.0), *errs)
    return worst


def _check(worst):
    table = "\n".join(f"DP x SP x TP = {layout:10s} {name:22s} {err:.2e}"
                      for (layout, name), err in sorted(worst.items()))
    print(table)
    bad = {k: v for k, v in worst.items() if not v <= TOL}
    assert not bad, f"errors above {TOL}:\n{table}"


def test_reference_clips():
    """The cases bite: GSPO's sequence clipping and the token clipping are active."""
    from megaloss import SINGLE_RANK, policy_loss, policy_metrics
    mask, cases, _ = _data()
    model = _student()
    for name in ("gspo", "bnpo"):
        opts = _cases()[name]
        ids, adv, noise = cases[name]
        with torch.no_grad():
            lp, ent = _full_log_probs(model, ids)
        out = policy_loss(lp, lp + 0.15 * noise[0], adv, mask, ref_log_probs=lp + 0.1 * noise[1],
                          entropy=ent, options=opts, return_stats=True)
        m = policy_metrics(out.stats, opts, group=SINGLE_RANK)
        assert 0 < m["clip_ratio/region_mean"] < 1, (name, m)


@pytest.mark.timeout(300)
def test_dp2_and_sp2_match_one_device():
    _check(_errors(run_distributed(_worker, 2, ((1, 1), (2, 1)), timeout=280), 2))


@pytest.mark.timeout(300)
def test_dp2_x_sp2_and_sp2_x_tp2_match_one_device():
    worst = _errors(run_distributed(_worker, 4, ((2, 1), (2, 2)), timeout=280), 4)
    assert {name for layout, name in worst if layout == "1 x 2 x 2"} == set(TP_CASES)
    _check(worst)
