from splitrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreItem(_message.Message):
    __slots__ = ("item_id", "prompt", "completion", "reference", "completion_tokens", "metadata", "truncated", "completion_raw", "columns_json", "prompt_messages", "group_id", "completion_ids", "weight_version", "completion_messages")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_RAW_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_JSON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    prompt: str
    completion: str
    reference: str
    completion_tokens: int
    metadata: _containers.ScalarMap[str, str]
    truncated: bool
    completion_raw: bytes
    columns_json: str
    prompt_messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    group_id: str
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    weight_version: int
    completion_messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    def __init__(self, item_id: _Optional[str] = ..., prompt: _Optional[str] = ..., completion: _Optional[str] = ..., reference: _Optional[str] = ..., completion_tokens: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., truncated: _Optional[bool] = ..., completion_raw: _Optional[bytes] = ..., columns_json: _Optional[str] = ..., prompt_messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., group_id: _Optional[str] = ..., completion_ids: _Optional[_Iterable[int]] = ..., weight_version: _Optional[int] = ..., completion_messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items", "functions")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    functions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ..., functions: _Optional[_Iterable[str]] = ...) -> None: ...

class ItemScore(_message.Message):
    __slots__ = ("item_id", "scores", "total", "reasons", "outcomes")
    class ScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class OutcomesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.RewardOutcome
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.RewardOutcome, str]] = ...) -> None: ...
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    item_id: str
    scores: _containers.ScalarMap[str, float]
    total: float
    reasons: _containers.ScalarMap[str, str]
    outcomes: _containers.ScalarMap[str, _common_pb2.RewardOutcome]
    def __init__(self, item_id: _Optional[str] = ..., scores: _Optional[_Mapping[str, float]] = ..., total: _Optional[float] = ..., reasons: _Optional[_Mapping[str, str]] = ..., outcomes: _Optional[_Mapping[str, _common_pb2.RewardOutcome]] = ...) -> None: ...

class ScoreReply(_message.Message):
    __slots__ = ("scores", "seconds")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[ItemScore]
    seconds: float
    def __init__(self, scores: _Optional[_Iterable[_Union[ItemScore, _Mapping]]] = ..., seconds: _Optional[float] = ...) -> None: ...

class ListRewardFunctionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RewardFunctionInfo(_message.Message):
    __slots__ = ("name", "weight", "description", "timeout_s", "style")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STYLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    weight: float
    description: str
    timeout_s: float
    style: str
    def __init__(self, name: _Optional[str] = ..., weight: _Optional[float] = ..., description: _Optional[str] = ..., timeout_s: _Optional[float] = ..., style: _Optional[str] = ...) -> None: ...

class ListRewardFunctionsReply(_message.Message):
    __slots__ = ("functions",)
    FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    functions: _containers.RepeatedCompositeFieldContainer[RewardFunctionInfo]
    def __init__(self, functions: _Optional[_Iterable[_Union[RewardFunctionInfo, _Mapping]]] = ...) -> None: ...
