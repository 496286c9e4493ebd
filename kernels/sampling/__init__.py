"""pagedserve.kernels.sampling: see docs/architecture.md."""
