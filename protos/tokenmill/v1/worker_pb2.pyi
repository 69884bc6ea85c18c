from protos.tokenmill.v1 import common_pb2 as _common_pb2
from protos.tokenmill.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetCapacityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetCapacityResponse(_message.Message):
    __slots__ = ("num_blocks", "block_size", "model_config", "device", "kv_cache_bytes", "kv_cache_sizing", "num_host_blocks", "draft_model", "columnar_steps")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_SIZING_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    COLUMNAR_STEPS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    model_config: _common_pb2.ModelConfig
    device: str
    kv_cache_bytes: int
    kv_cache_sizing: str
    num_host_blocks: int
    draft_model: str
    columnar_steps: bool
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., model_config: _Optional[_Union[_common_pb2.ModelConfig, _Mapping]] = ..., device: _Optional[str] = ..., kv_cache_bytes: _Optional[int] = ..., kv_cache_sizing: _Optional[str] = ..., num_host_blocks: _Optional[int] = ..., draft_model: _Optional[str] = ..., columnar_steps: _Optional[bool] = ...) -> None: ...

class NewRequestData(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "sampling_params", "block_ids", "num_computed_tokens", "trace_context")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling_params: _sampling_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    trace_context: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling_params: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., trace_context: _Optional[str] = ...) -> None: ...

class CachedRequestData(_message.Message):
    __slots__ = ("request_id", "new_block_ids", "num_computed_tokens", "num_dropped_block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_dropped_block_ids: int
    def __init__(self, request_id: _Optional[str] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_dropped_block_ids: _Optional[int] = ...) -> None: ...

class ScheduledTokens(_message.Message):
    __slots__ = ("request_id", "num_tokens", "spec_token_ids", "num_draft_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    spec_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., spec_token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("device_block_id", "host_block_id")
    DEVICE_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    device_block_id: int
    host_block_id: int
    def __init__(self, device_block_id: _Optional[int] = ..., host_block_id: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "num_scheduled_tokens", "finished_request_ids", "swap_out", "swap_in", "batch_request_ids", "batch_num_tokens", "cached_request_ids", "cached_num_computed_tokens", "cached_num_dropped_block_ids", "cached_num_new_block_ids", "cached_new_block_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    BATCH_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_NUM_DROPPED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_NUM_NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequestData]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequestData]
    num_scheduled_tokens: _containers.RepeatedCompositeFieldContainer[ScheduledTokens]
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    swap_out: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    swap_in: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    batch_request_ids: _containers.RepeatedScalarFieldContainer[str]
    batch_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    cached_request_ids: _containers.RepeatedScalarFieldContainer[str]
    cached_num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    cached_num_dropped_block_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_num_new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequestData, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequestData, _Mapping]]] = ..., num_scheduled_tokens: _Optional[_Iterable[_Union[ScheduledTokens, _Mapping]]] = ..., finished_request_ids: _Optional[_Iterable[str]] = ..., swap_out: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., swap_in: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., batch_request_ids: _Optional[_Iterable[str]] = ..., batch_num_tokens: _Optional[_Iterable[int]] = ..., cached_request_ids: _Optional[_Iterable[str]] = ..., cached_num_computed_tokens: _Optional[_Iterable[int]] = ..., cached_num_dropped_block_ids: _Optional[_Iterable[int]] = ..., cached_num_new_block_ids: _Optional[_Iterable[int]] = ..., cached_new_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("request_id", "token_id", "logprobs", "accepted_token_ids", "accepted_logprobs", "draft_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    logprobs: _common_pb2.TokenLogprobs
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    accepted_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., accepted_token_ids: _Optional[_Iterable[int]] = ..., accepted_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled_tokens", "forward_ns", "prompt_logprobs", "sampled_request_ids", "sampled_token_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    forward_ns: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    sampled_request_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., sampled_tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., forward_ns: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., sampled_request_ids: _Optional[_Iterable[str]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("request_id", "first_position", "entries")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_position: int
    entries: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., first_position: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ready", "num_steps_executed", "num_requests", "num_steps_queued")
    READY_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_EXECUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    num_steps_executed: int
    num_requests: int
    num_steps_queued: int
    def __init__(self, ready: _Optional[bool] = ..., num_steps_executed: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_steps_queued: _Optional[int] = ...) -> None: ...
