"""pagedserve.scheduler.beam: see docs/architecture.md."""
