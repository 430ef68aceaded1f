"""MegalossGRPOMixin in a real 2-process GRPOTrainer run with generation: a 1-layer Llama
sampling its own completions, a reward on the sampled text, 2 optimizer steps, on 2 CPU
processes two ways:

- DDP: 2 gloo processes (``megaloss.testing.run_distributed``; accelerate's MULTI_CPU DDP).
- DeepSpeed: ``GRPOConfig(deepspeed=<ZeRO-2 config, float32>)`` (:func:`ds_config`) in a
  ``deepspeed --num_gpus 2`` launch, as users start it (the Trainer tests' shared launch,
  ``shared_launch_hf`` of tests/helpers/shared_launches.py; this file's ``_worker_main`` is its
  part, also runnable alone: ``deepspeed --num_gpus 2
  tests/integrations/test_hf_trl_policy_distributed.py --worker <folder>`` with the repository
  on ``PYTHONPATH``). TRL 1.16 runs this on DeepSpeed's CPU accelerator as it is: the policy is
  a ZeRO-2 ``DeepSpeedEngine`` stepped by transformers' Trainer, the reference model a ZeRO-0
  engine from TRL's own ``prepare_deepspeed`` (trl/models/utils.py), generation uses the
  unwrapped engine (``unwrap_model_for_generation``, same file); the test checks both engines.

``class T(MegalossGRPOMixin, GRPOTrainer)`` trains both steps without error, and with the same
seed (the mixin draws no random numbers, so both runs sample the same completions as long as
their updates agree) its logged loss and grad norm of each step equal TRL's own
``GRPOTrainer``'s under the same launch and config, for ``grpo`` and ``dapo``: with one
micro-batch per process and the same rows on each, TRL's per-process normalisation is the
global one too (``grpo``: the row mean; ``dapo``: the global token count, uneven over the
processes). ``beta`` 0.04 against the initial model, so the second step's loss is not 0 (the
first's is, on-policy with group-normalised advantages, for ``grpo``). Tolerance: 1e-5 relative
plus 1e-7 (float32 model; the loss is a sum of O(1) terms that cancel to ~1e-3; measured: loss
within 1.5e-8 absolute under DDP and DeepSpeed, grad norms equal to the last bit under
DeepSpeed). ``bnpo``, which TRL normalises per process, parts from TRL's run, as it should.
"""
import argparse
import json
import os
import sys
import traceback
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megaloss.testing import run_distributed  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]

TOL = 1e-5
ATOL = 1e-7  # the loss sums O(1) float32 terms that cancel to ~1e-3
DS_LOSS_TYPES = ("grpo", "dapo")  # the DeepSpeed launch's cases (each: the mixin's run and TRL's)


def _reward(completions, **kwargs):
    """The number of ``a`` tokens in each sampled completion (varies within a group)."""
    return [float(str(c).split().count("a")) for c in completions]


def _save_model(out_dir):
    from test_hf_trl_policy import _tiny_grpo_parts
    _tiny_grpo_parts()["model"].save_pretrained(os.path.join(out_dir, "model"))


def ds_config():
    """ZeRO-2 in float32; batch sizes, accumulation and clipping from the GRPOConfig."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": False}, "fp16": {"enabled": False}, "steps_per_print": 1000}


def _train(out_dir, loss_type, ours, rank, deepspeed=False):
    """The trained ``GRPOTrainer`` (``ours``: with the mixin) of the model saved under
    ``out_dir``."""
    from datasets import Dataset
    from test_hf_trl_policy import _tiny_grpo_parts
    from trl import GRPOConfig, GRPOTrainer

    from megaloss.integrations.hf import MegalossGRPOMixin

    parts = _tiny_grpo_parts()
    parts["reward_funcs"] = _reward
    parts.pop("model")  # by path (saved by the caller), so TRL builds the reference from it
    path = os.path.join(out_dir, "model")
    parts["train_dataset"] = Dataset.from_dict({"prompt": ["a b", "b", "a", "b a b"] * 4})
    cls = type("T", (MegalossGRPOMixin, GRPOTrainer) if ours else (GRPOTrainer,), {})
    args = GRPOConfig(
        output_dir=os.path.join(out_dir, f"{loss_type}-{ours}-{rank}"), report_to="none",
        use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=4, max_steps=2, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", weight_decay=0.0, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, loss_type=loss_type, beta=0.04, use_bias_correction_kl=False,
        temperature=1.0, deepspeed=ds_config() if deepspeed else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=path, args=args, **parts)
        trainer.train()
    return trainer


def _logs(trainer):
    return [log for log in trainer.state.log_history if "loss" in log]


def _worker(rank, world, out_dir, loss_type, ours):
    return _logs(_train(out_dir, loss_type, ours, rank))


def _assert_runs_agree(ours, theirs):
    """``ours`` / ``theirs``: each process's logs of the mixin's run and of TRL's."""
    assert len(ours) == len(theirs) == 2 and len(ours[0]) == len(theirs[0]) == 2  # 2 steps
    for our_logs, their_logs in zip(ours, theirs):
        for mine, trl in zip(our_logs, their_logs):
            for name in ("loss", "grad_norm"):
                a, b = mine[name], trl[name]
                assert abs(a - b) <= TOL * abs(b) + ATOL, (name, mine, trl)
    assert all(abs(log["grad_norm"]) > 1e-2 for log in ours[0])  # the steps do train
    assert abs(ours[0][1]["loss"]) > 1e-4  # step 2: the KL to the reference is not 0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_two_process_grpo_run_equals_trl(tmp_path, loss_type):
    _save_model(str(tmp_path))
    ours = run_distributed(_worker, 2, str(tmp_path), loss_type, True, timeout=280)
    theirs = run_distributed(_worker, 2, str(tmp_path), loss_type, False, timeout=280)
    _assert_runs_agree(ours, theirs)


def test_two_process_bnpo_is_the_global_token_mean_not_trls():
    """``bnpo``: TRL divides by each process's own token count, the mixin by the global one,
    so with uneven completion lengths over the processes the two runs part (as the module
    docstring of ``megaloss.integrations.hf.trl_policy`` says); the check above is no
    tautology."""
    import tempfile
    with tempfile.TemporaryDirectory() as out:
        _save_model(out)
        ours = run_distributed(_worker, 2, out, "bnpo", True, timeout=280)
        theirs = run_distributed(_worker, 2, out, "bnpo", False, timeout=280)
    gap = abs(ours[0][0]["grad_norm"] - theirs[0][0]["grad_norm"])
    assert gap > 1e-3 * theirs[0][0]["grad_norm"], (ours, theirs)


# two processes under DeepSpeed: the shared deepspeed --num_gpus 2 launch ----------------------
def shared_launch_hf_jobs(tmp_path):
    """This module's worker job in the shared Trainer launch (``shared_launch_hf``): for each of
    :data:`DS_LOSS_TYPES`, the mixin's run and TRL's, ``<loss>-<ours|trl>.rank<r>.json`` per
    process under ``tmp_path``."""
    # Saved here, by this non-distributed process: once an earlier job of the launch has made a
    # process group, transformers' save_pretrained writes on rank 0 only
    # (transformers/distributed/mixin.py, should_save_on_this_rank).
    _save_model(str(tmp_path))
    return [{"worker": __file__, "argv": ["--worker", str(tmp_path)]}]


@pytest.fixture(scope="module")
def ds_run(shared_launch_hf):
    return shared_launch_hf["test_hf_trl_policy_distributed"]


def _load(run, name, rank):
    path = run.tmp_path / f"{name}.rank{rank}.json"
    assert path.exists(), f"{name} left no result: {run.outputs[0][-3000:]}{run.errors}"
    result = json.loads(path.read_text())
    assert "crash" not in result, result["crash"]
    return result


@pytest.mark.deepspeed
@pytest.mark.timeout(900)  # the first test using the shared launch waits for it
@pytest.mark.parametrize("loss_type", DS_LOSS_TYPES)
def test_deepspeed_two_process_grpo_run_equals_trl(ds_run, loss_type):
    runs = {who: [_load(ds_run, f"{loss_type}-{who}", r) for r in range(2)]
            for who in ("ours", "trl")}
    for result in runs["ours"] + runs["trl"]:  # a ZeRO-2 engine trained, TRL's ZeRO-0 reference
        assert result["engine"] == {"world": 2, "model": "DeepSpeedEngine", "zero_stage": 2,
                                    "ref_model": "DeepSpeedEngine", "ref_zero_stage": 0}, result
    _assert_runs_agree([r["logs"] for r in runs["ours"]], [r["logs"] for r in runs["trl"]])
    pairs = [(m, t) for o, th in zip(runs["ours"], runs["trl"])
             for m, t in zip(o["logs"], th["logs"])]
    loss_gap = max(abs(m["loss"] - t["loss"]) for m, t in pairs)
    norm_gap = max(abs(m["grad_norm"] - t["grad_norm"]) / t["grad_norm"] for m, t in pairs)
    print(f"{loss_type} under DeepSpeed ZeRO-2: loss gap to TRL {loss_gap:.1e} (absolute), "
          f"grad norm {norm_gap:.1e} (relative)")


def _worker_main(argv):
    """Every rank of the launch: the model saved per process, then for each loss type the
    mixin's run and TRL's (``ds_config``), the logs and the engines written as JSON."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--loss_types", default=",".join(DS_LOSS_TYPES))
    parser.add_argument("--local_rank", type=int, default=0)
    a = parser.parse_args(argv)
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from megaloss.integrations.deepspeed.compat import skip_cpu_shm_comm_build
    skip_cpu_shm_comm_build()
    rank = int(os.environ.get("RANK", "0"))
    folder = os.path.join(a.worker, f"rank{rank}")
    shared = os.path.join(a.worker, "model")
    if os.path.isdir(shared):  # saved by the test before the launch
        os.makedirs(folder, exist_ok=True)
        if not os.path.exists(os.path.join(folder, "model")):
            os.symlink(shared, os.path.join(folder, "model"))
    else:  # run alone (the command above): no process group yet, each rank saves its copy
        _save_model(folder)
    for loss_type in a.loss_types.split(","):
        for ours in (True, False):
            unset_hf_deepspeed_config()
            try:
                trainer = _train(folder, loss_type, ours, rank, deepspeed=True)
                engine, ref = trainer.model_wrapped, trainer.ref_model
                result = {"logs": _logs(trainer), "engine": {
                    "world": trainer.accelerator.num_processes,
                    "model": type(engine).__name__, "zero_stage": engine.zero_optimization_stage(),
                    "ref_model": type(ref).__name__,
                    "ref_zero_stage": ref.zero_optimization_stage()}}
            except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
                result = {"crash": f"rank {rank}: {traceback.format_exc()}"}
            name = f"{loss_type}-{'ours' if ours else 'trl'}"
            with open(os.path.join(a.worker, f"{name}.rank{rank}.json"), "w") as f:
                json.dump(result, f)
            if "crash" in result:
                raise SystemExit(1)  # the ranks may be out of step: stop here


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
