"""pagedserve.kernels."""
