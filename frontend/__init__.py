"""pagedserve.frontend."""
