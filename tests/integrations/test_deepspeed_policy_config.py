"""The ds_config ``"megaloss": {"policy": ..., "dpo": ...}`` sections and the other preference
sections (``cpo``, ``simpo``, ``orpo``, ``kto``): every option of PolicyLossOptions /
DPOOptions / CPOOptions / ORPOOptions / KTOOptions is a key with the dataclass's default,
honoured by ``options()`` (and ``preference_options()``, the one preference section given), and
a bad value (also one that is only bad together with another key), a misspelled key or two
preference sections are refused naming them. Training by the ds_config's ``orpo`` section:
``tests/integrations/test_post_training_sp.py``."""
import dataclasses

import pytest

from megaloss import DPOOptions, PolicyLossOptions
from megaloss.integrations.deepspeed import load_megaloss_config
from megaloss.losses import CPOOptions, KTOOptions, ORPOOptions


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
    ({"dpo": {"loss_type": "sft"}}, r"megaloss\.dpo\.loss_type"),
    ({"dpo": {"label_smoothing": 1.0}}, r"megaloss\.dpo\.label_smoothing: label_smoothing must"),
    ({"dpo": {"discopop_tau": 0}}, r"megaloss\.dpo\.discopop_tau: discopop_tau must"),
    ({"dpo": {"loss_type": "exo_pair"}}, "label_smoothing must be in \\(0, 1\\) for loss_type"),
])
def test_bad_values_are_refused_naming_the_key(section, match):
    with pytest.raises(ValueError, match=match):
        load_megaloss_config({"megaloss": section})


def test_preference_sections_default_to_the_dataclasses():
    ml = load_megaloss_config({})
    assert ml.preference_options() == DPOOptions()  # no preference section: DPO's defaults
    assert ml.cpo.options() == CPOOptions()
    assert ml.simpo.options() == CPOOptions(loss_type="simpo", cpo_alpha=0.0)  # simpo_loss's
    assert ml.orpo.options() == ORPOOptions()
    assert ml.kto.options() == KTOOptions()
    fields = {f.name for f in dataclasses.fields(CPOOptions)}
    assert set(ml.cpo.model_dump()) == fields
    assert set(ml.simpo.model_dump()) == fields - {"loss_type"}
    assert set(ml.orpo.model_dump()) == {f.name for f in dataclasses.fields(ORPOOptions)}
    assert set(ml.kto.model_dump()) == {f.name for f in dataclasses.fields(KTOOptions)}


@pytest.mark.parametrize("name,section,options", [
    ("dpo", {"loss_type": "ipo", "beta": 0.3}, DPOOptions(loss_type="ipo", beta=0.3)),
    ("cpo", {"loss_type": "hinge", "beta": 0.2, "label_smoothing": 0.0, "cpo_alpha": 0.5,
             "simpo_gamma": 0.1},
     CPOOptions(loss_type="hinge", beta=0.2, cpo_alpha=0.5, simpo_gamma=0.1)),
    ("simpo", {"beta": 2.5, "simpo_gamma": 0.3, "label_smoothing": 0.1, "cpo_alpha": 0.2},
     CPOOptions(loss_type="simpo", beta=2.5, simpo_gamma=0.3, label_smoothing=0.1,
                cpo_alpha=0.2)),
    ("orpo", {"beta": 0.25}, ORPOOptions(beta=0.25)),
    ("kto", {"loss_type": "apo_zero_unpaired", "beta": 0.2, "desirable_weight": 1.3,
             "undesirable_weight": 0.7},
     KTOOptions(loss_type="apo_zero_unpaired", beta=0.2, desirable_weight=1.3,
                undesirable_weight=0.7)),
])
def test_the_preference_section_given_is_the_step_default(name, section, options):
    ml = load_megaloss_config({"megaloss": {name: section}})
    assert getattr(ml, name).options() == options
    assert ml.preference_options() == options


@pytest.mark.parametrize("section,match", [
    ({"orpo": {"betta": 0.1}}, r"megaloss\.orpo\.betta: Extra inputs"),
    ({"simpo": {"loss_type": "simpo"}}, r"megaloss\.simpo\.loss_type: Extra inputs"),
    ({"kto": {"desirable_weigth": 1.0}}, r"megaloss\.kto\.desirable_weigth: Extra inputs"),
    ({"orpo": {"beta": -1.0}}, r"megaloss\.orpo\.beta: beta must be a finite number > 0"),
    ({"cpo": {"loss_type": "dpo"}}, r"megaloss\.cpo\.loss_type: loss_type must be one of"),
    ({"cpo": {"loss_type": "ipo", "label_smoothing": 0.1}},
     r"megaloss\.cpo: label_smoothing must be 0 for loss_type='ipo'"),
    ({"simpo": {"cpo_alpha": -0.5}}, r"megaloss\.simpo\.cpo_alpha"),
    ({"kto": {"loss_type": "bco"}}, r"megaloss\.kto\.loss_type: loss_type must be one of"),
    ({"dpo": {"beta": 0.1}, "orpo": {"beta": 0.1}},
     r"give at most one preference section .* got \['dpo', 'orpo'\]"),
])
def test_bad_preference_sections_are_refused_naming_the_key(section, match):
    with pytest.raises(ValueError, match=match):
        load_megaloss_config({"megaloss": section})
