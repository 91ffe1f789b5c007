"""The aggregation service's messages and methods, built at run time from one table.

`aggregation.proto` beside this module is the API as people read it (with the
table of who may call each method); `MESSAGES` and `METHODS` below are the same
API as the code uses it. There is no protoc step: `messages()` builds a
``FileDescriptorProto`` from the tables and asks protobuf for the classes, on
protobuf 3.19 (``MessageFactory().GetPrototype``) and 4.x
(``message_factory.GetMessageClass``) alike. ``tests/test_service.py`` parses
the ``.proto`` text and checks that it equals `file_descriptor()`, so the two
cannot drift.

Example::

    from tfe_estimator.service import wire

    classes = wire.messages()
    request = classes["ContributeRequest"](channel="grads", step=7, ring_bits=64,
                                           num_elements=3, payload=b"...")
    path = wire.method_path("Contribute")   # "/tfe_estimator.aggregation.v1.Aggregation/Contribute"

A share's bytes are copied once on each end: `encode` writes the payload
straight from the array into the message's bytes (gRPC's serializer takes them
as they are), and `decode`, gRPC's deserializer of the payload messages, hands
the payload on as a view of the received bytes.
"""
import functools
from typing import Dict, NamedTuple, Tuple

__all__ = ["CONTROL_MESSAGE_BYTES", "encode", "encoded_size", "serialize", "decode", "decoder", "Decoded", "PACKAGE",
           "SERVICE", "SERVICE_NAME", "PROTO_FILE", "MESSAGES", "METHODS", "Method", "OWNERS", "SERVER0",
           "OWNERS_AND_SERVER0", "PARTIES", "file_descriptor", "messages", "method", "method_path"]

PACKAGE = "tfe_estimator.aggregation.v1"
SERVICE = "Aggregation"
SERVICE_NAME = f"{PACKAGE}.{SERVICE}"
PROTO_FILE = "tfe_estimator/service/aggregation.proto"

#: The largest message a server's gRPC port reads when nothing large needs to come there: server0 always (its
#: Contribute is a 16-byte key, its other calls are small), server1 when it has a data plane (shares and
#: server0's part come there). gRPC reads a whole message, up to its receive limit, before the server sees who
#: sent it, so only this small limit keeps one owner's concurrent calls from making a server hold more than its
#: memory budget (1 MiB: a handshake row of ~35,000 fields, a sum of ~130,000 elements at ring 64, a key).
CONTROL_MESSAGE_BYTES = 1 << 20

#: Who may call a method: every configured data owner, server0 (task tfe:0) only, or both; or any party of the
#: federation (a certificate the CA of its own organisation issued: owners, servers, evaluators).
OWNERS, SERVER0, OWNERS_AND_SERVER0, PARTIES = "owners", "tfe:0", "owners and tfe:0", "any party"

#: message -> ((field, type, number), ...); type "repeated int64" for a repeated field.
MESSAGES: Tuple[Tuple[str, Tuple[Tuple[str, str, int], ...]], ...] = (
    ("ContributeRequest", (("channel", "string", 1), ("step", "int64", 2), ("ring_bits", "int32", 3),
                           ("num_elements", "int64", 4), ("payload", "bytes", 5))),
    ("ContributeReply", (("step", "int64", 1), ("payload", "bytes", 2), ("sealed_blinds", "repeated bytes", 3))),
    ("HandshakeRequest", (("step", "int64", 1), ("descriptor", "repeated int64", 2), ("model", "int64", 3),
                          ("seed_part", "bytes", 4))),
    ("HandshakeReply", (("rows", "repeated int64", 1), ("lengths", "repeated int64", 2),
                        ("models", "repeated int64", 3), ("ages_ms", "repeated int64", 4),
                        ("seed_parts", "repeated bytes", 5))),
    ("RewindRequest", (("step", "int64", 1),)),
    ("RewindReply", ()),
    ("ForwardRequest", (("channel", "string", 1), ("step", "int64", 2), ("ring_bits", "int32", 3),
                        ("num_elements", "int64", 4), ("payload", "bytes", 5), ("sealed_blinds", "repeated bytes", 6))),
    ("ForwardReply", ()),
    ("DataPlaneRequest", ()),
    ("DataPlaneReply", (("port", "int32", 1),)),
    ("StatusRequest", ()),
    ("StatusReply", (("channels", "repeated string", 1), ("steps", "repeated int64", 2))),
)


class Method(NamedTuple):
    """One rpc: its messages, the server roles that serve it and who may call it."""
    name: str
    request: str
    reply: str
    roles: Tuple[int, ...]  # 0: server0 (tfe:0, keys), 1: server1 (tfe:1, masked shares)
    callers: str            # OWNERS, SERVER0, OWNERS_AND_SERVER0 or PARTIES


METHODS: Tuple[Method, ...] = (
    Method("Contribute", "ContributeRequest", "ContributeReply", (0, 1), OWNERS),
    Method("Handshake", "HandshakeRequest", "HandshakeReply", (0,), OWNERS),
    Method("Rewind", "RewindRequest", "RewindReply", (0, 1), OWNERS),
    Method("ForwardBlinded", "ForwardRequest", "ForwardReply", (1,), SERVER0),
    Method("DataPlane", "DataPlaneRequest", "DataPlaneReply", (0, 1), OWNERS_AND_SERVER0),
    Method("Status", "StatusRequest", "StatusReply", (0, 1), PARTIES),
)


def method(name: str) -> Method:
    """The `Method` called `name`; `KeyError` naming the known methods otherwise."""
    for m in METHODS:
        if m.name == name:
            return m
    raise KeyError(f"method {name!r} is not part of {SERVICE_NAME}: it has {[m.name for m in METHODS]}.")


def method_path(name: str) -> str:
    """The gRPC path of method `name`: ``/<package>.<service>/<name>``."""
    return f"/{SERVICE_NAME}/{method(name).name}"


@functools.lru_cache(maxsize=None)
def file_descriptor():
    """The API as a ``descriptor_pb2.FileDescriptorProto`` (built once, on first use)."""
    from google.protobuf import descriptor_pb2  # pylint: disable=import-outside-toplevel

    field = descriptor_pb2.FieldDescriptorProto
    types = {"string": field.TYPE_STRING, "bytes": field.TYPE_BYTES, "int32": field.TYPE_INT32,
             "int64": field.TYPE_INT64}
    proto = descriptor_pb2.FileDescriptorProto(name=PROTO_FILE, package=PACKAGE, syntax="proto3")
    for name, fields in MESSAGES:
        message = proto.message_type.add(name=name)
        for field_name, kind, number in fields:
            repeated = kind.startswith("repeated ")
            message.field.add(name=field_name, number=number, type=types[kind.split()[-1]],
                              label=field.LABEL_REPEATED if repeated else field.LABEL_OPTIONAL)
    service = proto.service.add(name=SERVICE)
    for m in METHODS:
        service.method.add(name=m.name, input_type=f".{PACKAGE}.{m.request}", output_type=f".{PACKAGE}.{m.reply}")
    return proto


@functools.lru_cache(maxsize=None)
def messages() -> Dict[str, type]:
    """Message name -> generated protobuf class (built once, in a private descriptor pool)."""
    from google.protobuf import descriptor_pool, message_factory  # pylint: disable=import-outside-toplevel

    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_descriptor())
    classes = {}
    for name, _ in MESSAGES:
        descriptor = pool.FindMessageTypeByName(f"{PACKAGE}.{name}")
        if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.21
            classes[name] = message_factory.GetMessageClass(descriptor)
        else:  # protobuf 3.19 (the TF 2.9 stack)
            classes[name] = message_factory.MessageFactory(pool).GetPrototype(descriptor)
    return classes


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@functools.lru_cache(maxsize=None)  # a fact of the fixed API, looked up per message sent and received
def _payload_field(message: str) -> int:
    fields = dict(MESSAGES)[message]
    return dict((name, n) for name, _, n in fields)["payload"]


def encode(message: str, payload, **fields) -> bytes:
    """The wire bytes of `message` with `payload` (bytes or a contiguous array), copying the payload once.

    The message ``messages()[message](payload=bytes(payload), **fields)`` (an empty payload is omitted as
    proto3 does), with the payload written last, without protobuf's copies of a large payload (into the
    message, then into the serialized string): byte-identical to protobuf's ``SerializeToString()`` when
    the payload is the highest-numbered field set (protobuf writes fields in number order; a reply's
    ``sealed_blinds``, added later, come before it here). Parse the bytes with protobuf as usual.
    """
    head = messages()[message](**fields).SerializeToString()
    view = memoryview(payload).cast("B")
    if not view.nbytes:
        return head
    return b"".join((head, _varint(_payload_field(message) << 3 | 2), _varint(view.nbytes), view))


def encoded_size(message: str, payload_bytes: int, **fields) -> int:
    """``len(encode(message, payload, **fields))`` for a payload of `payload_bytes` bytes, without encoding it."""
    head = messages()[message](**fields).ByteSize()
    if not payload_bytes:
        return head
    return head + len(_varint(_payload_field(message) << 3 | 2)) + len(_varint(payload_bytes)) + payload_bytes


def serialize(message) -> bytes:
    """gRPC serializer of the service's messages: bytes from `encode` as they are, a protobuf message serialized."""
    return message if isinstance(message, bytes) else message.SerializeToString()


class Decoded:
    """A received message: its fields as protobuf parsed them, its ``payload`` a read-only view of the
    received bytes (`decode`). Reads like the message (``decoded.step``, ``decoded.payload``)."""

    __slots__ = ("message", "payload")

    def __init__(self, message, payload: memoryview):
        self.message, self.payload = message, payload

    def __getattr__(self, name):
        return getattr(self.message, name)


def _read_varint(data: memoryview, pos: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError(f"a truncated or overlong varint at byte {pos} of a {len(data)}-byte message")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def decode(message: str, data: bytes) -> Decoded:
    """Parses the wire bytes of `message` (one with a payload) without copying the payload.

    The top-level fields are walked once (protobuf's wire format: a varint key, then a varint, 8 or 4
    bytes, or a length and that many bytes); the payload field (the last occurrence wins, as in
    protobuf) becomes a view of `data`, every other field is handed to protobuf, so the result equals
    ``messages()[message].FromString(data)`` field by field. Raises ValueError naming what is malformed.
    """
    view = memoryview(data).cast("B")
    number = _payload_field(message)
    rest, payload, pos = [], view[0:0], 0
    while pos < len(view):
        start = pos
        key, pos = _read_varint(view, pos)
        field, kind = key >> 3, key & 7
        if kind == 0:
            _, pos = _read_varint(view, pos)
        elif kind in (1, 5):
            pos += 8 if kind == 1 else 4
        elif kind == 2:
            length, pos = _read_varint(view, pos)
            if pos + length > len(view):
                raise ValueError(f"{message}: field {field} says {length} bytes at byte {pos}, but only "
                                 f"{len(view) - pos} follow (a truncated message)")
            if field == number:
                payload, pos = view[pos:pos + length], pos + length
                continue
            pos += length
        else:
            raise ValueError(f"{message}: wire type {kind} of field {field} at byte {start} is not one this API "
                             "uses (0, 1, 2, 5)")
        if pos > len(view):
            raise ValueError(f"{message}: field {field} at byte {start} runs past the end (a truncated message)")
        rest.append(view[start:pos])
    return Decoded(messages()[message].FromString(b"".join(rest)), payload)


def decoder(message: str):
    """A gRPC deserializer of `message`: `decode` for one with a payload, protobuf's parser otherwise."""
    if any(name == "payload" for name, _, _ in dict(MESSAGES)[message]):
        return functools.partial(decode, message)
    return messages()[message].FromString
