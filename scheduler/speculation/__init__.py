"""pagedserve.scheduler.speculation: see docs/architecture.md."""
