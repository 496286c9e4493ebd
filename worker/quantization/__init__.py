"""pagedserve.worker.quantization: see docs/architecture.md."""
