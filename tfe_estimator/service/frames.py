"""The data plane's frames: how a Contribute or ForwardBlinded travels on a plain TLS stream.

The data plane (`data_plane`, `data_link`) carries the service's two large
calls beside gRPC, on a connection of Python's `ssl` (mutual TLS, the same
certificates), so that a masked share is read by ``recv_into`` straight into a
buffer that lives across steps and written from the array it is in: TLS
decrypts into our buffer and encrypts from it, with no copy in between.

A request is a 24-byte header, then the call's fields as the protobuf message
of `wire` *without* its payload (``head``), then its metadata (``meta``:
``name=value`` lines, UTF-8), then the payload's raw bytes::

    magic "TFD1" | kind u8 (1 Contribute, 2 ForwardBlinded) | 3 zero bytes | head u32 | meta u32 | payload u64

A reply is a 16-byte header, then its message: on OK the reply message's wire
bytes (exactly what gRPC would carry), else the refusal's text (UTF-8)::

    magic "TFR1" | code u8 (grpc.StatusCode's number) | flags u8 (1: replayed) | 2 zero bytes | message u64

All integers are little-endian. One call at a time per connection; a
connection serves many calls in turn.

Example::

    header = frames.request_header("Contribute", len(head), len(meta), len(payload))
    kind, head_len, meta_len, payload_len = frames.parse_request(header)
"""
import struct
from typing import Dict, Optional, Sequence, Tuple

import grpc

__all__ = ["REQUEST", "REPLY", "KINDS", "REPLAYED", "MAX_HEAD", "FrameError", "request_header", "parse_request",
           "reply_header", "parse_reply", "encode_meta", "decode_meta", "read_exact", "read_into"]

REQUEST = struct.Struct("<4sB3xIIQ")
REPLY = struct.Struct("<4sBB2xQ")
_REQUEST_MAGIC, _REPLY_MAGIC = b"TFD1", b"TFR1"
#: kind number -> method name (`wire.METHODS`)
KINDS: Dict[int, str] = {1: "Contribute", 2: "ForwardBlinded"}
_KIND_OF = {name: kind for kind, name in KINDS.items()}
#: reply flag: the answer came from the replay window (gRPC: trailing metadata ``tfe-replayed: 1``)
REPLAYED = 1
#: the largest head or meta a server reads (a channel name and a digest per owner fit many times over)
MAX_HEAD = 1 << 16
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class FrameError(ValueError):
    """Bytes that are not a frame of this protocol (a client of another protocol, or a broken stream)."""


def request_header(method: str, head: int, meta: int, payload: int) -> bytes:
    """The 24-byte header of a request of `method` with these section lengths."""
    return REQUEST.pack(_REQUEST_MAGIC, _KIND_OF[method], head, meta, payload)


def parse_request(header: bytes) -> Tuple[str, int, int, int]:
    """``(method, head, meta, payload)`` of a request header; FrameError naming what is wrong."""
    magic, kind, head, meta, payload = REQUEST.unpack(header)
    if magic != _REQUEST_MAGIC:
        raise FrameError(f"the stream starts with {bytes(magic)!r}, not a data-plane request ({_REQUEST_MAGIC!r}); "
                         "use OwnerClient (gRPC calls go to the service port, not the data port).")
    if kind not in KINDS:
        raise FrameError(f"request kind {kind} is none of {KINDS}.")
    if head > MAX_HEAD or meta > MAX_HEAD:
        raise FrameError(f"the request's fields take {head} and metadata {meta} bytes; at most {MAX_HEAD} each.")
    return KINDS[kind], head, meta, payload


def reply_header(code: grpc.StatusCode, message: int, replayed: bool = False) -> bytes:
    """The 16-byte header of a reply with status `code` and a `message` of that many bytes."""
    return REPLY.pack(_REPLY_MAGIC, code.value[0], REPLAYED if replayed else 0, message)


def parse_reply(header: bytes) -> Tuple[grpc.StatusCode, bool, int]:
    """``(code, replayed, message bytes)`` of a reply header; FrameError if it is not one."""
    magic, code, flags, message = REPLY.unpack(header)
    if magic != _REPLY_MAGIC or code not in _CODES:
        raise FrameError(f"the server's answer starts with {bytes(magic)!r} (code {code}): not a data-plane reply.")
    return _CODES[code], bool(flags & REPLAYED), message


def encode_meta(pairs: Optional[Sequence[Tuple[str, str]]]) -> bytes:
    """Metadata pairs as ``name=value`` lines."""
    return "".join(f"{name}={value}\n" for name, value in pairs or ()).encode("utf-8")


def decode_meta(data: bytes) -> Tuple[Tuple[str, str], ...]:
    """The pairs of `encode_meta`; FrameError for a line without ``=``."""
    pairs = []
    for line in bytes(data).decode("utf-8", "replace").splitlines():
        name, sep, value = line.partition("=")
        if not sep:
            raise FrameError(f"metadata line {line[:80]!r} is not name=value.")
        pairs.append((name, value))
    return tuple(pairs)


def read_into(sock, view: memoryview) -> bool:
    """Fills `view` (bytes) from `sock` with ``recv_into``; False if the stream ended before its first byte,
    ConnectionError if it ended in the middle."""
    view = view.cast("B") if view.format != "B" else view
    got, total = 0, view.nbytes
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if not n:
            if got == 0:
                return False
            raise ConnectionError(f"the stream ended after {got} of {total} bytes.")
        got += n
    return True


def read_exact(sock, nbytes: int) -> Optional[bytes]:
    """`nbytes` bytes from `sock`; None if the stream ended before the first."""
    buffer = bytearray(nbytes)
    if nbytes and not read_into(sock, memoryview(buffer)):
        return None
    return bytes(buffer)
