"""pagedserve.worker."""
