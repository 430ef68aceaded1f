"""Each option is spelled twice: its options dataclass's field and its entry point's keyword of
the same name; the entry point hands its arguments to ``resolve_options`` by name. So every
keyword that is a field must have the field's default (else ``options=`` and the keywords would
mean different things), and a full entry point must take every field."""
import dataclasses
import inspect

import pytest
import torch

import megaloss
from megaloss.ops.options import option_values, resolve_options

FULL = [  # entry points taking every field of their options as a keyword
    (megaloss.linear_cross_entropy, megaloss.CrossEntropyOptions),
    (megaloss.linear_log_probs, megaloss.LogProbsOptions),
    (megaloss.linear_distillation_loss, megaloss.DistillationOptions),
    (megaloss.mnr_loss, megaloss.MNROptions),
    (megaloss.MultipleNegativesRankingLoss.__init__, megaloss.MNROptions),
    (megaloss.dpo_loss, megaloss.DPOOptions),
    (megaloss.cpo_loss, megaloss.CPOOptions),
    (megaloss.orpo_loss, megaloss.ORPOOptions),
    (megaloss.kto_loss, megaloss.KTOOptions),
]
# policy_loss takes the common fields as keywords, the others only through options=
PARTIAL = [(megaloss.policy_loss, megaloss.PolicyLossOptions)]


def _defaults(cls):
    return {f.name: f.default for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("func, cls", FULL + PARTIAL,
                         ids=lambda x: getattr(x, "__qualname__", str(x)))
def test_keywords_have_the_fields_defaults(func, cls):
    params = inspect.signature(func).parameters
    fields = _defaults(cls)
    shared = [name for name in params if name in fields]
    assert shared, f"{func.__qualname__} takes none of {cls.__name__}'s fields"
    for name in shared:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY or name == "temperature"
        assert params[name].default == fields[name], (func.__qualname__, name)
    assert "options" in params and params["options"].default is None
    if (func, cls) in FULL:
        assert set(shared) == set(fields), set(fields) - set(shared)


def test_resolve_options_reads_the_fields_by_name_and_ignores_the_rest():
    arguments = {"reduction": "sum", "hidden_states": object(), "options": None, "z_loss": 0.5}
    assert option_values(megaloss.CrossEntropyOptions, arguments) == {"reduction": "sum",
                                                                      "z_loss": 0.5}
    got = resolve_options(megaloss.CrossEntropyOptions, None, arguments)
    assert got == megaloss.CrossEntropyOptions(reduction="sum", z_loss=0.5)
    given = megaloss.CrossEntropyOptions(reduction="sum")
    assert resolve_options(megaloss.CrossEntropyOptions, given, {"reduction": "mean"}) is given
    with pytest.raises(TypeError, match="not both: got options= and reduction, z_loss"):
        resolve_options(megaloss.CrossEntropyOptions, given, arguments)
    with pytest.raises(TypeError, match="options must be a DPOOptions"):
        resolve_options(megaloss.DPOOptions, given, {})


@pytest.mark.parametrize("call", ["keywords", "options", "both"])
def test_every_preference_loss_takes_keywords_or_options(call):
    x = -torch.rand(4, dtype=torch.float64)
    n = torch.full((4,), 3)
    kwargs = dict(chosen_lengths=n, rejected_lengths=n)
    cases = [(megaloss.dpo_loss, (x, x.flip(0), x / 2, x / 3), kwargs,
              dict(loss_type="ipo", beta=0.2), megaloss.DPOOptions),
             (megaloss.cpo_loss, (x, x.flip(0)), kwargs, dict(loss_type="simpo", beta=0.2),
              megaloss.CPOOptions),
             (megaloss.orpo_loss, (x, x.flip(0)), kwargs, dict(beta=0.2), megaloss.ORPOOptions),
             (megaloss.kto_loss, (x, x / 2, torch.tensor([1, 0, 1, 0])), {},
              dict(loss_type="apo_zero_unpaired", beta=0.2), megaloss.KTOOptions)]
    for loss, args, extra, fields, cls in cases:
        want = loss(*args, **extra, **fields)
        assert want != loss(*args, **extra)  # the keywords were read
        if call == "keywords":
            continue
        if call == "options":
            assert torch.equal(loss(*args, **extra, options=cls(**fields)), want)
        else:
            with pytest.raises(TypeError, match="not both"):
                loss(*args, **extra, **fields, options=cls(**fields))
