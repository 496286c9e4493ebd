"""pagedserve.frontend: the stateless public gRPC frontend.

frontend_config.py (the process's settings, from which its flags derive) -> server.py (process,
health, reflection, metrics; transport.py: message size, keepalive, TLS) ->
servicer.py (Generation RPCs; request_decoding.py: requests protobuf refuses; drain.py: requests
in flight and the drain at shutdown) -> validation.py, generation.py (one request against the
scheduler: scheduler_client.py, its messages converted by pagedserve/scheduler_codec.py) ->
completion_state.py (detokenizer.py + stop_strings.py per completion); client.py is
`pagedserve generate`.
"""
