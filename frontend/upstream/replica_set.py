"""Several replicas behind one frontend: each replica is one scheduler (with its worker ranks) at
one address. The set stands in for the single scheduler's ReadinessMonitor (readiness is "any
replica is ready"; the model limits are a ready replica's) and client (ModelInfo counts the KV
blocks of every ready replica), and places each request on one replica (router.py).

    --scheduler-address A --scheduler-address B   one replica per address
    --scheduler-address name:6000                 one replica per address the name resolves to,
                                                  resolved again every RESOLVE_INTERVAL_S (a
                                                  Kubernetes headless Service)

Each replica has its own ReadinessMonitor (its own poll, its own instance id for recovery);
their health verdicts are combined into the frontend's one grpc.health.v1 status. A replica
that is not ready gets no request. rerouting.py moves a request that a replica refused
before its first token (UNAVAILABLE, RESOURCE_EXHAUSTED) on another replica, and resumes one
whose replica was lost mid-stream on another ready replica (or on the same one, restarted).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from dataclasses import dataclass, replace

import structlog
from grpc_health.v1 import health, health_pb2

from pagedserve.frontend.upstream.readiness import DEFAULT_POLL_INTERVAL_S, GENERATION_SERVICE, ReadinessMonitor
from pagedserve.frontend.upstream.router import ReplicaRouter
from pagedserve.frontend.upstream.scheduler_client import SchedulerClient, SchedulerInfo, SchedulerUnavailable

RESOLVE_INTERVAL_S = 10.0
log = structlog.get_logger()


def is_dns_name(address: str) -> bool:
    """HOST:PORT names its host (not an IP literal, not localhost): it may stand for several replicas."""
    host = address.rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host not in ("", "localhost")
    return False


def resolve(address: str) -> list[str]:
    """HOST:PORT as the HOST:PORT of each address HOST resolves to (IPv4 ones when there are any;
    itself when it does not resolve)."""
    if not is_dns_name(address):
        return [address]
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return [address]
    if any(info[0] == socket.AF_INET for info in infos):
        infos = [info for info in infos if info[0] == socket.AF_INET]
    found = []
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        resolved = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
        if resolved not in found:
            found.append(resolved)
    return found or [address]


class _ReplicaHealth:
    """What a replica's ReadinessMonitor sees as its health servicer: it records the verdict and
    tells the set (called under the monitor's lock: nothing here may call back into the monitor)."""

    def __init__(self, replica_set: ReplicaSet) -> None:
        self._set = replica_set
        self.is_serving = False

    def set(self, service: str, status) -> None:
        if service == GENERATION_SERVICE:
            self.is_serving = status == health_pb2.HealthCheckResponse.SERVING
            self._set.publish()

    def enter_graceful_shutdown(self) -> None:
        self.is_serving = False


@dataclass(eq=False)
class Replica:
    index: int
    address: str
    client: SchedulerClient
    readiness: ReadinessMonitor
    health: _ReplicaHealth
    num_in_flight: int = 0
    instance_id: str = ""  # of the scheduler the router's index describes
    is_listed: bool = True  # still named by --scheduler-address (or its DNS answer)

    @property
    def is_ready(self) -> bool:
        return self.is_listed and self.health.is_serving and self.readiness.is_ready


class ReplicaSet:
    def __init__(self, addresses: list[str], health_servicer: health.HealthServicer, *, frontend_id: str = "",
                 routing: str = "prefix", poll_interval_s: float = DEFAULT_POLL_INTERVAL_S) -> None:
        self.addresses = list(addresses)
        self.address = ",".join(addresses)
        self._health = health_servicer
        self._frontend_id = frontend_id
        self._poll_interval_s = poll_interval_s
        self.router = ReplicaRouter(routing)
        self._replicas: list[Replica] = []
        # reentrant: a new replica's ReadinessMonitor reports its health (publish) while
        # _update_members holds the lock; monitors call publish under their own lock, never the reverse
        self._lock = threading.RLock()
        self._is_shutting_down = False
        self._is_started = False
        self._stop = threading.Event()
        self._resolver: threading.Thread | None = None
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_servicer.set(GENERATION_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._update_members()

    # -- membership ---------------------------------------------------------------------------
    def _update_members(self) -> None:
        wanted = [resolved for address in self.addresses for resolved in resolve(address)]
        started: list[Replica] = []
        with self._lock:
            known = {replica.address: replica for replica in self._replicas}
            for replica in self._replicas:
                replica.is_listed = replica.address in wanted
            for address in wanted:
                if address in known:
                    continue
                client = SchedulerClient(address, frontend_id=self._frontend_id)
                replica_health = _ReplicaHealth(self)
                monitor = ReadinessMonitor(client, replica_health, poll_interval_s=self._poll_interval_s)
                replica = Replica(len(self._replicas), address, client, monitor, replica_health)
                self._replicas.append(replica)
                started.append(replica)
            is_started = self._is_started
        for replica in started:
            log.info("replica_added", replica=replica.index, address=replica.address)
            if is_started:
                replica.readiness.start()
        self.publish()

    def _resolve_periodically(self) -> None:
        while not self._stop.wait(RESOLVE_INTERVAL_S):
            self._update_members()

    @property
    def replicas(self) -> list[Replica]:
        with self._lock:
            return list(self._replicas)

    # -- ReadinessMonitor's interface ---------------------------------------------------------
    def publish(self) -> None:
        """The frontend's health: SERVING while any replica is."""
        with self._lock:
            if self._is_shutting_down:
                return
            is_serving = any(replica.is_listed and replica.health.is_serving for replica in self._replicas)
        status = health_pb2.HealthCheckResponse.SERVING if is_serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self._health.set(GENERATION_SERVICE, status)

    @property
    def info(self) -> SchedulerInfo | None:
        ready = [replica for replica in self.replicas if replica.is_ready]
        for replica in ready or self.replicas:
            info = replica.readiness.info
            if info is not None:
                return info
        return None

    @property
    def is_ready(self) -> bool:
        return any(replica.is_ready for replica in self.replicas)

    def start(self) -> None:
        with self._lock:
            self._is_started = True
        for replica in self.replicas:
            replica.readiness.start()
        self._resolver = threading.Thread(target=self._resolve_periodically, name="replica-resolver", daemon=True)
        self._resolver.start()

    def begin_drain(self) -> None:
        with self._lock:
            self._is_shutting_down = True
        self._health.set(GENERATION_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        for replica in self.replicas:
            replica.readiness.begin_drain()

    def stop(self) -> None:
        with self._lock:
            self._is_shutting_down = True
        self._stop.set()
        for replica in self.replicas:
            replica.readiness.stop()
        self._health.enter_graceful_shutdown()

    def refresh(self) -> SchedulerInfo | None:
        for replica in self.replicas:
            replica.readiness.refresh()
        return self.info if self.is_ready else None

    def require_ready(self) -> SchedulerInfo:
        info = self.info
        if self.is_ready and info is not None:
            return info
        info = self.refresh()
        if info is not None:
            return info
        raise SchedulerUnavailable(f"no scheduler replica is ready ({', '.join(r.address for r in self.replicas)})")

    # -- SchedulerClient's interface (ModelInfo, shutdown) --------------------------------------
    def get_info(self, timeout: float = 5.0) -> SchedulerInfo:
        """A ready replica's info with num_kv_blocks summed over the ready replicas. Each replica is
        asked through its ReadinessMonitor, so a replica counted here as ready is also one the
        router sends requests to from now on (not only after the monitor's next poll)."""
        infos = []
        errors = []
        for replica in self.replicas:
            if not replica.is_listed:
                continue
            info = replica.readiness.refresh()
            if info is None:
                errors.append(SchedulerUnavailable(replica.readiness.last_error))
            elif info.is_ready:
                infos.append(info)
        if not infos:
            if errors:
                raise errors[0]
            raise SchedulerUnavailable("no scheduler replica is ready")
        return replace(infos[0], num_kv_blocks=sum(info.num_kv_blocks for info in infos),
                       num_cpu_blocks=sum(info.num_cpu_blocks for info in infos))

    def close(self) -> None:
        for replica in self.replicas:
            replica.client.close()

    # -- placement ------------------------------------------------------------------------------
    def place(self, prompt_token_ids: list[int], exclude: frozenset[int] = frozenset()) -> Replica | None:
        """The replica for a request (counted in flight until release()), or None when no ready
        replica outside `exclude` is left."""
        replicas = self.replicas
        candidates = [replica.index for replica in replicas if replica.is_ready and replica.index not in exclude]
        if not candidates:
            return None
        for index in candidates:
            info = replicas[index].readiness.info
            if info is None:
                continue
            if info.block_size:
                self.router.block_size = info.block_size
            if info.instance_id != replicas[index].instance_id:  # restarted: its prefix cache is empty
                self.router.forget(index)
                replicas[index].instance_id = info.instance_id
        with self._lock:
            loads = {replica.index: replica.num_in_flight for replica in replicas}
            chosen = replicas[self.router.choose(prompt_token_ids, candidates, loads)]
            chosen.num_in_flight += 1
        return chosen

    def release(self, replica: Replica) -> None:
        with self._lock:
            replica.num_in_flight -= 1
