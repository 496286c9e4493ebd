"""pagedserve.launch: see docs/architecture.md."""
