"""Hostile input on the public port of a real `serve`: a prompt of tens of megabytes is refused by
its length before it is tokenized (in little of the frontend's CPU time, and without its memory
growing), on Generate, on Tokenize and over HTTP. CPU time, not wall-clock time: what the frontend
spends on the call does not depend on what else loads the host."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from pagedserve.v1 import generation_pb2 as pb
from tests.e2e.conftest import OPENAI_API_KEY, start_server
from tests.e2e.harness import text_request, wait_for

HUGE_PROMPT_BYTES = 60 * 2**20
MAX_CPU_SECONDS = 1.0  # receiving and refusing; tokenizing the prompt would take many times more
MAX_RSS_GROWTH_BYTES = 100 * 2**20


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of the process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="module")
def fresh_server(llama_checkpoint, tmp_path_factory):
    """A serve of its own: the frontend's memory is measured from a known start."""
    server = start_server(llama_checkpoint, tmp_path_factory, "hostile", "--num-kv-blocks", "64")
    yield server
    code = server.stop()
    assert code == 0, f"serve exited with {code}:\n{server.logs()[-3000:]}"


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream", "Tokenize"])
def test_huge_prompt_is_refused_before_tokenizing(fresh_server, rpc):
    service_server = fresh_server
    frontend_pid = service_server.child_pids()["frontend"]
    rss_before = _rss_bytes(frontend_pid)
    huge = "lighthouse " * (HUGE_PROMPT_BYTES // 11)
    cpu_before = _cpu_seconds(frontend_pid)
    with pytest.raises(grpc.RpcError) as info:
        if rpc == "Generate":
            service_server.stub.Generate(text_request(huge, max_tokens=4), timeout=30)
        elif rpc == "GenerateStream":
            list(service_server.stub.GenerateStream(text_request(huge, max_tokens=4), timeout=30))
        else:
            service_server.stub.Tokenize(pb.TokenizeRequest(text=huge), timeout=30)
    cpu_seconds = _cpu_seconds(frontend_pid) - cpu_before
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bytes" in info.value.details()
    assert cpu_seconds < MAX_CPU_SECONDS, f"refused after {cpu_seconds:.2f} s of the frontend's CPU"
    print(f"{rpc}: refused after {cpu_seconds:.2f} s of the frontend's CPU")
    # the 60 MB message itself passes through gRPC's and protobuf's buffers: once the call is
    # cleaned up (a moment after its status), the frontend is back near where it was
    assert wait_for(lambda: _rss_bytes(frontend_pid) - rss_before < MAX_RSS_GROWTH_BYTES, timeout=5), \
        f"the frontend grew by {(_rss_bytes(frontend_pid) - rss_before) / 2**20:.0f} MiB"
    # an ordinary prompt is still served
    assert service_server.stub.Tokenize(pb.TokenizeRequest(text="lighthouse"), timeout=10).token_ids


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", lambda text: {"model": "tiny-chat", "prompt": text, "max_tokens": 2}),
    ("/v1/chat/completions", lambda text: {"model": "tiny-chat", "max_tokens": 2,
                                           "messages": [{"role": "user", "content": text}]}),
    ("/tokenize", lambda text: {"model": "tiny-chat", "prompt": text}),
])
def test_long_http_prompt_is_refused_before_tokenizing(openai_server, path, body):
    # under --max-request-bytes (16 MiB), far over max_model_len x 16 bytes
    text = "lighthouse " * (4 * 2**20 // 11)
    request = urllib.request.Request(openai_server.http_url + path, data=json.dumps(body(text)).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {OPENAI_API_KEY}"})
    frontend_pid = openai_server.child_pids()["frontend"]
    cpu_before = _cpu_seconds(frontend_pid)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    cpu_seconds = _cpu_seconds(frontend_pid) - cpu_before
    assert info.value.code == 400
    error = json.loads(info.value.read())["error"]
    assert "bytes" in error["message"]
    assert cpu_seconds < MAX_CPU_SECONDS, f"refused after {cpu_seconds:.2f} s of the frontend's CPU"
