"""free_port never hands out a port twice in one process, even when the system offers a port
again right after it was probed (plan and result sockets on one port fail to bind)."""

from __future__ import annotations

import socket

from pagedserve.launch import serve_config
from pagedserve.launch.serve_config import free_port


def test_a_port_offered_again_is_skipped(monkeypatch):
    offered = iter([61001, 61001, 61001, 61002])

    class Probe:
        def __init__(self, *args):
            self.port = None

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            return None

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(serve_config, "_handed_out_ports", set())
    monkeypatch.setattr(socket, "socket", Probe)
    assert [free_port(), free_port()] == [61001, 61002]


def test_ports_are_distinct_and_bindable():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[-1]))
