"""pagedserve.scheduler.kv.tiers: the KV tiers behind the device pool, host memory and block files on disk.

The code map: docs/architecture.md; the topic: docs/kv-tiers.md.
"""
