"""Serving's settings with the defaults that depend on other sections resolved.

Every default lives in :class:`services.settings.ServingSettings`; ``None`` there means "the same
as another service" (the trainer's model, the joiner's negative rate, ``<var_dir>/snapshots``),
which :meth:`ServingOptions.from_settings` fills in.
"""

from __future__ import annotations

from pathlib import Path

from services.settings import ServingSettings, Settings


class ServingOptions(ServingSettings):
    model: str = "deepfm"
    snapshot_dir: Path | None = None
    negative_sample_rate: float = 0.25

    @classmethod
    def from_settings(cls, settings: Settings) -> ServingOptions:
        s = settings.serving
        return cls(**{
            **s.model_dump(),
            "model": s.model or settings.trainer.model,
            "snapshot_dir": s.snapshot_dir or settings.var_dir / "snapshots",
            "negative_sample_rate": (
                settings.joiner.negative_sample_rate if s.negative_sample_rate is None else s.negative_sample_rate
            ),
        })
