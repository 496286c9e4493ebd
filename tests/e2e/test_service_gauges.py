"""The scheduler's gauges on a real `serve` are true within a second of any change, whether or not
steps run: the pool size from the start, and nothing running or used once streams are cancelled."""

from __future__ import annotations

import time

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import start_server
from tests.e2e.harness import token_request, wait_for

GAUGES = ("pagedserve_requests_running", "pagedserve_requests_waiting", "pagedserve_requests_swapped",
          "pagedserve_kv_blocks_used", "pagedserve_kv_blocks_total")


def _gauges(server) -> dict[str, float]:
    return {sample.name: sample.value for family in text_string_to_metric_families(server.metrics("scheduler"))
            for sample in family.samples if sample.name in GAUGES}


@pytest.fixture(scope="module")
def gauge_server(llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "gauges", "--num-kv-blocks", "192",
                          "--max-num-batched-tokens", "512", metrics=True)
    yield server
    assert server.stop() == 0, server.logs()[-3000:]


def _open_streams(server, num_streams: int) -> list:
    calls = [server.stub.GenerateStream(token_request([20 + i, 21, 22, 23] * 8, max_tokens=900, ignore_eos=True),
                                        timeout=300) for i in range(num_streams)]
    for call in calls:
        assert next(call).completions
    return calls


def _cancel_and_time_to_zero(server, calls) -> float:
    for call in calls:
        call.cancel()
    cancelled_at = time.monotonic()
    assert wait_for(lambda: (lambda g: g["pagedserve_requests_running"] == 0
                             and g["pagedserve_kv_blocks_used"] == 0)(_gauges(server)),
                    timeout=5, interval=0.05), _gauges(server)
    for call in calls:
        with pytest.raises(grpc.RpcError):
            list(call)
    return time.monotonic() - cancelled_at


def test_the_pool_size_shows_before_the_first_request(gauge_server):
    gauges = _gauges(gauge_server)  # no request has run on this server yet
    assert gauges["pagedserve_kv_blocks_total"] == gauge_server.stats().num_gpu_blocks_total == 192
    assert gauges["pagedserve_requests_running"] == gauges["pagedserve_kv_blocks_used"] == 0


def test_gauges_fall_to_zero_within_a_second_of_a_cancel(gauge_server):
    (call,) = calls = _open_streams(gauge_server, 1)
    gauges = _gauges(gauge_server)
    assert gauges["pagedserve_requests_running"] == 1 and gauges["pagedserve_kv_blocks_used"] > 0, gauges
    assert _cancel_and_time_to_zero(gauge_server, calls) < 1.0


def test_gauges_fall_to_zero_within_a_second_of_cancelling_many_streams(gauge_server):
    calls = _open_streams(gauge_server, 8)
    assert wait_for(lambda: _gauges(gauge_server)["pagedserve_requests_running"] == 8, timeout=10)
    assert _cancel_and_time_to_zero(gauge_server, calls) < 1.0
    stats = gauge_server.wait_idle()
    gauges = _gauges(gauge_server)
    assert gauges["pagedserve_kv_blocks_used"] == stats.num_gpu_blocks_used == 0
    assert gauges["pagedserve_requests_waiting"] == gauges["pagedserve_requests_swapped"] == 0
