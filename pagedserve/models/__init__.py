"""Models pagedserve can serve by name, and the builders of small test models."""
