"""token_coefficients against torch's own reductions (float64)."""
import torch
import torch.nn.functional as F

from megaloss.losses.token_coefficients import token_coefficients


def _labels():
    torch.manual_seed(0)
    labels = torch.randint(0, 7, (11,))
    labels[[2, 5]] = -100
    return labels


def test_mean_with_class_weights_is_torch_weighted_mean():
    labels, logits = _labels(), torch.randn(11, 7, dtype=torch.float64)
    class_weight = torch.rand(7, dtype=torch.float64) + 0.5
    per_token = F.cross_entropy(logits, labels, weight=class_weight, reduction="none")
    valid = labels != -100
    of_label = torch.where(valid, class_weight[labels.clamp(0)], 0.0)
    _, coef = token_coefficients(labels, -100, "mean", None, torch.float64, of_label)
    # per_token already carries w_label; coef divides by sum of w_label over valid tokens.
    expected = F.cross_entropy(logits, labels, weight=class_weight, reduction="mean")
    torch.testing.assert_close((coef * per_token).sum(), expected, rtol=1e-12, atol=0)


def test_loss_weights_sum_and_ignored_tokens():
    labels = _labels()
    w = torch.rand(11, dtype=torch.float64)
    valid, coef = token_coefficients(labels, -100, "sum", w, torch.float64)
    assert torch.equal(valid, labels != -100)
    torch.testing.assert_close(coef, torch.where(valid, w, 0.0), rtol=0, atol=0)
    _, mean = token_coefficients(labels, -100, "mean", w, torch.float64)
    torch.testing.assert_close(mean.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_every_label_ignored_gives_zero_not_nan():
    labels = torch.full((4,), -100)
    _, coef = token_coefficients(labels, -100, "mean", None, torch.float32)
    assert torch.equal(coef, torch.zeros(4))
