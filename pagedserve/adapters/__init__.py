"""pagedserve.adapters: see docs/architecture.md."""
