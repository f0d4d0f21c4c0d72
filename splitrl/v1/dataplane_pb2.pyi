from splitrl.v1 import sampler_pb2 as _sampler_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BulkOpen(_message.Message):
    __slots__ = ("authorization", "header", "relay_to")
    AUTHORIZATION_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RELAY_TO_FIELD_NUMBER: _ClassVar[int]
    authorization: str
    header: _sampler_pb2.PushHeader
    relay_to: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, authorization: _Optional[str] = ..., header: _Optional[_Union[_sampler_pb2.PushHeader, _Mapping]] = ..., relay_to: _Optional[_Iterable[str]] = ...) -> None: ...

class PushOutcome(_message.Message):
    __slots__ = ("data_address", "sampler_id", "code", "message", "version", "bytes_received", "seconds", "swap_seconds", "relay_failure")
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELAY_FAILURE_FIELD_NUMBER: _ClassVar[int]
    data_address: str
    sampler_id: str
    code: int
    message: str
    version: int
    bytes_received: int
    seconds: float
    swap_seconds: float
    relay_failure: bool
    def __init__(self, data_address: _Optional[str] = ..., sampler_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., version: _Optional[int] = ..., bytes_received: _Optional[int] = ..., seconds: _Optional[float] = ..., swap_seconds: _Optional[float] = ..., relay_failure: _Optional[bool] = ...) -> None: ...

class BulkReport(_message.Message):
    __slots__ = ("final", "outcomes")
    FINAL_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    final: bool
    outcomes: _containers.RepeatedCompositeFieldContainer[PushOutcome]
    def __init__(self, final: _Optional[bool] = ..., outcomes: _Optional[_Iterable[_Union[PushOutcome, _Mapping]]] = ...) -> None: ...

class BulkDecision(_message.Message):
    __slots__ = ("commit",)
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    commit: bool
    def __init__(self, commit: _Optional[bool] = ...) -> None: ...
