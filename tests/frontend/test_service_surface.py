"""Units of the frontend's service surface: the in-flight set and its drain, transport settings,
and naming the field of a request whose strings are not UTF-8."""

from __future__ import annotations

import threading
import time

import pytest

from pagedserve.frontend.generation.drain import Draining, InFlight
from pagedserve.frontend.grpc.request_decoding import bad_utf8_field, lenient_deserializer
from pagedserve.frontend.grpc.transport import TransportConfig, TransportConfigError
from pagedserve.v1 import generation_pb2 as pb


class _Request:
    def __init__(self) -> None:
        self.is_cancelled = False

    def cancel(self) -> None:
        self.is_cancelled = True


def test_drain_waits_for_running_requests_and_refuses_new_ones():
    in_flight = InFlight()
    request = _Request()
    in_flight.enter(request)
    threading.Timer(0.2, in_flight.leave, args=(request,)).start()
    started = time.monotonic()
    assert in_flight.drain(timeout=10) == 0
    assert 0.15 < time.monotonic() - started < 5
    with pytest.raises(Draining):
        in_flight.enter(_Request())


def test_cut_cancels_what_outlives_the_timeout():
    in_flight = InFlight()
    requests = [_Request(), _Request()]
    for request in requests:
        in_flight.enter(request)
    assert in_flight.drain(timeout=0.05) == 2

    def handlers_end_once_cancelled() -> None:  # what the RPC threads do after cancel()
        while not all(request.is_cancelled for request in requests):
            time.sleep(0.01)
        for request in requests:
            assert in_flight.was_cut(request)
            in_flight.leave(request)

    assert in_flight.was_cut(requests[0]) is False
    threading.Thread(target=handlers_end_once_cancelled, daemon=True).start()
    assert in_flight.cut(timeout=5) == 0
    assert all(request.is_cancelled for request in requests)


@pytest.mark.parametrize("kwargs", [
    dict(max_message_bytes=0), dict(keepalive_time_s=0), dict(tls_cert_file="c.pem"),
    dict(tls_key_file="k.pem"), dict(tls_client_ca_file="ca.pem"),
])
def test_transport_config_refuses_incomplete_settings(kwargs):
    with pytest.raises(TransportConfigError):
        TransportConfig(**kwargs)


def test_transport_defaults_are_plaintext_with_keepalive(tmp_path):
    config = TransportConfig()
    assert config.server_credentials() is None
    options = dict(config.server_options())
    assert options["grpc.keepalive_time_ms"] == 60_000
    assert options["grpc.max_receive_message_length"] == 64 * 2**20
    missing = TransportConfig(tls_cert_file=str(tmp_path / "none.pem"), tls_key_file=str(tmp_path / "none.key"))
    with pytest.raises(TransportConfigError, match="--tls-key"):
        missing.server_credentials()


def _with_bad_utf8(request) -> bytes:
    data = request.SerializeToString()
    assert data.count(b"Q~") == 1
    return data.replace(b"Q~", b"\xff\xfe")


@pytest.mark.parametrize("request_msg, field", [
    (pb.GenerateRequest(prompt="Q~"), "prompt"),
    (pb.GenerateRequest(request_id="Q~", prompt="hi"), "request_id"),
    (pb.GenerateRequest(prompt="hi", params=pb.SamplingParams(stop=["a", "b", "Q~"])), "params.stop[2]"),
])
def test_bad_utf8_field_is_named(request_msg, field):
    data = _with_bad_utf8(request_msg)
    assert bad_utf8_field(pb.GenerateRequest, data) == field
    decoded = lenient_deserializer(pb.GenerateRequest)(data)
    assert decoded.message == f"{field}: not valid UTF-8"


def test_corrupt_bytes_are_undecodable_without_a_field():
    decoded = lenient_deserializer(pb.GenerateRequest)(b"\xff\xff\xff")
    assert decoded.field_name == "" and decoded.message.startswith("undecodable request")
    valid = pb.GenerateRequest(prompt="fine")
    assert lenient_deserializer(pb.GenerateRequest)(valid.SerializeToString()) == valid
