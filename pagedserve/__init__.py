"""pagedserve: a paged-KV-cache LLM server (frontend, scheduler and workers).

This package is what every process shares, plus the launcher; each process lives in its own
folder (frontend/, scheduler/, worker/, with kernels/ for the worker) and imports no other's.

  cli.py, supervisor.py   the `pagedserve` command; `serve` starts and stops every process
  service_options.py      command-line options shared by `serve` and the processes
  request_types.py        Request, RequestOutput, CompletionDelta: frontend <-> scheduler
  scheduler_codec.py      those types <-> internal protobuf (internal/scheduler_pb2)
  sampling_params.py      resolved sampling parameters
  step_plan.py            StepPlan and StepResult: scheduler <-> workers
  plan_codec.py           those types <-> internal protobuf (internal/step_pb2)
  model_config.py         what every process reads from a checkpoint folder (no torch)
  demo.py                 the `--model demo` checkpoint (tiny_checkpoint.py, tiny_tokenizer.py)
  log.py                  structured JSON logs
  protogen.py             regenerates internal/ and v1/ (the public API) from proto/
"""

__version__ = "0.1.0"
