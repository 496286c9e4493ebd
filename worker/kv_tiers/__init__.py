"""pagedserve.worker.kv_tiers: the worker's side of the KV tiers, host slots, block files and their writer.

The code map: docs/architecture.md; the topic: docs/kv-tiers.md.
"""
