"""Lenient request parsing: bytes that protobuf refuses reach the servicer as UndecodableRequest.

gRPC itself answers INTERNAL for a request it cannot parse; the public contract wants
INVALID_ARGUMENT naming the field. The usual cause is a string field holding bytes that are not
UTF-8, and protobuf's error does not say which field. To name it, the bytes are parsed again
with a mirror of the request type whose string fields are `bytes` (built once from the real
descriptor, in a pool of its own), and each of them is decoded:

    GenerateRequest bytes ──parse──▶ DecodeError ──mirror parse──▶ first field that is not UTF-8
                                                                   ("prompt", "params.stop[1]", …)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

_MIRROR_SUFFIX = "bytes_mirror"


@dataclass(frozen=True, slots=True)
class UndecodableRequest:
    """Stands in for a request protobuf could not parse; `field_name` names the culprit when known."""

    field_name: str  # "" when the bytes are not a message of this type at all
    error: str

    @property
    def message(self) -> str:
        if self.field_name:
            return f"{self.field_name}: not valid UTF-8"
        return f"undecodable request: {self.error}"


def lenient_deserializer(message_class: type[Message]):
    """A gRPC request deserializer that returns UndecodableRequest instead of raising."""

    def deserialize(data: bytes):
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return UndecodableRequest(bad_utf8_field(message_class, data) or "", str(exc))

    return deserialize


def bad_utf8_field(message_class: type[Message], data: bytes) -> str | None:
    """The path of the first string field of `data` that is not UTF-8, or None."""
    try:
        mirror = _mirror_class(message_class.DESCRIPTOR.full_name, message_class.DESCRIPTOR.file)
        return _find_bad_utf8(mirror.FromString(data), "")
    except DecodeError:
        return None


def _find_bad_utf8(msg: Message, prefix: str) -> str | None:
    for field, value in msg.ListFields():
        path = f"{prefix}{field.name}"
        is_repeated = field.is_repeated
        values = list(value) if is_repeated else [value]
        for position, item in enumerate(values):
            item_path = f"{path}[{position}]" if is_repeated else path
            if field.type == FieldDescriptor.TYPE_BYTES:
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return item_path
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = _find_bad_utf8(item, f"{item_path}.")
                if found is not None:
                    return found
    return None


@cache
def _mirror_class(full_name: str, file_descriptor) -> type[Message]:
    """The message `full_name` rebuilt with every string field typed `bytes`."""
    proto = descriptor_pb2.FileDescriptorProto()
    file_descriptor.CopyToProto(proto)
    package = proto.package
    mirror_package = f"{package}.{_MIRROR_SUFFIX}"
    proto.name = f"{proto.name}.{_MIRROR_SUFFIX}"
    proto.package = mirror_package
    del proto.service[:]
    for message in _all_messages(proto.message_type):
        for field in message.field:
            if field.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
            if field.type_name.startswith(f".{package}."):
                field.type_name = f".{mirror_package}." + field.type_name[len(package) + 2:]
    pool = descriptor_pool.DescriptorPool()
    for dependency in file_descriptor.dependencies:
        dependency_proto = descriptor_pb2.FileDescriptorProto()
        dependency.CopyToProto(dependency_proto)
        pool.Add(dependency_proto)
    pool.Add(proto)
    mirror_name = f"{mirror_package}.{full_name[len(package) + 1:]}"
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(mirror_name))


def _all_messages(messages):
    for message in messages:
        yield message
        yield from _all_messages(message.nested_type)
