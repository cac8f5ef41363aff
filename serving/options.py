"""Serving options not (yet) in :class:`services.settings.ServingSettings`, with their defaults.

Each option is read from ``settings.serving`` when that section has a field of the same name, so
adding the field to ``ServingSettings`` (and thereby its ``DRIFTLINE_SERVING__*`` variable) makes it
configurable without touching this module.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from services.settings import Settings


class ServingOptions(BaseModel):
    host: str = "127.0.0.1"
    port: int = 8000
    max_candidates: int = 1_000
    feature_log_buffer: int = 10_000
    #: seconds a feature-log send may wait for the broker before it counts as failed
    feature_log_send_timeout_s: float = 2.0
    #: seconds between attempts to (re)connect the feature-log producer while Kafka is down
    kafka_retry_s: float = 2.0
    #: "fm": the built-in FM (serving.model.FMModel); otherwise a trainer model name ("deepfm",
    #: "lr") or a ModelConfig JSON path, served with trainer.inference.Scorer
    model: str = "deepfm"
    model_id: str = "deepfm"
    #: where the trainer writes snapshots; the newest one bootstraps the model
    snapshot_dir: Path | None = None
    #: rate at which the joiner kept negatives (log-odds correction); 1.0 disables correction
    negative_sample_rate: float = 0.25
    #: embedding dimension of the built-in FM model (columns: 1 linear weight + dim factors)
    embedding_dim: int = 8
    redis_prefix: str = "driftline"
    #: how many recent clicks per user the real-time feature keeps
    recent_clicks: int = 20
    #: action types that count as a click for the real-time feature
    click_actions: tuple[str, ...] = ("click", "like")

    @classmethod
    def from_settings(cls, settings: Settings) -> ServingOptions:
        section = settings.serving
        values = {name: getattr(section, name) for name in cls.model_fields if hasattr(section, name)}
        if not hasattr(section, "negative_sample_rate"):
            values["negative_sample_rate"] = settings.joiner.negative_sample_rate
        if not hasattr(section, "model"):
            values["model"] = settings.trainer.model
        if not hasattr(section, "snapshot_dir"):
            values["snapshot_dir"] = settings.var_dir / "snapshots"
        return cls(**values)
