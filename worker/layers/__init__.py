"""pagedserve.worker.layers: see docs/architecture.md."""
