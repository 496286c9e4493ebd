"""The torch.distributed rendezvous of a replica's tensor-parallel ranks, bound where the ranks meet.

    rank 0      binds --dist-init-address's HOST:PORT itself, listens, and hands the socket to
                its TCPStore (master_listen_fd)
    rank 1 …    connect to HOST:PORT
    then        init_process_group(store=…): NCCL on CUDA, gloo on CPU

torch's own `init_method="tcp://HOST:PORT"` makes rank 0's store listen on every interface
whatever HOST says, so a rendezvous meant for 127.0.0.1 (serve, a pod's ranks) was reachable from
the network: anyone reaching the port could join or disturb the group. Binding HOST keeps it where
the ranks are. A HOST rank 0 cannot bind (not one of its addresses: a NAT or a service address in
front of it) falls back to every interface, logged as `dist_rendezvous_on_all_interfaces`.
"""

from __future__ import annotations

import errno
import socket
from datetime import timedelta
from urllib.parse import urlsplit

from pagedserve.log import get_logger

LISTEN_BACKLOG = 128


class RendezvousAddressError(ValueError):
    """--dist-init-address is not tcp://HOST:PORT."""


def parse_rendezvous(address: str) -> tuple[str, int]:
    parts = urlsplit(address)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise RendezvousAddressError(f"--dist-init-address must be tcp://HOST:PORT, not {address!r}")
    return parts.hostname, parts.port


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or on every interface when host is not this machine's."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        if exc.errno != errno.EADDRNOTAVAIL:
            sock.close()
            raise
        get_logger(component="rendezvous").warning("dist_rendezvous_on_all_interfaces", host=host, port=port,
                                                   reason=str(exc))
        sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    sock.listen(LISTEN_BACKLOG)
    return sock


def rendezvous_store(address: str, rank: int, world_size: int, timeout_s: float):
    """The TCPStore of the ranks' rendezvous; rank 0 serves it on the address's own host. The
    store keeps rank 0's listening socket open for as long as it lives (returned with it)."""
    import torch.distributed as dist

    host, port = parse_rendezvous(address)
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout), None
    listener = bind_listener(host, port)
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                          wait_for_workers=False, master_listen_fd=listener.fileno())
    return store, listener


def init_process_group(address: str, rank: int, world_size: int, timeout_s: float, backend: str):
    """Joins the ranks' process group; returns rank 0's listening socket (None elsewhere), to be
    kept referenced for as long as the group lives."""
    import torch.distributed as dist

    store, listener = rendezvous_store(address, rank, world_size, timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return listener
