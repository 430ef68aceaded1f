"""The ds_config ``ce`` / ``mnr`` sections are built from the options dataclasses: every option
is settable, validated by the dataclass, and flows to the loss; EmbeddingModelWithMNR takes the
section's MNROptions and the renamed ``gather_across_ranks``."""
import dataclasses

import pytest
import torch

from megaloss import CrossEntropyOptions, MNROptions
from megaloss.integrations.config import CEConfig, MNRConfig, load_megaloss_config
from megaloss.integrations.hf.embedding import EmbeddingModelWithMNR


def test_every_option_is_a_section_field():
    ce = {f.name for f in dataclasses.fields(CrossEntropyOptions)} - {"reduction"}
    assert set(CEConfig.model_fields) == ce | {"loss_reduction"}
    mnr = {f.name for f in dataclasses.fields(MNROptions)}
    assert set(MNRConfig.model_fields) == mnr | {"mini_batch_size"}


def test_impl_accum_dtype_and_ignore_index_flow_to_the_options():
    cfg = load_megaloss_config({"megaloss": {"ce": {"impl": "torch", "accum_dtype": "float64",
                                                    "ignore_index": -1, "chunk_size": 8}}})
    assert cfg.ce.accum_dtype == "float64"  # JSON-friendly in model_dump()
    opts = cfg.ce.options()
    assert (opts.impl, opts.accum_dtype, opts.ignore_index, opts.chunk_size, opts.reduction) == (
        "torch", torch.float64, -1, 8, "sum")
    assert cfg.ce.options(ignore_index=-7).ignore_index == -7
    assert CEConfig().options() == CrossEntropyOptions(reduction="sum")


@pytest.mark.parametrize("section, message", [
    ({"ce": {"accum_dtype": "int8"}}, r"megaloss\.ce\.accum_dtype: accum_dtype must be a floating"),
    ({"ce": {"accum_dtype": "float33"}},
     r"megaloss\.ce\.accum_dtype: accum_dtype must be the name"),
    ({"ce": {"impl": "cuda"}}, r"megaloss\.ce\.impl: impl must be one of"),
    ({"ce": {"label_smoothing": 1.01}},
     r"megaloss\.ce\.label_smoothing: label_smoothing must be a float in \[0\.0, 1\.0\]"),
    ({"mnr": {"similarity": "l2"}}, r"megaloss\.mnr\.similarity: similarity must be one of"),
    ({"mnr": {"chunk_size": 0}}, r"megaloss\.mnr\.chunk_size: chunk_size must be an int >= 1"),
    ({"mnr": {"local_loss": 1}}, r"megaloss\.mnr\.local_loss: local_loss must be a bool"),
    ({"mnr": {"gather": False}}, r"megaloss\.mnr\.gather"),
])
def test_the_dataclass_message_under_the_key_path(section, message):
    with pytest.raises(ValueError, match=message):
        load_megaloss_config({"megaloss": section})


def test_label_smoothing_bound_is_the_dataclass_one():
    assert load_megaloss_config({"megaloss": {"ce": {"label_smoothing": 1.0}}}).ce \
        .options().label_smoothing == 1.0


def test_mnr_section_options_reach_the_embedding_model():
    cfg = load_megaloss_config({"megaloss": {"mnr": {"temperature": 0.1, "similarity": "dot",
                                                     "local_loss": False, "chunk_size": 3,
                                                     "mini_batch_size": 2}}})
    model = EmbeddingModelWithMNR(torch.nn.Identity(), options=cfg.mnr.options())
    assert model.options == MNROptions(temperature=0.1, similarity="dot", local_loss=False,
                                       chunk_size=3)
    assert (model.temperature, model.similarity, model.local_loss) == (0.1, "dot", False)
    with pytest.raises(TypeError, match="temperature"):
        EmbeddingModelWithMNR(torch.nn.Identity(), temperature=0.2, options=cfg.mnr.options())


def test_embedding_model_gather_keyword_is_renamed():
    with pytest.warns(DeprecationWarning, match="gather_across_ranks="):
        model = EmbeddingModelWithMNR(torch.nn.Identity(), gather=False)
    assert model.gather_across_ranks is False
    assert EmbeddingModelWithMNR(torch.nn.Identity(), gather_across_ranks=False).options == \
        model.options
