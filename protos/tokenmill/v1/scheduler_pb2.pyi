import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from protos.tokenmill.v1 import common_pb2 as _common_pb2
from protos.tokenmill.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "priority", "deadline", "resumable", "owner", "target_itl_ms", "target_ttft_ms", "delta_stream_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TARGET_ITL_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    DELTA_STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _sampling_pb2.SamplingParams
    eos_token_id: int
    priority: int
    deadline: _timestamp_pb2.Timestamp
    resumable: bool
    owner: str
    target_itl_ms: float
    target_ttft_ms: float
    delta_stream_id: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., eos_token_id: _Optional[int] = ..., priority: _Optional[int] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., resumable: _Optional[bool] = ..., owner: _Optional[str] = ..., target_itl_ms: _Optional[float] = ..., target_ttft_ms: _Optional[float] = ..., delta_stream_id: _Optional[str] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "logprobs", "finished", "finish_reason", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "num_preemptions", "timings", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finished: bool
    finish_reason: _common_pb2.FinishReason
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    timings: _common_pb2.Timings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class StreamDeltasRequest(_message.Message):
    __slots__ = ("stream_id", "columns")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    columns: bool
    def __init__(self, stream_id: _Optional[str] = ..., columns: _Optional[bool] = ...) -> None: ...

class StepDeltas(_message.Message):
    __slots__ = ("deltas", "request_ids", "num_new_tokens", "token_ids", "num_output_tokens", "num_prompt_tokens", "num_cached_tokens", "num_preemptions")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[SubmitResponse]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_output_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_preemptions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, deltas: _Optional[_Iterable[_Union[SubmitResponse, _Mapping]]] = ..., request_ids: _Optional[_Iterable[str]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_output_tokens: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[_Iterable[int]] = ..., num_preemptions: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids", "reason")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: _common_pb2.FinishReason
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ("include_running_request_ids",)
    INCLUDE_RUNNING_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    include_running_request_ids: bool
    def __init__(self, include_running_request_ids: _Optional[bool] = ...) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("num_waiting_requests", "num_running_requests", "num_waiting_tokens", "num_kv_pages_total", "num_kv_pages_used", "num_kv_pages_free", "kv_utilization", "prefix_cache_hit_rate", "num_preemptions_total", "running_request_ids", "step_token_budget", "itl_target_headroom", "num_itl_target_misses_total")
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    STEP_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    ITL_TARGET_HEADROOM_FIELD_NUMBER: _ClassVar[int]
    NUM_ITL_TARGET_MISSES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    num_waiting_requests: int
    num_running_requests: int
    num_waiting_tokens: int
    num_kv_pages_total: int
    num_kv_pages_used: int
    num_kv_pages_free: int
    kv_utilization: float
    prefix_cache_hit_rate: float
    num_preemptions_total: int
    running_request_ids: _containers.RepeatedScalarFieldContainer[str]
    step_token_budget: int
    itl_target_headroom: float
    num_itl_target_misses_total: int
    def __init__(self, num_waiting_requests: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_waiting_tokens: _Optional[int] = ..., num_kv_pages_total: _Optional[int] = ..., num_kv_pages_used: _Optional[int] = ..., num_kv_pages_free: _Optional[int] = ..., kv_utilization: _Optional[float] = ..., prefix_cache_hit_rate: _Optional[float] = ..., num_preemptions_total: _Optional[int] = ..., running_request_ids: _Optional[_Iterable[str]] = ..., step_token_budget: _Optional[int] = ..., itl_target_headroom: _Optional[float] = ..., num_itl_target_misses_total: _Optional[int] = ...) -> None: ...
