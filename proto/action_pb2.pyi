from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Action(_message.Message):
    __slots__ = ("request_id", "item_id", "action_type", "event_time_ms", "user_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_TYPE_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    item_id: int
    action_type: str
    event_time_ms: int
    user_id: int
    def __init__(self, request_id: _Optional[str] = ..., item_id: _Optional[int] = ..., action_type: _Optional[str] = ..., event_time_ms: _Optional[int] = ..., user_id: _Optional[int] = ...) -> None: ...
