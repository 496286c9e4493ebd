from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SampleSpec(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "has_seed", "seed", "output_index", "repetition_penalty", "presence_penalty", "frequency_penalty", "num_logprobs", "num_beam_candidates", "suppress_token_ids", "prompt_token_ids", "output_token_ids", "logit_bias_token_ids", "logit_bias_values")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_BEAM_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    SUPPRESS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    has_seed: bool
    seed: int
    output_index: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    num_logprobs: int
    num_beam_candidates: int
    suppress_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., output_index: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., num_logprobs: _Optional[int] = ..., num_beam_candidates: _Optional[int] = ..., suppress_token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ...) -> None: ...

class BlockPair(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: _containers.RepeatedScalarFieldContainer[int]
    dst: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src: _Optional[_Iterable[int]] = ..., dst: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("epoch", "step_id", "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy", "seq_ids", "start_positions", "num_tokens", "token_ids", "num_blocks", "block_ids", "sample_index", "samples", "num_draft_tokens", "drafts_from_worker", "draft_start_positions", "num_draft_context_tokens", "draft_context_ids", "num_mask_rows", "token_bitmasks", "masks_follow", "continuable", "num_steps", "end_token_ids", "streams_steps", "tier_ops", "lora_slots", "lora_loads")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FROM_WORKER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_START_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_MASK_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BITMASKS_FIELD_NUMBER: _ClassVar[int]
    MASKS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    CONTINUABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_STEPS_FIELD_NUMBER: _ClassVar[int]
    TIER_OPS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LORA_LOADS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step_id: int
    blocks_to_swap_out: BlockPair
    blocks_to_swap_in: BlockPair
    blocks_to_copy: BlockPair
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    start_positions: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_blocks: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    sample_index: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[SampleSpec]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    drafts_from_worker: bool
    draft_start_positions: _containers.RepeatedScalarFieldContainer[int]
    num_draft_context_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_context_ids: _containers.RepeatedScalarFieldContainer[int]
    num_mask_rows: _containers.RepeatedScalarFieldContainer[int]
    token_bitmasks: bytes
    masks_follow: bool
    continuable: bool
    num_steps: int
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    streams_steps: bool
    tier_ops: TierOps
    lora_slots: _containers.RepeatedScalarFieldContainer[int]
    lora_loads: _containers.RepeatedCompositeFieldContainer[LoraLoad]
    def __init__(self, epoch: _Optional[int] = ..., step_id: _Optional[int] = ..., blocks_to_swap_out: _Optional[_Union[BlockPair, _Mapping]] = ..., blocks_to_swap_in: _Optional[_Union[BlockPair, _Mapping]] = ..., blocks_to_copy: _Optional[_Union[BlockPair, _Mapping]] = ..., seq_ids: _Optional[_Iterable[int]] = ..., start_positions: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_blocks: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., sample_index: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[SampleSpec, _Mapping]]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., drafts_from_worker: _Optional[bool] = ..., draft_start_positions: _Optional[_Iterable[int]] = ..., num_draft_context_tokens: _Optional[_Iterable[int]] = ..., draft_context_ids: _Optional[_Iterable[int]] = ..., num_mask_rows: _Optional[_Iterable[int]] = ..., token_bitmasks: _Optional[bytes] = ..., masks_follow: _Optional[bool] = ..., continuable: _Optional[bool] = ..., num_steps: _Optional[int] = ..., end_token_ids: _Optional[_Iterable[int]] = ..., streams_steps: _Optional[bool] = ..., tier_ops: _Optional[_Union[TierOps, _Mapping]] = ..., lora_slots: _Optional[_Iterable[int]] = ..., lora_loads: _Optional[_Iterable[_Union[LoraLoad, _Mapping]]] = ...) -> None: ...

class TierOps(_message.Message):
    __slots__ = ("save_blocks", "save_slots", "save_to_disk", "save_keys", "fetch_keys", "fetch_slots", "load_slots", "load_blocks", "delete_keys")
    SAVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SAVE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SAVE_TO_DISK_FIELD_NUMBER: _ClassVar[int]
    SAVE_KEYS_FIELD_NUMBER: _ClassVar[int]
    FETCH_KEYS_FIELD_NUMBER: _ClassVar[int]
    FETCH_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DELETE_KEYS_FIELD_NUMBER: _ClassVar[int]
    save_blocks: _containers.RepeatedScalarFieldContainer[int]
    save_slots: _containers.RepeatedScalarFieldContainer[int]
    save_to_disk: _containers.RepeatedScalarFieldContainer[bool]
    save_keys: _containers.RepeatedScalarFieldContainer[bytes]
    fetch_keys: _containers.RepeatedScalarFieldContainer[bytes]
    fetch_slots: _containers.RepeatedScalarFieldContainer[int]
    load_slots: _containers.RepeatedScalarFieldContainer[int]
    load_blocks: _containers.RepeatedScalarFieldContainer[int]
    delete_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, save_blocks: _Optional[_Iterable[int]] = ..., save_slots: _Optional[_Iterable[int]] = ..., save_to_disk: _Optional[_Iterable[bool]] = ..., save_keys: _Optional[_Iterable[bytes]] = ..., fetch_keys: _Optional[_Iterable[bytes]] = ..., fetch_slots: _Optional[_Iterable[int]] = ..., load_slots: _Optional[_Iterable[int]] = ..., load_blocks: _Optional[_Iterable[int]] = ..., delete_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StepMasks(_message.Message):
    __slots__ = ("epoch", "step_id", "token_bitmasks")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BITMASKS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step_id: int
    token_bitmasks: bytes
    def __init__(self, epoch: _Optional[int] = ..., step_id: _Optional[int] = ..., token_bitmasks: _Optional[bytes] = ...) -> None: ...

class LoraLoad(_message.Message):
    __slots__ = ("slot", "name", "path", "digest")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    slot: int
    name: str
    path: str
    digest: str
    def __init__(self, slot: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class InitCache(_message.Message):
    __slots__ = ("epoch", "num_gpu_blocks", "num_cpu_blocks", "num_host_blocks")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    num_host_blocks: int
    def __init__(self, epoch: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., num_host_blocks: _Optional[int] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason", "instance_ids")
    REASON_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    reason: str
    instance_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reason: _Optional[str] = ..., instance_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EndRun(_message.Message):
    __slots__ = ("epoch", "step_id")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step_id: int
    def __init__(self, epoch: _Optional[int] = ..., step_id: _Optional[int] = ...) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("init_cache", "step_plan", "shutdown", "step_masks", "end_run")
    INIT_CACHE_FIELD_NUMBER: _ClassVar[int]
    STEP_PLAN_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    STEP_MASKS_FIELD_NUMBER: _ClassVar[int]
    END_RUN_FIELD_NUMBER: _ClassVar[int]
    init_cache: InitCache
    step_plan: StepPlan
    shutdown: Shutdown
    step_masks: StepMasks
    end_run: EndRun
    def __init__(self, init_cache: _Optional[_Union[InitCache, _Mapping]] = ..., step_plan: _Optional[_Union[StepPlan, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., step_masks: _Optional[_Union[StepMasks, _Mapping]] = ..., end_run: _Optional[_Union[EndRun, _Mapping]] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("rank", "world_size", "num_gpu_blocks", "num_cpu_blocks", "device", "pid", "num_host_blocks", "kv_layout_id", "num_bytes_per_block", "instance_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    device: str
    pid: int
    num_host_blocks: int
    kv_layout_id: str
    num_bytes_per_block: int
    instance_id: int
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., device: _Optional[str] = ..., pid: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., kv_layout_id: _Optional[str] = ..., num_bytes_per_block: _Optional[int] = ..., instance_id: _Optional[int] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ("rank", "epoch")
    RANK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    rank: int
    epoch: int
    def __init__(self, rank: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("epoch", "step_id", "forward_seconds", "seq_ids", "token_ids", "logprobs", "num_top", "top_token_ids", "top_logprobs", "num_beam", "beam_token_ids", "beam_logprobs", "failed_seq_ids", "failure_messages", "num_steps", "run_step", "failed_fetch_keys")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_BEAM_FIELD_NUMBER: _ClassVar[int]
    BEAM_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEAM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAILED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    RUN_STEP_FIELD_NUMBER: _ClassVar[int]
    FAILED_FETCH_KEYS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step_id: int
    forward_seconds: float
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_top: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_beam: _containers.RepeatedScalarFieldContainer[int]
    beam_token_ids: _containers.RepeatedScalarFieldContainer[int]
    beam_logprobs: _containers.RepeatedScalarFieldContainer[float]
    failed_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    failure_messages: _containers.RepeatedScalarFieldContainer[str]
    num_steps: int
    run_step: int
    failed_fetch_keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, epoch: _Optional[int] = ..., step_id: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., num_top: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., num_beam: _Optional[_Iterable[int]] = ..., beam_token_ids: _Optional[_Iterable[int]] = ..., beam_logprobs: _Optional[_Iterable[float]] = ..., failed_seq_ids: _Optional[_Iterable[int]] = ..., failure_messages: _Optional[_Iterable[str]] = ..., num_steps: _Optional[int] = ..., run_step: _Optional[int] = ..., failed_fetch_keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class WorkerError(_message.Message):
    __slots__ = ("rank", "message", "pid", "instance_id")
    RANK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    message: str
    pid: int
    instance_id: int
    def __init__(self, rank: _Optional[int] = ..., message: _Optional[str] = ..., pid: _Optional[int] = ..., instance_id: _Optional[int] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("register", "ready", "step_result", "error")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STEP_RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    register: Register
    ready: Ready
    step_result: StepResult
    error: WorkerError
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., ready: _Optional[_Union[Ready, _Mapping]] = ..., step_result: _Optional[_Union[StepResult, _Mapping]] = ..., error: _Optional[_Union[WorkerError, _Mapping]] = ...) -> None: ...
