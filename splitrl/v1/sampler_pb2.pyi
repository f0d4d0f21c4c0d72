from splitrl.v1 import common_pb2 as _common_pb2
from splitrl.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ("include_digests",)
    INCLUDE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    include_digests: bool
    def __init__(self, include_digests: _Optional[bool] = ...) -> None: ...

class ParamInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "partition", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    partition: _containers.RepeatedScalarFieldContainer[str]
    digest: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., partition: _Optional[_Iterable[str]] = ..., digest: _Optional[str] = ...) -> None: ...

class MeshInfo(_message.Message):
    __slots__ = ("axis_names", "axis_sizes", "device_count", "platform")
    AXIS_NAMES_FIELD_NUMBER: _ClassVar[int]
    AXIS_SIZES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    axis_names: _containers.RepeatedScalarFieldContainer[str]
    axis_sizes: _containers.RepeatedScalarFieldContainer[int]
    device_count: int
    platform: str
    def __init__(self, axis_names: _Optional[_Iterable[str]] = ..., axis_sizes: _Optional[_Iterable[int]] = ..., device_count: _Optional[int] = ..., platform: _Optional[str] = ...) -> None: ...

class SamplerInfo(_message.Message):
    __slots__ = ("sampler_id", "model_fingerprint", "architecture", "model_config_json", "params", "mesh", "weight_version", "max_batch_size", "max_sequence_length", "max_chunk_bytes", "address", "instance_id", "data_address", "weights_id", "base_fingerprint", "agreed")
    class AgreedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    AGREED_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    model_fingerprint: str
    architecture: str
    model_config_json: str
    params: _containers.RepeatedCompositeFieldContainer[ParamInfo]
    mesh: MeshInfo
    weight_version: int
    max_batch_size: int
    max_sequence_length: int
    max_chunk_bytes: int
    address: str
    instance_id: str
    data_address: str
    weights_id: str
    base_fingerprint: str
    agreed: _containers.ScalarMap[str, str]
    def __init__(self, sampler_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., architecture: _Optional[str] = ..., model_config_json: _Optional[str] = ..., params: _Optional[_Iterable[_Union[ParamInfo, _Mapping]]] = ..., mesh: _Optional[_Union[MeshInfo, _Mapping]] = ..., weight_version: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., address: _Optional[str] = ..., instance_id: _Optional[str] = ..., data_address: _Optional[str] = ..., weights_id: _Optional[str] = ..., base_fingerprint: _Optional[str] = ..., agreed: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LoraAdapters(_message.Message):
    __slots__ = ("rank", "alpha", "target_modules", "base_fingerprint")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    BASE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    base_fingerprint: str
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., base_fingerprint: _Optional[str] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("version", "tensor_count", "total_bytes", "sender", "reset", "push_id", "base_id", "lora")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensor_count: int
    total_bytes: int
    sender: str
    reset: bool
    push_id: str
    base_id: str
    lora: LoraAdapters
    def __init__(self, version: _Optional[int] = ..., tensor_count: _Optional[int] = ..., total_bytes: _Optional[int] = ..., sender: _Optional[str] = ..., reset: _Optional[bool] = ..., push_id: _Optional[str] = ..., base_id: _Optional[str] = ..., lora: _Optional[_Union[LoraAdapters, _Mapping]] = ...) -> None: ...

class WeightPushMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class PushWeightsReply(_message.Message):
    __slots__ = ("version", "bytes_received", "seconds", "swap_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes_received: int
    seconds: float
    swap_seconds: float
    def __init__(self, version: _Optional[int] = ..., bytes_received: _Optional[int] = ..., seconds: _Optional[float] = ..., swap_seconds: _Optional[float] = ...) -> None: ...

class RolloutRequest(_message.Message):
    __slots__ = ("request_id", "prompts", "group_size", "sampling", "min_version", "reward_functions", "reproducible")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    REPRODUCIBLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[_common_pb2.Prompt]
    group_size: int
    sampling: _common_pb2.SamplingParams
    min_version: int
    reward_functions: _containers.RepeatedScalarFieldContainer[str]
    reproducible: bool
    def __init__(self, request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[_common_pb2.Prompt, _Mapping]]] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., min_version: _Optional[int] = ..., reward_functions: _Optional[_Iterable[str]] = ..., reproducible: _Optional[bool] = ...) -> None: ...

class ScoredGroup(_message.Message):
    __slots__ = ("request_id", "prompt_id", "prompt_token_ids", "completions", "weight_version", "timings", "sampler_id", "reference", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completions: _containers.RepeatedCompositeFieldContainer[_common_pb2.Completion]
    weight_version: int
    timings: _common_pb2.Timings
    sampler_id: str
    reference: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completions: _Optional[_Iterable[_Union[_common_pb2.Completion, _Mapping]]] = ..., weight_version: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., sampler_id: _Optional[str] = ..., reference: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling", "n")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[_common_pb2.Prompt]
    sampling: _common_pb2.SamplingParams
    n: int
    def __init__(self, prompts: _Optional[_Iterable[_Union[_common_pb2.Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., n: _Optional[int] = ...) -> None: ...

class GeneratedPrompt(_message.Message):
    __slots__ = ("prompt_id", "prompt_token_ids", "completions")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completions: _containers.RepeatedCompositeFieldContainer[_common_pb2.Completion]
    def __init__(self, prompt_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completions: _Optional[_Iterable[_Union[_common_pb2.Completion, _Mapping]]] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("outputs", "weight_version")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[GeneratedPrompt]
    weight_version: int
    def __init__(self, outputs: _Optional[_Iterable[_Union[GeneratedPrompt, _Mapping]]] = ..., weight_version: _Optional[int] = ...) -> None: ...
