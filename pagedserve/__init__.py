"""pagedserve: a paged-KV-cache LLM server (frontend, scheduler and workers)."""

__version__ = "0.1.0"
