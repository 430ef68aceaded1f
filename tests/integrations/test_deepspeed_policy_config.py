"""The ds_config ``"megaloss": {"policy": ..., "dpo": ...}`` sections: every option of
PolicyLossOptions / DPOOptions is a key with the dataclass's default, honoured by ``options()``,
and a bad value (also one that is only bad together with another key) is refused naming it."""
import dataclasses

import pytest

from megaloss import DPOOptions, PolicyLossOptions
from megaloss.integrations.deepspeed import load_megaloss_config


def test_defaults_are_the_dataclasses():
    ml = load_megaloss_config({})
    assert ml.policy.options() == PolicyLossOptions()
    assert ml.dpo.options() == DPOOptions()
    assert set(ml.policy.model_dump()) == {f.name for f in dataclasses.fields(PolicyLossOptions)}
    assert set(ml.dpo.model_dump()) == {f.name for f in dataclasses.fields(DPOOptions)}


def test_every_key_is_honoured():
    section = {"policy": {"loss_type": "dr_grpo", "epsilon_low": 0.1, "epsilon_high": 0.3,
                          "delta": 2.0, "beta": 0.04, "entropy_coef": 0.01,
                          "importance_sampling_level": "sequence", "max_completion_length": 64,
                          "count_empty_rows": True},
               "dpo": {"loss_type": "robust", "beta": 0.5, "label_smoothing": 0.1,
                       "discopop_tau": 0.2}}
    ml = load_megaloss_config({"megaloss": section})
    assert ml.policy.options() == PolicyLossOptions(**section["policy"])
    assert ml.dpo.options() == DPOOptions(**section["dpo"])


@pytest.mark.parametrize("section,match", [
    ({"policy": {"loss_type": "ppo"}}, r"megaloss\.policy: loss_type must be one of"),
    ({"policy": {"loss_type": "dr_grpo"}}, "needs max_completion_length"),
    ({"policy": {"epsilon_high": 0.5, "delta": 1.2}}, "delta must be"),
    ({"policy": {"betta": 0.1}}, r"megaloss\.policy\.betta: Extra inputs"),
    ({"dpo": {"beta": 0}}, r"megaloss\.dpo\.beta: beta must be a finite number > 0"),
    ({"dpo": {"loss_type": "aot"}}, r"megaloss\.dpo\.loss_type"),
    ({"dpo": {"label_smoothing": 1.0}}, r"megaloss\.dpo\.label_smoothing: label_smoothing must"),
    ({"dpo": {"discopop_tau": 0}}, r"megaloss\.dpo\.discopop_tau: discopop_tau must"),
    ({"dpo": {"loss_type": "exo_pair"}}, "label_smoothing must be in \\(0, 1\\) for loss_type"),
])
def test_bad_values_are_refused_naming_the_key(section, match):
    with pytest.raises(ValueError, match=match):
        load_megaloss_config({"megaloss": section})
