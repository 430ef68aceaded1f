#!/usr/bin/env python3
"""Benchmark: megaloss's router losses against transformers' ``load_balancing_loss_func``, and
the cost of the calibrated step's ``"step"`` router scope (its routing pre-pass).

**Part 1, the loss** (``--tokens``, ``--layers``): ``L`` router-logit tensors ``[N, E]``, fp32
leaf tensors that require grad (standing for the routers' outputs), an attention mask whose last
``--padding`` fraction of tokens is 0, and one forward+backward of

* ``hf`` (the baseline): ``load_balancing_loss_func(tuple(logits), E, top_k, mask)`` of
  ``transformers/models/qwen3_moe/modeling_qwen3_moe.py``;
* ``megaloss_concatenated``: ``router_loss(logits, top_k, options=RouterLossOptions(aux_loss=1,
  layers="concatenated"), mask=mask).loss`` (the same loss);
* ``megaloss_per_layer``: the same with ``layers="per_layer"`` (one loss per layer, averaged:
  checked against the mean of ``hf`` on each layer alone).

Per (N, L): a fresh process per method runs it once under the memory probe (extra peak memory
above the logits and their preallocated ``.grad``: ``tools/_bench_common.py``), then compares
its loss and gradient with transformers' formula of its form on the same logits
(``loss_rel_diff``, ``grad_rel_diff``; the ``hf`` process computes these references and a
float64 one from the formula, and saves them for the others, which do not import transformers)
and with float64 (``loss_err64``, ``grad_err64``); each figure is the max abs difference over
the reference's max abs value. One more process times every method in ``--repeats``
interleaved rounds (order rotated, until ``--time-budget`` seconds), the minimum taken.
``time_vs_hf`` / ``mem_vs_hf``: ratios against ``hf`` of the same run.

**Part 2, the step** (``--step``, on by default): a random-init ``Qwen3MoeForCausalLM``
(``--moe-hidden``, ``--moe-layers``, ``--moe-experts`` top ``--moe-top-k``, ``--vocab``) and
``--micro-batches`` micro-batches of ``--batch`` rows of ``--seq`` random tokens (row 0 of each
ends in 16 padded tokens: attention mask 0, label -100), fp32, CPU, wrapped in
``megaloss.CausalLMWithLoss`` (the chunked CE sum plus the router pool's share the calibrated
step hands it, ``router_loss=``; the pool's counts alone for a pre-pass). In one process,
interleaved rounds of

* ``global`` (the baseline): ``run_step(engine, LanguageModelLoss(router=RouterLossOptions(
  aux_loss=1, scope="global", layers="concatenated")), micro_batches)`` on a one-process
  ``FSDPStepEngine`` (SGD, lr 0: the model does not change between rounds);
* ``step``: the same with ``scope="step"``: the pre-pass (each micro-batch's forward without
  gradients) before the first backward;
* ``prepass``: the pre-pass alone (``step_statistics`` over the same forwards);
* ``hf_loss``: the model's own loss, ``model(input_ids, attention_mask=, labels=,
  output_router_logits=True).loss / G``, backward per micro-batch, no optimizer step (what a
  plain Hugging Face loop spends: its per-micro-batch router loss).

``time_vs_global`` is each one's minimum over the rounds against ``global``'s;
``prepass_fraction`` is ``prepass / step``.

    python3 tools/bench_router.py --quick             # < 60 s on 2 cores
    python3 tools/bench_router.py                     # N 8192 32768, L 8 24, E 64, top-8
    python3 tools/bench_router.py --no-step --tokens 65536 --layers 48 --csv router.csv
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import (  # noqa: E402
    MALLOC_ENV,
    MemoryProbe,
    add_process_arguments,
    answer_worker,
    format_table,
    mib,
    require_positive,
    run_in_this_process,
    run_worker,
    write_csv,
)

METHODS = ("hf", "megaloss_concatenated", "megaloss_per_layer")
STEP_CASES = ("global", "step", "prepass", "hf_loss")
COLUMNS = ["tokens", "layers", "experts", "top_k", "method", "time_s", "time_vs_hf",
           "extra_MiB", "mem_vs_hf", "logits_MiB", "loss", "loss_rel_diff", "grad_rel_diff",
           "loss_err64", "grad_err64", "repeats", "threads", "mem_method", "note"]
TABLE_COLUMNS = ["tokens", "layers", "method", "time_s", "time_vs_hf", "extra_MiB", "mem_vs_hf",
                 "logits_MiB", "loss", "loss_rel_diff", "grad_rel_diff", "grad_err64"]
STEP_COLUMNS = ["case", "s_per_step", "time_vs_global", "prepass_fraction", "loss",
                "router_aux_loss", "repeats", "tokens_per_step", "hidden", "layers", "experts",
                "top_k", "vocab", "seq", "batch", "micro_batches", "threads", "note"]
STEP_TABLE_COLUMNS = ["case", "s_per_step", "time_vs_global", "prepass_fraction", "loss",
                      "router_aux_loss"]
QUICK = {"tokens": [2048], "layers": [4], "moe_hidden": 64, "moe_layers": 2, "vocab": 1024,
         "seq": 64, "batch": 2, "micro_batches": 2, "repeats": 2, "time_budget": 5.0}


# part 1: the loss ------------------------------------------------------------------------------
def inputs(spec: Dict[str, Any]):
    """``L`` router logits ``[N, E]`` (fp32, standard normal, no grad) and the mask ``[1, N]``
    (int64, the last ``padding`` fraction 0), from their own CPU generator: a function of
    ``spec`` alone, the same in every process."""
    import torch

    n, layers, experts = spec["tokens"], spec["layers"], spec["experts"]
    gen = torch.Generator().manual_seed(spec["seed"])
    logits = [torch.randn(n, experts, generator=gen) for _ in range(layers)]
    mask = torch.ones(1, n, dtype=torch.long)
    mask[:, n - int(n * spec["padding"]):] = 0
    return logits, mask


def _loss_fn(method: str, num_experts: int, top_k: int):
    """``fn(logits, mask) -> loss`` of ``method`` (transformers imported for ``hf`` only: its
    import is most of a worker's start-up)."""
    if method == "hf":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        return lambda xs, mask: load_balancing_loss_func(tuple(xs), num_experts, top_k, mask)
    from megaloss.losses.router import router_loss
    from megaloss.losses.router_options import RouterLossOptions

    layers = "concatenated" if method.endswith("concatenated") else "per_layer"
    options = RouterLossOptions(aux_loss=1.0, layers=layers)
    return lambda xs, mask: router_loss(xs, top_k, options=options, mask=mask).loss


def _save_references(path: str, xs, mask, num_experts: int, top_k: int) -> None:
    """transformers' loss and gradients on copies of ``xs``, saved to ``path`` for the other
    processes of the size: ``"concatenated"``, the function itself; ``"per_layer"``, its mean
    over the layers taken one at a time."""
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    out = {}
    for form in ("concatenated", "per_layer"):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        if form == "per_layer":
            loss = sum(load_balancing_loss_func((x,), num_experts, top_k, mask)
                       for x in leaves) / len(leaves)
        else:
            loss = load_balancing_loss_func(tuple(leaves), num_experts, top_k, mask)
        out[form] = (loss.detach(), torch.autograd.grad(loss, leaves))
        out["float64_" + form] = _float64_reference(form, xs, mask, num_experts, top_k)
    torch.save(out, path)


def _float64_reference(form: str, xs, mask, num_experts: int, top_k: int):
    """The load-balancing loss of ``form`` and its gradients in float64 from the formula
    (Switch Transformer, arXiv:2101.03961 eqs. 4-6, top-k counts, Hugging Face's
    normalisation): ``E sum_e f_e P_e``, ``f`` the masked top-k counts over the counted
    tokens, ``P`` the masked mean router probability; per layer and averaged, or summed over
    the layers first (``concatenated``)."""
    import torch

    leaves = [x.detach().double().requires_grad_() for x in xs]
    m = mask.reshape(-1).double()
    counts = [torch.zeros(num_experts, dtype=torch.float64).index_add_(
        0, x.topk(top_k, dim=-1).indices.reshape(-1), m.repeat_interleave(top_k))
        for x in leaves]
    probs = [(torch.softmax(x, dim=-1) * m[:, None]).sum(0) for x in leaves]
    n = m.sum()
    if form == "per_layer":
        loss = sum(num_experts * (c / n * p / n).sum() for c, p in zip(counts, probs))
        loss = loss / len(leaves)
    else:
        total = len(leaves) * n
        loss = num_experts * (sum(counts) / total * sum(probs) / total).sum()
    return loss.detach(), torch.autograd.grad(loss, leaves)


def _differences(path: str, method: str, loss, xs) -> Dict[str, float]:
    """``loss_rel_diff`` / ``grad_rel_diff`` of ``method``'s run against transformers' loss of
    its form in ``path`` and ``loss_err64`` / ``grad_err64`` against float64 (each: max abs
    difference over the reference's max abs value; ``{}`` when there is no reference)."""
    import torch

    if not path or not os.path.exists(path):
        return {}
    form = "per_layer" if method == "megaloss_per_layer" else "concatenated"
    refs = torch.load(path)
    out = {}
    for key, prefix in ((form, "{}_rel_diff"), ("float64_" + form, "{}_err64")):
        ref_loss, ref_grads = refs[key]
        scale = max(float(g.abs().max()) for g in ref_grads) or 1.0
        grad_diff = max(float((x.grad.double() - g).abs().max()) for x, g in zip(xs, ref_grads))
        out[prefix.format("loss")] = (abs(float(loss) - float(ref_loss))
                                      / max(abs(float(ref_loss)), 1e-30))
        out[prefix.format("grad")] = grad_diff / scale
    return out


def _loss_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """``mode="memory"``: one fwd+bwd of ``spec["method"]`` under the memory probe, then its
    loss and gradient against the references (:func:`_differences`; the ``hf`` process writes
    them first). ``mode="timing"``: interleaved rounds of
    every method."""
    import gc

    import torch

    torch.set_num_threads(spec["threads"])
    experts, top_k = spec["experts"], spec["top_k"]
    methods = [spec["method"]] if spec["mode"] == "memory" else list(METHODS)
    fns = {m: _loss_fn(m, experts, top_k) for m in methods}
    # warm-up at a small N (lazy state of the kernels in the baseline, not the real buffers)
    warm, warm_mask = inputs({**spec, "tokens": min(spec["tokens"], 256), "layers": 2})
    for m in methods:
        warm_leaves = [x.requires_grad_() for x in warm]
        fns[m](warm_leaves, warm_mask).backward()
    del warm, warm_leaves
    xs, mask = inputs(spec)
    for x in xs:
        x.requires_grad_()
        x.grad = torch.zeros_like(x)  # preallocated: the figure is beyond logits and grads
    gc.collect()
    if spec["mode"] == "memory":
        probe = MemoryProbe("cpu")
        probe.start()
        loss = fns[spec["method"]](xs, mask)
        loss.backward()
        extra = probe.peak_above_baseline()
        if spec["method"] == "hf" and spec.get("reference"):
            _save_references(spec["reference"], xs, mask, experts, top_k)
        return {"extra_bytes": extra, "loss": float(loss.detach()), "mem_method": probe.method,
                "baseline_slack": probe.baseline_slack,
                **_differences(spec.get("reference", ""), spec["method"], loss.detach(), xs)}
    times: Dict[str, List[float]] = {m: [] for m in methods}
    spent = 0.0
    for r in range(spec["repeats"]):
        k = r % len(methods)
        for m in methods[k:] + methods[:k]:
            t0 = time.perf_counter()
            fns[m](xs, mask).backward()
            dt = time.perf_counter() - t0
            times[m].append(dt)
            spent += dt
        if spent >= spec["budget"]:
            break
    return {"times": times}


def _loss_rows(args, n: int, layers: int, res: Dict[str, Any]) -> List[Dict[str, Any]]:
    times = res["timing"].get("times", {})
    fastest = {m: min(times.get(m) or [math.nan]) for m in METHODS}
    base_mem = res["memory"].get("hf", {}).get("extra_bytes", math.nan)
    rows = []
    for m in METHODS:
        mem = res["memory"].get(m, {})
        extra = mem.get("extra_bytes", math.nan)
        note = mem.get("error") or res["timing"].get("error") or ""
        rows.append({
            "tokens": n, "layers": layers, "experts": args.experts, "top_k": args.top_k,
            "method": m, "time_s": fastest[m], "time_vs_hf": fastest[m] / fastest["hf"],
            "extra_MiB": mib(extra),
            "mem_vs_hf": extra / base_mem if base_mem > 0 else math.nan,
            "logits_MiB": mib(layers * n * args.experts * 4),
            "loss": mem.get("loss", math.nan), "loss_rel_diff": mem.get("loss_rel_diff", math.nan),
            "grad_rel_diff": mem.get("grad_rel_diff", math.nan),
            "loss_err64": mem.get("loss_err64", math.nan),
            "grad_err64": mem.get("grad_err64", math.nan),
            "repeats": len(times.get(m, [])), "threads": args.threads,
            "mem_method": mem.get("mem_method", ""), "note": note})
    return rows


# part 2: the step ------------------------------------------------------------------------------
def step_model(spec: Dict[str, Any]):
    """The random-init ``Qwen3MoeForCausalLM`` of ``spec`` (seeded) and its micro-batches."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hidden = spec["moe_hidden"]
    config = Qwen3MoeConfig(
        vocab_size=spec["vocab"], hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2, num_hidden_layers=spec["moe_layers"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        num_experts=spec["moe_experts"], num_experts_per_tok=spec["moe_top_k"],
        router_aux_loss_coef=1.0, max_position_embeddings=max(spec["seq"], 64))
    if spec.get("experts_implementation"):
        config._experts_implementation = spec["experts_implementation"]
    torch.manual_seed(spec["seed"])
    model = Qwen3MoeForCausalLM(config)
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    batches = []
    for _ in range(spec["micro_batches"]):
        ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, -16:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return model, batches


def _step_worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Interleaved rounds of :data:`STEP_CASES` on one model (module docstring)."""
    import torch

    import megaloss
    from megaloss.integrations.fsdp import FSDPStepEngine
    from megaloss.integrations.step import run_step
    from megaloss.integrations.step.lm import LanguageModelLoss, model_inputs
    from megaloss.integrations.step.router import step_statistics
    from megaloss.losses.router_options import RouterLossOptions

    torch.set_num_threads(spec["threads"])
    model, batches = step_model(spec)
    module = megaloss.CausalLMWithLoss(
        model, options=megaloss.CrossEntropyOptions(reduction="sum"))
    engine = FSDPStepEngine(module, torch.optim.SGD(module.parameters(), lr=0.0),
                            megaloss.LossCalibrator())
    options = {s: RouterLossOptions(aux_loss=1.0, scope=s, layers="concatenated")
               for s in ("global", "step")}
    g = len(batches)
    out: Dict[str, Any] = {}

    def step(scope):
        m = run_step(engine, LanguageModelLoss(router=options[scope]), batches, log=False)
        out[scope] = {"loss": m.loss, "router_aux_loss": m.router_aux_loss}

    def prepass():
        def forward(mb):
            inputs = model_inputs(mb, engine.topology)
            return lambda pool: module(inputs.pop("input_ids"), router_loss=pool, **inputs)
        step_statistics(options["step"], engine.topology, [forward(mb) for mb in batches])

    def hf_loss():
        total = 0.0
        for mb in batches:
            o = model(mb["input_ids"], attention_mask=mb["attention_mask"], labels=mb["labels"],
                      output_router_logits=True)
            (o.loss / g).backward()
            total += float(o.loss.detach()) / g
        model.zero_grad(set_to_none=True)
        out["hf_loss"] = {"loss": total}

    cases = {"global": lambda: step("global"), "step": lambda: step("step"),
             "prepass": prepass, "hf_loss": hf_loss}
    order = list(STEP_CASES)
    for c in order:  # warm-up at the real size
        cases[c]()
    times: Dict[str, List[float]] = {c: [] for c in order}
    spent = 0.0
    for r in range(spec["repeats"]):
        k = r % len(order)
        for c in order[k:] + order[:k]:
            t0 = time.perf_counter()
            cases[c]()
            dt = time.perf_counter() - t0
            times[c].append(dt)
            spent += dt
        if spent >= spec["budget"]:
            break
    return {"times": times, "values": out,
            "experts_implementation": model.config._experts_implementation}


def _step_rows(args, spec: Dict[str, Any], res: Dict[str, Any]) -> List[Dict[str, Any]]:
    times = res.get("times", {})
    fastest = {c: min(times.get(c) or [math.nan]) for c in STEP_CASES}
    values = res.get("values", {})
    rows = []
    for c in STEP_CASES:
        v = values.get(c, {})
        rows.append({
            "case": c, "s_per_step": fastest[c], "time_vs_global": fastest[c] / fastest["global"],
            "prepass_fraction": fastest["prepass"] / fastest["step"] if c == "step" else "",
            "loss": v.get("loss", math.nan if c != "prepass" else ""),
            "router_aux_loss": v.get("router_aux_loss", ""),
            "repeats": len(times.get(c, [])),
            "tokens_per_step": spec["seq"] * spec["batch"] * spec["micro_batches"],
            "hidden": spec["moe_hidden"], "layers": spec["moe_layers"],
            "experts": spec["moe_experts"], "top_k": spec["moe_top_k"], "vocab": spec["vocab"],
            "seq": spec["seq"], "batch": spec["batch"], "micro_batches": spec["micro_batches"],
            "threads": spec["threads"], "note": res.get("error", "")})
    return rows


# driver ---------------------------------------------------------------------------------------
def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    return _step_worker(spec) if spec["part"] == "step" else _loss_worker(spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small sizes (N 2048, L 4; the step at hidden 64, 2 layers, vocab 1024, "
                        "2 micro-batches of 2 x 64 tokens), 2 rounds: < 60 s on 2 cores")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768],
                   help="routed tokens N of part 1 (default 8192 32768)")
    p.add_argument("--layers", type=int, nargs="+", default=[8, 24],
                   help="MoE layers L of part 1 (default 8 24)")
    p.add_argument("--experts", type=int, default=64, help="experts E of part 1 (default 64)")
    p.add_argument("--top-k", type=int, default=8, help="top_k of part 1 (default 8)")
    p.add_argument("--padding", type=float, default=0.125,
                   help="fraction of part 1's tokens masked out at the end (default 0.125)")
    p.add_argument("--no-loss", action="store_true", help="skip part 1")
    p.add_argument("--no-step", action="store_true", help="skip part 2")
    p.add_argument("--moe-hidden", type=int, default=128, help="part 2's hidden size (128)")
    p.add_argument("--moe-layers", type=int, default=4, help="part 2's layers (4)")
    p.add_argument("--moe-experts", type=int, default=8, help="part 2's experts (8)")
    p.add_argument("--moe-top-k", type=int, default=2, help="part 2's top_k (2)")
    p.add_argument("--vocab", type=int, default=4096, help="part 2's vocabulary (4096)")
    p.add_argument("--seq", type=int, default=256, help="part 2's sequence length (256)")
    p.add_argument("--batch", type=int, default=4, help="part 2's rows per micro-batch (4)")
    p.add_argument("--micro-batches", type=int, default=4, help="part 2's micro-batches (4)")
    p.add_argument("--experts-implementation", default="",
                   help="part 2's config._experts_implementation (default: transformers' own, "
                        "e.g. grouped_mm; 'eager' for the per-expert loop)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed rounds, the minimum taken (default 5)")
    p.add_argument("--time-budget", type=float, default=60.0,
                   help="stop adding rounds once a timing process's runs took this many "
                        "seconds (at least one round; default 60)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads per worker (default: all CPUs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", metavar="PATH", help="write part 1's rows as CSV")
    p.add_argument("--step-csv", metavar="PATH", help="write part 2's rows as CSV")
    add_process_arguments(p)
    args = p.parse_args(argv)

    if answer_worker(args, _worker):
        return 0
    if args.quick:
        explicit = set(a.lstrip("-").split("=")[0].replace("-", "_")
                       for a in (argv if argv is not None else sys.argv[1:]) if a.startswith("--"))
        for k, v in QUICK.items():
            if k not in explicit:
                setattr(args, k, v)
    require_positive(p, args, ("experts", "top_k", "moe_hidden", "moe_layers", "moe_experts",
                               "moe_top_k", "vocab", "seq", "batch", "micro_batches", "repeats",
                               "threads"))
    if any(n < 1 for n in args.tokens) or any(n < 1 for n in args.layers):
        p.error("--tokens and --layers must be >= 1")
    if args.top_k > args.experts or args.moe_top_k > args.moe_experts:
        p.error("--top-k must be <= --experts and --moe-top-k <= --moe-experts")
    if not 0 <= args.padding < 1:
        p.error("--padding must be in [0, 1)")
    if args.seq <= 16:
        p.error("--seq must be > 16 (row 0 of each micro-batch ends in 16 padded tokens)")

    script = os.path.abspath(__file__)
    if args.same_process:
        print(f"# every case in this process, {args.threads} threads", file=sys.stderr)
    else:
        print(f"# workers: fresh process per case, {args.threads} threads, "
              + " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items()), file=sys.stderr)

    def run(spec):
        t0 = time.perf_counter()
        out = (run_in_this_process(_worker, spec) if args.same_process
               else run_worker(script, spec, args.threads, args.timeout))
        label = " ".join(f"{k}={spec[k]}" for k in ("part", "tokens", "layers", "mode", "method")
                         if k in spec)
        print(f"# {label}: {out.get('error', 'ok')} ({time.perf_counter() - t0:.1f} s)",
              file=sys.stderr)
        return out

    rows: List[Dict[str, Any]] = []
    errors: List[str] = []
    tmp = tempfile.TemporaryDirectory(prefix="bench_router_")
    if not args.no_loss:
        for n in args.tokens:
            for layers in args.layers:
                base = {"part": "loss", "tokens": n, "layers": layers, "experts": args.experts,
                        "top_k": args.top_k, "padding": args.padding, "seed": args.seed,
                        "threads": args.threads, "repeats": args.repeats,
                        "budget": args.time_budget}
                base["reference"] = os.path.join(tmp.name, f"reference_{n}_{layers}.pt")
                res: Dict[str, Any] = {"memory": {m: run({**base, "mode": "memory", "method": m})
                                                  for m in METHODS}}  # hf first: it writes
                if os.path.exists(base["reference"]):                # the references
                    os.remove(base["reference"])
                res["timing"] = run({**base, "mode": "timing", "method": "all"})
                errors += [f"N={n} L={layers} {k}: {v['error']}"
                           for k, v in [*res["memory"].items(), ("timing", res["timing"])]
                           if "error" in v]
                rows += _loss_rows(args, n, layers, res)
                if args.csv:
                    write_csv(args.csv, rows, COLUMNS)  # a killed run keeps its rows
        print(f"router load-balancing loss fwd+bwd, E={args.experts}, top_k={args.top_k}, fp32 "
              f"logits (L leaf tensors [N, E]), last {args.padding:g} of the tokens masked; "
              f"time = min seconds over the rounds; extra_MiB = peak memory above the logits "
              f"and their grads; ratios against hf (transformers' load_balancing_loss_func); "
              f"*_rel_diff against hf's formula (per_layer: its mean over single layers)")
        print(format_table(rows, TABLE_COLUMNS))

    step_rows: List[Dict[str, Any]] = []
    if not args.no_step:
        spec = {"part": "step", "moe_hidden": args.moe_hidden, "moe_layers": args.moe_layers,
                "moe_experts": args.moe_experts, "moe_top_k": args.moe_top_k,
                "vocab": args.vocab, "seq": args.seq, "batch": args.batch,
                "micro_batches": args.micro_batches,
                "experts_implementation": args.experts_implementation, "seed": args.seed,
                "threads": args.threads, "repeats": args.repeats, "budget": args.time_budget}
        res = run(spec)
        if "error" in res:
            errors.append(f"step: {res['error']}")
        step_rows = _step_rows(args, spec, res)
        if rows:
            print()
        print(f"calibrated step of a random-init Qwen3-MoE (hidden {args.moe_hidden}, "
              f"{args.moe_layers} layers, {args.moe_experts} experts top-{args.moe_top_k}, "
              f"vocab {args.vocab}, experts {res.get('experts_implementation', '?')}), "
              f"{args.micro_batches} micro-batches of {args.batch} x {args.seq} tokens, fp32 "
              f"CPU: seconds per step (min over the rounds); ratios against the 'global' scope's "
              f"run_step; prepass_fraction = prepass / step")
        print(format_table(step_rows, STEP_TABLE_COLUMNS))
        if args.step_csv:
            write_csv(args.step_csv, step_rows, STEP_COLUMNS)
    tmp.cleanup()
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
