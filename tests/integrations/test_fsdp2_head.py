"""megaloss's Hugging Face heads under PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) on 2
gloo ranks over a CPU DeviceMesh: a tiny float64 ``LlamaForCausalLM`` wrapped in
:class:`CausalLMWithLoss` / :class:`CausalLMWithLogProbs` / :class:`CausalLMWithDistillation`,
then ``fully_shard`` per decoder layer and on the wrapper as root (torchtitan's layout), the head
in the root unit or its own unit, ``reshard_after_forward`` True and False, tied embeddings.

Each case trains 2 SGD steps; each rank's loss and every full parameter after the steps
(``DTensor.full_tensor()``) equal a single-process float64 reference on plain full logits
(``F.cross_entropy`` / ``F.log_softmax``) within 1e-10. FSDP2 averages gradients over its ranks
(the data-parallel mean), so the reference steps on the gradient of the global batch's
sum-reduced loss divided by the world size. With ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)`` the first step's loss and gradients are within twice eager bf16's own
error of the float64 reference: eager bf16 is the same model cast to bf16 with HF's logits upcast
to fp32 (its loss on each rank's rows, its gradient on the global batch / world as FSDP2's); a
gradient's error is the relative L2 error ``||g - g_ref|| / ||g_ref||`` over all parameters
together, and over the lm_head weight alone (measured: 4.6e-3 to 5.4e-3 for both, FSDP2's
0.95x to 1.01x eager's).

Policy losses on the log-probs: :func:`megaloss.policy_loss` (DAPO with a KL penalty and an
entropy bonus, ``reshard_after_forward=True``; GRPO, ``False``) on the per-token log-probs and
entropies of a ``CausalLMWithLogProbs`` forward under FSDP2 (the head in the root unit), each
rank on its rows of completions of different lengths, the step's global weights from
``policy_calibrator`` with ``probe_fsdp``'s multiplier, sampling-policy log-probs far enough
off for the clip to act: the global loss and every parameter after 2 SGD steps equal
``policy_loss`` on the whole global batch in one process (float64 full logits) within 1e-10
(measured: 2e-16 and 7e-18).

Refusals: a sharded DTensor weight given to the loss functions directly (TypeError naming
``register_fsdp_forward_method``), a model or a teacher already sharded before wrapping
(ValueError).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megaloss.testing import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

WORLD, B, T, V, H = 2, 2, 8, 50, 16
LR = 0.05
STEPS = 2

# name: (wrapper kind, head placement, reshard_after_forward, tied, mixed precision)
CASES = {
    "ce-root-reshard": ("ce", "root", True, False, False),
    "ce-root-keep": ("ce", "root", False, False, False),
    "ce-unit-reshard": ("ce", "unit", True, False, False),
    "ce-unit-keep": ("ce", "unit", False, False, False),
    "ce-tied-reshard": ("ce", "root", True, True, False),
    "ce-tied-keep": ("ce", "root", False, True, False),
    "ce-tied-unit-reshard": ("ce", "unit", True, True, False),
    "logprobs-root-reshard": ("logprobs", "root", True, False, False),
    "logprobs-unit-keep": ("logprobs", "unit", False, False, False),
    "distill-root-reshard": ("distill", "root", True, False, False),
    "distill-unit-keep": ("distill", "unit", False, False, False),
    "ce-root-bf16": ("ce", "root", True, False, True),
    "ce-unit-bf16": ("ce", "unit", False, True, True),
}


def _llama(seed, tied=False):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=tied, attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(torch.float64)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, V, (WORLD * B, T), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100  # a prompt without loss
    return ids, labels


def _ref_loss(model, teacher, kind, ids, labels, dtype=torch.float64):
    """The per-row-sum loss of HF's full logits (float64 unless ``dtype``), plain torch."""
    logits = model(input_ids=ids).logits[:, :-1].to(dtype)
    target = labels[:, 1:]
    valid = target != -100
    if kind == "ce":
        return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction="sum")
    logp = F.log_softmax(logits, dim=-1)
    if kind == "logprobs":
        picked = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0]
        return -(picked * valid).sum()
    with torch.no_grad():
        t_logp = F.log_softmax(teacher(input_ids=ids).logits[:, :-1].to(dtype), dim=-1)
    kl = (t_logp.exp() * (t_logp - logp)).sum(-1)  # forward KL(P_teacher || Q_student)
    return (kl * valid).sum()


def _wrap(model, teacher, kind, dtype):
    from megaloss import CrossEntropyOptions, DistillationOptions, LogProbsOptions
    from megaloss.integrations.hf import (
        CausalLMWithDistillation,
        CausalLMWithLogProbs,
        CausalLMWithLoss,
    )
    if kind == "ce":
        return CausalLMWithLoss(model, options=CrossEntropyOptions(reduction="sum",
                                                                   accum_dtype=dtype))
    if kind == "logprobs":
        return CausalLMWithLogProbs(model, options=LogProbsOptions(accum_dtype=dtype))
    return CausalLMWithDistillation(model, teacher, options=DistillationOptions(
        reduction="sum", accum_dtype=dtype))


def _wrapper_loss(wrapper, kind, ids, labels):
    out = wrapper(ids, labels=labels)
    return -out.log_probs.sum() if kind == "logprobs" else out.loss


def _grad_err(grads, want, names):
    """``||g - g_ref|| / ||g_ref||`` over the parameters ``names`` together, in float64."""
    num = sum(float((grads[n].to(torch.float64) - want[n]).pow(2).sum()) for n in names)
    den = sum(float(want[n].pow(2).sum()) for n in names)
    return math.sqrt(num / den)


def _run_case(rank, world, mesh, kind, place, reshard, tied, mixed):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    rows = slice(rank * B, (rank + 1) * B)
    ref = _llama(0, tied)
    teacher = _llama(1) if kind == "distill" else None
    model = _llama(0, tied)
    model.load_state_dict(ref.state_dict())
    wrapper = _wrap(model, teacher, kind, torch.float32 if mixed else torch.float64)
    kw = dict(mesh=mesh, reshard_after_forward=reshard)
    if mixed:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    if place == "unit" and tied:
        # a tied weight in one group with both users (FSDP2 refuses it in two groups)
        fully_shard([model.model.embed_tokens, model.lm_head], **kw)
    elif place == "unit":
        fully_shard(model.lm_head, **kw)  # the loss head as its own FSDP unit
    fully_shard(wrapper, **kw)
    head_type = type(model.lm_head.weight).__name__
    opt = torch.optim.SGD(wrapper.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    out = dict(head_type=head_type, loss_err=[], loss=[], ref_loss=[])
    for step in range(STEPS):
        ids, labels = _batch(step)
        loss = _wrapper_loss(wrapper, kind, ids[rows], labels[rows])
        with torch.no_grad():
            ref_rank = _ref_loss(ref, teacher, kind, ids[rows], labels[rows])
        out["loss"].append(float(loss.detach()))
        out["ref_loss"].append(float(ref_rank))
        out["loss_err"].append(abs(out["loss"][-1] - float(ref_rank)) / abs(float(ref_rank)))
        if mixed and step == 0:
            eager = _llama(0, tied)
            eager.load_state_dict(ref.state_dict())
            eager = eager.to(torch.bfloat16)
            with torch.no_grad():
                e = _ref_loss(eager, None, kind, ids[rows], labels[rows], dtype=torch.float32)
            out["eager_bf16_err"] = abs(float(e) - float(ref_rank)) / abs(float(ref_rank))
            out["fsdp_bf16_err"] = out["loss_err"][0]
        opt.zero_grad()
        loss.backward()
        if mixed and step == 0:  # the full gradients (collective: every rank, same order)
            grads = {name.removeprefix("model."): p.grad.full_tensor().detach()
                     for name, p in wrapper.named_parameters()}
        opt.step()
        # FSDP2's gradient is the mean over ranks of each rank's sum: the global sum / world
        ref_opt.zero_grad()
        (_ref_loss(ref, teacher, kind, ids, labels) / world).backward()
        if mixed and step == 0:
            (_ref_loss(eager, None, kind, ids, labels, dtype=torch.float32) / world).backward()
            want = {n: p.grad for n, p in ref.named_parameters()}
            eager_grads = {n: p.grad for n, p in eager.named_parameters()}
            for part, names in (("", list(want)), ("_head", ["lm_head.weight"])):
                if tied and part:  # the tied head's gradient is the embedding's
                    names = ["model.embed_tokens.weight"]
                out[f"fsdp_bf16_grad_err{part}"] = _grad_err(grads, want, names)
                out[f"eager_bf16_grad_err{part}"] = _grad_err(eager_grads, want, names)
        ref_opt.step()
    ref_params = dict(ref.named_parameters())
    param_err = 0.0
    names = []
    for name, p in wrapper.named_parameters():
        full = p.full_tensor().detach()
        r = ref_params[name.removeprefix("model.")].detach()
        param_err = max(param_err, float((full - r).abs().max()) / max(1.0, float(r.abs().max())))
        names.append(name)
    moved = max(float((a - b).abs().max()) for a, b in
                zip(ref.parameters(), _llama(0, tied).parameters()))
    out.update(param_err=param_err, n_params=len(names), moved=moved)
    return out


# name: (loss_type, beta, entropy_coef, reshard_after_forward)
POLICY_CASES = {
    "policy-dapo-kl-entropy-reshard": ("dapo", 0.05, 0.01, True),
    "policy-grpo-keep": ("grpo", 0.0, 0.0, False),
}


def _policy_batch(step):
    """The global batch of a policy step: ``ids``, the shifted targets with ignored prompt and
    padding (completions of different lengths), the completion mask, per-sequence advantages,
    and noise for the sampling and reference policies' log-probs."""
    g = torch.Generator().manual_seed(200 + step)
    ids = torch.randint(0, V, (WORLD * B, T), generator=g)
    shift = torch.cat([ids[:, 1:], torch.full((WORLD * B, 1), -100)], dim=1)
    shift[:, :2] = -100  # the prompt
    for row, n in enumerate(torch.randint(0, 3, (WORLD * B,), generator=g).tolist()):
        if n:
            shift[row, T - 1 - n:] = -100  # shorter completions
    mask = shift != -100
    adv = torch.randn(WORLD * B, generator=g, dtype=torch.float64)
    noise = torch.randn(2, WORLD * B, T, generator=g, dtype=torch.float64)
    return ids, shift, mask, adv, noise


def _ref_log_probs(model, ids, shift):
    """Per-token log-probs of ``shift`` (0 where none) and entropies, float64 full logits."""
    logp = F.log_softmax(model(input_ids=ids).logits.to(torch.float64), dim=-1)
    picked = logp.gather(-1, shift.clamp(min=0)[..., None])[..., 0] * (shift != -100)
    return picked, -(logp.exp() * logp).sum(-1)


def _run_policy(rank, world, mesh, loss_type, beta, entropy_coef, reshard):
    """``megaloss.policy_loss`` on the log-probs (and entropies) of a ``CausalLMWithLogProbs``
    forward under FSDP2, the step's weights from ``policy_calibrator`` with ``probe_fsdp``'s
    multiplier: 2 SGD steps against the single-process float64 reference (plain full logits,
    ``policy_loss`` on the whole global batch)."""
    from torch.distributed.fsdp import fully_shard

    from megaloss import LogProbsOptions, PolicyLossOptions, Topology
    from megaloss.calibration import probe_fsdp
    from megaloss.integrations.hf import CausalLMWithLogProbs
    from megaloss.losses.policy import (
        completion_labels,
        policy_calibrator,
        policy_loss,
        policy_loss_weights,
    )
    rows = slice(rank * B, (rank + 1) * B)
    ref = _llama(0)
    model = _llama(0)
    model.load_state_dict(ref.state_dict())
    wrapper = CausalLMWithLogProbs(model, options=LogProbsOptions(
        accum_dtype=torch.float64, return_entropy=entropy_coef != 0))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(wrapper, mesh=mesh, reshard_after_forward=reshard)
    options = PolicyLossOptions(loss_type=loss_type, beta=beta, entropy_coef=entropy_coef,
                                epsilon_low=0.2, epsilon_high=0.28, max_completion_length=T)
    scale = probe_fsdp(wrapper)
    calib = policy_calibrator(options, Topology.default(), engine_scale=scale,
                              weight_dtype=torch.float64)
    opt = torch.optim.SGD(wrapper.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    out = dict(loss_err=[], multiplier=scale.loss_multiplier, clipped=0.0)
    for step in range(STEPS):
        ids, shift, mask, adv, noise = _policy_batch(step)
        ref_lp, ref_h = _ref_log_probs(ref, ids, shift)
        # the sampling policy and the reference policy: near the current one, masked like it
        old = (ref_lp.detach() + 0.3 * noise[0]) * mask
        kl_ref = (ref_lp.detach() + 0.2 * noise[1]) * mask
        kw = dict(ref_log_probs=kl_ref, options=options)
        calibrated = calib.begin_step([completion_labels(mask[rows])])
        lp = wrapper(ids[rows], shift_labels=shift[rows])
        loss = policy_loss(lp.log_probs, old[rows], adv[rows], mask[rows],
                           ref_log_probs=kl_ref[rows], entropy=lp.entropy, options=options,
                           weights=policy_loss_weights(calibrated, 0, options))
        opt.zero_grad()
        calibrated.loss_for_backward(loss).backward()
        opt.step()
        got = float(calibrated.global_loss())
        ref_opt.zero_grad()
        want = policy_loss(ref_lp, old, adv, mask, entropy=ref_h, return_stats=True, **kw)
        want.loss.backward()
        ref_opt.step()
        want = float(want.loss.detach())
        out["loss_err"].append(abs(got - want) / max(1.0, abs(want)))
        ratio = torch.exp(ref_lp.detach() - old)[mask]
        out["clipped"] = max(out["clipped"], float(((ratio < 0.8) | (ratio > 1.28)).double()
                                                   .mean()))
    ref_params = dict(ref.named_parameters())
    out["param_err"] = max(
        float((p.full_tensor().detach() - ref_params[n.removeprefix("model.")]).abs().max())
        / max(1.0, float(ref_params[n.removeprefix("model.")].abs().max()))
        for n, p in wrapper.named_parameters())
    out["moved"] = max(float((a.detach() - b).abs().max())
                       for a, b in zip(ref.parameters(), _llama(0).parameters()))
    return out


def _refusals(rank, world, mesh):
    from torch.distributed.fsdp import fully_shard

    import megaloss
    from megaloss.integrations.hf import CausalLMWithDistillation, CausalLMWithLoss
    out = {}
    model = _llama(0)
    fully_shard(model.lm_head, mesh=mesh)
    weight = model.lm_head.weight
    h = torch.randn(5, H, dtype=torch.float64)
    lab = torch.randint(0, V, (5,))
    for name, fn in (("ce", megaloss.linear_cross_entropy),
                     ("logprobs", megaloss.linear_log_probs)):
        try:
            fn(h, weight, lab)
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the type and message are what is tested
            out[name] = f"{type(e).__name__}: {e}"
    try:
        megaloss.linear_distillation_loss(h, torch.randn(V, H, dtype=torch.float64), lab,
                                          teacher_hidden_states=h, teacher_weight=weight)
        out["distill_teacher"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["distill_teacher"] = f"{type(e).__name__}: {e}"
    try:
        CausalLMWithLoss(model)
        out["wrap_after"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["wrap_after"] = f"{type(e).__name__}: {e}"
    try:
        CausalLMWithDistillation(_llama(2), model)
        out["teacher"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["teacher"] = f"{type(e).__name__}: {e}"
    return out


def _worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    results = {name: _run_case(rank, world, mesh, *case) for name, case in CASES.items()}
    results.update({name: _run_policy(rank, world, mesh, *case)
                    for name, case in POLICY_CASES.items()})
    results["refusals"] = _refusals(rank, world, mesh)
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD, timeout=540)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c[4]])
def test_fsdp2_float64_equals_reference(results, name):
    for rank, res in enumerate(results):
        r = res[name]
        assert r["head_type"] == "DTensor", r  # the head weight really is sharded
        assert r["moved"] > 1e-4  # the steps changed the parameters
        assert max(r["loss_err"]) < 1e-10, (rank, r)
        assert r["param_err"] < 1e-10, (rank, r)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[4]])
def test_fsdp2_bf16_mixed_precision_within_eager_error(results, name):
    for rank, res in enumerate(results):
        r = res[name]
        assert math.isfinite(r["fsdp_bf16_err"])
        assert r["fsdp_bf16_err"] <= 2 * r["eager_bf16_err"], (rank, r)
        for part in ("", "_head"):  # all parameters; the lm_head (the loss's own gradient)
            fsdp, eager = r[f"fsdp_bf16_grad_err{part}"], r[f"eager_bf16_grad_err{part}"]
            assert math.isfinite(fsdp) and 0 < eager < 0.05, (rank, part, r)
            assert fsdp <= 2 * eager, (rank, part, r)
        assert max(r["loss_err"]) < 5e-2, (rank, r)  # step 2 still trains in bf16


@pytest.mark.parametrize("name", list(POLICY_CASES))
def test_fsdp2_policy_loss_float64_equals_reference(results, name):
    for rank, res in enumerate(results):
        r = res[name]
        assert r["multiplier"] == 2.0, (rank, r)  # measured: FSDP2 averages over 2 ranks
        assert r["moved"] > 1e-4 and r["clipped"] > 0.05, (rank, r)  # trains; clipping active
        assert max(r["loss_err"]) < 1e-10, (rank, r)
        assert r["param_err"] < 1e-10, (rank, r)


def test_sharded_weight_outside_fsdp_forward_is_refused(results):
    for res in results:
        ref = res["refusals"]
        for key in ("ce", "logprobs", "distill_teacher"):
            assert ref[key].startswith("TypeError"), (key, ref[key])
            assert "DTensor" in ref[key] and "register_fsdp_forward_method" in ref[key], ref[key]
        assert ref["wrap_after"].startswith("ValueError") and "wrap it first" in ref["wrap_after"]
        assert ref["teacher"].startswith("ValueError") and "teacher" in ref["teacher"]
