"""pagedserve.worker.speculation: see docs/architecture.md."""
