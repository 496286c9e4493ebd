"""pagedserve.kernels.native: see docs/architecture.md."""
