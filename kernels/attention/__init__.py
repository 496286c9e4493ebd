"""pagedserve.kernels.attention: see docs/architecture.md."""
