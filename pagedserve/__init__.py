"""pagedserve: a paged-KV-cache LLM server (frontend, scheduler and workers).

This package is what every process shares, plus the launcher; each process lives in its own
folder (frontend/, scheduler/, worker/, with kernels/ for the worker) and imports no other's.

  cli.py, supervisor.py   the `pagedserve` command; `serve` starts and stops every process
  serve_config.py         serve's options and the configs (and so the argv) of its children
  serve_preflight.py      what serve checks before starting: model splits, lengths, memory
  restart_policy.py       serve's back-off and restart budgets; replica_probe.py: is it serving
  parent_death.py         children of serve exit with it (PR_SET_PDEATHSIG)
  host_memory.py          the host's memory and the CPU defaults of KV pool and swap space
  cpu_features.py         what the CPU computes natively (--dtype auto on CPU: bfloat16 or float32)
  config_flags.py         config dataclass fields -> CLI flags, parsed args -> configs -> argv
  shared_options.py       flags several processes share; grpc_options.py: gRPC limits, keepalive
  serve_process.py        `serve` as a child process tree (tests, benchmarks, embedding)
  digest_worker.py        a torch-free worker stand-in that checks plans (scheduler tests, bench)
  request_types.py        Request, RequestOutput, CompletionDelta: frontend <-> scheduler
  scheduler_codec.py      those types <-> internal protobuf (internal/scheduler_pb2)
  sampling_params.py      resolved sampling parameters
  prefix_hash.py          the prefix cache's block keys (scheduler cache, frontend replica routing)
  step_plan.py            StepPlan and StepResult: scheduler <-> workers
  plan_codec.py           those types <-> internal protobuf (internal/step_pb2)
  model_config.py         what every process reads from a checkpoint folder (no torch)
  models/                 --model names: resolve.py, the `demo` checkpoint (demo.py,
                          tiny_checkpoint.py, tiny_tokenizer.py)
  internal_token.py, zmq_curve.py   the internal transport's secrets: the scheduler's gRPC
                          token, the ZeroMQ CURVE keys (each process only those of its role)
  log.py                  structured JSON logs
  protogen.py             regenerates internal/ and v1/ (the public API) from proto/
"""

__version__ = "0.1.0"
