"""pagedserve.checkpoints: where the checkpoint a process serves comes from (shared by every process).

resolve.py (`--model` -> a checkpoint folder or GGUF file: resolve_model; smollm2.py fetches
the real model once) -> demo.py (the built-in `demo`
model, built on first use into the cache folder) -> tiny_checkpoint.py (seeded Llama-family
checkpoints, also for tests and benchmarks) + tiny_tokenizer.py (a deterministic byte-level BPE
tokenizer folder); tiny_gguf.py writes small GGUF files for tests. Reading a folder's config.json is pagedserve.checkpoints.model_config's job.
"""
