"""pagedserve.worker: one process per tensor-parallel rank with its model shard and KV cache; rank 0
samples and answers.

The code map, with one line per module and a request's life across the processes:
docs/architecture.md.
"""
