"""Everything one worker rank computes for a step: block operations, forward, logits, sampling.

    runner = ModelRunner(path, device="cpu", dtype="auto", block_size=16)
    runner.load()
    num_gpu_blocks = runner.profile_num_blocks()             # or kv_cache_memory_gib=...
    runner.init_cache(num_gpu_blocks, runner.num_blocks_for_bytes(4 << 30))
    result = runner.execute(plan)        # rank 0: one SeqSample per sampling sequence

With world_size > 1 the caller initialises torch.distributed (and picks the rank's device) before
load(); every rank executes every plan, only rank 0 samples.

With a draft model (speculative_model=...) load() loads it too (draft_model.py), the KV pool's blocks
hold the draft's KV beside the target's, and a plan with drafts_from_worker has its placeholder
drafts proposed by the draft model (draft_proposer.py) before the target's forward verifies them
(draft_verify.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.adapters.lora_config import LoraConfig
from pagedserve.kernels.ops import resolve_kv_cache_dtype
from pagedserve.checkpoints.model_config import load_model_info
from pagedserve.contracts.plan_codec import attach_masks
from pagedserve.contracts.step_plan import SampleSpec, ScheduledSeq, SeqFailure, StepPlan, StepResult
from pagedserve.worker.cache_engine import (
    GIB,
    CacheEngine,
    CacheShape,
    blocks_for_bytes,
    cpu_device_blocks,
    cuda_device_blocks,
    pair_bytes_per_block,
)
from pagedserve.contracts.tier_ops import layout_dir
from pagedserve.worker.kv_tiers.layout import KvLayout, model_digest, scales_digest
from pagedserve.worker.kv_tiers.tier_store import TierStore
from pagedserve.worker.speculation.draft_model import DraftModel
from pagedserve.worker.speculation.draft_proposer import DraftProposer
from pagedserve.worker.speculation.draft_verify import sample_verifying_drafts
from pagedserve.worker.loading.hf_checkpoint import resolve_dtype
from pagedserve.worker.decode_run import DecodeRun
from pagedserve.worker.model_input import PlanError, build_model_input, mask_rows
from pagedserve.worker.loading.build import load_model
from pagedserve.worker.lora.slots import LoraSlots
from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.models.llama_native import release_native_layers
from pagedserve.worker.models.llama_config import LlamaModelConfig
from pagedserve.worker.quantization.quantizers import QuantizationConfig
from pagedserve.worker.sampler import Sampler
from pagedserve.worker.speculation.ngram_verify import sample_verifying
from pagedserve.worker.structured_output import apply_constraints
from pagedserve.worker.layers.tensor_parallel import TensorParallelGroup

DEFAULT_PROFILE_TOKENS = 2048
DEFAULT_PROFILE_SEQS = 256
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
_PROFILE_SPEC = SampleSpec(temperature=1.0, top_p=0.9, top_k=50, num_logprobs=5)  # the costliest path


class RunnerStateError(RuntimeError):
    pass


class ModelRunner:
    """One rank's model, KV cache and (rank 0) sampler.

    dtype "auto" takes the checkpoint's torch_dtype on CUDA, and on CPU bfloat16 with native bfloat16
    (pagedserve.cpu_features), else float32; max_model_len bounds
    positions (default max_position_embeddings); seed fixes the generator of unseeded sampling;
    quantization int8|int4 (with quantization_group_size for int4, default 32) quantizes the
    linear layers' weights after the load, auto keeps a GGUF's Q4_0/Q4_1/Q8_0 linear weights
    quantized as loaded, none dequantizes them (see pagedserve.worker.quantization.quantizers); kv_cache_dtype
    auto|float32|bfloat16|float16|fp8_e4m3|fp8_e5m2 is the KV cache's storage dtype (auto: the
    model's), which sets the bytes per block and so the pool's size in blocks.

    speculative_model: a draft model's checkpoint (folder or GGUF) for draft-model speculation,
    loaded with the same dtype and sharding, quantized per speculative_quantization (with
    quantization_group_size); its KV cache dtype follows kv_cache_dtype.

    lora: serve LoRA adapters (pagedserve.worker.lora.slots): the plan's lora_loads fill slots,
    each sequence's lora_slot picks the delta added to its rows.
    """

    def __init__(self, model_path: str | Path, *, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype = "auto", block_size: int = 16, rank: int = 0, world_size: int = 1,
                 max_model_len: int | None = None, seed: int | None = None, quantization: str = "none",
                 quantization_group_size: int | None = None, kv_cache_dtype: str = "auto",
                 speculative_model: str | Path | None = None, speculative_quantization: str = "none",
                 lora: LoraConfig | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        if max_model_len is not None and max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, not {max_model_len}")
        self.model_path = Path(model_path)
        self.device = torch.device(device)
        self.requested_dtype = dtype
        self.block_size = block_size
        self.rank = rank
        self.world_size = world_size
        self.max_model_len = max_model_len
        self.seed = seed
        self.quantization = QuantizationConfig(quantization, quantization_group_size)
        resolve_kv_cache_dtype(kv_cache_dtype, torch.float32)  # a bad name fails here, not after the load
        self.requested_kv_cache_dtype = kv_cache_dtype
        self.kv_cache_dtype: torch.dtype | None = None
        self.config: LlamaModelConfig | None = None
        self.model: LlamaForCausalLM | None = None
        self.cache: CacheEngine | None = None
        self.sampler: Sampler | None = None
        self.dtype: torch.dtype | None = None
        self.num_checkpoint_bytes_read = 0
        self.num_prepacked_bytes = 0
        self.draft: DraftModel | None = None
        if speculative_model is not None:
            self.draft = DraftModel(speculative_model, quantization=speculative_quantization,
                                    quantization_group_size=quantization_group_size)
        self.draft_proposer: DraftProposer | None = None
        self.tp: TensorParallelGroup | None = None
        self.tiers: TierStore | None = None
        self.lora_config = lora
        self.lora: LoraSlots | None = None
        self._decode_run: DecodeRun | None = None  # kept between plans (decode_run.py)

    def load(self) -> None:
        """Reads config.json, builds this rank's shard of the model and loads its weights."""
        self.config = LlamaModelConfig.from_folder(self.model_path)
        if isinstance(self.requested_dtype, torch.dtype):
            self.dtype = self.requested_dtype
        else:
            checkpoint_dtype = load_model_info(self.model_path).torch_dtype
            self.dtype = resolve_dtype(self.requested_dtype, checkpoint_dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(self.requested_kv_cache_dtype, self.dtype)
        tp = TensorParallelGroup(rank=self.rank, world_size=self.world_size)
        self.tp = tp
        max_positions = self.max_model_len or self.config.max_position_embeddings
        loaded = load_model(self.model_path, self.config, tp=tp, dtype=self.dtype, device=self.device,
                            max_positions=max_positions, quantization=self.quantization)
        self.model = loaded.model
        self.num_checkpoint_bytes_read = loaded.num_checkpoint_bytes_read
        self.num_prepacked_bytes = loaded.num_prepacked_bytes
        if self.rank == 0:
            self.sampler = Sampler(self.device, seed=self.seed)
        if self.lora_config is not None:
            self.lora = LoraSlots(self.model, self.lora_config, model_path=self.model_path, dtype=self.dtype,
                                  device=self.device)
        if self.draft is not None:
            self.draft.load(target_config=self.config, tp=tp, dtype=self.dtype, device=self.device,
                            max_positions=self.model.max_positions, kv_cache_dtype=self.requested_kv_cache_dtype)
            self.num_checkpoint_bytes_read += self.draft.loaded.num_checkpoint_bytes_read
            self.draft_proposer = DraftProposer(self.draft, sampler=self.sampler, tp=tp, block_size=self.block_size,
                                                device=self.device)

    def _require_model(self) -> LlamaForCausalLM:
        if self.model is None:
            raise RunnerStateError("load() must run first")
        return self.model

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of this rank's parameters of the target model (its shard; a tied LM head counted
        once) and of their prepacked copies (worker/loading/prepacked_weights.py)."""
        parameters = sum(param.numel() * param.element_size() for param in self._require_model().parameters())
        return parameters + self.num_prepacked_bytes

    @property
    def num_draft_weight_bytes(self) -> int:
        """The same for the draft model (0 without one)."""
        return self.draft.num_weight_bytes if self.draft is not None else 0

    @property
    def cache_shape(self) -> CacheShape:
        model = self._require_model()
        return CacheShape(num_layers=len(model.layers), block_size=self.block_size,
                          num_kv_heads=model.num_kv_heads_per_rank, head_size=model.head_size,
                          dtype=self.kv_cache_dtype)

    @property
    def draft_cache_shape(self) -> CacheShape | None:
        """The draft model's KV geometry on this rank (None without a draft model)."""
        self._require_model()
        return self.draft.cache_shape(self.block_size) if self.draft is not None else None

    @property
    def bytes_per_block(self) -> int:
        """A pool block's bytes on this rank: the target's KV and the draft model's."""
        return pair_bytes_per_block(self.cache_shape, self.draft_cache_shape)

    def num_blocks_for_bytes(self, num_bytes: int) -> int:
        """How many KV blocks (with their draft part) of this rank fit in num_bytes (e.g. the swap space)."""
        return blocks_for_bytes(num_bytes, self.cache_shape, self.draft_cache_shape)

    def profile_num_blocks(self, *, kv_cache_memory_gib: float | None = None,
                           max_num_batched_tokens: int = DEFAULT_PROFILE_TOKENS,
                           max_num_seqs: int = DEFAULT_PROFILE_SEQS,
                           gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> int:
        """This rank's device pool size in blocks (see pagedserve.worker.cache_engine for the rules).

        kv_cache_memory_gib, when given, is the budget itself. Otherwise, on CUDA, one forward of
        max_num_batched_tokens tokens over max_num_seqs sequences (sampling included) against a
        one-block scratch cache measures the peak memory first; on CPU a share of the host's memory.
        """
        shape, draft_shape = self.cache_shape, self.draft_cache_shape
        if kv_cache_memory_gib is not None:
            if kv_cache_memory_gib <= 0:
                raise ValueError(f"kv_cache_memory_gib must be positive, not {kv_cache_memory_gib}")
            return blocks_for_bytes(int(kv_cache_memory_gib * GIB), shape, draft_shape)
        if self.device.type != "cuda":
            return cpu_device_blocks(shape, self.num_weight_bytes + self.num_draft_weight_bytes, self.world_size,
                                     draft=draft_shape)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_forward(shape, max_num_batched_tokens, max_num_seqs)
        num_gpu_blocks = cuda_device_blocks(shape, self.device, gpu_memory_utilization, draft=draft_shape)
        torch.cuda.empty_cache()
        return num_gpu_blocks

    def _profile_forward(self, shape: CacheShape, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        model = self._require_model()
        max_len = model.max_positions
        num_seqs = max(min(max_num_seqs, max_num_batched_tokens), -(-max_num_batched_tokens // max_len))
        lengths = [max_num_batched_tokens // num_seqs] * num_seqs
        lengths[0] += max_num_batched_tokens - sum(lengths)
        seqs = [ScheduledSeq(seq_id=i, token_ids=[0] * length, start_position=0,
                             block_table=[0] * -(-length // shape.block_size), sample=_PROFILE_SPEC)
                for i, length in enumerate(lengths) if length > 0]
        scratch = [(torch.zeros(shape.block_shape(1), dtype=shape.dtype, device=self.device),
                    torch.zeros(shape.block_shape(1), dtype=shape.dtype, device=self.device))
                   for _ in range(shape.num_layers)]
        inputs = build_model_input(seqs, block_size=shape.block_size, num_blocks=1, max_positions=max_len,
                                   device=self.device)
        inputs.metadata.slot_mapping.fill_(-1)  # nothing is written into the scratch block
        with torch.inference_mode():
            logits = model.compute_logits(model(inputs.token_ids, inputs.metadata, scratch))
            if self.sampler is not None and logits is not None:
                self.sampler.sample(logits, inputs.sample_specs, inputs.sample_seq_ids, inputs.sample_positions)
            if self.draft is not None:  # its forwards hold at most as many tokens (draft_proposer.py)
                del scratch
                draft_shape = self.draft_cache_shape
                scratch = [(torch.zeros(draft_shape.block_shape(1), dtype=draft_shape.dtype, device=self.device),
                            torch.zeros(draft_shape.block_shape(1), dtype=draft_shape.dtype, device=self.device))
                           for _ in range(draft_shape.num_layers)]
                self.draft.logits(inputs.token_ids, inputs.metadata, scratch)
        del scratch, logits

    def kv_layout(self) -> KvLayout:
        """What makes this rank's KV blocks reusable (worker/kv_tiers/layout.py)."""
        model = self._require_model()
        shape = self.cache_shape
        draft = ""
        if self.draft is not None:
            draft_shape = self.draft_cache_shape
            draft = (f"{model_digest(self.draft.path)}:{draft_shape.num_layers}x{draft_shape.num_kv_heads}"
                     f"x{draft_shape.head_size}:{self.draft.quantization.method}")
        return KvLayout(model_digest=model_digest(self.model_path), dtype=str(self.dtype).removeprefix("torch."),
                        kv_cache_dtype=str(shape.dtype).removeprefix("torch."), kv_scales=scales_digest(model),
                        block_size=shape.block_size, num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
                        head_size=shape.head_size, world_size=self.world_size,
                        quantization=f"{self.quantization.method}:{self.quantization.group_size}", draft=draft)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, num_host_blocks: int = 0,
                   kv_cache_dir: str | None = None, layout: KvLayout | None = None) -> None:
        """The device pool and swap space; with num_host_blocks or kv_cache_dir, the KV tiers too."""
        self.release_cache()
        self.cache = CacheEngine(self.cache_shape, num_gpu_blocks, num_cpu_blocks, self.device,
                                 draft_shape=self.draft_cache_shape)
        if num_host_blocks or kv_cache_dir:
            layout = layout or self.kv_layout()
            folder = layout_dir(kv_cache_dir, layout.layout_id) if kv_cache_dir else None
            self.tiers = TierStore(self.cache, num_host_blocks, folder=folder, layout_id=layout.layout_id,
                                   layout=layout.describe(), rank=self.rank, tp=self.tp)

    def release_cache(self) -> None:
        """Drops the KV pool, the tiers and what holds on to them (the kept decode run, the model's
        native layer structures), so that a new pool is not allocated beside the old one."""
        self.cache = self.tiers = self._decode_run = None
        for model in (self.model, self.draft.loaded.model if self.draft is not None and self.draft.loaded else None):
            if model is not None:
                release_native_layers(model)

    def execute(self, plan: StepPlan, receive_masks: Callable[[], bytes] | None = None) -> StepResult:
        """Block operations, then the forward (the draft model's first when it proposes the drafts);
        rank 0 returns the samples, other ranks none. forward_seconds covers the draft forwards too.
        With LoRA adapters the plan's loads come first, and each sequence's rows get its slot's delta;
        sequences whose adapter could not be loaded come back as failures. A plan of plain greedy
        one-token decodes goes through the decode run kept for its sequences (decode_run.py): the
        same samples, for less of the step's Python."""
        if (result := self._execute_in_run(plan)) is not None:
            return result
        if plan.lora_loads or any(seq.lora_slot >= 0 for seq in plan.seqs):
            if self.lora is None:
                raise PlanError("the plan uses LoRA adapters, and this worker was started without --enable-lora")
            with torch.inference_mode():
                for load in plan.lora_loads:
                    self.lora.load_or_fail(load)
        if self.lora is None or not plan.seqs:
            return self._execute_step(plan, receive_masks)
        self.lora.rows_for_step(plan.seqs)
        try:
            result = self._execute_step(plan, receive_masks)
        finally:
            failed = self.lora.failed_seqs
            self.lora.clear_step()
        if failed:
            result.samples = [sample for sample in result.samples if sample.seq_id not in failed]
            result.failures += [SeqFailure(seq_id, message) for seq_id, message in failed.items()]
        return result

    def _execute_in_run(self, plan: StepPlan) -> StepResult | None:
        """plan's result through the kept decode run (a new one when plan starts another), or None
        when plan or this worker does not qualify (decode_run.py)."""
        if self.lora is not None or self.sampler is None or self.cache is None or self.model is None:
            return None
        kv_caches = self.cache.gpu_cache
        run = self._decode_run
        if run is None or not run.accepts(plan, kv_caches):
            with torch.inference_mode():
                run = self._decode_run = DecodeRun.for_plan(self.model, kv_caches, plan, self.block_size)
            if run is None:
                return None
        if torch.is_inference_mode_enabled():  # a decode run's later steps: the caller entered it once
            return run(plan)
        with torch.inference_mode():
            return run(plan)

    def steps_after(self, result: StepResult):
        """The later steps of a decode run through the kept decode run, where it computed `result`
        (DecodeRun.steps_after; continuation.py run_steps), else None."""
        run = self._decode_run
        return run.steps_after(result) if run is not None else None

    def _execute_step(self, plan: StepPlan, receive_masks: Callable[[], bytes] | None = None) -> StepResult:
        """Block operations, then the forward (the draft model's first when it proposes the drafts);
        rank 0 returns the samples, other ranks none. forward_seconds covers the draft forwards too."""
        model = self._require_model()
        if self.cache is None:
            raise RunnerStateError("init_cache() must run before execute()")
        if plan.drafts_from_worker and self.draft_proposer is None:
            raise PlanError("the plan asks for drafts from the worker's draft model, and this worker has none "
                            "(--speculative-model)")
        result = StepResult(step_id=plan.step_id, epoch=plan.epoch)
        tier_ops = plan.tier_ops
        if tier_ops is not None and self.tiers is None:
            raise PlanError("the plan has KV tier operations, and this worker has no KV tiers "
                            "(--kv-offloading-size, --kv-cache-dir)")
        if tier_ops is None:
            self.cache.execute_block_ops(plan.blocks_to_swap_out, plan.blocks_to_swap_in, plan.blocks_to_copy)
        else:  # the order of pagedserve.contracts.tier_ops
            self.tiers.save(tier_ops)
            self.cache.swap_out(plan.blocks_to_swap_out)
            result.failed_fetch_keys = self.tiers.fetch(tier_ops)
            self.cache.swap_in(plan.blocks_to_swap_in)
            self.tiers.load(tier_ops)
            self.cache.copy(plan.blocks_to_copy)
        if not plan.seqs:
            return result
        with torch.inference_mode():
            seqs, draft_probs, draft_seconds = plan.seqs, {}, 0.0
            if plan.drafts_from_worker:
                started = time.perf_counter()
                proposal = self.draft_proposer.propose(plan.seqs, self.cache)
                seqs, draft_probs = proposal.seqs, proposal.draft_probs
                draft_seconds = time.perf_counter() - started
            inputs = build_model_input(seqs, block_size=self.block_size, num_blocks=self.cache.num_gpu_blocks,
                                       max_positions=model.max_positions, device=self.device)
            started = time.perf_counter()
            hidden = model(inputs.token_ids, inputs.metadata, self.cache.gpu_cache)  # [num_sampled, hidden]
            logits = model.compute_logits(hidden) if inputs.num_sampled else None  # [num_sampled, vocab]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            result.forward_seconds = draft_seconds + time.perf_counter() - started
            if logits is not None and plan.masks_follow:  # computed by the scheduler during the forward
                if receive_masks is None:
                    raise PlanError("the plan's token bitmask rows follow it, and this runner cannot receive them")
                attach_masks(seqs, receive_masks())
                inputs.mask_row_indices, inputs.token_bitmasks = mask_rows(seqs)
            if logits is not None:  # structured output and logit_bias, before any sampling
                logits = apply_constraints(logits, inputs.mask_row_indices, inputs.token_bitmasks,
                                           inputs.sample_specs)
            if self.sampler is not None and logits is not None and draft_probs and inputs.sample_draft_ids is not None:
                result.samples, result.failures = sample_verifying_drafts(self.sampler, logits, inputs, draft_probs)
            elif self.sampler is not None and logits is not None and inputs.sample_draft_ids is not None:
                result.samples, result.failures = sample_verifying(self.sampler, logits, inputs)
            elif self.sampler is not None and logits is not None:
                result.samples, result.failures = self.sampler.sample_isolating_failures(
                    logits, inputs.sample_specs, inputs.sample_seq_ids, inputs.sample_positions)
        return result

