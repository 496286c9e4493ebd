"""pagedserve.config: see docs/architecture.md."""
