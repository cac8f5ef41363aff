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

The ``r`` is the rate the served model was trained under, not a setting serving copies: the
trainer measures it from the examples it learned (:mod:`trainer.sample_rates`: the effective
negative keep rate, globally and per slice, the slice being the serving ``model_id`` that served
the impression), records it in its snapshot manifest (``sample_rates``) and sends it with every
dense delta; the model serving holds keeps the newest (:class:`SampleRates`) and ``/rank`` corrects
with the rate of the slice it serves (its model's ``model_id``), else the model's global rate,
else 1.0 (the model recorded none: nothing to undo).

>>> rates = SampleRates.from_mapping({"global": 0.3, "slices": {"deepfm": 0.1}})
>>> rates.rate_for("deepfm"), rates.rate_for("other"), SampleRates().rate_for("deepfm")
((0.1, 'slice'), (0.3, 'global'), (1.0, 'unrecorded'))
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import numpy.typing as npt

from proto import SampleRates as SampleRatesMessage


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


class BadSampleRates(ValueError):
    """Sample rates (from a manifest or a dense delta) that are not rates in (0, 1]."""


@dataclass(frozen=True)
class SampleRates:
    """The negative keep rates a served model was trained under: ``global_rate`` over all its
    negatives, ``slices`` per slice; ``recorded`` False for a model whose trainer recorded none
    (scored uncorrected). Immutable: a new dense delta swaps in a new object, so a request reads
    one consistent set."""

    global_rate: float = 1.0
    slices: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    recorded: bool = False

    def __post_init__(self) -> None:
        # Wire input, checked here and not trusted: these rates come from a snapshot manifest or a
        # dense delta on Kafka, which any client may write, not from the joiner's validated setting.
        for name, r in [("global", self.global_rate), *self.slices.items()]:
            if not (0.0 < r <= 1.0):
                raise BadSampleRates(f"sample rate of {name} is {r}, not in (0, 1]")
        object.__setattr__(self, "slices", MappingProxyType(dict(self.slices)))

    def rate_for(self, slice_name: str) -> tuple[float, str]:
        """``(rate, source)`` for the model serving ``slice_name``: its slice's rate if the trainer
        learned negatives of it (``"slice"``), else the global one (``"global"``), else 1.0
        (``"unrecorded"``). See :mod:`trainer.sample_rates` on when each is right."""
        if not self.recorded:
            return 1.0, "unrecorded"
        if slice_name in self.slices:
            return self.slices[slice_name], "slice"
        return self.global_rate, "global"

    @classmethod
    def from_mapping(cls, rates: Mapping) -> SampleRates:
        """From a snapshot manifest's ``sample_rates`` (``{"global": r, "slices": {s: r}}``, more
        keys ignored)."""
        try:
            return cls(float(rates["global"]), {str(k): float(v) for k, v in rates["slices"].items()}, True)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            if isinstance(err, BadSampleRates):
                raise
            raise BadSampleRates(f"sample rates {rates!r} are not {{'global': r, 'slices': {{...}}}}") from None

    @classmethod
    def from_message(cls, msg: SampleRatesMessage) -> SampleRates:
        """From a dense delta's ``DenseParameters.sample_rates``."""
        return cls(float(msg.global_rate), {k: float(v) for k, v in msg.slices.items()}, True)

    def as_dict(self) -> dict:
        """``{"global": r, "slices": {...}}`` (the manifest's form); empty when unrecorded."""
        return {"global": self.global_rate, "slices": dict(self.slices)} if self.recorded else {}
