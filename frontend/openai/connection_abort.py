"""Closing an HTTP connection at once, its unsent bytes dropped: for a client that stopped reading.

uvicorn ends a response the app left unfinished (a stream cut by --stream-write-timeout) with
`transport.close()`, which first waits for the write buffer to drain. To a client that never
reads again it never drains, so the socket stayed open for good after its request was aborted:
half-open, holding a file descriptor, the kernel's socket buffers and the unsent frames. The
connection is aborted instead (`transport.abort()`: the buffer is dropped and the socket closed
now; the kernel sends what it already took, then gives up on its own).

ASGI does not hand the app its transport. uvicorn's `send` is a method of the request's cycle,
which holds it; `expose_transport` (the outermost ASGI layer) puts it in the scope under
TRANSPORT_KEY, where `abort_connection` finds it. The transport is taken by what it does (an
`abort()`), as uvloop's transports are not asyncio.BaseTransport subclasses. Under another server,
or a uvicorn that changed this, there is no transport in the scope and the connection is closed as
the server closes it.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

TRANSPORT_KEY = "pagedserve.transport"


def expose_transport(app: ASGIApp) -> ASGIApp:
    """app with each HTTP request's transport in its scope (see the module docstring)."""

    async def with_transport(scope: Scope, receive: Receive, send: Send) -> None:
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if scope["type"] == "http" and callable(getattr(transport, "abort", None)):
            scope[TRANSPORT_KEY] = transport
        await app(scope, receive, send)

    return with_transport


def abort_connection(scope: Scope) -> bool:
    """Closes the request's connection now, dropping what is still buffered; whether it could."""
    transport = scope.get(TRANSPORT_KEY)
    if transport is None:
        return False
    transport.abort()
    return True
