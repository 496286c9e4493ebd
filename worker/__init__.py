"""pagedserve.worker: one process per GPU (tensor-parallel rank) with its model shard and KV cache;
rank 0 samples and answers.

process.py (ZeroMQ loop: register, InitCache, StepPlan -> StepResult; memory_budget.py: weights,
KV pool, swap and headroom; resident_memory.py: memory in the logs) -> model_runner.py (one step: block operations, forward, logits, sampling):
  model_input.py      a step's scheduled sequences -> flat tensors and attention metadata
  models/llama.py     the Llama family (models/llama_config.py: its config.json parameters), built
                      from parallel_layers.py, attention.py (paged attention through kernels/),
                      rotary.py and layernorm.py
  cache_engine.py     KV tensors on the device and in host swap space, their block operations
  sampler.py          the next token per SampleSpec, logprobs, beam candidates
  spec_verify.py      speculative drafts verified row by row (rejection_sampler.py: the
                      rejection sampler of speculative decoding as pure functions)
  draft_model.py      draft-model speculation: the draft model, loaded and sharded like the
                      target, its KV in the target's blocks; draft_proposer.py fills a step's
                      placeholder drafts with its proposals; draft_verify.py verifies them
                      (greedy one-hot, or the rejection sampler with the draft's q)
  model_loading.py    one model's shard built, loaded, quantized and prepacked (target and draft)
  loader.py           checkpoint tensors -> this rank's slices (gguf_weights.py for GGUF:
                      dequantized, or Q4/Q8 linear weights kept packed by quantized_linear.py)
  prepacked_weights.py after the load: bfloat16 CPU weights prepacked once for oneDNN
tensor_parallel.py: the process group and the arithmetic of splitting a dimension across ranks.
"""
