"""pagedserve.scheduler.lora: see docs/architecture.md."""
