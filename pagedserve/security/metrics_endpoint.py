"""The Prometheus /metrics endpoint of frontend and scheduler: loopback by default, a bearer token
when one is set.

    --metrics-port P            serves /metrics (the pinned flag)
    --metrics-host HOST         where it listens: 127.0.0.1 unless set, whatever --host is, so a
                                frontend serving the API on 0.0.0.0 does not publish its metrics
                                with it; set it (a private interface, or 0.0.0.0 in a container)
                                to let a Prometheus on another host scrape
    PAGEDSERVE_METRICS_TOKEN    when set (or PAGEDSERVE_METRICS_TOKEN_FILE, a secret mount), every
                                scrape must send `Authorization: Bearer TOKEN` (Prometheus:
                                `authorization: {credentials_file: …}` in the scrape config);
                                others get 401

The token comes from the environment, never the command line (readable in /proc/*/cmdline).
The metric names are pinned (docs/reliability.md, DESIGN.md) and unchanged by any of this.
"""

from __future__ import annotations

import hmac
import os
import threading
from pathlib import Path
from wsgiref.simple_server import WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler

from pagedserve.config.shared_options import DEFAULT_METRICS_HOST

METRICS_TOKEN_ENV = "PAGEDSERVE_METRICS_TOKEN"
METRICS_TOKEN_FILE_ENV = "PAGEDSERVE_METRICS_TOKEN_FILE"


class MetricsTokenError(ValueError):
    """The token file cannot be read or is empty."""


def metrics_token() -> str | None:
    """The scrape token of this deployment, or None when none is configured."""
    token = os.environ.get(METRICS_TOKEN_ENV, "").strip()
    if token:
        return token
    path = os.environ.get(METRICS_TOKEN_FILE_ENV)
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise MetricsTokenError(f"cannot read {METRICS_TOKEN_FILE_ENV}={path}: {exc}") from exc
    if not token:
        raise MetricsTokenError(f"{METRICS_TOKEN_FILE_ENV}={path} is empty")
    return token


def _with_bearer(app, token: str):
    expected = f"Bearer {token}".encode()

    def guarded(environ, start_response):
        sent = environ.get("HTTP_AUTHORIZATION", "").encode()
        if not hmac.compare_digest(sent, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                ("WWW-Authenticate", 'Bearer realm="metrics"')])
            return [b"a bearer token is required (PAGEDSERVE_METRICS_TOKEN)\n"]
        return app(environ, start_response)

    return guarded


def serve_metrics(registry: CollectorRegistry, port: int, host: str | None = None) -> WSGIServer:
    """Serves registry on host:port (host None: loopback) in a daemon thread, behind the bearer
    token when one is configured; returns the server (server_port is the bound port)."""

    class Server(ThreadingWSGIServer):
        pass

    Server.address_family, address = _get_best_family(host or DEFAULT_METRICS_HOST, port)
    app = make_wsgi_app(registry)
    token = metrics_token()
    if token is not None:
        app = _with_bearer(app, token)
    server = make_server(address, port, app, Server, handler_class=_SilentHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
