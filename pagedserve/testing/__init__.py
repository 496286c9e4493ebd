"""pagedserve.testing: see docs/architecture.md."""
