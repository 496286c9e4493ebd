"""CURVE on the scheduler <-> worker ZeroMQ link: authenticated and encrypted plans and results.

    scheduler  PUB  plans    curve_server (server key pair)   ZAP: only the workers' public key
               PULL results  curve_server (server key pair)
    worker     SUB  plans    curve client (client key pair, knows the server's public key)
               PUSH results  curve client

A peer without the client secret key cannot complete the handshake: it reads no plan and pushes
no result (libzmq drops the connection; the ZAP handler logs `zmq_peer_refused`). The keys (Z85
text, 40 characters) come from the environment, never from the command line:

    PAGEDSERVE_ZMQ_SERVER_PUBLIC_KEY   scheduler and workers
    PAGEDSERVE_ZMQ_SERVER_SECRET_KEY   scheduler only
    PAGEDSERVE_ZMQ_CLIENT_PUBLIC_KEY   scheduler (the key it admits) and workers
    PAGEDSERVE_ZMQ_CLIENT_SECRET_KEY   workers only

`serve` generates both pairs per run (ensure_curve_keys) and its children inherit them. Without
them the link runs without authentication, which the scheduler logs (`internal_zmq_unauthenticated`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq

from pagedserve.log import get_logger

SERVER_PUBLIC_ENV = "PAGEDSERVE_ZMQ_SERVER_PUBLIC_KEY"
SERVER_SECRET_ENV = "PAGEDSERVE_ZMQ_SERVER_SECRET_KEY"
CLIENT_PUBLIC_ENV = "PAGEDSERVE_ZMQ_CLIENT_PUBLIC_KEY"
CLIENT_SECRET_ENV = "PAGEDSERVE_ZMQ_CLIENT_SECRET_KEY"
CURVE_ENVS = (SERVER_PUBLIC_ENV, SERVER_SECRET_ENV, CLIENT_PUBLIC_ENV, CLIENT_SECRET_ENV)
ZAP_DOMAIN = b"pagedserve"
Z85_KEY_CHARS = 40


class CurveKeyError(ValueError):
    """A key in the environment is not a Z85 CURVE key, or one half of a pair is missing."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    server_public: bytes
    client_public: bytes
    server_secret: bytes | None = None  # the scheduler's
    client_secret: bytes | None = None  # the workers'


def curve_keys_from_env() -> CurveKeys | None:
    """The keys of this deployment, or None when no server public key is set."""
    values = {name: os.environ.get(name, "").strip().encode() or None
              for name in (SERVER_PUBLIC_ENV, SERVER_SECRET_ENV, CLIENT_PUBLIC_ENV, CLIENT_SECRET_ENV)}
    if values[SERVER_PUBLIC_ENV] is None:
        return None
    if values[CLIENT_PUBLIC_ENV] is None:
        raise CurveKeyError(f"{SERVER_PUBLIC_ENV} is set but {CLIENT_PUBLIC_ENV} is not")
    for name, value in values.items():
        if value is not None and len(value) != Z85_KEY_CHARS:
            raise CurveKeyError(f"{name} must be a Z85 CURVE key of {Z85_KEY_CHARS} characters")
    return CurveKeys(server_public=values[SERVER_PUBLIC_ENV], client_public=values[CLIENT_PUBLIC_ENV],
                     server_secret=values[SERVER_SECRET_ENV], client_secret=values[CLIENT_SECRET_ENV])


def ensure_curve_keys() -> None:
    """Generates both key pairs into this process's environment unless they are set (serve's
    children inherit them)."""
    if os.environ.get(SERVER_PUBLIC_ENV):
        return
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    os.environ.update({SERVER_PUBLIC_ENV: server_public.decode(), SERVER_SECRET_ENV: server_secret.decode(),
                       CLIENT_PUBLIC_ENV: client_public.decode(), CLIENT_SECRET_ENV: client_secret.decode()})


class _AllowClientKey:
    def __init__(self, client_public: bytes) -> None:
        self._allowed = client_public  # the ZAP handler passes keys Z85-encoded

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self._allowed:
            return True
        get_logger(component="zmq_curve").warning("zmq_peer_refused", reason="unknown CURVE public key")
        return False


class CurveServer:
    """The scheduler's side: a ZAP handler admitting only the workers' public key, and the
    options that make a socket a CURVE server."""

    def __init__(self, context: zmq.Context, keys: CurveKeys) -> None:
        if keys.server_secret is None:
            raise CurveKeyError(f"the scheduler needs {SERVER_SECRET_ENV}")
        from zmq.auth.thread import ThreadAuthenticator

        self._keys = keys
        self._authenticator = ThreadAuthenticator(context)
        self._authenticator.start()
        self._authenticator.configure_curve_callback(domain=ZAP_DOMAIN.decode(),
                                                     credentials_provider=_AllowClientKey(keys.client_public))

    def secure(self, socket: zmq.Socket) -> None:
        """Before bind."""
        socket.zap_domain = ZAP_DOMAIN
        socket.curve_secretkey = self._keys.server_secret
        socket.curve_publickey = self._keys.server_public
        socket.curve_server = True

    def stop(self) -> None:
        self._authenticator.stop()


def secure_client(socket: zmq.Socket, keys: CurveKeys) -> None:
    """A worker's socket as a CURVE client of the scheduler (before connect)."""
    if keys.client_secret is None:
        raise CurveKeyError(f"a worker needs {CLIENT_SECRET_ENV}")
    socket.curve_secretkey = keys.client_secret
    socket.curve_publickey = keys.client_public
    socket.curve_serverkey = keys.server_public
