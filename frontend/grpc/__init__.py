"""pagedserve.frontend.grpc: see docs/architecture.md."""
