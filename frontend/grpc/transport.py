"""Transport settings of the public port: message size, keepalive, TLS and mutual TLS.

Plaintext is the default (a localhost or sidecar-terminated deployment). With `tls_cert_file` and
`tls_key_file` the port speaks TLS; adding `tls_client_ca_file` makes it mutual: a client must
present a certificate signed by that CA, or the handshake fails.

Keepalive: the server pings a connection idle for `keepalive_time_s` and closes it when no answer
comes within `keepalive_timeout_s`, so a client whose host vanished has its requests cancelled
(and aborted in the scheduler). Clients may ping too (pagedserve.config.grpc_options has the option list
and the defaults, shared with the scheduler's internal port).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from pagedserve.config import grpc_options
from pagedserve.config.flags import ConfigError, option
from pagedserve.config.grpc_options import DEFAULT_KEEPALIVE_TIME_S, DEFAULT_KEEPALIVE_TIMEOUT_S, MAX_MESSAGE_BYTES


class TransportConfigError(ConfigError):
    """A transport setting is out of range or names a file that cannot be read."""


@dataclass(frozen=True, slots=True)
class TransportConfig:
    max_message_bytes: int = option(MAX_MESSAGE_BYTES, flag="--max-message-size", metavar="BYTES", serve=True,
                                    help="largest request or response message")
    keepalive_time_s: float = option(DEFAULT_KEEPALIVE_TIME_S, flag="--keepalive-time", metavar="S", serve=True,
                                     help="ping a connection idle this long")
    keepalive_timeout_s: float = option(DEFAULT_KEEPALIVE_TIMEOUT_S, flag="--keepalive-timeout", metavar="S",
                                        serve=True, help="close a connection whose ping is not answered in this time")
    tls_cert_file: str | None = option(None, flag="--tls-cert", metavar="PEM", serve=True,
                                       help="serve TLS with this certificate chain")
    tls_key_file: str | None = option(None, flag="--tls-key", metavar="PEM", serve=True,
                                      help="private key of --tls-cert")
    tls_client_ca_file: str | None = option(None, flag="--tls-client-ca", metavar="PEM", serve=True,
                                            help="mutual TLS: require client certificates signed by this CA")

    def __post_init__(self) -> None:
        if self.max_message_bytes <= 0:
            raise TransportConfigError("max_message_bytes", "must be positive")
        for name in ("keepalive_time_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise TransportConfigError(name, "must be positive")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise TransportConfigError("tls_key_file" if self.tls_cert_file else "tls_cert_file",
                                       "TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise TransportConfigError("tls_client_ca_file",
                                       "mutual TLS (--tls-client-ca) needs a server certificate and key as well")

    @property
    def is_tls(self) -> bool:
        return bool(self.tls_cert_file)

    @property
    def is_mutual_tls(self) -> bool:
        return bool(self.tls_client_ca_file)

    def server_options(self) -> list[tuple[str, int]]:
        return grpc_options.server_options(max_message_bytes=self.max_message_bytes,
                                           keepalive_time_s=self.keepalive_time_s,
                                           keepalive_timeout_s=self.keepalive_timeout_s)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for the port, or None for plaintext."""
        if not self.is_tls:
            return None
        key = _read(self.tls_key_file, "tls_key_file", "--tls-key")
        cert = _read(self.tls_cert_file, "tls_cert_file", "--tls-cert")
        client_ca = None
        if self.is_mutual_tls:
            client_ca = _read(self.tls_client_ca_file, "tls_client_ca_file", "--tls-client-ca")
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                           require_client_auth=self.is_mutual_tls)


def _read(path: str, field_name: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TransportConfigError(field_name, f"{flag} {path}: {exc.strerror or exc}") from exc
