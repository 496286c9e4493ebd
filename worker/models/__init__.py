"""pagedserve.worker.models: see docs/architecture.md."""
