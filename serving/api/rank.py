"""``POST /rank``: score a user's candidates, log what was shown (the feature log), answer them
ranked (:mod:`serving.app`'s docstring says what each status means)."""

from __future__ import annotations

import time
import uuid

import numpy as np
from fastapi import APIRouter, Depends, HTTPException, Response

from proto import ModelVersion
from serving import metrics, positions, shown
from serving.correction import correct
from serving.feature_log import features_message
from serving.feature_store import FeatureStoreError, RankFeatures
from serving.replica import Serving, serving_of
from serving.request_features import BadFeatures, Declared, check_names, dense_for, drop_unknown, logged_dense, slots_for
from serving.responses import FastJSONResponse
from serving.schemas import RankRequest, RankResponse

__all__ = ["check_features", "request_dense", "router"]

router = APIRouter()


@router.post("/rank", response_model=RankResponse, response_class=FastJSONResponse,
             summary="Rank candidate items for a user",
             responses={413: {"description": "The request's feature log would exceed the topic's message size"},
                        422: {"description": "Invalid request (empty/oversize candidates, wrong types, "
                                             "event time out of range, a feature the model does not "
                                             "declare, a dense feature it reads missing)"},
                        503: {"description": "No model loaded yet, the feature store could not answer in time, "
                                             "or the feature-log spool is full (with Retry-After)"}})
async def rank(body: RankRequest, s: Serving = Depends(serving_of)) -> Response:
    n = len(body.candidates)
    if n > s.options.max_candidates:
        raise HTTPException(422, f"candidates: {n} given, at most {s.options.max_candidates} allowed")
    event_time_ms = s.event_time("event_time_ms", body.event_time_ms, int(time.time() * 1000), body.log)
    declared = s.model.declared  # one declaration for the whole request
    cands = body.candidates
    featured = [i for i, c in enumerate(cands) if c.features is not None]  # usually none
    check_features(declared, body, s.options.unknown_features, featured)  # a 4xx whether or not a model is loaded
    if not s.deltas.loaded:
        raise HTTPException(503, "no model loaded yet: waiting for a snapshot or the delta topic")
    request_id = body.request_id or uuid.uuid4().hex
    degraded = "feature-store-emptied" if s.store_watch.emptied else \
        "feature-store-evicted" if s.store_watch.evicted else None
    item_ids = [c.item_id for c in cands]
    try:
        feats = await s.store.fetch(body.user_id, item_ids)
    except FeatureStoreError as err:
        if not body.allow_default_features:  # overload or Redis away: an error, not a wrong answer
            metrics.FEATURE_STORE_REFUSED.inc()
            s.log_limited.warning("%s: 503", err)
            raise HTTPException(503, f"{err}: retry later", headers={"Retry-After": "1"}) from None
        s.log_limited.warning("%s; scoring with default features (asked for), not logged", err)
        degraded = "feature-store"
        feats = RankFeatures(None, [], [None] * n)
    user_known = feats.user is not None
    if not user_known:
        metrics.UNKNOWN_USERS.inc()
    dense, context_dense, logged = request_dense(declared, body, feats, featured, degraded == "feature-store")
    user_slots, item_slots, keys = slots_for(declared, body.user_id, feats.user, feats.recent_items,
                                             feats.items, item_ids, feats.items_raw)
    if body.context is not None:
        user_slots.update(body.context.sparse)
    for i in featured:  # a new row: the stored one is shared (slots_for)
        item_slots[i] = {**item_slots[i], **cands[i].features.sparse}
        keys[i] = None  # its feature log is its own, not the stored item's
    scored_user, scored_items, given = user_slots, item_slots, []
    if declared.position is not None:  # every candidate at the first place, but those that give theirs
        given = positions.given_by(declared.position, item_slots, featured)
        scored_user, scored_items = positions.scored_at_first(declared.position, user_slots, item_slots, given,
                                                              body.first_position)
    version = s.version()  # read before scoring: the served version is at least this one
    raw = s.model.score(scored_user, scored_items, dense)
    # the rate the served parameters were trained under, for the slice this replica serves
    rate, _source = s.model.sample_rates.rate_for(s.model.model_id)
    scores = correct(raw, rate)
    order = np.argsort(-scores, kind="stable")
    metrics.CANDIDATES.observe(n)

    if body.log:
        if declared.position is not None:  # each candidate at the place it is answered at
            item_slots, keys = positions.logged_at_answer(declared.position, item_slots, keys, order, given,
                                                          body.first_position)
            user_slots = {k: v for k, v in user_slots.items() if k != declared.position}  # (per candidate)
        columns: tuple = (item_ids, keys, item_slots, scores.tolist(), logged)
        if (kept := shown.logged_of(order, body.shown)) is not None:  # the impressions: what the client shows
            columns = shown.take(kept, *columns)
        context = features_message(user_slots, context_dense)
        mv = ModelVersion(model_id=version.model_id, sparse_version=version.sparse_version,
                          dense_version=version.dense_version)
        encoded = s.log_encoder.encode(request_id, event_time_ms, body.user_id, context, mv, *columns)
        s.log_impression(request_id, encoded, degraded)
    else:  # score only: no impression to learn from or join
        metrics.SCORE_ONLY.inc()

    # The body is built directly (response_model documents it; re-validating 1000 items is waste).
    ranked = zip(np.asarray(item_ids, np.int64)[order].tolist(), scores[order].tolist(), raw[order].tolist())
    return FastJSONResponse({
        "request_id": request_id, "user_known": user_known, "model_version": version.model_dump(),
        "items": [{"item_id": i, "score": p, "raw_score": r} for i, p, r in ranked],
    }, headers={"X-Driftline-Degraded": degraded} if degraded is not None else None)


def check_features(declared: Declared, body: RankRequest, unknown: str = "reject",
                   featured: list[int] | None = None) -> None:
    """A 422 naming the first feature of the request the served model does not declare (unless
    ``unknown`` is "ignore": they are dropped from ``body`` and counted). ``featured``: the
    indexes of the candidates with features of their own (found here when not given)."""
    cands = body.candidates
    if featured is None:
        featured = [i for i, c in enumerate(cands) if c.features is not None]
    if unknown == "ignore":
        groups = ([body.context] if body.context is not None else []) + [cands[i].features for i in featured]
        for g in groups:
            for kind, names in (("sparse", g.sparse), ("dense", g.dense)):
                if n := drop_unknown(declared, names, dense=kind == "dense"):
                    metrics.UNKNOWN_FEATURES.labels(kind).inc(n)
    try:
        if body.context is not None:
            check_names(declared, "context.sparse", body.context.sparse)
            if declared.position is not None:
                positions.check_context(declared.position, body.context.sparse)
            check_names(declared, "context.dense", body.context.dense, dense=True)
        for i in featured:
            f = cands[i].features
            check_names(declared, f"candidates[{i}].features.sparse", f.sparse)
            check_names(declared, f"candidates[{i}].features.dense", f.dense, dense=True)
            if declared.position is not None:
                positions.check_given(declared.position, f"candidates[{i}].features.sparse", f.sparse)
    except BadFeatures as err:
        raise HTTPException(422, str(err)) from None


def request_dense(declared: Declared, body: RankRequest, feats: RankFeatures, featured: list[int],
                  degraded: bool = False
                  ) -> tuple[np.ndarray | None, dict[str, float] | None, list[dict[str, float] | None] | None]:
    """The dense input (:func:`serving.request_features.dense_for`) from the request's values over
    the store's, and what the feature log carries of them: the context's values and each
    candidate's (None: none has any); a 422 naming the first dense feature missing, unless
    ``degraded`` (the store did not answer: a missing value scores as 0, and nothing is logged)."""
    ctx = logged_dense(declared, body.context.dense if body.context is not None else None, feats.user_dense)
    own = _own(body.candidates, featured, "dense") if featured else None
    stored = feats.items_dense
    if stored is None or not declared.dense:
        cands = own
    else:
        cands = [logged_dense(declared, own[i] if own else None, d) for i, d in enumerate(stored)]
    if not declared.dense:
        return None, ctx, cands
    try:
        return dense_for(declared, ctx, cands if cands is not None else [None] * len(body.candidates),
                         0.0 if degraded else None), ctx, cands
    except BadFeatures as err:
        raise HTTPException(422, str(err)) from None


def _own(cands: list, featured: list[int], kind: str) -> list[dict | None]:
    """Each candidate's own ``features.<kind>`` (None for a candidate without features)."""
    out: list[dict | None] = [None] * len(cands)
    for i in featured:
        out[i] = getattr(cands[i].features, kind)
    return out
