"""pagedserve.worker.models."""
