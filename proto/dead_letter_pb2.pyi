from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class DeadLetter(_message.Message):
    __slots__ = ("source_topic", "partition", "offset", "key", "value", "reason", "consumer", "rejected_at_ms")
    SOURCE_TOPIC_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    REJECTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    source_topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes
    reason: str
    consumer: str
    rejected_at_ms: int
    def __init__(self, source_topic: _Optional[str] = ..., partition: _Optional[int] = ..., offset: _Optional[int] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., reason: _Optional[str] = ..., consumer: _Optional[str] = ..., rejected_at_ms: _Optional[int] = ...) -> None: ...
