from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SparseRows(_message.Message):
    __slots__ = ("table", "dim", "keys", "values", "tombstones")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONES_FIELD_NUMBER: _ClassVar[int]
    table: str
    dim: int
    keys: bytes
    values: bytes
    tombstones: bytes
    def __init__(self, table: _Optional[str] = ..., dim: _Optional[int] = ..., keys: _Optional[bytes] = ..., values: _Optional[bytes] = ..., tombstones: _Optional[bytes] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "shape", "values")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    values: bytes
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., values: _Optional[bytes] = ...) -> None: ...

class SampleRates(_message.Message):
    __slots__ = ("global_rate", "slices")
    class SlicesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    GLOBAL_RATE_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    global_rate: float
    slices: _containers.ScalarMap[str, float]
    def __init__(self, global_rate: _Optional[float] = ..., slices: _Optional[_Mapping[str, float]] = ...) -> None: ...

class DenseParameters(_message.Message):
    __slots__ = ("tensors", "sample_rates")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATES_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    sample_rates: SampleRates
    def __init__(self, tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., sample_rates: _Optional[_Union[SampleRates, _Mapping]] = ...) -> None: ...

class ParameterDelta(_message.Message):
    __slots__ = ("model_id", "version", "chunk_index", "chunk_count", "created_at_ms", "max_event_time_ms", "shard", "shard_count", "sparse", "dense")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COUNT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENT_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    version: int
    chunk_index: int
    chunk_count: int
    created_at_ms: int
    max_event_time_ms: int
    shard: int
    shard_count: int
    sparse: SparseRows
    dense: DenseParameters
    def __init__(self, model_id: _Optional[str] = ..., version: _Optional[int] = ..., chunk_index: _Optional[int] = ..., chunk_count: _Optional[int] = ..., created_at_ms: _Optional[int] = ..., max_event_time_ms: _Optional[int] = ..., shard: _Optional[int] = ..., shard_count: _Optional[int] = ..., sparse: _Optional[_Union[SparseRows, _Mapping]] = ..., dense: _Optional[_Union[DenseParameters, _Mapping]] = ...) -> None: ...
