"""Command-line options of the production service surface, shared by `serve` and the processes.

    --shutdown-timeout S       frontend and scheduler: how long a drain waits for running requests
    --max-waiting-tokens N     scheduler: prompt tokens allowed in the waiting queue
    --max-message-size B  --keepalive-time S  --keepalive-timeout S  --max-concurrent-rpcs N
    --tls-cert PEM  --tls-key PEM  [--tls-client-ca PEM]        frontend: the public port

`serve` takes them all and forwards each to the process it belongs to.
"""

from __future__ import annotations

import argparse

from pagedserve.grpc_options import (
    DEFAULT_KEEPALIVE_TIME_S, DEFAULT_KEEPALIVE_TIMEOUT_S, DEFAULT_SHUTDOWN_TIMEOUT_S, MAX_MESSAGE_BYTES,
)

DEFAULT_MAX_WAITING_TOKENS = 1 << 20
DEFAULT_MAX_CONCURRENT_RPCS = 512

_TRANSPORT_FLAGS = (  # (flag, attribute) forwarded from serve to the frontend when set
    ("--max-message-size", "max_message_size"),
    ("--keepalive-time", "keepalive_time"),
    ("--keepalive-timeout", "keepalive_timeout"),
    ("--max-concurrent-rpcs", "max_concurrent_rpcs"),
    ("--tls-cert", "tls_cert"),
    ("--tls-key", "tls_key"),
    ("--tls-client-ca", "tls_client_ca"),
)


def add_shutdown_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="S",
                        help="on SIGTERM: seconds running requests get to finish before they are cut")


def add_waiting_tokens_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-waiting-tokens", type=int, default=DEFAULT_MAX_WAITING_TOKENS,
                        help="prompt tokens of requests not yet scheduled; beyond it RESOURCE_EXHAUSTED")


def add_transport_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("public port transport")
    group.add_argument("--max-message-size", type=int, default=MAX_MESSAGE_BYTES, metavar="BYTES",
                       help="largest request or response message")
    group.add_argument("--keepalive-time", type=float, default=DEFAULT_KEEPALIVE_TIME_S, metavar="S",
                       help="ping a connection idle this long")
    group.add_argument("--keepalive-timeout", type=float, default=DEFAULT_KEEPALIVE_TIMEOUT_S, metavar="S",
                       help="close a connection whose ping is not answered in this time")
    group.add_argument("--max-concurrent-rpcs", type=int, default=DEFAULT_MAX_CONCURRENT_RPCS, metavar="N",
                       help="calls served at once (health checks included); beyond it RESOURCE_EXHAUSTED")
    group.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS with this certificate chain")
    group.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    group.add_argument("--tls-client-ca", default=None, metavar="PEM",
                       help="mutual TLS: require client certificates signed by this CA")


def transport_from_args(args):
    from pagedserve.frontend.transport import TransportConfig

    return TransportConfig(max_message_bytes=args.max_message_size, keepalive_time_s=args.keepalive_time,
                           keepalive_timeout_s=args.keepalive_timeout, tls_cert_file=args.tls_cert,
                           tls_key_file=args.tls_key, tls_client_ca_file=args.tls_client_ca)


def frontend_argv(args) -> list[str]:
    """What `serve` adds to the frontend's command line."""
    argv = ["--shutdown-timeout", str(args.shutdown_timeout)]
    for flag, attribute in _TRANSPORT_FLAGS:
        value = getattr(args, attribute)
        if value is not None:
            argv += [flag, str(value)]
    return argv


def scheduler_argv(args) -> list[str]:
    """What `serve` adds to the scheduler's command line."""
    return ["--shutdown-timeout", str(args.shutdown_timeout),
            "--max-waiting-tokens", str(args.max_waiting_tokens)]
