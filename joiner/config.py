"""The join's configuration: :class:`JoinConfig`, built from the service's settings.

It checks nothing itself: every value comes from :class:`services.settings.JoinerSettings`, whose
fields carry the bounds (sample rates in (0, 1], a ``Literal`` late policy...), validated once
where the settings are read. ``from_settings``'s overrides (tests, benchmarks) that name a setting
go through the settings too, so they meet the same bounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.settings import JoinerSettings, LatePolicy, PositiveEmit


@dataclass(frozen=True)
class JoinConfig:
    """The join rules. Times are event-time milliseconds.

    * ``window_ms`` W: an action joins an impression when ``action_time - impression_time <= W``.
    * ``lateness_ms`` L: how far the action stream may be out of order. The window of an
      impression closes when the action watermark (max action time seen on the partition)
      passes ``impression_time + W + L``; an action that arrives after that is late.
    * ``orphan_grace_ms`` G: an action whose features have not arrived by the time the features
      watermark passes ``action_time + G`` is an orphan and is dropped.
    * ``retention_ms`` R: closed impressions are remembered (as tombstones) until the action
      watermark passes ``impression_time + W + L + R`` so that late actions are recognised as late.
    * ``watermark_outliers`` k: a watermark is the (k+1)-th largest distinct event time seen on
      its partition, so k far-off events cannot move it (:mod:`joiner.watermark`).

    The values, and their defaults, come from ``settings.joiner`` (:class:`JoinerSettings`, in
    seconds) through :meth:`from_settings` only; its keyword overrides are in the fields' units:

    >>> cfg = JoinConfig.from_settings(JoinerSettings(window_seconds=60), lateness_ms=0)
    >>> cfg.window_ms, cfg.lateness_ms, cfg.retention_ms, cfg.labels
    (60000, 0, 60000, ['click', 'like'])
    >>> JoinConfig.from_settings(JoinerSettings(), late_policy="never")
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: 1 validation error for JoinerSettings
    late_policy
      Input should be 'drop' or 'correction' [type=literal_error, input_value='never', input_type=str]
    ...
    """

    window_ms: int
    lateness_ms: int
    orphan_grace_ms: int
    retention_ms: int
    negative_sample_rate: float
    # Per-slice negative rates; the slice of an impression is the model_id that served it.
    slice_sample_rates: Mapping[str, float]
    seed: int
    label_map: Mapping[str, str]
    late_policy: LatePolicy
    positive_emit: PositiveEmit
    # with "immediate": the label whose join emits an impression at once (None: any label's)
    immediate_label: str | None
    watermark_outliers: int

    @property
    def labels(self) -> list[str]:
        """Label names in a fixed order (bit i of a label mask is ``labels[i]``)."""
        return sorted(set(self.label_map.values()))

    @classmethod
    def from_settings(cls, s: JoinerSettings, **overrides: Any) -> JoinConfig:
        """Build from ``settings.joiner``, some fields replaced by ``overrides``: those named like
        a setting (``negative_sample_rate``, ``late_policy``...) are validated as that setting; the
        millisecond ones (``window_ms``...) replace what the settings' seconds give."""
        named = {k: overrides.pop(k) for k in list(overrides) if k in JoinerSettings.model_fields}
        if named:
            s = JoinerSettings.model_validate({**s.model_dump(), **named})
        values: dict[str, Any] = dict(
            window_ms=int(s.window_seconds * 1000),
            lateness_ms=int(s.allowed_lateness_seconds * 1000),
            orphan_grace_ms=int(s.orphan_after_seconds * 1000),
            retention_ms=int(s.retention_seconds * 1000),
            negative_sample_rate=s.negative_sample_rate,
            slice_sample_rates=dict(s.slice_sample_rates),
            seed=s.seed,
            label_map=dict(s.label_map),
            late_policy=s.late_policy,
            positive_emit=s.positive_emit,
            immediate_label=s.immediate_label,
            watermark_outliers=s.watermark_outliers,
        )
        values.update(overrides)
        return cls(**values)


def short_grace_warning(s: JoinerSettings) -> str | None:
    """What an orphan grace shorter than the refusal distance costs (the joiner logs it at start).

    >>> short_grace_warning(JoinerSettings()) is None  # the default waits the refusal distance
    True
    >>> print(short_grace_warning(JoinerSettings(orphan_grace_seconds=300)))  # doctest: +ELLIPSIS
    joiner.orphan_grace_seconds (300 s) is shorter than window + lateness + retention (1805 s): ...
    """
    if s.orphan_after_seconds >= s.refused_after_seconds:
        return None
    return (f"joiner.orphan_grace_seconds ({s.orphan_after_seconds:g} s) is shorter than window + lateness + "
            f"retention ({s.refused_after_seconds:g} s): a feature log that reaches the joiner between the two "
            "behind its partition (a serving replica's spool shipping late) has its clicks dropped as orphans "
            "and is emitted as a negative; leave the setting out to wait as long as a feature log can be joined")
