"""``POST /actions``: users' actions (clicks, likes, ...) onto the actions topic; a 202 means Kafka
acknowledged every one of them, and serving keeps them a while to send again after a broker reset
(:meth:`serving.feature_log.FeatureLogger.retain_actions`). A 503 may hide an action the producer
still writes once Kafka answers: sending it again is safe (the joiner and the recent clicks count
an action once)."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, HTTPException

from proto import Action
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
    producer = s.feature_log.producer  # one producer per replica
    if producer is None:
        raise HTTPException(503, "Kafka unavailable: actions cannot be written now")
    messages = [(a.request_id, Action(request_id=a.request_id, item_id=a.item_id, action_type=a.action_type,
                                      event_time_ms=event_time_ms, user_id=a.user_id).SerializeToString())
                for a, event_time_ms in zip(body.actions, times)]
    try:
        futures = []
        for request_id, value in messages:
            futures.append(await asyncio.wait_for(
                producer.send(s.settings.topics.actions, value, key=request_id.encode()),
                s.options.feature_log_send_timeout_s))
        await asyncio.wait_for(asyncio.gather(*futures), s.options.feature_log_send_timeout_s)
    except TimeoutError:
        # (the producer may still deliver what it took: repeated, an action is recorded once)
        raise HTTPException(503, f"Kafka unavailable: no acknowledgement within {s.options.feature_log_send_timeout_s:g} s; "
                                 "some of the actions may still be written, and sending them again is safe") from None
    except Exception as err:  # noqa: BLE001 - any failure to send: a 503, never a 500
        raise HTTPException(503, f"Kafka unavailable: {type(err).__name__}: {err}"[:300]) from None
    s.feature_log.retain_actions(messages)
    metrics.ACTIONS_PRODUCED.inc(len(body.actions))
    return ActionsResponse(accepted=len(body.actions))
