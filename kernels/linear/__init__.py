"""pagedserve.kernels.linear: see docs/architecture.md."""
