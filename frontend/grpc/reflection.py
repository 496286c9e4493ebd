"""gRPC server reflection under both names clients ask for.

grpcio-reflection implements `grpc.reflection.v1alpha.ServerReflection`; newer clients (grpcurl,
Postman) ask `grpc.reflection.v1.ServerReflection` first. The two protocols are the same messages
under another package name, identical on the wire, so the v1 method is served by the v1alpha
servicer with the v1alpha message codecs.
"""

from __future__ import annotations

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: tuple[str, ...], server: grpc.Server) -> None:
    """Reflection of service_names (and of reflection itself) under v1alpha and v1."""
    servicer = reflection.ReflectionServicer((*service_names, reflection.SERVICE_NAME))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1_method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": v1_method}),))
