"""Each pytest-xdist process draws its free ports from its own band (PAGEDSERVE_PORT_RANGE, which
the `serve` trees it starts inherit): a port one process picked for a tree that has not bound it
yet cannot be picked by the other."""

from __future__ import annotations

import os

from pagedserve.launch.serve_config import LOWEST_FREE_PORT, PORT_RANGE_ENV, ephemeral_port_range


def _port_band() -> str | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return None
    span = ephemeral_port_range()
    top = span[0] if span is not None and span[0] > LOWEST_FREE_PORT + 1000 * count else 32768
    width = (top - LOWEST_FREE_PORT) // count
    low = LOWEST_FREE_PORT + int(worker[2:]) * width
    return f"{low}-{low + width - 1}"


if PORT_RANGE_ENV not in os.environ and (_band := _port_band()) is not None:
    os.environ[PORT_RANGE_ENV] = _band
