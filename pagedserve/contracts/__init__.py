"""pagedserve.contracts: see docs/architecture.md."""
