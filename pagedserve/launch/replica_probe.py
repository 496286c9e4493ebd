"""Whether the replica serves, as `serve` sees it: the scheduler's GetInfo `is_ready` (every rank
registered and its KV cache allocated, and the scheduler not draining), asked over the internal
gRPC port like a frontend asks it.

`serve` restarts only what was serving, refills a restart budget after a healthy period and tells
a configuration error at start-up from a crash (pagedserve.launch.supervisor); this is what it polls.
"""

from __future__ import annotations

import grpc

from pagedserve.security.bearer_auth import with_bearer
from pagedserve.security.internal_token import internal_token
from pagedserve.config.grpc_options import INTERNAL_CHANNEL_OPTIONS
from pagedserve.internal import scheduler_pb2, scheduler_pb2_grpc

PROBE_TIMEOUT_S = 0.5


class ReplicaProbe:
    def __init__(self, scheduler_address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self._timeout_s = timeout_s
        # the internal channel's options: it reconnects within 2 s to a restarted scheduler
        self._channel = with_bearer(grpc.insecure_channel(scheduler_address, options=INTERNAL_CHANNEL_OPTIONS),
                                    internal_token())
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    def is_ready(self) -> bool:
        """True when the scheduler answers that it serves; False when it does not, or does not
        answer within the timeout."""
        try:
            info = self._stub.GetInfo(scheduler_pb2.GetInfoRequest(), timeout=self._timeout_s)
        except grpc.RpcError:
            return False
        return info.is_ready

    def close(self) -> None:
        self._channel.close()
