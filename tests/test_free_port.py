"""free_port never hands out a port twice in one process, even when the system offers a port
again right after it was probed (plan and result sockets on one port fail to bind)."""

from __future__ import annotations

import socket

import pytest

from pagedserve.launch import serve_config
from pagedserve.launch.serve_config import PORT_RANGE_ENV, free_port


@pytest.fixture(autouse=True)
def _no_configured_range(monkeypatch):
    """The system's ranges decide, whatever band this test process was given (tests/conftest.py)."""
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)


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
    monkeypatch.setattr(serve_config, "ephemeral_port_range", lambda: None)  # the system picks
    monkeypatch.setattr(socket, "socket", Probe)
    assert [free_port(), free_port()] == [61001, 61002]


def test_ports_are_distinct_and_bindable():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[-1]))


def test_ports_are_drawn_below_the_ephemeral_range(monkeypatch):
    """Outgoing connections take local ports from the ephemeral range, so a port from it may be
    taken before the process it was given to binds it: free_port draws below the range."""
    monkeypatch.setattr(serve_config, "ephemeral_port_range", lambda: (32768, 60999))
    ports = [free_port() for _ in range(50)]
    assert all(serve_config.LOWEST_FREE_PORT <= port < 32768 for port in ports)
    assert len(set(ports)) == len(ports)


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        drawn = []

        def draw(low: int, high: int) -> int:
            drawn.append(taken)
            return taken

        monkeypatch.setattr(serve_config, "ephemeral_port_range", lambda: (taken + 10, 60999))
        monkeypatch.setattr(serve_config, "LOWEST_FREE_PORT", taken)
        monkeypatch.setattr(serve_config, "FREE_PORT_TRIES", 3)
        monkeypatch.setattr(serve_config.random, "randrange", draw)  # every candidate is the taken port
        port = free_port()
        assert drawn == [taken] * 3 and port != taken  # then the system picks one


def test_serve_never_gives_its_children_a_port_its_caller_named(tmp_path, monkeypatch):
    """A caller (a test harness, an operator's script) picks free ports for serve's frontend,
    scheduler and metrics, which stay unbound until those processes start; serve's own picks for
    its ZeroMQ sockets, made meanwhile in another process, must not land on them (the scheduler
    then failed to bind its port)."""
    from pagedserve.cli import build_parser
    from pagedserve.launch.serve_config import ServeConfig

    (tmp_path / "config.json").write_text("{}")
    named = [20001, 20002, 20003, 20004, 20005, 20006]  # frontend, http, metrics (+1), scheduler x 2
    candidates = iter([*named, 20101, 20102, 20103, 20104, 20105])
    monkeypatch.setattr(serve_config, "_handed_out_ports", set())
    monkeypatch.setattr(serve_config, "ephemeral_port_range", lambda: (32768, 60999))
    monkeypatch.setattr(serve_config.random, "randrange", lambda low, high: next(candidates))
    monkeypatch.setattr(serve_config, "resolve_model", str)
    args = build_parser(["serve"]).parse_args(
        ["serve", "--model", str(tmp_path), "--port", "20001", "--http-port", "20002", "--metrics-port", "20003",
         "--scheduler-port", "20005", "--data-parallel-size", "2"])
    serve = ServeConfig.from_args(args)
    picked = {int(address.rsplit(":", 1)[1]) for address in
              (serve.scheduler.plan_address, serve.scheduler.result_address, serve.workers[0].dist_init_address)}
    assert picked.isdisjoint(named) and len(picked) == 3


def test_a_configured_range_is_the_only_source(monkeypatch):
    """Two processes that pick ports side by side (two test processes, two deployments) each get
    their own range, so neither can pick a port the other picked and has not bound yet."""
    monkeypatch.setattr(serve_config, "_handed_out_ports", set())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv(PORT_RANGE_ENV, f"{port}-{port}")
    assert free_port() == port
    with pytest.raises(RuntimeError, match=f"{PORT_RANGE_ENV}={port}-{port}"):  # handed out: none left
        free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setenv(PORT_RANGE_ENV, f"{taken}-{taken}")
        with pytest.raises(RuntimeError, match="no free port"):
            free_port()


@pytest.mark.parametrize("value", ["20000", "a-b", "30000-20000", "0-10", "60000-70000"])
def test_a_malformed_range_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv(PORT_RANGE_ENV, value)
    with pytest.raises(ValueError, match=PORT_RANGE_ENV):
        free_port()
