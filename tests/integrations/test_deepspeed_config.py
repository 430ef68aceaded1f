"""The ds_config "megaloss" section: defaults, the issue's example, and errors naming the key."""
import json

import pytest

from megaloss.integrations.config import CEConfig, MegalossConfig, load_megaloss_config

EXAMPLE = {"megaloss": {"ce": {"chunk_size": 1024, "z_loss": 1e-4, "label_smoothing": 0.0,
                               "logit_softcapping": None, "loss_reduction": "token"},
                        "tensor_parallel_size": 2,
                        "mnr": {"temperature": 0.05, "symmetric": True}}}


def test_issue_example_round_trips_from_dict_and_path(tmp_path):
    cfg = load_megaloss_config(EXAMPLE)
    assert cfg.tensor_parallel_size == 2
    assert cfg.ce == CEConfig(chunk_size=1024, z_loss=1e-4, loss_reduction="token")
    assert cfg.mnr.temperature == 0.05 and cfg.mnr.symmetric is True
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, **EXAMPLE}))
    assert load_megaloss_config(path) == cfg
    assert load_megaloss_config(str(path)) == cfg


def test_missing_section_gives_defaults():
    assert load_megaloss_config({"train_batch_size": 8}) == MegalossConfig()
    assert load_megaloss_config(None) == MegalossConfig()
    assert MegalossConfig().ce.loss_reduction == "token"


@pytest.mark.parametrize("section, key", [
    ({"ce": {"chunksize": 8}}, "megaloss.ce.chunksize"),
    ({"ce": {"chunk_size": 0}}, "megaloss.ce.chunk_size"),
    ({"ce": {"chunk_size": True}}, "megaloss.ce.chunk_size"),
    ({"ce": {"loss_reduction": "mean"}}, "megaloss.ce.loss_reduction"),
    ({"ce": {"reduction": "token"}}, "'reduction' is now 'loss_reduction'"),
    ({"ce": {"label_smoothing": 1.5}}, "megaloss.ce.label_smoothing"),  # bound [0, 1]
    ({"ce": {"z_loss": -1e-4}}, "megaloss.ce.z_loss"),
    ({"ce": {"logit_softcapping": 0.0}}, "megaloss.ce.logit_softcapping"),
    ({"tensor_parallel_size": 0}, "megaloss.tensor_parallel_size"),
    ({"mnr": {"temperature": 0}}, "megaloss.mnr.temperature"),
    ({"mnr": {"symmetric": "yes"}}, "megaloss.mnr.symmetric"),
    ({"lossy": 1}, "megaloss.lossy"),
    ({"router": {"scope": "batch"}}, "megaloss.router.scope"),
    ({"router": {"aux_loss": -0.01}}, "megaloss.router.aux_loss"),
    ({"router": {"aux_los": 0.01}}, "megaloss.router.aux_los"),
])
def test_bad_keys_and_values_name_the_key(section, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_megaloss_config({"megaloss": section})


def test_router_section_gives_the_router_options():
    from megaloss.losses.router_options import RouterLossOptions

    ml = load_megaloss_config({"megaloss": {"router": {"aux_loss": 0.01, "z_loss": 1e-3,
                                                       "scope": "step"}}})
    assert ml.router.options() == RouterLossOptions(aux_loss=0.01, z_loss=1e-3, scope="step")
    assert MegalossConfig().router is None


def test_ce_options_flow_to_the_kernel_options():
    opts = CEConfig(chunk_size=64, z_loss=1e-3, label_smoothing=0.1,
                    logit_softcapping=30.0).options(ignore_index=-1)
    assert (opts.chunk_size, opts.z_loss, opts.label_smoothing, opts.logit_softcapping,
            opts.ignore_index, opts.reduction) == (64, 1e-3, 0.1, 30.0, -1, "sum")


def test_bad_container_types():
    with pytest.raises(TypeError, match="megaloss"):
        load_megaloss_config({"megaloss": [1, 2]})
    with pytest.raises(TypeError, match="ds_config"):
        load_megaloss_config(42)


def test_shipped_configs_validate():
    import glob
    import os
    root = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    paths = sorted(glob.glob(os.path.join(root, "*.json")))
    assert paths, "configs/*.json missing"
    for p in paths:
        load_megaloss_config(p)


@pytest.mark.parametrize("key", ["megalos", "mega_loss", "Megaloss", "megaloss "])
def test_misspelled_section_fails_naming_megaloss(key):
    """DeepSpeed keeps unknown top-level keys: a misspelled section would run with defaults."""
    with pytest.raises(ValueError, match=r"ds_config key .* did you mean 'megaloss'\?"):
        load_megaloss_config({key: {"tensor_parallel_size": 2}})


def test_key_close_to_a_deepspeed_key_warns_naming_it():
    with pytest.warns(UserWarning, match=r"'gradient_clippin' .* did you mean "
                                         r"'gradient_clipping'\?"):
        load_megaloss_config({"gradient_clippin": 1.0})
    with pytest.warns(UserWarning, match="'zero_optimisation'.*'zero_optimization'"):
        load_megaloss_config({"zero_optimisation": {"stage": 2}})


def test_known_and_unrelated_keys_pass_silently(recwarn):
    import glob
    import os
    root = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
    for p in sorted(glob.glob(os.path.join(root, "*.json"))):
        load_megaloss_config(p)
    load_megaloss_config({"my_experiment_notes": "kept for the user", "train_batch_size": 8})
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_deepspeeds_own_sequence_parallel_key_is_honoured_or_refused():
    """DeepSpeed-Ulysses' top-level ``sequence_parallel_size`` used to be ignored (the LM job ran
    SP 1 with it): it sets megaloss's when the section has none, and two values must agree."""
    assert load_megaloss_config({"sequence_parallel_size": 2}).sequence_parallel_size == 2
    both = {"sequence_parallel_size": 2, "megaloss": {"sequence_parallel_size": 2}}
    assert load_megaloss_config(both).sequence_parallel_size == 2
    with pytest.raises(ValueError, match=r"sequence_parallel_size=2 \(DeepSpeed's key\) differs "
                                         r"from megaloss.sequence_parallel_size=4"):
        load_megaloss_config({"sequence_parallel_size": 2,
                              "megaloss": {"sequence_parallel_size": 4}})
    with pytest.raises(ValueError, match="sequence_parallel_size must be an int >= 1"):
        load_megaloss_config({"sequence_parallel_size": "2"})


def test_deepspeeds_autotp_with_a_vocab_parallel_lm_head_is_accepted():
    """megaloss's loss runs on AutoTP's lm_head shard (tests/integrations/
    test_deepspeed_autotp.py); what it does not compose with is refused with the reason."""
    tp = {"autotp_size": 2, "vocab_parallel_lm_head": True}
    for stage in (0, 1, 2):
        ml = load_megaloss_config({"tensor_parallel": tp, "zero_optimization": {"stage": stage}})
        assert ml.tensor_parallel_size == 1
    assert load_megaloss_config({"tensor_parallel": {"autotp_size": 1}}).tensor_parallel_size == 1
    with pytest.raises(ValueError, match=r"autotp_size=2 needs tensor_parallel\."
                                         r"vocab_parallel_lm_head=true.*"
                                         r"megaloss.tensor_parallel_size=2"):
        load_megaloss_config({"tensor_parallel": {"autotp_size": 2}})
    with pytest.raises(ValueError, match="vocab_parallel_lm_head=true"):
        load_megaloss_config({"tensor_parallel": {"tp_size": 2, "vocab_parallel_lm_head": False}})
    with pytest.raises(ValueError, match="ZeRO-3: DeepSpeed accepts it, but ZeRO-3 gathers"):
        load_megaloss_config({"tensor_parallel": tp, "zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match="give one tensor-parallel scheme"):
        load_megaloss_config({"tensor_parallel": tp, "megaloss": {"tensor_parallel_size": 2}})
    # DeepSpeed's kernel for its own loss on the logits: megaloss's loss replaces that loss
    assert load_megaloss_config({"tensor_parallel": dict(
        tp, vocab_parallel_ce_backend="torch")}).tensor_parallel_size == 1
    with pytest.raises(ValueError, match="vocab_parallel_ce_backend='liger': that is the kernel "
                                         "of DeepSpeed's own loss"):
        load_megaloss_config({"tensor_parallel": dict(tp, vocab_parallel_ce_backend="liger")})
    with pytest.raises(ValueError, match="sequence parallelism"):
        load_megaloss_config({"tensor_parallel": tp, "sequence_parallel_size": 2})
    # a loss section AutoTP's path would not train is refused, never silently replaced by CE
    for name, section in (("distillation", {"alpha": 0.5}), ("policy", {"loss_type": "grpo"}),
                          ("dpo", {"beta": 0.1})):
        with pytest.raises(ValueError, match=rf"megaloss\.{name}: under AutoTP megaloss trains "
                                             "the causal-LM cross-entropy"):
            load_megaloss_config({"tensor_parallel": tp, "megaloss": {name: section}})
