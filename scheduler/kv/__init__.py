"""pagedserve.scheduler.kv: see docs/architecture.md."""
