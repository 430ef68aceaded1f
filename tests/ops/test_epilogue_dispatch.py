"""``CrossEntropyOptions.impl`` and the choice of chunk epilogue (no triton needed here)."""
import pytest
import torch

import megaloss
from megaloss import CrossEntropyOptions
from megaloss.ops import epilogue_choice
from megaloss.ops.cross_entropy_chunk import epilogue_impl
from megaloss.ops.cross_entropy_options import CE_IMPLS


def test_impl_option_is_validated():
    assert CrossEntropyOptions().impl == "auto"
    for impl in CE_IMPLS:
        assert CrossEntropyOptions(impl=impl).impl == impl
    for bad in ("cuda", "Triton", "", None, 1):
        with pytest.raises(ValueError, match="impl must be one of"):
            CrossEntropyOptions(impl=bad)
    assert CrossEntropyOptions(impl="torch").as_dict()["impl"] == "torch"
    assert "impl=triton" in megaloss.LinearCrossEntropyLoss(impl="triton").extra_repr()


def test_auto_and_torch_take_torch_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter is opt-in through "triton" only
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        logits = torch.zeros(2, 3, dtype=dtype)
        assert epilogue_impl("auto", logits) == "torch"
        assert epilogue_impl("torch", logits) == "torch"


def test_forced_triton_refusals(monkeypatch):
    logits = torch.zeros(2, 3)
    monkeypatch.setattr(epilogue_choice, "_triton_importable", lambda: True)
    monkeypatch.setattr(epilogue_choice, "_interpreter_ready", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        epilogue_impl("triton", logits)
    monkeypatch.setattr(epilogue_choice, "_interpreter_ready", lambda: True)
    assert epilogue_impl("triton", logits) == "triton"
    with pytest.raises(ValueError, match="float64"):
        epilogue_impl("triton", logits.double())
    monkeypatch.setattr(epilogue_choice, "_triton_importable", lambda: False)
    with pytest.raises(ValueError, match="needs the triton package"):
        epilogue_impl("triton", logits)
    with pytest.raises(ValueError, match="impl must be one of"):
        epilogue_impl("fused", logits)


def test_forced_triton_raises_through_the_public_api(monkeypatch):
    monkeypatch.setattr(epilogue_choice, "_triton_importable", lambda: True)
    monkeypatch.setattr(epilogue_choice, "_interpreter_ready", lambda: False)
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    y = torch.randint(0, 10, (4,))
    opts = CrossEntropyOptions(impl="triton")
    with pytest.raises(ValueError, match="impl='triton'"):
        megaloss.linear_cross_entropy_with_stats(h, w, y, options=opts)
    # "torch" and "auto" on CPU: the same numbers (both are the torch epilogue here).
    a = megaloss.linear_cross_entropy_with_stats(h, w, y, options=opts.replace(impl="torch"))
    b = megaloss.linear_cross_entropy_with_stats(h, w, y, options=opts.replace(impl="auto"))
    assert torch.equal(a.loss, b.loss)
