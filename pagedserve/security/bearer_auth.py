"""A shared secret on a gRPC server: every call but the open ones must carry
`authorization: Bearer KEY` metadata, else it ends UNAUTHENTICATED before its handler runs.

    frontend (public port, --api-key)             scheduler (internal port, internal token)
    /grpc.health.v1.Health/*          open        /grpc.health.v1.Health/*        open
    /grpc.reflection.*                open        everything else                 Bearer TOKEN
    /pagedserve.v1.Generation/*       Bearer KEY

Keys are compared in constant time; a refusal is logged (`request_unauthenticated`, the method).
"""

from __future__ import annotations

import secrets

import grpc
import structlog

log = structlog.get_logger()
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIX = "/grpc.reflection."
AUTHORIZATION_METADATA = "authorization"


def bearer_token(metadata) -> bytes | None:
    """The token of `authorization: Bearer TOKEN` in gRPC metadata, or None."""
    for key, value in metadata or ():
        if key == AUTHORIZATION_METADATA:
            text = value if isinstance(value, str) else value.decode("latin-1")
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer":
                return token.strip().encode()
    return None


def is_authorized(metadata, key: bytes) -> bool:
    token = bearer_token(metadata)
    return token is not None and secrets.compare_digest(token, key)


def bearer_metadata(key: str) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with every call."""
    return ((AUTHORIZATION_METADATA, f"Bearer {key}"),)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the key (UNAUTHENTICATED), except methods under `open_prefixes`."""

    def __init__(self, key: str, open_prefixes: tuple[str, ...] = (HEALTH_PREFIX,), what: str = "the API key") -> None:
        if not key:
            raise ValueError("an empty key authenticates nobody")
        self._key = key.encode()
        self._open_prefixes = open_prefixes
        self._what = what

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(self._open_prefixes) or is_authorized(handler_call_details.invocation_metadata,
                                                                    self._key):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        log.info("request_unauthenticated", method=method)
        return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                                f"send {self._what} as `authorization: Bearer KEY` metadata")


def refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends every call with `code`."""

    def refuse(_request, context):
        context.abort(code, details)

    def refuse_stream(_request, context):
        context.abort(code, details)
        yield  # pragma: no cover  (makes this a generator for streaming responses)

    return _shaped_like(handler, refuse, refuse_stream)


class AioBearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """BearerTokenInterceptor for a grpc.aio server (the scheduler's internal port)."""

    def __init__(self, key: str, open_prefixes: tuple[str, ...] = (HEALTH_PREFIX,), what: str = "the token") -> None:
        if not key:
            raise ValueError("an empty key authenticates nobody")
        self._key = key.encode()
        self._open_prefixes = open_prefixes
        self._what = what

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(self._open_prefixes) or \
                is_authorized(handler_call_details.invocation_metadata, self._key):
            return handler
        log.warning("request_unauthenticated", method=method)
        return _aio_refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                                     f"send {self._what} as `authorization: Bearer KEY` metadata")


def _aio_refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str):
    async def refuse(_request, context):
        await context.abort(code, details)

    async def refuse_stream(_request, context):
        await context.abort(code, details)
        yield  # pragma: no cover  (an async generator, for streaming responses)

    return _shaped_like(handler, refuse, refuse_stream)


def _shaped_like(handler, refuse, refuse_stream):
    """A method handler of handler's streaming kind whose behaviour is refuse / refuse_stream."""
    deserializer, serializer = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, deserializer, serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, deserializer, serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, deserializer, serializer)
    return grpc.unary_unary_rpc_method_handler(refuse, deserializer, serializer)


class _MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                           grpc.StreamStreamClientInterceptor):
    """Adds `metadata` to every call of a channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _with_metadata(self, details):
        return details._replace(metadata=(*(details.metadata or ()), *self._metadata))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_metadata(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_metadata(client_call_details), request)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._with_metadata(client_call_details), request_iterator)


def with_bearer(channel: grpc.Channel, key: str | None) -> grpc.Channel:
    """`channel` sending `authorization: Bearer KEY` with every unary, server-streaming and bidirectional call
    (unchanged when key is None)."""
    if not key:
        return channel
    return grpc.intercept_channel(channel, _MetadataInterceptor(bearer_metadata(key)))
