"""Attacks on the internal edges of a real `serve` from another local process, which reads the
ports off /proc/*/cmdline: unauthenticated internal gRPC calls are refused and logged; a Submit
with a token id outside the vocabulary is INVALID_ARGUMENT (the scheduler does not trust its
frontends); sockets without the workers' CURVE key read no plan and push nothing while a stream
runs, and the stream's tokens are unaffected; each child of serve holds only the CURVE keys of its
role; a scheduler or worker started by hand on tcp:// without keys refuses to start unless told
--allow-insecure-internal-transport."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import zmq
from grpc_health.v1 import health_pb2

from pagedserve.security.bearer_auth import with_bearer
from pagedserve.internal import scheduler_pb2, scheduler_pb2_grpc, step_pb2
from pagedserve.launch.serve_config import free_port
from pagedserve.security.zmq_curve import CURVE_ENVS, ROLE_ENVS
from tests.e2e.conftest import VOCAB_SIZE, start_server
from tests.e2e.harness import assert_pool_whole, token_request, wait_for

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def server(llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "internal", "--num-kv-blocks", "128")
    yield server
    code = server.stop()
    assert code == 0, f"serve exited with {code}:\n{server.logs()[-3000:]}"


def _flag_of(pid: int, flag: str) -> str:
    """What any local user can read: a flag's value on a process's command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index(flag) + 1]


def _submit(stub, prompt: list[int], metadata=None) -> list[scheduler_pb2.SubmitResponse]:
    request = scheduler_pb2.SubmitRequest(request_id="intruder", prompt_token_ids=prompt,
                                          sampling=scheduler_pb2.Sampling(max_tokens=4, top_p=1.0, n=1, beam_width=1,
                                                                          repetition_penalty=1.0,
                                                                          length_penalty=1.0))
    return list(stub.Submit(request, timeout=30, metadata=metadata))


@pytest.mark.parametrize("metadata", [None, (("authorization", "Bearer guessed"),)], ids=["none", "wrong"])
def test_internal_calls_without_the_token_are_refused_and_logged(server, metadata):
    address = f"127.0.0.1:{_flag_of(server.child_pids()['scheduler'], '--port')}"
    with grpc.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for call in (lambda: _submit(stub, PROMPT, metadata),
                     lambda: stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10, metadata=metadata),
                     lambda: stub.GetInfo(scheduler_pb2.GetInfoRequest(), timeout=10, metadata=metadata)):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert wait_for(lambda: server.log_events_named("request_unauthenticated") >= 3, timeout=10)
    assert server.health() == health_pb2.HealthCheckResponse.SERVING


def test_submit_with_a_token_outside_the_vocabulary_is_invalid_and_nothing_crashes(server):
    scheduler_pid = server.child_pids()["scheduler"]
    address = f"127.0.0.1:{_flag_of(scheduler_pid, '--port')}"
    with with_bearer(grpc.insecure_channel(address), server.internal_token) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        for prompt in ([5, VOCAB_SIZE], [2**31]):
            with pytest.raises(grpc.RpcError) as info:
                _submit(stub, prompt)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "vocabulary" in info.value.details()
        assert _submit(stub, PROMPT)[-1].is_finished
    assert server.child_pids()["scheduler"] == scheduler_pid
    assert_pool_whole(server)


def test_the_zeromq_link_admits_no_local_intruder_and_the_stream_is_unaffected(server):
    """serve's link is CURVE: a plain socket completes no handshake (it reads no plan, pushes no
    frame); one with a key pair of its own is refused by the scheduler's ZAP handler, which logs
    it. (Frames from an admitted peer that do not parse are dropped: tests/scheduler/test_worker_link.py.)"""
    request = token_request(PROMPT, max_tokens=48, ignore_eos=True)
    expected = server.stub.Generate(request, timeout=60).completions[0].token_ids
    scheduler_pid = server.child_pids()["scheduler"]
    result_address = _flag_of(scheduler_pid, "--result-address")
    plan_address = _flag_of(scheduler_pid, "--plan-address")
    context = zmq.Context.instance()
    server_public = _env_of(server.child_pids()["worker-0"], "PAGEDSERVE_ZMQ_SERVER_PUBLIC_KEY").encode()
    own_public, own_secret = zmq.curve_keypair()
    sockets = []
    for is_keyed in (False, True):
        push, sub = context.socket(zmq.PUSH), context.socket(zmq.SUB)
        for socket in (push, sub):
            socket.setsockopt(zmq.LINGER, 0)
            if is_keyed:
                socket.curve_secretkey, socket.curve_publickey, socket.curve_serverkey = \
                    own_secret, own_public, server_public
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        push.connect(result_address)
        sub.connect(plan_address)
        sockets += [push, sub]
    received: list[int] = []

    def stream() -> None:
        for message in server.stub.GenerateStream(request, timeout=60):
            for completion in message.completions:
                received.extend(completion.token_ids)

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        frames = [b"\xff\xff\xff"] * 4 + [step_pb2.WorkerMessage(step_result=step_pb2.StepResult(
            step_id=1, epoch=1, seq_ids=[0], token_ids=[1])).SerializeToString()]
        for push in sockets[0::2]:
            for frame in frames:
                try:
                    push.send(frame, zmq.NOBLOCK)
                except zmq.Again:  # no handshake completed: nowhere to send
                    pass
        thread.join(60)
        plans_read = sum(bool(sub.poll(500)) for sub in sockets[1::2])
    finally:
        for socket in sockets:
            socket.close(0)
    assert not thread.is_alive()
    assert received == list(expected)
    assert plans_read == 0
    assert wait_for(lambda: server.log_events_named("zmq_peer_refused") >= 1, timeout=10), server.logs()[-2000:]
    assert server.log_events_named("worker_message_dropped") == 0  # nothing got as far as the scheduler
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    assert list(server.stub.Generate(request, timeout=60).completions[0].token_ids) == list(expected)


def _env_of(pid: int, name: str) -> str:
    """A variable of a process's environment (readable by its own user only, unlike its argv)."""
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        key, _, value = item.partition(b"=")
        if key == name.encode():
            return value.decode()
    raise KeyError(name)


def _environ_names(pid: int) -> set[str]:
    return {item.partition(b"=")[0].decode() for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")}


def test_each_child_of_serve_holds_only_the_curve_keys_of_its_role(server):
    pids = server.child_pids()
    held = {name: _environ_names(pid) & set(CURVE_ENVS) for name, pid in pids.items()}
    assert held["scheduler"] == {"PAGEDSERVE_ZMQ_SERVER_PUBLIC_KEY", "PAGEDSERVE_ZMQ_SERVER_SECRET_KEY",
                                 "PAGEDSERVE_ZMQ_CLIENT_PUBLIC_KEY"}
    assert held["worker-0"] == set(ROLE_ENVS["worker"]) and "PAGEDSERVE_ZMQ_SERVER_SECRET_KEY" not in held["worker-0"]
    assert held["frontend"] == set()


def _plain_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items()
            if not any(name.startswith(key) for key in CURVE_ENVS)}


def _scheduler_args(checkpoint: Path, plan: str, result: str) -> list[str]:
    return [sys.executable, "-m", "pagedserve.cli", "scheduler", "--model", str(checkpoint), "--port",
            str(free_port()), "--plan-address", plan, "--result-address", result]


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_a_tcp_link_without_curve_keys_is_refused_naming_the_fix(llama_checkpoint, role):
    plan, result = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    args = (_scheduler_args(llama_checkpoint, plan, result) if role == "scheduler" else
            [sys.executable, "-m", "pagedserve.cli", "worker", "--model", str(llama_checkpoint), "--device", "cpu",
             "--plan-address", plan, "--result-address", result])
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=_plain_env())
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--allow-insecure-internal-transport" in done.stderr and "CURVE" in done.stderr, done.stderr
    assert "python -m pagedserve.security.zmq_curve" in done.stderr


@pytest.mark.parametrize("transport", ["tcp-opted-out", "ipc"])
def test_an_unauthenticated_link_runs_with_the_opt_out_or_on_ipc_and_warns(llama_checkpoint, tmp_path, transport):
    if transport == "ipc":
        plan, result = f"ipc://{tmp_path}/plans", f"ipc://{tmp_path}/results"
        args = _scheduler_args(llama_checkpoint, plan, result)
    else:
        plan, result = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
        args = [*_scheduler_args(llama_checkpoint, plan, result), "--allow-insecure-internal-transport"]
    log_path = tmp_path / "scheduler.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=_plain_env())
    try:
        assert wait_for(lambda: "scheduler_listening" in log_path.read_text() or proc.poll() is not None,
                        timeout=120)
        assert proc.poll() is None, log_path.read_text()[-2000:]
        assert "internal_zmq_unauthenticated" in log_path.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, log_path.read_text()[-2000:]
