"""The join's configuration: :class:`JoinConfig`, built from the service's settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.settings import JoinerSettings


LATE_POLICIES = ("drop", "correction")
POSITIVE_EMIT = ("immediate", "window_close")


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
    ValueError: late_policy must be one of ('drop', 'correction'), not 'never'
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
    late_policy: str
    positive_emit: str
    watermark_outliers: int

    def __post_init__(self) -> None:
        if self.late_policy not in LATE_POLICIES:
            raise ValueError(f"late_policy must be one of {LATE_POLICIES}, not {self.late_policy!r}")
        if self.positive_emit not in POSITIVE_EMIT:
            raise ValueError(f"positive_emit must be one of {POSITIVE_EMIT}, not {self.positive_emit!r}")
        rates = [self.negative_sample_rate, *self.slice_sample_rates.values()]
        if not all(0.0 < r <= 1.0 for r in rates):
            raise ValueError(f"negative sample rates must lie in (0, 1]: {rates}")
        if len(set(self.label_map.values())) > 16:
            raise ValueError("at most 16 distinct labels")
        if self.watermark_outliers < 0:
            raise ValueError(f"watermark_outliers must be >= 0, not {self.watermark_outliers}")

    @property
    def labels(self) -> list[str]:
        """Label names in a fixed order (bit i of a label mask is ``labels[i]``)."""
        return sorted(set(self.label_map.values()))

    @classmethod
    def from_settings(cls, s: JoinerSettings, **overrides: object) -> JoinConfig:
        """Build from ``settings.joiner``, some fields replaced by ``overrides``."""
        values: dict[str, object] = dict(
            window_ms=int(s.window_seconds * 1000),
            lateness_ms=int(s.allowed_lateness_seconds * 1000),
            orphan_grace_ms=int(s.orphan_grace_seconds * 1000),
            retention_ms=int(s.retention_seconds * 1000),
            negative_sample_rate=s.negative_sample_rate,
            slice_sample_rates=dict(s.slice_sample_rates),
            seed=s.seed,
            label_map=dict(s.label_map),
            late_policy=s.late_policy,
            positive_emit=s.positive_emit,
            watermark_outliers=s.watermark_outliers,
        )
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
