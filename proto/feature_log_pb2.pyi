from proto import features_pb2 as _features_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelVersion(_message.Message):
    __slots__ = ("model_id", "sparse_version", "dense_version")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SPARSE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DENSE_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    sparse_version: int
    dense_version: int
    def __init__(self, model_id: _Optional[str] = ..., sparse_version: _Optional[int] = ..., dense_version: _Optional[int] = ...) -> None: ...

class Candidate(_message.Message):
    __slots__ = ("item_id", "features", "score")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    item_id: int
    features: _features_pb2.Features
    score: float
    def __init__(self, item_id: _Optional[int] = ..., features: _Optional[_Union[_features_pb2.Features, _Mapping]] = ..., score: _Optional[float] = ...) -> None: ...

class FeatureLog(_message.Message):
    __slots__ = ("request_id", "event_time_ms", "user_id", "context", "model_version", "candidates")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    event_time_ms: int
    user_id: int
    context: _features_pb2.Features
    model_version: ModelVersion
    candidates: _containers.RepeatedCompositeFieldContainer[Candidate]
    def __init__(self, request_id: _Optional[str] = ..., event_time_ms: _Optional[int] = ..., user_id: _Optional[int] = ..., context: _Optional[_Union[_features_pb2.Features, _Mapping]] = ..., model_version: _Optional[_Union[ModelVersion, _Mapping]] = ..., candidates: _Optional[_Iterable[_Union[Candidate, _Mapping]]] = ...) -> None: ...
