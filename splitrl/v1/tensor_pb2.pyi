from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "region_start", "region_shape", "offset", "data", "checksum", "version", "encoding", "length", "payload_bytes")
    class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RAW: _ClassVar[TensorChunk.Encoding]
        SPARSE: _ClassVar[TensorChunk.Encoding]
        BITMAP: _ClassVar[TensorChunk.Encoding]
    RAW: TensorChunk.Encoding
    SPARSE: TensorChunk.Encoding
    BITMAP: TensorChunk.Encoding
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    REGION_START_FIELD_NUMBER: _ClassVar[int]
    REGION_SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    region_start: _containers.RepeatedScalarFieldContainer[int]
    region_shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    checksum: int
    version: int
    encoding: TensorChunk.Encoding
    length: int
    payload_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., region_start: _Optional[_Iterable[int]] = ..., region_shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., version: _Optional[int] = ..., encoding: _Optional[_Union[TensorChunk.Encoding, str]] = ..., length: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...
