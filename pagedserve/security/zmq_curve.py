"""CURVE on the scheduler <-> worker ZeroMQ link: authenticated and encrypted plans and results.

    scheduler  PUB  plans    curve_server (server key pair)   ZAP: only the workers' public key
               PULL results  curve_server (server key pair)
    worker     SUB  plans    curve client (client key pair, knows the server's public key)
               PUSH results  curve client

A peer without the client secret key cannot complete the handshake: it reads no plan and pushes
no result (libzmq drops the connection; the ZAP handler logs `zmq_peer_refused`). The keys (Z85
text, 40 characters) come from the environment, never from the command line, each either itself
or as a file named by NAME_FILE (a compose or Kubernetes secret mount):

    PAGEDSERVE_ZMQ_SERVER_PUBLIC_KEY   scheduler and workers
    PAGEDSERVE_ZMQ_SERVER_SECRET_KEY   scheduler only
    PAGEDSERVE_ZMQ_CLIENT_PUBLIC_KEY   scheduler (the key it admits) and workers
    PAGEDSERVE_ZMQ_CLIENT_SECRET_KEY   workers only

`serve` generates both pairs per run (ensure_curve_keys) and hands each child only the keys of
its role (curve_env_for): the scheduler never holds the workers' secret, a worker never the
scheduler's, the frontend none. A `tcp://` link without keys is refused at start (exit 2) unless
the operator opts out with --allow-insecure-internal-transport (then logged as
`internal_zmq_unauthenticated`); an `ipc://` link (a socket file, guarded by the file system's
permissions) may run without keys.
`python -m pagedserve.security.zmq_curve DIR` writes a fresh set of keys into DIR, one file per key
(server_public, server_secret, client_public, client_secret, readable by the owner only), for
deployments that start the processes themselves (compose.yaml, deploy/kubernetes).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq

from pagedserve.log import get_logger

SERVER_PUBLIC_ENV = "PAGEDSERVE_ZMQ_SERVER_PUBLIC_KEY"
SERVER_SECRET_ENV = "PAGEDSERVE_ZMQ_SERVER_SECRET_KEY"
CLIENT_PUBLIC_ENV = "PAGEDSERVE_ZMQ_CLIENT_PUBLIC_KEY"
CLIENT_SECRET_ENV = "PAGEDSERVE_ZMQ_CLIENT_SECRET_KEY"
CURVE_ENVS = (SERVER_PUBLIC_ENV, SERVER_SECRET_ENV, CLIENT_PUBLIC_ENV, CLIENT_SECRET_ENV)
ROLE_ENVS = {  # the keys each kind of process holds
    "scheduler": (SERVER_PUBLIC_ENV, SERVER_SECRET_ENV, CLIENT_PUBLIC_ENV),
    "worker": (SERVER_PUBLIC_ENV, CLIENT_PUBLIC_ENV, CLIENT_SECRET_ENV),
    "frontend": (),
}
INSECURE_TRANSPORT_FLAG = "--allow-insecure-internal-transport"
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
    values = {name: _key_from_env(name) for name in CURVE_ENVS}
    if values[SERVER_PUBLIC_ENV] is None:
        return None
    if values[CLIENT_PUBLIC_ENV] is None:
        raise CurveKeyError(f"{SERVER_PUBLIC_ENV} is set but {CLIENT_PUBLIC_ENV} is not")
    for name, value in values.items():
        if value is not None and len(value) != Z85_KEY_CHARS:
            raise CurveKeyError(f"{name} must be a Z85 CURVE key of {Z85_KEY_CHARS} characters")
    return CurveKeys(server_public=values[SERVER_PUBLIC_ENV], client_public=values[CLIENT_PUBLIC_ENV],
                     server_secret=values[SERVER_SECRET_ENV], client_secret=values[CLIENT_SECRET_ENV])


def _key_from_env(name: str) -> bytes | None:
    value = os.environ.get(name, "").strip()
    path = os.environ.get(f"{name}_FILE")
    if not value and path:
        try:
            value = Path(path).read_text().strip()
        except OSError as exc:
            raise CurveKeyError(f"cannot read {name}_FILE={path}: {exc}") from exc
    return value.encode() or None


def ensure_curve_keys() -> None:
    """Generates both key pairs into this process's environment unless they are set (serve's
    children inherit them)."""
    if os.environ.get(SERVER_PUBLIC_ENV):
        return
    os.environ.update(new_curve_env())


def new_curve_env() -> dict[str, str]:
    """A fresh set of both key pairs, by environment variable name."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return {SERVER_PUBLIC_ENV: server_public.decode(), SERVER_SECRET_ENV: server_secret.decode(),
            CLIENT_PUBLIC_ENV: client_public.decode(), CLIENT_SECRET_ENV: client_secret.decode()}


def curve_env_for(role: str, env: dict[str, str]) -> dict[str, str]:
    """env without the CURVE keys a process of this role ("scheduler", "worker", "frontend") does
    not need; any other role (a replica, which is a serve of its own) keeps them all."""
    if role not in ROLE_ENVS:
        return dict(env)
    withheld = {variable for name in CURVE_ENVS if name not in ROLE_ENVS[role] for variable in (name, f"{name}_FILE")}
    return {name: value for name, value in env.items() if name not in withheld}


def check_internal_transport(addresses: tuple[str, ...], keys: CurveKeys | None, *,
                             is_insecure_allowed: bool) -> bool:
    """Whether the link runs without authentication; raises CurveKeyError (the process exits 2)
    for a tcp:// address without keys unless the operator allowed it."""
    if keys is not None:
        return False
    exposed = [address for address in addresses if not address.startswith("ipc://")]
    if exposed and not is_insecure_allowed:
        raise CurveKeyError(
            f"{', '.join(exposed)}: a tcp:// ZeroMQ link needs CURVE keys ({SERVER_PUBLIC_ENV} and the others; "
            f"`python -m pagedserve.security.zmq_curve` prints a set, `serve` sets them itself), or an ipc:// address, "
            f"or {INSECURE_TRANSPORT_FLAG} to run it unauthenticated")
    return True


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


def require_client_secret(keys: CurveKeys | None) -> None:
    """Raises CurveKeyError when keys are set but the worker's secret key is not: checked at a
    worker's start, before its model loads, so a missing secret mount costs no load."""
    if keys is not None and keys.client_secret is None:
        raise CurveKeyError(f"a worker needs {CLIENT_SECRET_ENV} (or {CLIENT_SECRET_ENV}_FILE): "
                            f"{SERVER_PUBLIC_ENV} is set, so the link to the scheduler is CURVE")


def secure_client(socket: zmq.Socket, keys: CurveKeys) -> None:
    """A worker's socket as a CURVE client of the scheduler (before connect)."""
    require_client_secret(keys)
    socket.curve_secretkey = keys.client_secret
    socket.curve_publickey = keys.client_public
    socket.curve_serverkey = keys.server_public


KEY_FILES = dict(zip(CURVE_ENVS, ("server_public", "server_secret", "client_public", "client_secret")))


def write_key_files(folder: Path) -> None:
    """A fresh set of keys in folder, one file per key (KEY_FILES), readable by the owner only."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in new_curve_env().items():
        path = folder / KEY_FILES[name]
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(value + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m pagedserve.security.zmq_curve DIR   (writes a fresh set of CURVE keys into DIR)")
    write_key_files(Path(sys.argv[1]))
    print(f"wrote {', '.join(KEY_FILES.values())} to {sys.argv[1]}")
