"""pagedserve.scheduler.core: see docs/architecture.md."""
