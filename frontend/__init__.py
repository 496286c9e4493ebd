"""pagedserve.frontend: the stateless public frontend (gRPC and the OpenAI-compatible HTTP API):
validates, tokenizes, admits and routes requests, detokenizes their tokens and applies stop strings.

The code map, with one line per module and a request's life across the processes:
docs/architecture.md.
"""
