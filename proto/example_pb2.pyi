from proto import features_pb2 as _features_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Example(_message.Message):
    __slots__ = ("example_id", "request_id", "item_id", "user_id", "labels", "features", "event_time_ms", "sample_rate", "model_id")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    EXAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    example_id: str
    request_id: str
    item_id: int
    user_id: int
    labels: _containers.ScalarMap[str, float]
    features: _features_pb2.Features
    event_time_ms: int
    sample_rate: float
    model_id: str
    def __init__(self, example_id: _Optional[str] = ..., request_id: _Optional[str] = ..., item_id: _Optional[int] = ..., user_id: _Optional[int] = ..., labels: _Optional[_Mapping[str, float]] = ..., features: _Optional[_Union[_features_pb2.Features, _Mapping]] = ..., event_time_ms: _Optional[int] = ..., sample_rate: _Optional[float] = ..., model_id: _Optional[str] = ...) -> None: ...
