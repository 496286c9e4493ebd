"""Slow readers of the OpenAI HTTP API against a real `serve`: a client that starts an SSE stream
and stops reading (a raw socket with a small receive buffer, so the server's writes stall) is cut
by --stream-write-timeout like a gRPC stream, and the output left unread is bounded by
--max-undelivered-messages; either way its request is aborted and its blocks freed. A client that
never reads again does not keep its connection: the frontend closes its socket at once."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import start_server
from tests.e2e.harness import PAUSE_ARGS, assert_pool_whole, wait_for

WRITE_TIMEOUT_S = 3.0
MAX_UNDELIVERED = 16
# 64 choices (the most a request may ask for) of 1000 tokens with 20 alternatives each: far more
# frames than the socket buffers hold (4 MiB at most here), so the server's writes stall on a
# client that does not read. Each step's frames are tens of KiB (64 choices of 20 alternatives), so
# the output of STALLED_AFTER_STEPS steps is more than every buffer on the way holds: once that many
# have run (or the timeout has cut it already), the write timeout test pauses the workers, and the
# request cannot finish before the timeout cuts it, however fast the host decodes.
STALLED_AFTER_STEPS = 200
BODY = {"model": "demo", "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "n": 64, "temperature": 1.0,
        "seed": 1, "logprobs": 20, "stream": True}


def _start_unread_stream(port: int) -> socket.socket:
    """Sends a streaming completion, reads the status line, then reads nothing more."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(BODY).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    head = sock.recv(64)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def _read_rest(sock: socket.socket, timeout: float = 60.0) -> bytes:
    sock.settimeout(timeout)
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _server_socket_inode(http_port: int, client_port: int) -> int | None:
    """The inode of the server's end of the connection from client_port (/proc/net/tcp), if any."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port, remote_port = (int(address.split(":")[1], 16) for address in fields[1:3])
        if (local_port, remote_port) == (http_port, client_port) and fields[9] != "0":
            return int(fields[9])
    return None


def _holds_socket(pid: int, inode: int) -> bool:
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == f"socket:[{inode}]":
                return True
        except OSError:
            pass
    return False


@pytest.fixture
def server(request, llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "slow-http", "--num-kv-blocks", "4400",
                          "--served-model-name", "demo", *PAUSE_ARGS, *request.param, http_port=True)
    yield server
    code = server.stop()
    assert code == 0, f"serve exited with {code}:\n{server.logs()[-3000:]}"


@pytest.mark.parametrize("server", [["--stream-write-timeout", str(WRITE_TIMEOUT_S)]], indirect=True)
def test_an_sse_stream_not_read_is_cut_after_the_write_timeout(server):
    started = time.monotonic()
    sock = _start_unread_stream(server.http_port)
    try:
        # paused once the writes must stall (or have already been cut): no more steps, so it cannot finish
        assert wait_for(lambda: server.log_events_named("stream_write_timeout") == 1
                        or server.stats().num_steps >= STALLED_AFTER_STEPS, timeout=120)
        with server.workers_paused():
            assert wait_for(lambda: server.log_events_named("stream_write_timeout") == 1,
                            timeout=WRITE_TIMEOUT_S + 60), server.logs()[-3000:]
            assert wait_for(lambda: server.log_events_named("request_cancelled") == 1, timeout=30)
        assert time.monotonic() - started >= WRITE_TIMEOUT_S
        assert_pool_whole(server)  # aborted before its 1000 tokens: its blocks are free
        rest = _read_rest(sock)  # what was buffered, then the connection closes: no [DONE]
        assert b"data: [DONE]" not in rest
    finally:
        sock.close()
    assert server.log_events_named("request_cancelled") == 1  # aborted, not finished
    assert server.log_events_named("stream_backlog_exceeded") == 0


@pytest.mark.parametrize("server", [["--stream-write-timeout", "600", "--max-undelivered-messages",
                                     str(MAX_UNDELIVERED)]], indirect=True)
def test_output_left_unread_beyond_the_cap_aborts_the_request(server):
    sock = _start_unread_stream(server.http_port)
    try:
        assert wait_for(lambda: server.log_events_named("stream_backlog_exceeded") == 1, timeout=60), \
            server.logs()[-3000:]
        assert_pool_whole(server)  # aborted long before the write timeout: its blocks are free
        stats = server.stats()
        assert stats.num_running == 0 and stats.num_waiting == 0
        rest = _read_rest(sock)  # the client reads on: what was queued, then the error, then [DONE]
    finally:
        sock.close()
    error_lines = [line for line in rest.split(b"\n") if line.startswith(b"data: {\"error\"")]
    assert len(error_lines) == 1, rest[-2000:]
    error = json.loads(error_lines[0].removeprefix(b"data: "))["error"]
    assert error["type"] == "rate_limit_error" and "--max-undelivered-messages" in error["message"]
    assert rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # the last chunk, then the chunked body's end
    assert server.log_events_named("stream_write_timeout") == 0


@pytest.mark.parametrize("server", [["--stream-write-timeout", str(WRITE_TIMEOUT_S)]], indirect=True)
def test_the_connection_of_a_client_that_never_reads_again_is_closed_after_the_write_timeout(server):
    """uvicorn's own close waits for the unsent bytes to drain, which they never do here: the
    frontend would hold the socket as long as the client keeps it open."""
    sock = _start_unread_stream(server.http_port)
    try:
        frontend = server.child_pids()["frontend"]
        inode = _server_socket_inode(server.http_port, sock.getsockname()[1])
        assert inode is not None and _holds_socket(frontend, inode)
        assert wait_for(lambda: server.log_events_named("stream_write_timeout") == 1, timeout=WRITE_TIMEOUT_S + 60), \
            server.logs()[-3000:]
        assert wait_for(lambda: not _holds_socket(frontend, inode), timeout=30)  # and the client reads nothing
        assert_pool_whole(server)
    finally:
        sock.close()
