"""Log-odds correction for negative down-sampling (He et al. 2014; Monolith section 3.2).

The joiner keeps every positive and a fraction ``r`` of the negatives, so the trainer sees the
negatives ``1/r`` times less often than they occur and its predicted odds are ``1/r`` times too
high. Serving undoes it: ``p' = p / (p + (1 - p) / r)``, i.e. ``logit(p') = logit(p) + log(r)``.

>>> round(float(correct(0.5, 0.25)), 6)
0.2
>>> float(correct(0.3, 1.0))
0.3
>>> round(float(correct_logits(0.0, 0.25)), 6) == round(float(correct(0.5, 0.25)), 6)
True
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt


def _check_rate(rate: float) -> None:
    if not (0.0 < rate <= 1.0):
        raise ValueError(f"negative sample rate {rate} is outside (0, 1]")


def correct(p: npt.ArrayLike, rate: float) -> np.ndarray:
    """Probabilities from a model trained with negatives kept at ``rate`` -> true probabilities."""
    _check_rate(rate)
    p = np.asarray(p, dtype=np.float64)
    if rate == 1.0:
        return p
    return p / (p + (1.0 - p) / rate)


def correct_logits(logits: npt.ArrayLike, rate: float) -> np.ndarray:
    """The same correction on logits (numerically exact near 0 and 1): sigmoid(z + log r)."""
    _check_rate(rate)
    z = np.asarray(logits, dtype=np.float64) + math.log(rate)
    return 1.0 / (1.0 + np.exp(-z))
