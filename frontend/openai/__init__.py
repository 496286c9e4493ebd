"""pagedserve.frontend.openai: see docs/architecture.md."""
