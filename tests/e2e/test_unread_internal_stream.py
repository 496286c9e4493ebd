"""A frontend that keeps its Submit stream (or its Session) to the scheduler open but stops reading
it: past --max-undelivered-bytes of unread output the scheduler aborts the request (its blocks are
freed while the stream is still open) and the request ends with RESOURCE_EXHAUSTED once the stream
is read.

The test is that frontend: it submits to the scheduler's internal port itself, reads one message
and then nothing. Its channel does not grow its HTTP/2 window (no BDP probing), so gRPC holds at
most 64 KiB for it; the request's output (16 samples of 500 tokens with 20 alternatives each,
megabytes) cannot fit there and under the cap, so the cap is reached by construction."""

from __future__ import annotations

import queue

import grpc
import pytest

from pagedserve.contracts.sampling_params import SamplingParams
from pagedserve.contracts.scheduler_codec import sampling_to_proto
from pagedserve.internal import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.security.bearer_auth import with_bearer
from tests.e2e.conftest import start_server
from tests.e2e.harness import assert_pool_whole, wait_for

MAX_UNDELIVERED_BYTES = 65536
CODES = {code.value[0]: code for code in grpc.StatusCode}


@pytest.fixture
def server(llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "unread-internal", "--num-kv-blocks", "700",
                          "--max-undelivered-bytes", str(MAX_UNDELIVERED_BYTES))
    yield server
    code = server.stop()
    assert code == 0, f"serve exited with {code}:\n{server.logs()[-3000:]}"


def _aborted_for_the_cap(server) -> bool:
    return any(event.get("event") == "request_aborted" and event.get("reason") == "undelivered_output_cap"
               for event in server.log_events())


def _unread_request() -> scheduler_pb2.SubmitRequest:
    sampling = sampling_to_proto(SamplingParams(max_tokens=500, ignore_eos=True, n=16, temperature=1.0,
                                                seed=1, logprobs=20))
    return scheduler_pb2.SubmitRequest(request_id="unread", prompt_token_ids=[5, 6, 7, 8], sampling=sampling)


def _outputs_of_submit(stub):
    """The request on its own Submit stream: its messages, then its status as an RpcError."""
    yield from stub.Submit(_unread_request(), timeout=600)


def _outputs_of_session(stub):
    """The request on a Session: its outputs, then its status as an RpcError (as Submit's would be)."""
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    outbox.put(scheduler_pb2.SessionRequest(submit=scheduler_pb2.SessionSubmit(request=_unread_request())))
    for response in stub.Session(iter(outbox.get, None), timeout=600):
        for output in response.outputs:
            if output.status_code:
                raise _Status(CODES[output.status_code], output.status_message)
            yield output.response


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize("outputs_of", [_outputs_of_submit, _outputs_of_session], ids=["submit", "session"])
def test_a_frontend_that_stops_reading_gets_its_request_aborted_at_the_cap(server, outputs_of):
    channel = with_bearer(grpc.insecure_channel(f"127.0.0.1:{server.scheduler_port}",
                                                options=[("grpc.http2.bdp_probe", 0)]), server.internal_token)
    try:
        call = outputs_of(scheduler_pb2_grpc.SchedulerStub(channel))
        first = next(call)
        assert first.prompt_tokens == 4
        # nothing more is read: the scheduler aborts the request and frees its blocks meanwhile
        assert wait_for(lambda: _aborted_for_the_cap(server), timeout=300), server.logs()[-3000:]
        assert_pool_whole(server, timeout=60)
        with pytest.raises(grpc.RpcError) as raised:
            for message in call:
                assert not message.is_finished  # the request did not run to its end
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"more than {MAX_UNDELIVERED_BYTES} bytes" in raised.value.details()
    finally:
        channel.close()
