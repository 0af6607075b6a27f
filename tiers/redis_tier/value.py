"""The Redis tier's value format (version 1) and key names: pure functions, no IO.

A block is stored as one Redis string, an 80-byte header followed by the raw block bytes.
Integers are little-endian:

    magic "KVRB" | version u8 | codec u8 | flags u16 | length u64 | checksum u64 |
    key (32 bytes) | namespace fingerprint (16 bytes) | xxh3-64 of the 72 bytes before

``length`` is the raw block size, ``checksum`` the xxh3-64 of the raw block (what every tier
stores). Codec 0 (none) is the only one written; a reader rejects any other, so a later codec
cannot be taken for raw bytes. The header names its key and namespace, so a value copied or
renamed under another key is refused, and its own checksum makes every header byte count.
"""

from __future__ import annotations

import struct

import xxhash

from kvstore.keys import FINGERPRINT_BYTES, KEY_BYTES

MAGIC = b"KVRB"
VERSION = 2  # 2: the checksum is bound to namespace and key (kvstore.checksum)
CODEC_NONE = 0
_FIELDS = struct.Struct("<4sBBHQQ32s16s")
_U64 = struct.Struct("<Q")
HEADER_BYTES = _FIELDS.size + _U64.size
assert HEADER_BYTES == 80


def pack_header(key: bytes, namespace: bytes, length: int, checksum: int) -> bytes:
    fields = _FIELDS.pack(MAGIC, VERSION, CODEC_NONE, 0, length, checksum, key, namespace)
    return fields + _U64.pack(xxhash.xxh3_64_intdigest(fields))


def header_checksum(
    head: bytes | bytearray | memoryview,
    key: bytes,
    namespace: bytes,
    length: int,
    expected: int | None,
) -> int | None:
    """The block checksum a header states if it is intact and describes exactly this block
    (key, namespace, raw length, codec none and, when given, ``expected``); else None."""
    if len(head) != HEADER_BYTES:
        return None
    fields = memoryview(head)[: _FIELDS.size]
    if _U64.unpack_from(head, _FIELDS.size)[0] != xxhash.xxh3_64_intdigest(fields):
        return None
    magic, version, codec, flags, h_length, h_checksum, h_key, h_ns = _FIELDS.unpack(fields)
    if (magic, version, codec, flags) != (MAGIC, VERSION, CODEC_NONE, 0):
        return None
    if h_key != key or h_ns != namespace or h_length != length:
        return None
    if expected is not None and h_checksum != expected:
        return None
    return int(h_checksum)


def check_key_prefix(prefix: str) -> str:
    # Braces would make Redis Cluster hash only the text between them: every block of every
    # namespace would land in one slot.
    if not prefix or "{" in prefix or "}" in prefix or any(c.isspace() for c in prefix):
        raise ValueError(f"key_prefix {prefix!r} must be non-empty, without braces or spaces")
    return prefix


def check_namespace(namespace: bytes) -> bytes:
    if not isinstance(namespace, bytes) or len(namespace) != FINGERPRINT_BYTES:
        raise ValueError(f"namespace must be the {FINGERPRINT_BYTES}-byte fingerprint")
    return namespace


def check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"block keys must be {KEY_BYTES} bytes")
    return key


def namespace_prefix(key_prefix: str, namespace: bytes) -> bytes:
    """``b"<key_prefix>:<namespace hex>:"``; a block's Redis key is this plus its key's hex."""
    return f"{key_prefix}:{namespace.hex()}:".encode()


def block_name(ns_prefix: bytes, key: bytes) -> bytes:
    return ns_prefix + key.hex().encode()


def index_name(ns_prefix: bytes) -> bytes:
    """The namespace's age index (a sorted set of raw keys). Its suffix is not 64 hex digits,
    so it never collides with a block's name."""
    return ns_prefix + b"age"
