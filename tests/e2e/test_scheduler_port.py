"""A scheduler whose --port is taken refuses to start and says why. gRPC servers bind with
SO_REUSEPORT unless told otherwise; a second scheduler on a port another gRPC server holds then
started, and the kernel handed it a share of the first server's new connections (a frontend's
requests, a GetStats call) at random."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent import futures

import grpc

from pagedserve.launch.serve_config import free_port


def test_a_scheduler_on_a_port_another_grpc_server_holds_exits_naming_it(llama_checkpoint, tmp_path):
    port = free_port()
    holder = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # gRPC's defaults: SO_REUSEPORT on
    assert holder.add_insecure_port(f"127.0.0.1:{port}") == port
    holder.start()
    try:
        env = {name: value for name, value in os.environ.items() if not name.startswith("PAGEDSERVE_ZMQ_")}
        done = subprocess.run(
            [sys.executable, "-m", "pagedserve.cli", "scheduler", "--model", str(llama_checkpoint),
             "--port", str(port), "--plan-address", f"ipc://{tmp_path}/plans",
             "--result-address", f"ipc://{tmp_path}/results"],
            capture_output=True, text=True, timeout=60, env=env)
    finally:
        holder.stop(None)
    events = [json.loads(line) for line in done.stdout.splitlines() + done.stderr.splitlines()
              if line.startswith("{")]
    assert done.returncode == 1, (done.stdout + done.stderr)[-2000:]
    refused = [event for event in events if event.get("event") == "scheduler_cannot_listen"]
    assert refused and refused[0]["address"] == f"127.0.0.1:{port}", events
    assert not any(event.get("event") == "scheduler_listening" for event in events)
