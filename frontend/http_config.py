"""Settings of the frontend's OpenAI-compatible HTTP port.

The port shares the frontend's --host and its TLS settings (--tls-cert, --tls-key, and
--tls-client-ca for mutual TLS) with the gRPC port.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_HTTP_PORT = 8000
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
API_KEY_ENV = "PAGEDSERVE_API_KEY"


class HttpConfigError(ValueError):
    """An HTTP setting is out of range."""


@dataclass(frozen=True, slots=True)
class HttpConfig:
    port: int = DEFAULT_HTTP_PORT  # 0: no HTTP port
    served_model_name: str | None = None  # None: the model folder's name ("demo" for the demo)
    api_key: str | None = None  # None: PAGEDSERVE_API_KEY, or no authentication when that is unset
    chat_template_file: str | None = None  # None: the tokenizer's own template
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise HttpConfigError(f"--http-port must be a port number (0-65535; 0 turns HTTP off), not {self.port}")
        if self.max_request_bytes < 1024:
            raise HttpConfigError(f"--max-request-bytes must be at least 1024, not {self.max_request_bytes}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise HttpConfigError("--served-model-name must not be empty")

    @property
    def is_enabled(self) -> bool:
        return self.port != 0

    def resolved_api_key(self) -> str | None:
        """--api-key, else PAGEDSERVE_API_KEY; None (or empty) means no authentication."""
        key = self.api_key if self.api_key is not None else os.environ.get(API_KEY_ENV)
        return key or None
