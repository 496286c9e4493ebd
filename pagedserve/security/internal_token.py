"""The shared secret of the internal gRPC port (frontend -> scheduler, and serve's readiness probe).

The scheduler refuses every call but health without `authorization: Bearer TOKEN` metadata
(pagedserve.security.bearer_auth); its clients send it. The token comes from the environment, never from
the command line (which any local user reads in /proc/*/cmdline):

    PAGEDSERVE_INTERNAL_TOKEN        the token itself
    PAGEDSERVE_INTERNAL_TOKEN_FILE   a file holding it (a Kubernetes or compose secret mount)

`serve` generates a fresh random token per run when neither is set and hands it to its children
in their environment. A scheduler started by hand without one serves its port unauthenticated and
logs `internal_port_unauthenticated` (keep it on loopback, or set a token).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

INTERNAL_TOKEN_ENV = "PAGEDSERVE_INTERNAL_TOKEN"
INTERNAL_TOKEN_FILE_ENV = "PAGEDSERVE_INTERNAL_TOKEN_FILE"
TOKEN_BYTES = 32


class InternalTokenError(RuntimeError):
    """The token file cannot be read or is empty."""


def internal_token() -> str | None:
    """The token of this deployment, or None when none is configured."""
    token = os.environ.get(INTERNAL_TOKEN_ENV)
    if token:
        return token.strip()
    path = os.environ.get(INTERNAL_TOKEN_FILE_ENV)
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise InternalTokenError(f"cannot read {INTERNAL_TOKEN_FILE_ENV}={path}: {exc}") from exc
    if not token:
        raise InternalTokenError(f"{INTERNAL_TOKEN_FILE_ENV}={path} is empty")
    return token


def ensure_internal_token() -> str:
    """The configured token, else a fresh one put in this process's environment (so children
    started afterwards inherit it)."""
    token = internal_token()
    if token is None:
        token = secrets.token_urlsafe(TOKEN_BYTES)
        os.environ[INTERNAL_TOKEN_ENV] = token
    return token
