"""pagedserve.frontend.tokenization: see docs/architecture.md."""
