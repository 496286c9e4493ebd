"""pagedserve.frontend: the stateless public gRPC frontend.

server.py (process, health, reflection, metrics) -> servicer.py (Generation RPCs) ->
validation.py, generation.py (one request against the scheduler: scheduler_client.py) ->
completion_state.py (detokenizer.py + stop_strings.py per completion); client.py is
`pagedserve generate`.
"""
