"""Request and response bodies of the serving API (pydantic, with OpenAPI examples)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints

INT64_MAX = 2**63 - 1
#: hard cap in the schema; the configured ``max_candidates`` (smaller) is checked per request
SCHEMA_MAX_CANDIDATES = 10_000

Id = Annotated[int, Field(ge=0, le=INT64_MAX)]
#: a place in a list (``first_position``): far past any page a person scrolls to
MAX_POSITION = 1_000_000
FeatureId = Annotated[int, Field(ge=-(2**63), le=INT64_MAX)]
SlotName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
RequestId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:\-]{1,128}$")]
#: dense values are logged as float32: a larger magnitude would become inf, which the joiner
#: rejects (the impression would be lost after a 200)
FLOAT32_MAX = 3.4028234663852886e38
DenseValue = Annotated[float, Field(ge=-FLOAT32_MAX, le=FLOAT32_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class FeaturesIn(_Strict):
    """Named sparse slots (bags of int64 ids) and named dense values."""

    sparse: dict[SlotName, Annotated[list[FeatureId], Field(max_length=256)]] = Field(
        default_factory=dict, max_length=64,
        description="Slot -> ids. Per-item slots replace the stored item slot of the same name; "
                    "context slots replace the stored user slot of the same name.")
    dense: dict[SlotName, DenseValue] = Field(default_factory=dict, max_length=64)

    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False,
        json_schema_extra={"examples": [{"sparse": {"device": [3]}, "dense": {"hour": 14.0}}]},
    )


class CandidateIn(_Strict):
    item_id: Id
    features: FeaturesIn | None = None


class RankRequest(_Strict):
    """Rank ``candidates`` for ``user_id``. Unknown users are scored with default features.

    Features are those the served model declares: a context or candidate feature it does not
    know is a 422 naming it."""

    request_id: RequestId | None = Field(None, description="Echoed back; generated when absent. One per request: "
                                         "the joiner drops an impression whose request id another user's used.")
    user_id: Id = Field(0, description="0 = no user (traffic without users). Serving adds a user_id "
                                       "slot for a user the store does not know only if the model reads one.")
    event_time_ms: Annotated[int, Field(gt=0, le=INT64_MAX)] | None = Field(
        None, description="Unix milliseconds the request happened at (a replay's data time). When absent: "
                          "the newest event time recent requests carried (serving.event_clock_s), else now. "
                          "Outside [now - event_time.max_past_s, now + event_time.max_future_s]: 422.")
    context: FeaturesIn | None = Field(None, description="Request features shared by every candidate.")
    allow_default_features: bool = Field(
        False, description="When the feature store cannot answer in time: score with default features "
                           "(a 200 with the X-Driftline-Degraded header, its feature log not written, so "
                           "its actions join nothing) instead of a 503 with Retry-After.")
    log: StrictBool = Field(
        True, description="false: score only (a probe, a preview, an offline check). No feature log is "
                          "written, so nothing is trained on it and no action can join it, and its event "
                          "time moves no clock.")
    candidates: list[CandidateIn] = Field(
        ..., min_length=1, max_length=SCHEMA_MAX_CANDIDATES,
        description="Items to rank (at most the configured max_candidates, 1000 by default).",
    )
    shown: Annotated[int, Field(ge=1, le=SCHEMA_MAX_CANDIDATES)] | None = Field(
        None, description="How many of the answer's first items the client shows (it ranks 500 candidates, shows "
                          "10): only they are logged as impressions, so the rest, never seen, are not learned as "
                          "passed over; the answer still has every candidate, scored. Absent: all are shown.")
    first_position: Annotated[int, Field(ge=0, le=MAX_POSITION)] = Field(
        0, description="Where the answer's first item is shown: 0 for the top of a list, 20 for its second page of "
                       "20. A model with a position feature scores every candidate at this place and logs each at it "
                       "plus the candidate's place in the answer (a candidate that gives its own position keeps "
                       "it); other models ignore it.")

    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False,
        json_schema_extra={"examples": [{
            "request_id": "r-0001", "user_id": 42,
            "candidates": [{"item_id": 1193}, {"item_id": 661}, {"item_id": 914}],
        }]},
    )


class ModelVersionOut(BaseModel):
    model_id: str
    sparse_version: int = Field(description="The newest sparse version every shard has reached "
                                            "(the minimum of sparse_versions).")
    dense_version: int
    shard_count: int = Field(0, description="Shards of the trainer's sparse deltas (0: one process).")
    sparse_versions: dict[str, int] = Field(default_factory=dict, description=(
        "Shard -> the sparse version served of it (shard numbers as strings; one-process: {\"0\": v})."))


class ScoredItem(BaseModel):
    item_id: int
    score: float = Field(description="Calibrated probability (after log-odds correction).")
    raw_score: float = Field(description="The model's probability before correction.")


class RankResponse(BaseModel):
    request_id: str
    user_known: bool = Field(description="False when the user is not in the feature store.")
    model_version: ModelVersionOut
    items: list[ScoredItem] = Field(description="Sorted by score, highest first.")

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "request_id": "r-0001", "user_known": True,
        "model_version": {"model_id": "deepfm", "sparse_version": 17, "dense_version": 2,
                          "shard_count": 2, "sparse_versions": {"0": 17, "1": 18}},
        "items": [{"item_id": 661, "score": 0.031, "raw_score": 0.114},
                  {"item_id": 1193, "score": 0.02, "raw_score": 0.075}],
    }]})


class ActionIn(_Strict):
    request_id: RequestId
    item_id: Id
    action_type: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    user_id: Id = Field(0, description="The user who acted; 0 = unknown: the action still labels its impression, "
                                       "but a click without a user cannot be among the user's recent clicks "
                                       "(the recent_items feature; counted in "
                                       "driftline_serving_realtime_clicks_without_user_total).")
    event_time_ms: Annotated[int, Field(gt=0, le=INT64_MAX)] | None = Field(
        None, description="Unix milliseconds. When absent: the newest event time recent requests carried "
                          "(serving.event_clock_s), else now. Outside [now - event_time.max_past_s, "
                          "now + event_time.max_future_s]: 422."
    )


class ActionsRequest(_Strict):
    actions: list[ActionIn] = Field(..., min_length=1, max_length=1000)

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "actions": [{"request_id": "r-0001", "item_id": 661, "action_type": "click", "user_id": 42}],
    }]})


class ActionsResponse(BaseModel):
    accepted: int


class Health(BaseModel):
    status: str


class SampleRateOut(BaseModel):
    rate: float = Field(description="The negative sample rate /rank's log-odds correction uses now.")
    source: str = Field(description="slice: the served model's rate for its slice; global: its rate over "
                                    "all slices (it learned no negative of this one); unrecorded: its "
                                    "trainer recorded none, scores are uncorrected (rate 1.0).")
    slice: str = Field(description="The slice served: the model's model_id (what its feature logs carry).")


class Readiness(BaseModel):
    ready: bool
    model_loaded: bool
    feature_store: bool = Field(description="The feature store answers and holds its loaded features.")
    feature_store_emptied: bool = Field(description="The store lost the features loaded into it (Redis "
                                                    "restarted empty or was flushed): answers are marked degraded.")
    feature_store_evicted: bool = Field(description="Redis evicted keys since the features were loaded (maxmemory "
                                                    "with an allkeys-* policy): answers are marked degraded.")
    model_version: ModelVersionOut
    deltas_behind_s: float = Field(description="Seconds deltas published on param-deltas have waited unapplied "
                                               "(a worker of a serving PS: or the PS's silence); past "
                                               "serving.ready_max_behind_s the replica is not ready.")
    sparse_staleness_s: float | None
    dense_staleness_s: float | None
    feature_log_connected: bool
    feature_log_buffered: int = Field(description="Feature logs spooled, not yet acknowledged by Kafka.")
    feature_log_spool_bytes: int = Field(description="Bytes in the feature-log spool (unshipped + retained).")
    feature_log_disk_full: bool = Field(description="The spool's disk is below disk.pause_below_bytes: /rank answers 503.")
    sample_rate: SampleRateOut
