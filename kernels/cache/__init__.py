"""pagedserve.kernels.cache: see docs/architecture.md."""
