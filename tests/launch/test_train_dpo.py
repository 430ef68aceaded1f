"""The preference job as the README runs it (``bash launch/train_dpo.sh``), shrunk, under
``deepspeed --num_gpus 2`` on CPU (ZeRO-2, DP=2):

- DPO at a small size near the defaults (the tiny Llama, 300 kB of the stdlib, a BPE of 1024
  tokens, 60 SFT + 40 DPO steps, 256 held-out pairs): the held-out preference accuracy after
  DPO beats the SFT model's, the DPO reward accuracy and margin rise from 0;
- SimPO, ORPO, CPO and KTO at tiny sizes (3 SFT + 3 preference steps, micro-batch 4 pairs x
  GAS 2): what a user reads in summary.json, metrics.csv and the table;
- checkpoints and resume, as tests/launch/test_grpo_resume.py checks the GRPO job's: a tiny DPO
  run against the same run stopped (the stop request injected at a step boundary, as SIGTERM
  there would) once in SFT and once in DPO (the reference model must come back from the
  checkpoint), then resumed: ``metrics.csv`` and the evaluations bitwise equal; ``--eval_only``
  reproduces the final evaluation; a rerun into the folder is refused.

The pairs themselves: tests/launch/test_preference_data.py. The jobs are part of the launch
several test files share (``shared_launch`` in shared_launches.py)."""
import csv
import json
import math

import pytest

from tests.helpers.launch_helpers import REPO, assert_launches, script_command

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow, pytest.mark.xdist_group("shared_launch")]

SFT, STEPS = 60, 40  # the small DPO run
TINY_SFT, TINY_STEPS = 3, 3
TINY_TOTAL = TINY_SFT + TINY_STEPS
STOPS = {"sft": 2, "dpo": TINY_SFT + 2}  # the step the interrupted runs stop after
TINY_LOSSES = ("simpo", "orpo", "cpo", "kto")


def _small_args(tmp_path) -> list:
    return ["--vocab_size", "1024", "--max_train_bytes", "300000", "--sft_steps", str(SFT),
            "--steps", str(STEPS), "--eval_pairs", "256", "--eval_every", "20",
            "--output_dir", str(tmp_path / "small"), "--cache_dir", str(tmp_path / "cache"),
            "--no_progress"]


def _tiny_args(tmp_path, out: str, *extra: str) -> list:
    return ["--deepspeed_config", str(tmp_path / "dpo.json"), "--vocab_size", "512",
            "--max_train_bytes", "100000", "--prompt_length", "12", "--completion_length", "6",
            "--sft_steps", str(TINY_SFT), "--steps", str(TINY_STEPS), "--eval_pairs", "32",
            "--eval_every", "2", "--output_dir", str(tmp_path / out),
            "--cache_dir", str(tmp_path / "cache_tiny"), "--no_progress", *extra]


def shared_launch_jobs(tmp_path) -> list:
    cfg = json.loads((REPO / "configs" / "dpo.json").read_text())
    cfg.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    (tmp_path / "dpo.json").write_text(json.dumps(cfg))
    cmd = script_command("train_dpo.sh", *_small_args(tmp_path))
    jobs = [{"job": "train_dpo", "argv": cmd[6:]}]
    jobs += [{"job": "train_dpo", "argv": _tiny_args(tmp_path, loss, "--loss", loss)}
             for loss in TINY_LOSSES]
    jobs += [{"job": "train_dpo", "argv": _tiny_args(tmp_path, "full", "--save_every",
                                                     str(TINY_TOTAL))}]
    for name, k in STOPS.items():
        jobs += [{"job": "train_dpo", "argv": _tiny_args(tmp_path, name), "stop_after": k},
                 {"job": "train_dpo", "argv": _tiny_args(tmp_path, name, "--resume")}]
    jobs += [{"job": "train_dpo", "argv": _tiny_args(tmp_path, "dpo", "--resume", "--eval_only")},
             {"job": "train_dpo", "argv": _tiny_args(tmp_path, "full"),
              "expect_exit": str(tmp_path / "refused.txt")}]
    return jobs


@pytest.fixture(scope="module")
def run(shared_launch):
    return shared_launch["test_train_dpo"]


def _rows(out) -> list:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_script_launches_the_job_with_the_dpo_config(tmp_path):
    cmd = script_command("train_dpo.sh", *_small_args(tmp_path))
    assert_launches(cmd, 2, "train_dpo", "dpo", [*_small_args(tmp_path)])


@pytest.mark.timeout(900)
def test_dpo_raises_the_held_out_preference_accuracy(run):
    out = run.tmp_path / "small"
    s = json.loads((out / "summary.json").read_text())
    assert (s["dp"], s["zero_stage"], s["sft_steps"], s["steps"]) == (2, 2, SFT, STEPS)
    assert s["pairs_per_step"] == 2 * 16 * 2  # DP x micro x GAS
    assert s["loss"]["loss"] == "dpo" and s["loss"]["loss_type"] == "sigmoid"
    assert s["reference_model"] and s["pairs"]["rejected"] == "other" and s["eval_pairs"] == 256
    assert [e["phase"] for e in s["evals"]] == ["init", "sft", "dpo", "dpo"]
    assert s["accuracy_before"] == s["eval_before"]["accuracy"]
    assert s["accuracy_after"] == s["eval_after"]["accuracy"]
    assert s["sft_last_loss"] < s["sft_first_loss"] - 1.0
    assert s["accuracy_before"] > s["eval_init"]["accuracy"]
    assert s["accuracy_after"] > s["accuracy_before"] + 0.03, s["evals"]
    # the implicit reward is 0 at the reference (the SFT model), then prefers chosen
    assert s["reward_accuracy_before"] == 0 and s["reward_margin_before"] == 0
    assert s["reward_accuracy_after"] > 0.55 and s["reward_margin_after"] > 0.05, s["eval_after"]
    assert s["eval_after"]["loss"] < math.log(2) < s["eval_init"]["loss"] + 1e-9
    rows = _rows(out)
    assert [r["phase"] for r in rows] == ["sft"] * SFT + ["dpo"] * STEPS
    assert int(rows[-1]["optimizer_step"]) == SFT + STEPS
    assert all(float(r["num_pairs"]) == 64 for r in rows[SFT:])
    assert float(rows[SFT + 19]["eval_accuracy"]) == s["evals"][2]["accuracy"]
    assert (out / "loss_curve.png").stat().st_size > 0
    assert "after DPO" in run.outputs[0] and "held-out preference accuracy" in run.outputs[0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("loss", TINY_LOSSES)
def test_each_loss_trains_and_reports(run, loss):
    out = run.tmp_path / loss
    s = json.loads((out / "summary.json").read_text())
    assert s["loss"]["loss"] == loss and (s["sft_steps"], s["steps"]) == (TINY_SFT, TINY_STEPS)
    assert s["reference_model"] == (loss == "kto")
    assert s["pairs_per_step"] == 2 * 4 * 2 and s["eval_pairs"] == 32
    for key in ("accuracy", "reward_accuracy"):
        assert 0 <= s[f"{key}_before"] <= 1 and 0 <= s[f"{key}_after"] <= 1
    assert math.isfinite(s["reward_margin_after"]) and math.isfinite(s["eval_after"]["loss"])
    if loss != "kto":  # reference-free: the implicit reward is the length-normalised log-prob
        assert s["reward_accuracy_before"] == s["accuracy_before"]
    rows = _rows(out)
    assert [r["phase"] for r in rows] == ["sft"] * TINY_SFT + [loss] * TINY_STEPS
    assert all(math.isfinite(float(r["loss"])) for r in rows)
    assert all(float(r["num_pairs"]) == 16 for r in rows[TINY_SFT:])
    if loss == "kto":
        assert all(float(r["kl"]) >= 0 for r in rows[TINY_SFT:])
    else:
        assert all(0 <= float(r["reward_accuracy"]) <= 1 for r in rows[TINY_SFT:])
    name = {"simpo": "SimPO", "orpo": "ORPO", "cpo": "CPO", "kto": "KTO"}[loss]
    assert any(f"megaloss {name} job" in o for o in run.outputs)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("phase", sorted(STOPS))
def test_a_resumed_run_equals_the_uninterrupted_one(run, phase):
    full, part = run.tmp_path / "full", run.tmp_path / phase
    a, b = _rows(full), _rows(part)
    assert [(r["phase"], int(r["step"])) for r in a] == (
        [("sft", s) for s in range(1, TINY_SFT + 1)]
        + [("dpo", s) for s in range(1, TINY_STEPS + 1)])
    assert a == b  # every column, every step, bitwise (as printed: repr of the floats)
    summary, resumed = (json.loads((p / "summary.json").read_text()) for p in (full, part))
    assert resumed["resumed_at_step"] == STOPS[phase] and resumed["stopped"] is None
    assert resumed["evals"] == summary["evals"]
    assert resumed["checkpoints"]["last"] == str(part / "checkpoints" / f"step_{TINY_TOTAL}")
    stopped = f"stopped by SIGTERM after step {STOPS[phase]}; continue with --resume"
    assert stopped in run.stdout + run.stderr


@pytest.mark.timeout(900)
def test_eval_only_and_a_rerun_refused(run):
    report = json.loads((run.tmp_path / "dpo" / f"eval_step{TINY_TOTAL}.json").read_text())
    full = json.loads((run.tmp_path / "full" / "summary.json").read_text())
    assert report["step"] == TINY_TOTAL
    assert report["eval"] == {k: v for k, v in full["eval_after"].items()
                              if k not in ("phase", "step")}
    refused = (run.tmp_path / "refused.txt").read_text()
    assert "already holds a run" in refused and "--resume" in refused and "--overwrite" in refused


def test_the_loss_and_its_options_come_from_the_ds_config_section(tmp_path):
    """``--loss`` defaults to the ds_config's preference section (other than ``dpo``), whose
    options the job trains with; ``--beta`` (and ``--simpo_gamma`` / ``--cpo_alpha``) override
    them; without a section the job's defaults (DPO: the ``dpo`` section's)."""
    from launch.train_dpo import _preference_spec, parse_args
    from megaloss.integrations.deepspeed import load_megaloss_config
    from megaloss.losses import CPOOptions, DPOOptions, KTOOptions, ORPOOptions

    def spec(section, *flags):
        args = parse_args(["--output_dir", str(tmp_path), *flags])
        s = _preference_spec(args, load_megaloss_config({"megaloss": section}))
        assert args.loss == s.name
        return s.name, s.options

    assert spec({"orpo": {"beta": 0.3}}) == ("orpo", ORPOOptions(beta=0.3))
    assert spec({"orpo": {"beta": 0.3}}, "--beta", "0.2") == ("orpo", ORPOOptions(beta=0.2))
    assert spec({"simpo": {"beta": 2.5, "simpo_gamma": 0.2}}, "--simpo_gamma", "0.4") == (
        "simpo", CPOOptions(loss_type="simpo", beta=2.5, simpo_gamma=0.4, cpo_alpha=0.0))
    assert spec({"kto": {"desirable_weight": 1.2}}) == ("kto", KTOOptions(desirable_weight=1.2))
    assert spec({"dpo": {"loss_type": "ipo"}}) == ("dpo", DPOOptions(loss_type="ipo"))
    # the shipped config's dpo section with --loss simpo: SimPO's job defaults
    assert spec({"dpo": {"beta": 0.1}}, "--loss", "simpo") == (
        "simpo", CPOOptions(loss_type="simpo", beta=2.0, cpo_alpha=0.0))
    assert spec({}, "--loss", "cpo", "--cpo_alpha", "0.5") == (
        "cpo", CPOOptions(beta=0.1, cpo_alpha=0.5))
