"""One entry point per loss: the unified signatures, ``options=`` vs keywords, and every
deprecated name warning (naming its replacement) while giving the new name's results."""
import inspect

import pytest
import torch

import megaloss
from megaloss import (
    CrossEntropyOptions,
    MNROptions,
    VocabParallelOptions,
    linear_cross_entropy,
    linear_cross_entropy_with_stats,
    mnr_loss,
    mnr_loss_with_stats,
)
from megaloss.losses.mnr import MultipleNegativesRankingLoss


def _ce_inputs(seed=0, n=7, h=4, v=9):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[1] = -100
    return hidden, weight, labels


def _mnr_inputs(seed=0, b=5, k=2, d=4):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, d, generator=g, dtype=torch.float64),
            torch.randn(b, d, generator=g, dtype=torch.float64),
            torch.randn(b, k, d, generator=g, dtype=torch.float64))


def test_ce_entry_points_share_one_signature():
    params = inspect.signature(linear_cross_entropy).parameters
    assert params == inspect.signature(linear_cross_entropy_with_stats).parameters
    assert list(params)[:3] == ["hidden_states", "weight", "labels"]
    assert list(params)[-2:] == ["options", "vocab_parallel_options"]
    option_fields = [f for f in CrossEntropyOptions.__dataclass_fields__]
    assert [p for p in params if p in option_fields] == option_fields


def test_options_and_keywords_give_the_same_loss():
    hidden, weight, labels = _ce_inputs()
    kw = dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3, chunk_size=3)
    a = linear_cross_entropy_with_stats(hidden, weight, labels, **kw)
    b = linear_cross_entropy_with_stats(hidden, weight, labels, options=CrossEntropyOptions(**kw))
    assert torch.equal(a.loss, b.loss) and torch.equal(a.z_loss, b.z_loss)
    assert torch.equal(linear_cross_entropy(hidden, weight, labels, **kw), a.loss)


def test_options_together_with_non_default_keywords_is_a_type_error_naming_them():
    hidden, weight, labels = _ce_inputs()
    opts = CrossEntropyOptions(reduction="sum")
    # keywords left at their default are fine next to options=
    loss = linear_cross_entropy(hidden, weight, labels, reduction="mean", options=opts)
    assert torch.equal(loss, linear_cross_entropy(hidden, weight, labels, reduction="sum"))
    with pytest.raises(TypeError, match="z_loss, chunk_size"):
        linear_cross_entropy(hidden, weight, labels, z_loss=1e-3, chunk_size=2, options=opts)
    with pytest.raises(TypeError, match="options must be a CrossEntropyOptions"):
        linear_cross_entropy(hidden, weight, labels, options={"reduction": "sum"})
    with pytest.raises(TypeError, match="vocab_parallel_options must be a VocabParallelOptions"):
        linear_cross_entropy(hidden, weight, labels, vocab_parallel_options={"vocab_size": 9})
    q, p, n = _mnr_inputs()
    with pytest.raises(TypeError, match="symmetric"):
        mnr_loss(q, p, n, symmetric=True, options=MNROptions())


def test_vocab_parallel_options_are_validated():
    with pytest.raises(ValueError, match="vocab_size"):
        VocabParallelOptions(vocab_size=0)
    with pytest.raises(TypeError, match="sequence_parallel"):
        VocabParallelOptions(sequence_parallel="yes")


@pytest.mark.parametrize("old_name", ["vocab_parallel_linear_cross_entropy",
                                      "vocab_parallel_linear_cross_entropy_with_stats"])
def test_old_vocab_parallel_names_warn_and_match_the_unified_entry_point(old_name):
    hidden, weight, labels = _ce_inputs(seed=1)
    parallel = VocabParallelOptions(vocab_size=9)  # one process: tp = 1
    opts = CrossEntropyOptions(label_smoothing=0.2, chunk_size=2)
    old = getattr(megaloss, old_name)
    with pytest.warns(DeprecationWarning, match="vocab_parallel_options"):
        if old_name.endswith("_with_stats"):
            got = old(hidden, weight, labels, vocab_size=9, options=opts)
        else:
            got = old(hidden, weight, labels, vocab_size=9, label_smoothing=0.2, chunk_size=2)
    new = linear_cross_entropy_with_stats(hidden, weight, labels, options=opts,
                                          vocab_parallel_options=parallel)
    if old_name.endswith("_with_stats"):
        assert all(torch.equal(a, b) for a, b in zip(got, new))
    else:
        assert torch.equal(got, new.loss)
    # tp = 1 vocab-parallel equals the single-device path
    torch.testing.assert_close(new.loss, linear_cross_entropy(hidden, weight, labels,
                                                              options=opts), rtol=1e-12,
                               atol=1e-12)


def test_mnr_with_metrics_and_gather_keyword_warn_and_match():
    q, p, n = _mnr_inputs(seed=2)
    new = mnr_loss_with_stats(q, p, n, gather_across_ranks=False, symmetric=True)
    with pytest.warns(DeprecationWarning, match="mnr_loss_with_stats"):
        old = megaloss.mnr_loss_with_metrics(q, p, n, gather_across_ranks=False, symmetric=True)
    assert torch.equal(old.loss, new.loss) and torch.equal(old.mean_rank, new.mean_rank)
    with pytest.warns(DeprecationWarning, match="gather_across_ranks="):
        old_kw = mnr_loss(q, p, n, gather=False, symmetric=True)
    assert torch.equal(old_kw, new.loss)
    with pytest.raises(TypeError, match="gather_across_ranks"):
        mnr_loss(q, p, n, gather=False, gather_across_ranks=False)
    via_options = mnr_loss(q, p, n, options=MNROptions(gather_across_ranks=False, symmetric=True))
    assert torch.equal(via_options, new.loss)


def test_mnr_module_renames_warn_and_match():
    q, p, n = _mnr_inputs(seed=3)
    module = MultipleNegativesRankingLoss(0.1, gather_across_ranks=False, similarity="dot")
    assert module.options == MNROptions(temperature=0.1, gather_across_ranks=False,
                                        similarity="dot")
    with pytest.warns(DeprecationWarning, match="gather_across_ranks="):
        old_module = MultipleNegativesRankingLoss(0.1, gather=False, similarity="dot")
    assert old_module.gather_across_ranks is False
    new = module.forward_with_stats(q, p, n)
    with pytest.warns(DeprecationWarning, match="forward_with_stats"):
        old = module.forward_with_metrics(q, p, n)
    assert torch.equal(old.loss, new.loss) and torch.equal(old.accuracy, new.accuracy)
    assert torch.equal(module(q, p, n), new.loss)
    with pytest.raises(ValueError, match="similarity must be one of"):
        MultipleNegativesRankingLoss(similarity="l2")


def test_mnr_options_validate_with_the_functional_messages():
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        MNROptions(temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        MNROptions(chunk_size=True)
    with pytest.raises(TypeError, match="local_loss must be a bool"):
        MNROptions(local_loss=1)
    q, p, n = _mnr_inputs()
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        mnr_loss(q, p, n, temperature=-1.0)


def test_grad_cache_module_is_not_shadowed_and_the_old_function_warns():
    import megaloss.losses
    from megaloss.losses import grad_cache as module
    assert inspect.ismodule(megaloss.losses.grad_cache) and module is megaloss.losses.grad_cache
    from megaloss._deprecated import grad_cache as old_function

    enc = torch.nn.Linear(3, 2).double()
    batch = torch.randn(6, 3, dtype=torch.float64)

    def run(step_fn):
        enc.zero_grad()
        step = step_fn(lambda m: [enc(m), enc(m * 2)], megaloss.split_rows(batch, 4),
                       lambda cols: (cols[0] * cols[1]).sum())
        step.surrogate.backward()
        return step.loss, enc.weight.grad.clone()

    new_loss, new_grad = run(megaloss.grad_cache_step)
    for old in (old_function, megaloss.grad_cache):
        with pytest.warns(DeprecationWarning, match="grad_cache_step"):
            old_loss, old_grad = run(old)
        assert torch.equal(old_loss, new_loss) and torch.equal(old_grad, new_grad)
    enc.zero_grad()
    (enc(batch) * enc(batch * 2)).sum().backward()  # the non-cached loss
    torch.testing.assert_close(new_grad, enc.weight.grad, rtol=1e-12, atol=1e-12)
    assert "grad_cache" not in megaloss.__all__ and "grad_cache_step" in megaloss.__all__
