"""pagedserve.frontend.generation: see docs/architecture.md."""
