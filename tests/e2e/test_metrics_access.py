"""Who reaches the Prometheus endpoints: with the API on every interface (--host 0.0.0.0) both
/metrics ports stay on loopback unless --metrics-host says otherwise, and with
PAGEDSERVE_METRICS_TOKEN set a scrape without `Authorization: Bearer TOKEN` gets 401 while one with
it gets the pinned metrics."""

from __future__ import annotations

import urllib.error
from pathlib import Path

import pytest

from tests.e2e.conftest import start_server

TOKEN = "scrape-secret"
PINNED = {"frontend": "pagedserve_requests_total", "scheduler": "pagedserve_kv_blocks_total"}


def _listening_hosts(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) listening on port."""
    hosts = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            host, local_port = fields[1].rsplit(":", 1)
            if int(local_port, 16) == port and fields[3] == "0A":
                hosts.append(host)
    return hosts


def test_metrics_stay_on_loopback_and_ask_for_the_token(llama_checkpoint, tmp_path_factory):
    server = start_server(llama_checkpoint, tmp_path_factory, "metrics-access", "--host", "0.0.0.0",
                          "--num-kv-blocks", "64", metrics=True, env={"PAGEDSERVE_METRICS_TOKEN": TOKEN})
    try:
        assert set("".join(_listening_hosts(server.port))) == {"0"}  # the API: every interface (0.0.0.0 or ::)
        for port in (server.metrics_port, server.scheduler_metrics_port):
            assert _listening_hosts(port) == ["0100007F"]  # /metrics: 127.0.0.1 only
        for process, name in PINNED.items():
            for token in (None, "wrong"):
                with pytest.raises(urllib.error.HTTPError) as refused:
                    server.metrics(process, token=token)
                assert refused.value.code == 401
            assert name in server.metrics(process, token=TOKEN)
    finally:
        code = server.stop()
    assert code == 0, server.logs()[-3000:]
