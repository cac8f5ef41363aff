"""Log-odds correction restores calibration of a model trained on negative-down-sampled data."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from serving.correction import correct, correct_logits


def _calibration(p: np.ndarray, y: np.ndarray, bins: int = 10) -> tuple[float, float]:
    """(mean predicted / observed CTR, expected calibration error over equal-count bins)."""
    order = np.argsort(p)
    ece = 0.0
    for idx in np.array_split(order, bins):
        ece += len(idx) / len(p) * abs(p[idx].mean() - y[idx].mean())
    return float(p.mean() / y.mean()), float(ece)


def test_correction_formula() -> None:
    p = np.linspace(0.01, 0.99, 99)
    for r in (0.05, 0.25, 1.0):
        z = np.log(p / (1 - p))
        np.testing.assert_allclose(correct(p, r), correct_logits(z, r), rtol=1e-9)
    with pytest.raises(ValueError):
        correct(0.5, 0.0)


def test_down_sampled_model_is_calibrated_after_correction() -> None:
    rng = np.random.default_rng(0)
    n, d, rate = 200_000, 8, 0.1
    w_true = rng.normal(scale=0.8, size=d)
    x = rng.normal(size=(n, d))
    y = (rng.random(n) < 1 / (1 + np.exp(-(x @ w_true - 3.0)))).astype(np.float64)  # ~7% CTR
    train, test = slice(0, n // 2), slice(n // 2, n)
    # The joiner's sampling: every positive, negatives kept with probability `rate`.
    keep = (y[train] == 1) | (rng.random(n // 2) < rate)
    xt = torch.tensor(x[train][keep], dtype=torch.float32)
    yt = torch.tensor(y[train][keep], dtype=torch.float32)
    model = torch.nn.Linear(d, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xt).squeeze(1), yt)
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        raw = torch.sigmoid(model(torch.tensor(x[test], dtype=torch.float32)).squeeze(1)).double().numpy()
    y_test = y[test]
    ratio_before, ece_before = _calibration(raw, y_test)
    fixed = correct(raw, rate)
    ratio_after, ece_after = _calibration(fixed, y_test)
    # Uncorrected: predicted CTR several times the observed one. Corrected: within 5%.
    assert ratio_before > 3.0
    assert abs(ratio_after - 1.0) < 0.05, ratio_after
    assert ece_after < 0.005 < ece_before
    # Ranking is unchanged: the correction is monotonic.
    assert np.array_equal(np.argsort(raw, kind="stable"), np.argsort(fixed, kind="stable"))
