from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RewardOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REWARD_OUTCOME_SCORED: _ClassVar[RewardOutcome]
    REWARD_OUTCOME_NO_SCORE: _ClassVar[RewardOutcome]
    REWARD_OUTCOME_ERROR: _ClassVar[RewardOutcome]
    REWARD_OUTCOME_NON_FINITE: _ClassVar[RewardOutcome]
    REWARD_OUTCOME_TIMEOUT: _ClassVar[RewardOutcome]
REWARD_OUTCOME_SCORED: RewardOutcome
REWARD_OUTCOME_NO_SCORE: RewardOutcome
REWARD_OUTCOME_ERROR: RewardOutcome
REWARD_OUTCOME_NON_FINITE: RewardOutcome
REWARD_OUTCOME_TIMEOUT: RewardOutcome

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "max_new_tokens", "stop_token_ids", "seed", "has_seed", "greedy")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    has_seed: bool
    greedy: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., has_seed: _Optional[bool] = ..., greedy: _Optional[bool] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("prompt_id", "token_ids", "text", "messages", "reference", "metadata", "seed", "has_seed", "columns_json")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_JSON_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    reference: str
    metadata: _containers.ScalarMap[str, str]
    seed: int
    has_seed: bool
    columns_json: str
    def __init__(self, prompt_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., reference: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., seed: _Optional[int] = ..., has_seed: _Optional[bool] = ..., columns_json: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls_json")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_calls_json: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls_json: _Optional[str] = ...) -> None: ...

class ToolCallRecord(_message.Message):
    __slots__ = ("name", "arguments_json", "status", "seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments_json: str
    status: str
    seconds: float
    def __init__(self, name: _Optional[str] = ..., arguments_json: _Optional[str] = ..., status: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("start", "generated_tokens", "observation_tokens", "weight_versions", "tool_calls")
    START_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    start: int
    generated_tokens: int
    observation_tokens: int
    weight_versions: _containers.RepeatedScalarFieldContainer[int]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallRecord]
    def __init__(self, start: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., observation_tokens: _Optional[int] = ..., weight_versions: _Optional[_Iterable[int]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallRecord, _Mapping]]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("token_ids", "logprobs", "text", "finish_reason", "rewards", "total_reward", "reward_reasons", "weight_versions", "reward_outcomes", "model_token_mask", "turns", "messages", "episode_end")
    class RewardsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class RewardReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class RewardOutcomesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: RewardOutcome
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[RewardOutcome, str]] = ...) -> None: ...
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_REASONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REWARD_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    MODEL_TOKEN_MASK_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    EPISODE_END_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    finish_reason: str
    rewards: _containers.ScalarMap[str, float]
    total_reward: float
    reward_reasons: _containers.ScalarMap[str, str]
    weight_versions: _containers.RepeatedScalarFieldContainer[int]
    reward_outcomes: _containers.ScalarMap[str, RewardOutcome]
    model_token_mask: _containers.RepeatedScalarFieldContainer[bool]
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    episode_end: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., rewards: _Optional[_Mapping[str, float]] = ..., total_reward: _Optional[float] = ..., reward_reasons: _Optional[_Mapping[str, str]] = ..., weight_versions: _Optional[_Iterable[int]] = ..., reward_outcomes: _Optional[_Mapping[str, RewardOutcome]] = ..., model_token_mask: _Optional[_Iterable[bool]] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., episode_end: _Optional[str] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "generate_s", "score_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    GENERATE_S_FIELD_NUMBER: _ClassVar[int]
    SCORE_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    generate_s: float
    score_s: float
    def __init__(self, queue_s: _Optional[float] = ..., generate_s: _Optional[float] = ..., score_s: _Optional[float] = ...) -> None: ...
