"""pagedserve.worker.loading: see docs/architecture.md."""
