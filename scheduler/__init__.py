"""pagedserve.scheduler."""
