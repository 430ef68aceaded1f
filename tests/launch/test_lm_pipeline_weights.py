"""The LM job's pipeline stages start from the model every other layout trains.

``launch/jobs/lm_pipeline.py`` builds the stages of ``--pipeline_parallel_size N``; the other
layouts train ``build_llama(args, vocab)`` (``launch/jobs/models.py``) of the same seed. Checked
for an untied and a tied (``--tie_word_embeddings``) tiny Llama of a non-default seed:

- one process: the layers of :func:`llama_stage_layers`, each built, hold exactly (bitwise)
  the weights of ``build_llama`` under their ``LlamaForCausalLM`` names;
- 2 processes, the job's functions: PP=2 (``build_pipeline_job``, ``configs/zero1.json``)
  against DP1 x TP=2 (``build_llama`` -> ``CausalLMWithLoss`` -> ``initialize``, what
  ``launch/train_lm.py`` runs without PP) on the same micro-batches: the pipeline engine's
  parameters equal ``build_llama``'s before training, and the held-out CE before training and
  the step-1 loss agree within 1e-5 relative (fp32; vocab-parallel against whole-vocabulary CE,
  measured within 1e-7). A model drawn from other seeds misses by ~1e-3 (7.6270 against 7.6279
  held-out CE on the job's default data).
"""
import json

import pytest
import torch

from megaloss.testing import run_distributed
from tests.helpers.launch_helpers import REPO

VOCAB, SEQ, SEED, MICRO, GAS = 96, 16, 3, 2, 2
REL_TOL = 1e-5


def _args(tied, *extra):
    from launch.train_lm import parse_args
    return parse_args(["--model_size", "tiny", "--num_layers", "2", "--seq_len", str(SEQ),
                       "--seed", str(SEED), *extra] + ["--tie_word_embeddings"] * tied)


def _built_parameters(layers, num_layers):
    """``LlamaForCausalLM`` name -> tensor of every layer spec, built here (one process)."""
    from deepspeed.pipe import TiedLayerSpec

    from megaloss.integrations.deepspeed.pipeline_llama import hf_parameter_name
    out = {}
    for k, spec in enumerate(layers):
        prefix = f"tied_modules.{spec.key}." if isinstance(spec, TiedLayerSpec) else f"{k}."
        for name, p in spec.build().named_parameters():
            out[hf_parameter_name(prefix + name, num_layers)] = p.detach()
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_stage_layers_hold_the_weights_of_build_llama(tied):
    from launch.jobs.lm_pipeline import llama_stage_layers
    from launch.jobs.models import build_llama

    args = _args(tied)
    layers, cfg, n_params, _ = llama_stage_layers(args, VOCAB)
    model, _ = build_llama(args, VOCAB)
    want = dict(model.named_parameters())  # a tied lm_head is the embedding, named once
    got = _built_parameters(layers, cfg.num_hidden_layers)
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert torch.equal(got[name], p.detach()), name
    assert n_params == sum(p.numel() for p in want.values())


def _ds_config(tp):
    cfg = json.loads((REPO / "configs" / "zero1.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=GAS)
    cfg["megaloss"]["tensor_parallel_size"] = tp
    cfg["megaloss"]["ce"]["chunk_size"] = 24  # several chunks per micro-batch
    return cfg


def _worker(rank, world, out_dir):
    """Per layout (tied or not): the PP engine's parameters before training (this stage's, by
    ``LlamaForCausalLM`` name), and the held-out CE before training and the step-1 loss of PP=2
    and of TP=2."""
    from launch.jobs.lm_pipeline import build_pipeline_job, pipeline_parallel_size
    from launch.jobs.models import build_llama
    from megaloss import CausalLMWithLoss, Topology
    from megaloss.integrations.deepspeed import evaluate, initialize, load_ds_config, train_step
    from megaloss.integrations.deepspeed.pipeline_llama import hf_parameter_name

    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, VOCAB, ((GAS + 2) * MICRO, SEQ + 1), generator=g)
    rows = [{"input_ids": b[:, :-1].contiguous(), "shift_labels": b[:, 1:].contiguous()}
            for b in blocks.split(MICRO)]
    mbs, held = rows[:GAS], rows[GAS:]
    out = {}
    for tied in (False, True):
        args = _args(tied, "--pipeline_parallel_size", "2")
        where = f"{out_dir}/{'tied' if tied else 'untied'}"
        ds_config, ml = load_ds_config(_ds_config(1), output_dir=f"{where}-pp")
        assert pipeline_parallel_size(args, ml, ds_config) == 2
        pipe = build_pipeline_job(args, ds_config, ml, VOCAB, f"{where}-pp", lambda msg: None)
        params = {hf_parameter_name(n, pipe.config.num_hidden_layers): p.detach().clone()
                  for n, p in pipe.me.engine.module.named_parameters()}
        pp = (pipe.evaluate(held).loss, pipe.train_step(mbs).loss)
        pipe.me.engine.destroy()

        ds_config, ml = load_ds_config(_ds_config(2), output_dir=f"{where}-tp")
        topo = Topology.build(ml.tensor_parallel_size)
        model, _ = build_llama(args, VOCAB)
        wrapper = CausalLMWithLoss(model, options=ml.ce.options(), tp_group=topo.tp_group)
        me = initialize(wrapper, ds_config, topology=topo, output_dir=f"{where}-tp")
        tp = (evaluate(me, held).loss, train_step(me, mbs).loss)
        me.engine.destroy()
        out[tied] = params, pp, tp
    return out


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(400)
def test_pipeline_job_starts_from_the_model_of_the_other_layouts(tmp_path):
    from launch.jobs.models import build_llama

    results = run_distributed(_worker, 2, str(tmp_path), timeout=380)
    failures = []
    for tied in (False, True):
        name = "tied" if tied else "untied"
        want = dict(build_llama(_args(tied), VOCAB)[0].named_parameters())
        seen = set()
        for rank, out in enumerate(results):
            params, pp, tp = out[tied]
            seen |= params.keys()
            failures += [f"{name}, rank {rank}: {k} differs from build_llama's"
                         for k, p in params.items() if not torch.equal(p, want[k].detach())]
            for what, a, b in zip(("held-out CE before training", "step-1 loss"), pp, tp):
                if abs(a - b) > REL_TOL * abs(b):
                    failures.append(f"{name}, rank {rank}: {what} PP=2 {a:.6f} != TP=2 {b:.6f}")
        if seen != want.keys():
            failures.append(f"{name}: the stages hold {sorted(seen)}, not {sorted(want)}")
    assert not failures, "\n".join(failures)
