"""pagedserve.worker.lora: see docs/architecture.md."""
