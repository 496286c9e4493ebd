"""Settings of the frontend's OpenAI-compatible HTTP port (nested in FrontendConfig; `serve`
forwards them all). The API key also guards the gRPC port (pagedserve.security.bearer_auth).

The port shares the frontend's --host and its TLS settings (--tls-cert, --tls-key, and
--tls-client-ca for mutual TLS) with the gRPC port. The API key is --api-key, else the
PAGEDSERVE_API_KEY environment variable (which keeps it off the command line that `ps` shows;
`serve`'s children inherit it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagedserve.config.flags import option, require

DEFAULT_HTTP_PORT = 8000
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
MIN_REQUEST_BYTES = 1024
API_KEY_ENV = "PAGEDSERVE_API_KEY"


@dataclass(frozen=True, slots=True)
class HttpConfig:
    port: int = option(DEFAULT_HTTP_PORT, flag="--http-port", metavar="P", serve=True,
                       help="OpenAI-compatible HTTP port on --host (0: no HTTP port)")
    served_model_name: str | None = option(
        None, metavar="NAME", serve=True,
        help="the model name HTTP clients send (default: the model folder's name, `demo` for the demo)")
    api_key: str | None = option(
        None, metavar="KEY", serve=True,
        help=f"clients must send Authorization: Bearer KEY, on gRPC (metadata; health and reflection open) "
             f"and HTTP (/health open) (default: ${API_KEY_ENV}; unset: no key)")
    chat_template_file: str | None = option(
        None, flag="--chat-template", metavar="FILE", serve=True,
        help="Jinja chat template for /v1/chat/completions (default: the tokenizer's own)")
    max_request_bytes: int = option(DEFAULT_MAX_REQUEST_BYTES, metavar="N", serve=True,
                                    help="largest HTTP request body; a larger one gets 400")

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "port", f"--http-port must be a port number (0-65535; 0: off), not {self.port}")
        require(self.max_request_bytes >= MIN_REQUEST_BYTES, "max_request_bytes",
                f"must be at least {MIN_REQUEST_BYTES}, not {self.max_request_bytes}")
        require(self.served_model_name is None or bool(self.served_model_name.strip()), "served_model_name",
                "must not be empty")

    @property
    def is_enabled(self) -> bool:
        return self.port != 0

    def resolved_api_key(self) -> str | None:
        """--api-key, else PAGEDSERVE_API_KEY; None (or empty) means no authentication."""
        key = self.api_key if self.api_key is not None else os.environ.get(API_KEY_ENV)
        return key or None
