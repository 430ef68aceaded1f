"""GatheredMultipleNegativesRankingLoss inside SentenceTransformerTrainer under ``deepspeed
--num_gpus 2`` (CPU, gloo): one SGD step (lr 1, no clipping) equals the float64 single-process
gradient of the loss on the step's global batch.

One launch (the one the Trainer tests share: ``shared_launch_hf`` of
tests/helpers/shared_launches.py) runs
every case (:data:`CASES`) in turn and writes one result file per case; the tests assert per
case. The dataset is 8 triplets; the step gives each rank 4, and a collator wrapper
keeps only the first ``keep[rank]`` of them (``(4, 1)``: an uneven global batch of 5 rows;
``(4, 0)``: rank 1 holds an empty batch). ZeRO-3 runs with
``stage3_param_persistence_threshold: 0``, so every parameter is partitioned and all-gathered in
every forward (the tiny model would otherwise be kept whole and hide collective mismatches).

Tolerance: ``||update + grad|| <= 2e-4 ||grad|| + 1e-7`` per parameter (fp32 training against
float64; see test_hf_trainer.py). This file is also the worker:
``deepspeed --num_gpus 2 tests/integrations/test_hf_sentence_transformers_deepspeed.py --worker
OUT --model_dir DIR``.
"""
import argparse
import os
import sys
import traceback

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_hf_sentence_transformers import batch, load_model, make_model_dir  # noqa: E402

N_PAIRS = 8
# case: (ZeRO stage, rows kept per rank of the 4 each is given)
CASES = {"zero2-even": (2, (4, 4)), "zero3-even": (3, (4, 4)), "zero3-uneven": (3, (4, 1)),
         "zero3-empty": (3, (4, 0))}


def columns():
    return batch(N_PAIRS, 1, seed=11)  # anchor, positive, negative


class _KeepFirst:
    """Collator wrapper: this rank keeps the first ``keep`` rows of its micro-batch (records
    them); an empty batch keeps the tokenised columns' shapes but 0 rows."""

    def __init__(self, inner, keep):
        self.inner, self.keep, self.seen = inner, keep, []

    def __call__(self, rows):
        self.seen.extend(rows[:self.keep])
        out = self.inner(rows)
        return {k: (v[:self.keep] if isinstance(v, torch.Tensor) and v.dim() >= 1
                    and v.shape[0] == len(rows) else v) for k, v in out.items()}

    def __getattr__(self, name):  # the Trainer reads the collator's settings
        return getattr(self.inner, name)


def _run_case(out_dir, model_dir, zero, keep):
    import torch.distributed as dist
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from megaloss.integrations.hf.sentence_transformers import GatheredMultipleNegativesRankingLoss
    unset_hf_deepspeed_config()  # the previous case's ZeRO-3 config must not zero.Init the model
    model = load_model(model_dir).float()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    anchor, positive, negative = columns()
    data = Dataset.from_dict({"anchor": anchor, "positive": positive, "negative": negative})
    zero_cfg = {"stage": zero}
    if zero == 3:
        zero_cfg["stage3_param_persistence_threshold"] = 0
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "train_batch_size": "auto", "gradient_clipping": 0.0,
           "zero_optimization": zero_cfg, "zero_allow_untested_optimizer": True,
           "steps_per_print": 1000}
    args = SentenceTransformerTrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=4,
        max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, deepspeed=cfg, disable_tqdm=True, seed=0)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                         loss=GatheredMultipleNegativesRankingLoss(model))
    trainer.data_collator = collator = _KeepFirst(trainer.data_collator, keep[dist.get_rank()])
    trainer.train()
    params = list(trainer.model.parameters())
    if zero == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(params):
            after = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    else:
        after = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, collator.seen)
    return {"before": before, "after": after, "logs": trainer.state.log_history, "seen": seen}


def _worker_main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--local_rank", type=int, default=0)
    a = parser.parse_args(argv)
    from megaloss.integrations.deepspeed.compat import skip_cpu_shm_comm_build
    skip_cpu_shm_comm_build()
    import deepspeed
    deepspeed.init_distributed()
    rank = int(os.environ.get("RANK", "0"))
    for name in a.cases.split(","):
        zero, keep = CASES[name]
        try:
            result = _run_case(os.path.join(a.worker, name), a.model_dir, zero, keep)
        except Exception:  # noqa: BLE001 - reported to the parent, which fails that case
            result = {"crash": traceback.format_exc()}
        if rank == 0 or "crash" in result:
            torch.save(result, os.path.join(a.worker, f"{name}.rank{rank}.pt"))
        if "crash" in result:
            raise SystemExit(1)  # the ranks may be out of step: stop here


def shared_launch_hf_jobs(tmp_path):
    """This module's worker job in the shared Trainer launch (``shared_launch_hf``): every
    case, the tiny
    model written under ``tmp_path / "model"``."""
    model = make_model_dir(str(tmp_path / "model"))
    return [{"worker": __file__, "argv": ["--worker", str(tmp_path), "--model_dir", model]}]


@pytest.fixture(scope="module")
def launch(shared_launch_hf):
    """This module's run in the shared ``deepspeed --num_gpus 2`` launch of every case; returns
    the run (its folder holds the results) and the model folder."""
    pytest.importorskip("datasets")
    run = shared_launch_hf["test_hf_sentence_transformers_deepspeed"]
    return run, str(run.tmp_path / "model")


def _load(run, name, rank=0):
    path = run.tmp_path / f"{name}.rank{rank}.pt"
    assert path.exists(), f"case {name} left no result on rank {rank}: {run.outputs[0][-3000:]}"
    result = torch.load(path, weights_only=False)
    assert "crash" not in result, result["crash"]
    return result


@pytest.mark.deepspeed
@pytest.mark.timeout(900)  # the first test using the shared launch waits for it
@pytest.mark.parametrize("case", list(CASES))
def test_sentence_transformer_trainer_equals_float64(launch, case):
    from megaloss.integrations.hf.sentence_transformers import GatheredMultipleNegativesRankingLoss
    out, model_dir = launch
    result = _load(out, case)
    keep = CASES[case][1]
    assert [len(s) for s in result["seen"]] == list(keep)
    rows = [row for rank_rows in result["seen"] for row in rank_rows]  # rank order
    model = load_model(model_dir)  # float64
    model.load_state_dict({k: v.double() for k, v in result["before"].items()})
    cols = [[row[c] for row in rows] for c in ("anchor", "positive", "negative")]
    loss = GatheredMultipleNegativesRankingLoss(model)([model.tokenize(c) for c in cols], None)
    loss.backward()
    err2 = norm2 = 0.0  # ||update + grad|| / ||grad|| over all parameters, for the report
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        update = result["after"][name].double() - result["before"][name].double()
        err = (update + g).norm()
        assert err <= 2e-4 * g.norm() + 1e-7, (name, float(err), float(g.norm()))
        err2, norm2 = err2 + float(err) ** 2, norm2 + float(g.norm()) ** 2
    step = [e for e in result["logs"] if "loss" in e][0]
    assert step["loss"] == pytest.approx(loss.item(), rel=1e-3)
    print(f"{case}: update rel err {(err2 / norm2) ** 0.5:.2e}, loss {step['loss']} vs "
          f"{loss.item():.6f}")


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
