"""pagedserve.frontend.lora: see docs/architecture.md."""
