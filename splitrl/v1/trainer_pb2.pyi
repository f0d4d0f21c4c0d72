from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SamplerStatus(_message.Message):
    __slots__ = ("sampler_id", "address", "weight_version", "healthy", "inflight_prompts", "last_seen_s")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    address: str
    weight_version: int
    healthy: bool
    inflight_prompts: int
    last_seen_s: float
    def __init__(self, sampler_id: _Optional[str] = ..., address: _Optional[str] = ..., weight_version: _Optional[int] = ..., healthy: _Optional[bool] = ..., inflight_prompts: _Optional[int] = ..., last_seen_s: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("run_id", "state", "step", "total_steps", "weight_version", "samplers", "tokens_per_second", "steps_per_second", "data_cursor_json", "last_metrics", "stalled")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    DATA_CURSOR_JSON_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    state: str
    step: int
    total_steps: int
    weight_version: int
    samplers: _containers.RepeatedCompositeFieldContainer[SamplerStatus]
    tokens_per_second: float
    steps_per_second: float
    data_cursor_json: str
    last_metrics: _containers.ScalarMap[str, float]
    stalled: str
    def __init__(self, run_id: _Optional[str] = ..., state: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., weight_version: _Optional[int] = ..., samplers: _Optional[_Iterable[_Union[SamplerStatus, _Mapping]]] = ..., tokens_per_second: _Optional[float] = ..., steps_per_second: _Optional[float] = ..., data_cursor_json: _Optional[str] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., stalled: _Optional[str] = ...) -> None: ...

class RegisterSamplerRequest(_message.Message):
    __slots__ = ("sampler_id", "address")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    address: str
    def __init__(self, sampler_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RegisterSamplerReply(_message.Message):
    __slots__ = ("accepted", "heartbeat_interval_s", "weight_version")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    heartbeat_interval_s: float
    weight_version: int
    def __init__(self, accepted: _Optional[bool] = ..., heartbeat_interval_s: _Optional[float] = ..., weight_version: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("sampler_id", "address", "weight_version")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    address: str
    weight_version: int
    def __init__(self, sampler_id: _Optional[str] = ..., address: _Optional[str] = ..., weight_version: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "weight_version")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    known: bool
    weight_version: int
    def __init__(self, known: _Optional[bool] = ..., weight_version: _Optional[int] = ...) -> None: ...
