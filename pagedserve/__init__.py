"""pagedserve: a paged-KV-cache LLM server (frontend, scheduler and workers).

This package is what every process shares, plus the launcher; each process lives in its own
folder (frontend/, scheduler/, worker/, with kernels/ for the worker) and imports no other's.
The code map, with one line per module and a request's life across the processes:
docs/architecture.md.
"""

__version__ = "0.1.0"
