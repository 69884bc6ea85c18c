from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class KvCachePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CACHE_POLICY_UNSPECIFIED: _ClassVar[KvCachePolicy]
    KV_CACHE_POLICY_PAGED: _ClassVar[KvCachePolicy]
    KV_CACHE_POLICY_STATIC: _ClassVar[KvCachePolicy]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
KV_CACHE_POLICY_UNSPECIFIED: KvCachePolicy
KV_CACHE_POLICY_PAGED: KvCachePolicy
KV_CACHE_POLICY_STATIC: KvCachePolicy

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ns", "time_to_first_token_ns", "decode_ns", "e2e_ns", "first_token_forward_ns")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NS_FIELD_NUMBER: _ClassVar[int]
    E2E_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    time_to_first_token_ns: int
    decode_ns: int
    e2e_ns: int
    first_token_forward_ns: int
    def __init__(self, queue_ns: _Optional[int] = ..., time_to_first_token_ns: _Optional[int] = ..., decode_ns: _Optional[int] = ..., e2e_ns: _Optional[int] = ..., first_token_forward_ns: _Optional[int] = ...) -> None: ...

class ModelConfig(_message.Message):
    __slots__ = ("name", "architecture", "vocab_size", "max_context_length", "num_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_kv_heads", "head_dim", "rope_theta", "eos_token_id", "bos_token_id", "dtype", "quantization", "has_chat_template", "sliding_window")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    ROPE_THETA_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    vocab_size: int
    max_context_length: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    eos_token_id: int
    bos_token_id: int
    dtype: str
    quantization: str
    has_chat_template: bool
    sliding_window: int
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., rope_theta: _Optional[float] = ..., eos_token_id: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., has_chat_template: _Optional[bool] = ..., sliding_window: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_config", "block_size", "num_blocks", "kv_cache_policy", "device")
    MODEL_CONFIG_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_POLICY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    model_config: ModelConfig
    block_size: int
    num_blocks: int
    kv_cache_policy: KvCachePolicy
    device: str
    def __init__(self, model_config: _Optional[_Union[ModelConfig, _Mapping]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., kv_cache_policy: _Optional[_Union[KvCachePolicy, str]] = ..., device: _Optional[str] = ...) -> None: ...
