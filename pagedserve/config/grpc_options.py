"""gRPC message size, keepalive and drain settings shared by the frontend and the scheduler.

    public port     client ──▶ frontend      server_options(keepalive_time_s=--keepalive-time, ...)
    internal link   frontend ──▶ scheduler   INTERNAL_CHANNEL_OPTIONS (frontend side),
                                             INTERNAL_SERVER_OPTIONS (scheduler side)

Keepalive finds a peer that vanished without closing its connection (host lost): a server pings a
connection idle for keepalive_time_s and closes it when no answer comes within
keepalive_timeout_s, which cancels the calls on it. Servers accept client pings down to every
MIN_CLIENT_PING_INTERVAL_S, also without calls in flight. The internal channel keeps the client's
default cap of two pings without data, so a default-configured server never answers "too many
pings" (GOAWAY); the frontend's GetInfo polls keep data flowing anyway.

The internal channel reads each Submit stream on the thread that iterates it (gRPC's
SingleThreadedUnaryStream): without it, every message of every stream passes through the channel's
spin thread first, one more thread hand-off per token. With the tiny model of bench/overheads.py,
that took the frontend from 250-312 to 209-263 us of CPU per streamed token at 32 streams.
"""

from __future__ import annotations

import grpc.experimental

MAX_MESSAGE_BYTES = 64 * 2**20  # largest message on either link (the public one: --max-message-size)
MIN_CLIENT_PING_INTERVAL_S = 5.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # a drain lets running requests finish this long (--shutdown-timeout)

# Public port (frontend): the defaults of --keepalive-time and --keepalive-timeout.
DEFAULT_KEEPALIVE_TIME_S = 60.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 20.0

# Internal link: the scheduler pings frontends, the frontend pings the scheduler.
INTERNAL_SERVER_KEEPALIVE_TIME_S = 20.0
INTERNAL_CLIENT_KEEPALIVE_TIME_S = 30.0
INTERNAL_KEEPALIVE_TIMEOUT_S = 10.0
# The frontend reconnects quickly to a scheduler that starts after it or restarts.
INTERNAL_RECONNECT_BACKOFF_MS = 200
INTERNAL_MAX_RECONNECT_BACKOFF_MS = 2_000

Options = list[tuple[str, int]]


def server_options(*, max_message_bytes: int = MAX_MESSAGE_BYTES,
                   keepalive_time_s: float = DEFAULT_KEEPALIVE_TIME_S,
                   keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S) -> Options:
    """Channel arguments of a server: message size both ways, keepalive pings and client pings.
    A port in use is an error, not shared: gRPC servers otherwise bind with SO_REUSEPORT, and a
    second server on a taken port (another deployment's, or a restarted one beside a stale one)
    would start and take a share of the first one's new connections."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", int(keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_CLIENT_PING_INTERVAL_S * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
    ]


INTERNAL_SERVER_OPTIONS: Options = server_options(keepalive_time_s=INTERNAL_SERVER_KEEPALIVE_TIME_S,
                                                  keepalive_timeout_s=INTERNAL_KEEPALIVE_TIMEOUT_S)

INTERNAL_CHANNEL_OPTIONS: Options = [
    ("grpc.keepalive_time_ms", int(INTERNAL_CLIENT_KEEPALIVE_TIME_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(INTERNAL_KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", INTERNAL_RECONNECT_BACKOFF_MS),
    ("grpc.min_reconnect_backoff_ms", INTERNAL_RECONNECT_BACKOFF_MS),
    ("grpc.max_reconnect_backoff_ms", INTERNAL_MAX_RECONNECT_BACKOFF_MS),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),  # above
]
