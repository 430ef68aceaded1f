"""The sentence-transformers drop-in (megaloss.integrations.hf.sentence_transformers).

A tiny random-init SentenceTransformer (1-layer BERT, word-level tokenizer, written to a temp
dir: no download), float64. Tolerances: single process, same model and inputs, against
sentence-transformers' own MultipleNegativesRankingLoss: rtol 1e-10 on the loss, 1e-8 on every
parameter gradient (float64, different summation order only). Two gloo processes with uneven
per-rank batches: the mean of the ranks' gradients (what DDP / ZeRO-2 reduce) against the single
process on the concatenated batch, rtol 1e-8.
"""
import os

import pytest
import torch

from megaloss.testing import run_distributed

# Importing sentence-transformers costs ~10 CPU-s (sklearn, transformers' model code): the module
# is in the slow tier and imports it only when a test runs, so collecting the fast tier does not.
pytestmark = pytest.mark.slow


def gathered_mnrl(*args, **kwargs):
    """``GatheredMultipleNegativesRankingLoss(*args, **kwargs)``, imported on first use."""
    from megaloss.integrations.hf.sentence_transformers import (
        GatheredMultipleNegativesRankingLoss,
    )
    return GatheredMultipleNegativesRankingLoss(*args, **kwargs)

WORDS = [f"w{i}" for i in range(60)]


def make_model_dir(path: str) -> str:
    """Write a tiny BERT + word-level tokenizer that SentenceTransformer's Transformer loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(special + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                            cls_token="[CLS]", sep_token="[SEP]",
                            mask_token="[MASK]").save_pretrained(path)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=32, max_position_embeddings=32,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    BertModel(cfg).save_pretrained(path)
    return path


def load_model(path: str):
    os.environ["HF_HUB_OFFLINE"] = "1"
    from sentence_transformers import SentenceTransformer, models
    model = SentenceTransformer(modules=[models.Transformer(path), models.Pooling(16, "mean")],
                                device="cpu")
    return model.double()


def texts(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(2, 7, (1,), generator=g))
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(0, 60, (k,), generator=g)))
    return out


def batch(n: int, negatives: int, seed: int = 1):
    """Columns anchor, positive, negative_1..k as lists of texts."""
    return [texts(n, seed + 100 * c) for c in range(2 + negatives)]


def features(model, columns):
    return [model.tokenize(c) for c in columns]


def grads(model):
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def loss_and_grads(model, loss_fn, columns, labels=None):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(features(model, columns), labels)
    loss.backward()
    return loss.detach(), grads(model)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("sentence_transformers")
    return make_model_dir(str(tmp_path_factory.mktemp("tiny_st")))


def assert_grads_close(a, b, rtol=1e-8, atol=1e-12):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("negatives,symmetric,similarity", [
    (0, False, "cosine"), (2, False, "cosine"), (1, True, "cosine"), (1, False, "dot")])
def test_matches_sentence_transformers_mnrl(model_dir, negatives, symmetric, similarity):
    from sentence_transformers import util
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    model = load_model(model_dir)
    columns = batch(7, negatives)
    scale = 20.0 if similarity == "cosine" else 1.0
    fct = util.cos_sim if similarity == "cosine" else util.dot_score
    st_kwargs = (dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction")
                 if symmetric else {})
    ref_loss, ref_grads = loss_and_grads(
        model, MultipleNegativesRankingLoss(model, scale=scale, similarity_fct=fct, **st_kwargs),
        columns)
    ours = gathered_mnrl(model, scale=scale, similarity_fct=fct,
                                                symmetric=symmetric)
    loss, g = loss_and_grads(model, ours, columns)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=0)
    assert_grads_close(g, ref_grads)


def test_duplicate_ids_from_labels(model_dir):
    import megaloss
    model = load_model(model_dir)
    columns = batch(6, 1)
    ids = torch.tensor([0, 1, 0, 2, 3, 1])
    loss_fn = gathered_mnrl(model, labels_as_duplicate_ids=True)
    loss, g = loss_and_grads(model, loss_fn, columns, ids)
    model.zero_grad(set_to_none=True)
    emb = [model(f)["sentence_embedding"] for f in features(model, columns)]
    ref = megaloss.mnr_loss(emb[0], emb[1], emb[2].unsqueeze(1), temperature=0.05,
                            duplicate_ids=ids)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=0)
    assert_grads_close(g, grads(model))
    plain = gathered_mnrl(model)(features(model, columns), ids)
    assert not torch.allclose(plain, loss)  # labels ignored by default: duplicates are negatives


def test_conventions_and_errors(model_dir):
    model = load_model(model_dir)
    loss_fn = gathered_mnrl(model, scale=50, symmetric=True)
    assert loss_fn.get_config_dict() == {"scale": 50.0, "similarity_fct": "cosine",
                                         "symmetric": True, "gather_across_devices": True,
                                         "labels_as_duplicate_ids": False}
    assert loss_fn.temperature == pytest.approx(0.02)
    assert "1807.03748" in loss_fn.citation
    with pytest.raises(ValueError, match="scale"):
        gathered_mnrl(model, scale=0)
    with pytest.raises(ValueError, match="similarity_fct"):
        gathered_mnrl(model, similarity_fct=torch.cdist)
    with pytest.raises(ValueError, match="at least 2"):
        loss_fn(features(model, batch(3, 0)[:1]), None)
    with pytest.raises(ValueError, match="label column"):
        gathered_mnrl(model, labels_as_duplicate_ids=True)(
            features(model, batch(3, 0)), None)


# two processes ---------------------------------------------------------------------------------
def _rank_grads(rank, world, model_dir, columns, sizes, symmetric, with_st):
    torch.manual_seed(0)
    model = load_model(model_dir)
    start = sum(sizes[:rank])
    mine = [c[start:start + sizes[rank]] for c in columns]
    if sizes[rank] == 0:
        feats = [{k: (v[:0] if isinstance(v, torch.Tensor) else v)
                  for k, v in model.tokenize(["w1"]).items()} for _ in columns]
    else:
        feats = features(model, mine)
    loss = gathered_mnrl(model, symmetric=symmetric)(feats, None)
    loss.backward()
    out = {"loss": loss.detach(), "grads": grads(model)}
    if with_st:  # sentence-transformers' own gathered loss, where it works (even batches)
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
        model.zero_grad(set_to_none=True)
        st = MultipleNegativesRankingLoss(model, gather_across_devices=True)(feats, None)
        st.backward()
        out["st_loss"], out["st_grads"] = st.detach(), grads(model)
    return out


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("sizes,negatives,symmetric", [
    ((5, 2), 1, False), ((4, 0), 1, True), ((3, 3), 2, False)])
def test_two_ranks_equal_single_process_global_batch(model_dir, sizes, negatives, symmetric):
    columns = batch(sum(sizes), negatives, seed=7)
    model = load_model(model_dir)
    ref_loss, ref_grads = loss_and_grads(
        model, gathered_mnrl(model, symmetric=symmetric), columns)
    even = sizes[0] == sizes[1]
    results = run_distributed(_rank_grads, 2, model_dir, columns, list(sizes), symmetric, even,
                              timeout=140)
    for r in results:
        torch.testing.assert_close(r["loss"], ref_loss, rtol=1e-10, atol=0)
    mean = {n: sum(r["grads"][n] for r in results) / 2 for n in ref_grads}
    assert_grads_close(mean, ref_grads)
    if even:
        st_mean = {n: sum(r["st_grads"][n] for r in results) / 2 for n in ref_grads}
        # ST returns each rank's local mean; with even batches their mean is the global loss
        st_loss = sum(r["st_loss"] for r in results) / 2
        torch.testing.assert_close(st_loss, ref_loss, rtol=1e-10, atol=0)
        assert_grads_close(st_mean, ref_grads)
