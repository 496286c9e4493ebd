"""pagedserve.frontend.upstream: see docs/architecture.md."""
