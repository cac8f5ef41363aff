"""``POST /actions``: users' actions (clicks, likes, ...) onto the actions topic; a 202 means Kafka
acknowledged every one of them. They go through the replica's spool, in order with its feature
logs (:meth:`serving.feature_log.FeatureLogger.submit_actions`), which re-ships them after a broker
reset. A 503 may hide an action that is still written once Kafka answers: sending it again is safe
(the joiner and the recent clicks count an action once)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, HTTPException

from proto import Action
from services.spool import SpoolError
from serving import metrics
from serving.replica import Serving, serving_of
from serving.schemas import ActionsRequest, ActionsResponse

__all__ = ["router"]

router = APIRouter()


@router.post("/actions", response_model=ActionsResponse, status_code=202,
             summary="Record user actions (writes Action messages to the actions topic)",
             responses={422: {"description": "Invalid request (wrong types, event time out of range)"},
                        503: {"description": "Kafka unavailable"}})
async def actions(body: ActionsRequest, s: Serving = Depends(serving_of)) -> ActionsResponse:
    now = int(time.time() * 1000)
    times = [s.event_time(f"actions[{i}].event_time_ms", a.event_time_ms, now)
             for i, a in enumerate(body.actions)]
    if s.feature_log.producer is None:  # (one producer per replica, the feature log's)
        raise HTTPException(503, "Kafka unavailable: actions cannot be written now")
    messages = [(a.request_id, Action(request_id=a.request_id, item_id=a.item_id, action_type=a.action_type,
                                      event_time_ms=event_time_ms, user_id=a.user_id).SerializeToString())
                for a, event_time_ms in zip(body.actions, times)]
    timeout_s = s.options.feature_log_send_timeout_s
    try:
        await asyncio.wait_for(s.feature_log.shipped_to(s.feature_log.submit_actions(messages)), timeout_s)
    except TimeoutError:
        # (the spool still ships them: repeated, an action is recorded once)
        raise HTTPException(503, f"Kafka unavailable: no acknowledgement within {timeout_s:g} s; "
                                 "some of the actions may still be written, and sending them again is safe") from None
    except SpoolError as err:  # full (Kafka slow or down), the disk full, damaged, stopping
        raise HTTPException(503, f"actions not kept: {err}"[:300]) from None
    metrics.ACTIONS_PRODUCED.inc(len(body.actions))
    return ActionsResponse(accepted=len(body.actions))
