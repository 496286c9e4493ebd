"""pagedserve.frontend: the stateless public frontend (gRPC and the OpenAI-compatible HTTP API).

frontend_config.py (the process's settings, from which its flags derive; http_config.py: the HTTP
port's) -> server.py (process, health, reflection, metrics; transport.py: message size,
keepalive, TLS) ->
  gRPC: servicer.py (Generation RPCs; request_decoding.py: requests protobuf refuses;
        public_codec.py: responses)
  HTTP: http_server.py (uvicorn on a thread) -> http_app.py (routes, API key, access log;
        http_errors.py: statuses) -> openai_serving.py (completions and chat; openai_protocol.py:
        bodies -> SamplingParams; chat_template.py; openai_responses.py, openai_streaming.py: JSON
        and SSE; generation_run.py: Generations on worker threads, read from the event loop)
both -> admission.py (draining, readiness, limits, requests in flight: drain.py; failures:
request_errors.py) -> validation.py, generation.py (one request against the scheduler:
scheduler_client.py, its messages converted by pagedserve/contracts/scheduler_codec.py; with several
replicas replica_set.py stands in for client and readiness, and replica_router.py places each
request) ->
completion_state.py (detokenizer.py + stop_strings.py per completion); metrics.py counts both,
labelled by protocol; client.py is `pagedserve generate`.
"""
