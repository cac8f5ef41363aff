"""The project file: one place where a user declares their features, tables, model, labels and
sync intervals (``driftline.toml``), validated by pydantic.

This module is being built (issue 16); :class:`FeatureSpec` is the shared contract the loaders, the
client and serving read: a feature's name, where its value comes from, sparse or dense, and whether
its ids are strings (hashed by :func:`services.hashing.string_id`) or int64.

>>> FeatureSpec(name="device", source="context", kind="sparse", ids="string").hashed
True
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["FeatureSpec"]


class FeatureSpec(BaseModel):
    """One feature the model reads."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    #: context: the request (``/rank`` ``context``); candidate: per candidate in the request;
    #: user / item: the online feature store (Redis), filled by ``driftline features load``
    source: Literal["context", "candidate", "user", "item"]
    kind: Literal["sparse", "dense"] = "sparse"
    #: sparse only: "string" values are hashed to int64 ids with services.hashing.string_id
    ids: Literal["int", "string"] = "int"

    @property
    def hashed(self) -> bool:
        return self.kind == "sparse" and self.ids == "string"
