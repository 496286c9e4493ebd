"""The readiness monitor asks again soon while the scheduler is not ready, and at its poll interval
once it is."""

from __future__ import annotations

import threading

from grpc_health.v1 import health, health_pb2

from pagedserve.frontend.upstream.readiness import GENERATION_SERVICE, RECOVERY_POLL_INTERVAL_S, ReadinessMonitor
from pagedserve.frontend.upstream.scheduler_client import SchedulerInfo

SERVING = health_pb2.HealthCheckResponse.SERVING


def _info(is_ready: bool) -> SchedulerInfo:
    return SchedulerInfo(is_ready=is_ready, model_name="m", max_model_len=64, vocab_size=512, block_size=16,
                         num_kv_blocks=8, num_cpu_blocks=0, tensor_parallel_size=1, max_num_seqs=4,
                         max_num_batched_tokens=64, instance_id="a")


class LoadingScheduler:
    """Answers GetInfo "not ready" `num_loading` times, then "ready"; counts the calls."""

    address = "127.0.0.1:1"

    def __init__(self, num_loading: int) -> None:
        self.num_loading = num_loading
        self.calls = 0
        self.lock = threading.Lock()

    def get_info(self, timeout: float) -> SchedulerInfo:
        with self.lock:
            self.calls += 1
            return _info(self.calls > self.num_loading)


def _status(servicer: health.HealthServicer) -> int:
    request = health_pb2.HealthCheckRequest(service=GENERATION_SERVICE)
    return servicer.Check(request, None).status


def test_a_loading_scheduler_is_asked_again_at_the_recovery_interval_not_the_poll_interval():
    scheduler = LoadingScheduler(num_loading=3)
    servicer = health.HealthServicer()
    # a poll interval no test waits out: only the faster polls while not ready can reach "ready"
    monitor = ReadinessMonitor(scheduler, servicer, poll_interval_s=3600.0)
    monitor.start()
    try:
        pause = threading.Event()
        for _ in range(int(30 / RECOVERY_POLL_INTERVAL_S)):
            if _status(servicer) == SERVING:
                break
            pause.wait(RECOVERY_POLL_INTERVAL_S)
        assert _status(servicer) == SERVING
        assert scheduler.calls == 4
        # ready: the next question waits for the poll interval
        pause.wait(5 * RECOVERY_POLL_INTERVAL_S)
        assert scheduler.calls == 4
    finally:
        monitor.stop()
