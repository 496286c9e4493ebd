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
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_ABORT: FinishReason

class Sampling(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "has_seed", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop_token_ids", "ignore_eos", "n", "beam_width", "length_penalty", "logprobs", "json_schema", "json_object", "regex", "choice", "grammar", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    has_seed: bool
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    n: int
    beam_width: int
    length_penalty: float
    logprobs: int
    json_schema: str
    json_object: bool
    regex: str
    choice: ChoiceList
    grammar: str
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., n: _Optional[int] = ..., beam_width: _Optional[int] = ..., length_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[ChoiceList, _Mapping]] = ..., grammar: _Optional[str] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class ChoiceList(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class Continuation(_message.Message):
    __slots__ = ("index", "token_ids", "is_finished", "cumulative_logprob")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    is_finished: bool
    cumulative_logprob: float
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., is_finished: _Optional[bool] = ..., cumulative_logprob: _Optional[float] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "frontend_id", "continuations", "priority", "hold_output", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_ID_FIELD_NUMBER: _ClassVar[int]
    CONTINUATIONS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    HOLD_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    frontend_id: str
    continuations: _containers.RepeatedCompositeFieldContainer[Continuation]
    priority: int
    hold_output: bool
    adapter: LoraAdapter
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., frontend_id: _Optional[str] = ..., continuations: _Optional[_Iterable[_Union[Continuation, _Mapping]]] = ..., priority: _Optional[int] = ..., hold_output: _Optional[bool] = ..., adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    digest: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class CompletionDelta(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "cumulative_logprob", "finish_reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    cumulative_logprob: float
    finish_reason: FinishReason
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., cumulative_logprob: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("deltas", "prompt_tokens", "cached_prompt_tokens", "is_finished")
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    deltas: _containers.RepeatedCompositeFieldContainer[CompletionDelta]
    prompt_tokens: int
    cached_prompt_tokens: int
    is_finished: bool
    def __init__(self, deltas: _Optional[_Iterable[_Union[CompletionDelta, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., is_finished: _Optional[bool] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("submit", "cancel_request_id")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    submit: SessionSubmit
    cancel_request_id: str
    def __init__(self, submit: _Optional[_Union[SessionSubmit, _Mapping]] = ..., cancel_request_id: _Optional[str] = ...) -> None: ...

class SessionSubmit(_message.Message):
    __slots__ = ("request", "timeout")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    request: SubmitRequest
    timeout: float
    def __init__(self, request: _Optional[_Union[SubmitRequest, _Mapping]] = ..., timeout: _Optional[float] = ...) -> None: ...

class SessionOutput(_message.Message):
    __slots__ = ("request_id", "response", "status_code", "status_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: SubmitResponse
    status_code: int
    status_message: str
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[SubmitResponse, _Mapping]] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[SessionOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[SessionOutput, _Mapping]]] = ...) -> None: ...

class FinishCompletionRequest(_message.Message):
    __slots__ = ("request_id", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class FinishCompletionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerInfo(_message.Message):
    __slots__ = ("is_ready", "model_name", "max_model_len", "vocab_size", "block_size", "num_kv_blocks", "num_cpu_blocks", "tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "instance_id", "has_session")
    IS_READY_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_SESSION_FIELD_NUMBER: _ClassVar[int]
    is_ready: bool
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    num_cpu_blocks: int
    tensor_parallel_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    instance_id: str
    has_session: bool
    def __init__(self, is_ready: _Optional[bool] = ..., model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., instance_id: _Optional[str] = ..., has_session: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("max_recent_steps",)
    MAX_RECENT_STEPS_FIELD_NUMBER: _ClassVar[int]
    max_recent_steps: int
    def __init__(self, max_recent_steps: _Optional[int] = ...) -> None: ...

class StepSummary(_message.Message):
    __slots__ = ("step_id", "request_ids", "num_prefill_tokens", "num_decode_tokens", "seconds", "forward_seconds")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    num_prefill_tokens: int
    num_decode_tokens: int
    seconds: float
    forward_seconds: float
    def __init__(self, step_id: _Optional[int] = ..., request_ids: _Optional[_Iterable[str]] = ..., num_prefill_tokens: _Optional[int] = ..., num_decode_tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_swapped", "num_gpu_blocks_total", "num_gpu_blocks_free", "num_gpu_blocks_used", "num_gpu_blocks_cached", "num_cpu_blocks_total", "num_cpu_blocks_free", "num_cpu_blocks_used", "num_cpu_blocks_cached", "num_steps", "num_preemptions_swap", "num_preemptions_recompute", "num_prefix_cache_queries", "num_prefix_cache_hits", "recent_steps", "is_pool_consistent")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_SWAP_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    RECENT_STEPS_FIELD_NUMBER: _ClassVar[int]
    IS_POOL_CONSISTENT_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_swapped: int
    num_gpu_blocks_total: int
    num_gpu_blocks_free: int
    num_gpu_blocks_used: int
    num_gpu_blocks_cached: int
    num_cpu_blocks_total: int
    num_cpu_blocks_free: int
    num_cpu_blocks_used: int
    num_cpu_blocks_cached: int
    num_steps: int
    num_preemptions_swap: int
    num_preemptions_recompute: int
    num_prefix_cache_queries: int
    num_prefix_cache_hits: int
    recent_steps: _containers.RepeatedCompositeFieldContainer[StepSummary]
    is_pool_consistent: bool
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_gpu_blocks_total: _Optional[int] = ..., num_gpu_blocks_free: _Optional[int] = ..., num_gpu_blocks_used: _Optional[int] = ..., num_gpu_blocks_cached: _Optional[int] = ..., num_cpu_blocks_total: _Optional[int] = ..., num_cpu_blocks_free: _Optional[int] = ..., num_cpu_blocks_used: _Optional[int] = ..., num_cpu_blocks_cached: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_preemptions_swap: _Optional[int] = ..., num_preemptions_recompute: _Optional[int] = ..., num_prefix_cache_queries: _Optional[int] = ..., num_prefix_cache_hits: _Optional[int] = ..., recent_steps: _Optional[_Iterable[_Union[StepSummary, _Mapping]]] = ..., is_pool_consistent: _Optional[bool] = ...) -> None: ...
