"""Local calls: the control RPCs of ``kvstore.v1.KVStore`` over the session socket.

A unary gRPC call costs 0.4-0.6 ms in Python on this class of machine, most of it in the gRPC
stack on both sides, and a batch of blocks pays several. A same-host client already holds a
connection the kernel vouches for (the session socket, ``SO_PEERCRED``), so it may send the same
calls over it instead: the same protobuf messages, served by the same servicer methods, with the
session's principal, the same handle checks and the same errors. gRPC stays the API (remote
clients, tools, health, reflection, the streams); a client falls back to it when the daemon does
not offer local calls, or a message is too large for one datagram.

A call is one datagram each way on the ``SOCK_SEQPACKET`` connection, and a connection has at
most one call in flight (the client waits for each reply), so a call's queue is bounded by
construction. Frames (little endian), told apart from the session's JSON messages by their first
byte, which JSON never starts with:

- request: ``0x00``, method index (in ``METHODS``), call id (u32), deadline in seconds (f32),
  then the serialized request message;
- reply: ``0x00``, status (``STATUS_OK`` or a gRPC status code's number), the call id, then the
  serialized reply message, or, for an error, ``kvstore-error name`` + ``\\n`` + the message.

The call id lets a client drop a late reply to a call it stopped waiting for.

Decoding a peer's frame (``decode_request``, ``decode_reply``) raises ``FrameError`` (a
``ValueError``) with a message for any bytes that are not a frame, and nothing else: the daemon
answers it with an error reply (``INVALID_ARGUMENT``) and serves on.

Shared by ``kvstore.client`` and ``kvstore.daemon`` (core types only: it imports nothing of ours).
"""

from __future__ import annotations

import struct

MAGIC = 0
# The calls a client may send this way: small, unary, and the ones every batch makes. Order is
# the wire format: append only.
METHODS = (
    "Lookup",
    "Reserve",
    "Commit",
    "Abort",
    "Acquire",
    "Release",
    "Prefetch",
    "Delete",
    "Bind",
)
METHOD_INDEX = {name: i for i, name in enumerate(METHODS)}

REQUEST = struct.Struct("<BBIf")
REPLY = struct.Struct("<BBI")
STATUS_OK = 0
STATUS_INVALID = 3  # grpc.StatusCode.INVALID_ARGUMENT
STATUS_EXHAUSTED = 8  # grpc.StatusCode.RESOURCE_EXHAUSTED
STATUS_INTERNAL = 13  # grpc.StatusCode.INTERNAL

MAX_REQUEST_BYTES = 64 << 10
"""Largest request datagram the daemon reads (a 2000-key lookup); larger calls go over gRPC."""
MAX_REPLY_BYTES = 256 << 10
"""Largest reply datagram (an acquire of max_keys_per_request keys: ~20 bytes a key)."""


class FrameError(ValueError):
    """Bytes that are not a frame of this protocol; the message says why. ``call_id``: the
    frame's call id where its header could be read (0 otherwise), for the error reply."""

    def __init__(self, message: str, call_id: int = 0) -> None:
        super().__init__(message)
        self.call_id = call_id


def call_id_of(frame: bytes | memoryview) -> int:
    """The call id of a request frame, 0 if it is too short to have one (for an error reply)."""
    return REQUEST.unpack_from(frame)[2] if len(frame) >= REQUEST.size else 0


def encode_request(method: int, call_id: int, timeout_s: float, body: bytes) -> bytes:
    return REQUEST.pack(MAGIC, method, call_id, timeout_s) + body


def decode_request(frame: bytes | memoryview) -> tuple[int, int, float, memoryview]:
    """(method index, call id, timeout_s, body) of a request frame; ``FrameError`` for any
    bytes that are not one (too short, another first byte, an unknown method, a deadline that
    is not a positive number of seconds). Pure: the peer's bytes decide nothing else."""
    if len(frame) < REQUEST.size or frame[0] != MAGIC:
        raise FrameError(f"not a call frame (a call is at least {REQUEST.size} bytes, from 0x00)")
    _, method, call_id, timeout_s = REQUEST.unpack_from(frame)
    if method >= len(METHODS):
        raise FrameError(f"unknown method index {method}", call_id)
    if not timeout_s > 0:  # also NaN
        raise FrameError(f"bad deadline {timeout_s!r} (seconds, positive)", call_id)
    return method, call_id, timeout_s, memoryview(frame)[REQUEST.size :]


def encode_reply(call_id: int, body: bytes) -> bytes:
    return REPLY.pack(MAGIC, STATUS_OK, call_id) + body


def encode_error(call_id: int, status: int, name: str, message: str) -> bytes:
    text = f"{name}\n{message}".encode()[: MAX_REQUEST_BYTES - REPLY.size]
    return REPLY.pack(MAGIC, status, call_id) + text


def decode_reply(frame: memoryview) -> tuple[int, int, memoryview]:
    """(status, call id, body); ``FrameError`` for a frame that is not a reply."""
    if len(frame) < REPLY.size or frame[0] != MAGIC:
        raise FrameError("not a call reply")
    _, status, call_id = REPLY.unpack_from(frame)
    return status, call_id, frame[REPLY.size :]


def decode_error(body: memoryview) -> tuple[str, str]:
    """(kvstore-error name, message) of an error reply."""
    name, _, message = bytes(body).decode("utf-8", "replace").partition("\n")
    return name, message
