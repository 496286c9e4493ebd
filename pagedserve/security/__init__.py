"""pagedserve.security: see docs/architecture.md."""
