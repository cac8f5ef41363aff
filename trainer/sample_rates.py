"""The negative sample rates a model was trained under, recorded by the trainer for serving.

The joiner keeps every positive and a fraction of the negatives: ``joiner.negative_sample_rate``,
or ``joiner.slice_sample_rates[slice]`` where the slice is the serving ``model_id`` that served the
impression. Every example carries its keep rate (``sample_rate``: 1.0 for positives) and its slice
(``model_id``). A model trained on that stream predicts odds ``1/r`` times too high, and serving
undoes it (:mod:`serving.correction`). The ``r`` must be the one the *model* was trained under, not
a copy of the joiner's current setting: the setting may have changed since, differ per slice, or
belong to another deployment's joiner. So the trainer measures it from what it learned, records it
in its snapshot manifest (``sample_rates``) and sends it with every dense delta, and serving corrects
with the rate that came with the parameters it serves.

What is measured: the *effective* keep rate of the negatives (label 0 for the model's label)

    r = n_neg / sum(1 / sample_rate over the negatives learned)

i.e. negatives seen / negatives that occurred. This is exactly the factor by which the learned odds
are inflated, also when the negatives were kept at different rates: e.g. for a model of ``like``,
the like-negatives that were clicks were kept at 1.0 and the rest at the joiner's rate; or a
changed setting mixes two rates. Positives do not enter (they are all kept).

Slices: ``rates()["slices"][s]`` is computed over slice ``s``'s negatives only,
``rates()["global"]`` over all negatives. The per-slice rate is right when the model can tell the
slice's traffic apart (its features differ: other users, other items, or a slot naming the
slice): it then learns each slice's base rate under that slice's sampling, and each slice's odds
are inflated by its own ``1/r``. The global (effective) rate is what a model that cannot tell them
apart needs: it learns one pooled base rate, inflated by the pooled factor. Serving uses its
slice's rate if the trainer saw negatives of that slice, else the global one (a slice the model
never learned is scored like the pooled traffic), else 1.0 (no negative learned: nothing to undo).
Serving's slice is its model's ``model_id``: the value its feature logs carry and the joiner keys
``slice_sample_rates`` by. The limit of this choice: slices that split the *same* traffic (an A/B
test over one user population) with different rates are not told apart by the model, and each
slice's rate is then off by its ratio to the global rate; give the model a feature that names the
slice (then the per-slice rate is right again), or sample both slices at one rate.

Decay: the sums decay exponentially per *negative example* of their own slice (the global sums
per negative of any slice), with half-life ``trainer.sample_rate_half_life``. Per example, not per
second, because the model forgets an old mix by learning new examples, not by the clock: a quiet
slice (or a stopped stream) keeps the rate its parameters were trained under. Per negative of the
slice, not per example of any slice, so one busy slice does not age out a quiet slice's rate.
While a setting stays the same every negative of a slice carries the same rate and the estimate
is exact whatever the half-life; after a change it moves to the new rate with that half-life
(``2**-k`` of the old weight is left after ``k`` half-lives), about as fast as the model's bias.

>>> import numpy as np
>>> t = SampleRateTracker(half_life=1e9)  # effectively no decay
>>> slices = np.array([0, 0, 0, 1, 1, 1], np.int32)        # index into the names below
>>> rates = np.array([1.0, 0.1, 0.1, 1.0, 0.5, 1.0], np.float32)
>>> labels = np.array([1, 0, 0, 1, 0, 0], np.float32)     # slice "b": one negative kept at 1.0
>>> t.update(slices, ("a", "b"), rates, labels)
>>> {k: round(v, 4) for k, v in t.rates()["slices"].items()}
{'a': 0.1, 'b': 0.6667}
>>> round(t.rates()["global"], 4)  # 4 negatives learned of 20 + 2 + 1 that occurred
0.1739
>>> SampleRateTracker(half_life=10).rates()  # nothing learned yet: no correction
{'global': 1.0, 'slices': {}}
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


class SampleRateError(ValueError):
    """A tracker state (a snapshot manifest's ``sample_rates``) that cannot be loaded."""


class SampleRateTracker:
    """Decayed sums per slice and globally: ``n`` = negatives learned, ``w`` = sum of their
    ``1/sample_rate`` (negatives that occurred); the rate is ``n / w``. See the module docstring."""

    def __init__(self, half_life: float) -> None:
        if not (half_life > 0 and math.isfinite(half_life)):
            raise ValueError(f"sample rate half-life {half_life} must be a positive number of examples")
        self.half_life = float(half_life)
        self._decay = 0.5 ** (1.0 / self.half_life)  # per negative example
        self._global = np.zeros(2, np.float64)  # [n, w]
        self._slices: dict[str, np.ndarray] = {}

    def _fold(self, sums: np.ndarray, inv_rate: np.ndarray) -> None:
        """Fold negatives (in order) into ``sums``: the j-th of k weighs ``decay**(k - 1 - j)``
        and the old sums ``decay**k`` (what folding them one at a time would give)."""
        k = inv_rate.size
        w = self._decay ** np.arange(k - 1, -1, -1, dtype=np.float64)
        sums *= self._decay ** k
        sums += (w.sum(), float(w @ inv_rate))

    def update(self, slice_ids: np.ndarray | None, slice_names: Sequence[str], sample_rate: np.ndarray,
               labels: np.ndarray) -> None:
        """Fold one applied batch in: per example its slice (``slice_ids`` into ``slice_names``;
        None: slices unknown, the global rate only), its keep rate and its label (negative: 0;
        NaN or soft labels are not negatives). Vectorized; a Python step per slice present."""
        neg = np.asarray(labels) == 0
        if not neg.any():
            return
        inv = 1.0 / np.asarray(sample_rate, np.float64)[neg]
        self._fold(self._global, inv)
        if slice_ids is None:
            return
        ids = np.asarray(slice_ids)[neg]
        present, inverse = np.unique(ids, return_inverse=True)
        for j, code in enumerate(present.tolist()):
            sums = self._slices.setdefault(slice_names[code], np.zeros(2, np.float64))
            self._fold(sums, inv[inverse == j] if present.size > 1 else inv)

    @staticmethod
    def _rate(sums: np.ndarray) -> float:
        # the two decayed sums of negatives all kept at 1.0 are equal only up to rounding, and the
        # rates they come from are float32 (7 digits): round to 9 decimals, and a rate is at most 1
        return min(1.0, round(float(sums[0] / sums[1]), 9)) if sums[1] > 0 else 1.0

    def rates(self) -> dict:
        """``{"global": r, "slices": {slice: r}}`` (1.0 where no negative was learned)."""
        return {"global": self._rate(self._global),
                "slices": {s: self._rate(v) for s, v in sorted(self._slices.items())}}

    def state(self) -> dict:
        """JSON-ready: :meth:`rates` (what serving reads) plus the decayed sums to resume from
        (``sums``: ``[negatives, negatives that occurred]``, global and per slice)."""
        return dict(self.rates(), sums={"global": self._global.tolist(),
                                        "slices": {s: v.tolist() for s, v in sorted(self._slices.items())}})

    def load(self, state: Mapping) -> None:
        """Resume from :meth:`state` (``{}``: a snapshot that recorded none, start empty)."""
        sums = state.get("sums", {"global": [0.0, 0.0], "slices": {}})
        try:
            g = np.array(sums["global"], np.float64).reshape(2)
            sl = {str(s): np.array(v, np.float64).reshape(2) for s, v in sums["slices"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise SampleRateError(f"sample_rates state {state!r} is not a tracker state: {err!r}") from None
        for name, v in [("global", g), *sl.items()]:
            if not (np.isfinite(v).all() and 0 <= v[0] <= v[1] * (1 + 1e-9)):
                raise SampleRateError(f"sample_rates sums of {name} {v.tolist()} are not "
                                      "0 <= negatives <= negatives that occurred")
        self._global, self._slices = g, sl
