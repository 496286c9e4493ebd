"""run_frontend as its own process: serves until SIGTERM, then stops cleanly with JSON logs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.launch.serve_config import free_port
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc


def test_run_frontend_serves_until_sigterm(tokenizer_folder, scheduler_server, fake):
    port = free_port()
    code = (f"import sys; from pagedserve.frontend.config import FrontendConfig; "
            f"from pagedserve.frontend.openai.config import HttpConfig; "
            f"from pagedserve.frontend.server import run_frontend; "
            f"sys.exit(run_frontend(FrontendConfig(model_path={str(tokenizer_folder)!r}, "
            f"scheduler_address={scheduler_server.address!r}, host='127.0.0.1', port={port}, "
            f"http=HttpConfig(port=0))))")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 30
            status = None
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation"),
                                          timeout=1).status
                except grpc.RpcError:
                    status = None
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
                time.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.SERVING
            stub = generation_pb2_grpc.GenerationStub(channel)
            response = stub.Generate(pb.GenerateRequest(prompt="Hi", request_id="proc-1",
                                                        params=pb.SamplingParams(max_tokens=3)), timeout=10)
            assert len(response.completions[0].token_ids) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
    names = [event["event"] for event in events]
    assert "frontend_serving" in names and "frontend_stopped" in names
    finished = [event for event in events if event["event"] == "request_finished"]
    assert finished and finished[0]["request_id"] == "proc-1" and finished[0]["completion_tokens"] == 3
