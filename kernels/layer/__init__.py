"""pagedserve.kernels.layer: see docs/architecture.md."""
