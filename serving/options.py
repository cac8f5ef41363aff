"""Serving's settings with the defaults that depend on other sections resolved.

Every default lives in :class:`services.settings.ServingSettings`; ``None`` there means "the same
as another service" (the trainer's model, the joiner's negative rate, ``<var_dir>/snapshots``) or
"derived" (the spool directory ``<var_dir>/serving/spool-<port>``, one per replica), which
:meth:`ServingOptions.from_settings` fills in.

>>> from services.settings import Settings
>>> ServingOptions.from_settings(Settings(var_dir=Path("v")), port=8001).spool_dir
PosixPath('v/serving/spool-8001')
"""

from __future__ import annotations

from pathlib import Path

from services.settings import ServingSettings, Settings


class ServingOptions(ServingSettings):
    model: str = "deepfm"
    snapshot_dir: Path | None = None
    negative_sample_rate: float = 0.25

    @classmethod
    def from_settings(cls, settings: Settings, port: int | None = None) -> ServingOptions:
        """``port`` replaces ``serving.port`` (``python -m serving --port``), and with it the
        default spool directory: each replica has its own, found again by a restart."""
        s = settings.serving
        port = s.port if port is None else port
        return cls(**{
            **s.model_dump(),
            "port": port,
            "model": s.model or settings.trainer.model,
            "snapshot_dir": s.snapshot_dir or settings.var_dir / "snapshots",
            "spool_dir": s.spool_dir or settings.var_dir / "serving" / f"spool-{port}",
            "negative_sample_rate": (
                settings.joiner.negative_sample_rate if s.negative_sample_rate is None else s.negative_sample_rate
            ),
        })
