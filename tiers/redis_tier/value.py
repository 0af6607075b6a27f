"""The Redis tier's value format (version 3) and key names: pure functions, no IO.

A block is stored as one Redis string, a 96-byte header followed by the payload its codec
(``kvstore.tiers.codecs``) wrote. Integers are little-endian:

    magic "KVRB" | version u8 | codec u8 | flags u16 | length u64 | checksum u64 |
    stored length u64 | stored checksum u64 | key (32 bytes) | namespace fingerprint (16 bytes) |
    xxh3-64 of the 88 bytes before

``length`` is the raw block size; ``checksum`` the bound checksum (``kvstore.checksum``) of the
block a read yields (for a lossy codec, of the decoded block, taken when it was encoded);
``stored length`` and ``stored checksum`` describe the payload. The header names its codec, so
a reader decodes a value whatever codec the writer was configured with; it names its key and
namespace, so a value copied or renamed under another key is refused, and its own checksum makes
every header byte count. Version 2 values (an 80-byte header without the stored fields, codec
none) are still read.

xxh3 is a checksum, not a MAC: whoever can write to Redis can forge a value that passes it.
With a shared secret (``redis.mac_key_file``) every value is *keyed*: flag bit 0 is set and the
namespace field holds ``mac`` (a keyed BLAKE2b-128 of the namespace fingerprint, the header's
other fields and the payload) instead, which a reader with the secret verifies before trusting
anything else; it then reads keyed values only. A reader without the secret reads unkeyed values
only (a keyed one has flags it does not know).
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple

import xxhash

from kvstore.keys import FINGERPRINT_BYTES, KEY_BYTES
from kvstore.tiers import codecs

MAGIC = b"KVRB"
VERSION = 3  # 3: codecs and the payload's own checksum. 2: checksums bound to namespace and key
CODEC_NONE = codecs.CODEC_NONE
_FIELDS = struct.Struct("<4sBBHQQQQ32s16s")
_FIELDS_V2 = struct.Struct("<4sBBHQQ32s16s")
_U64 = struct.Struct("<Q")
HEADER_BYTES = _FIELDS.size + _U64.size
CODEC_OFFSET = 5  # of the codec byte, in version 2 and 3 headers alike
V2_HEADER_BYTES = _FIELDS_V2.size + _U64.size
assert HEADER_BYTES == 96 and V2_HEADER_BYTES == 80
KEYED = 1  # flags: the namespace field holds the value's MAC
MAC_BYTES = 16
_MACED = _FIELDS.size - MAC_BYTES  # header bytes a MAC covers (all fields before it)


class ValueHeader(NamedTuple):
    """What a value's header states: its header's size (96, or 80 for version 2), the codec
    of its payload, the payload's length and checksum, and the checksum of the block a read
    yields."""

    header_bytes: int
    codec: int
    stored_length: int
    stored_checksum: int
    checksum: int
    mac: bytes = b""  # a keyed value's MAC, to verify (``mac``) before trusting the rest


def mac_key(secret: bytes) -> bytes:
    """The MAC key derived from an operator's secret (any length, at least 16 bytes)."""
    if len(secret) < 16:
        raise ValueError("the redis MAC secret must be at least 16 bytes")
    return hashlib.blake2b(secret, digest_size=32, person=b"kvstore-mac-key").digest()


def mac(key: bytes, namespace: bytes, head: bytes | memoryview, payload: object) -> bytes:
    """The MAC of a keyed value: over the namespace fingerprint, the header's fields before the
    MAC (magic to block key: lengths, checksums, codec) and the stored payload."""
    h = hashlib.blake2b(key=key, digest_size=MAC_BYTES, person=b"kvstore-redis-v3")
    h.update(namespace)
    h.update(head[:_MACED])
    h.update(payload)  # type: ignore[arg-type]
    return h.digest()


def pack_header(
    key: bytes,
    namespace: bytes,
    length: int,
    checksum: int,
    codec: int = CODEC_NONE,
    stored_length: int | None = None,
    stored_checksum: int | None = None,
    keyed: tuple[bytes, object] | None = None,
) -> bytes:
    """A version 3 header; ``keyed`` (MAC key, stored payload): a keyed value's, its MAC in
    the namespace field."""
    stored_length = length if stored_length is None else stored_length
    stored_checksum = checksum if stored_checksum is None else stored_checksum
    flags, field = (KEYED, b"\0" * MAC_BYTES) if keyed else (0, namespace)
    fields = _FIELDS.pack(
        MAGIC, VERSION, codec, flags, length, checksum, stored_length, stored_checksum, key, field
    )
    if keyed:
        tag = mac(keyed[0], namespace, fields, keyed[1])
        fields = fields[:_MACED] + tag
    return fields + _U64.pack(xxhash.xxh3_64_intdigest(fields))


def pack_header_v2(key: bytes, namespace: bytes, length: int, checksum: int) -> bytes:
    """A header as version 2 wrote it (tests: such values must stay readable)."""
    fields = _FIELDS_V2.pack(MAGIC, 2, CODEC_NONE, 0, length, checksum, key, namespace)
    return fields + _U64.pack(xxhash.xxh3_64_intdigest(fields))


def is_keyed(head: bytes | bytearray | memoryview) -> bool:
    """Whether a header's flags say it carries a MAC (``KEYED``)."""
    return len(head) >= 8 and bool(int.from_bytes(bytes(head[6:8]), "little") & KEYED)


def parse_header(
    head: bytes | bytearray | memoryview,
    key: bytes,
    namespace: bytes,
    length: int,
    expected: int | None,
    keyed: bool = False,
) -> ValueHeader | None:
    """What the header at the start of ``head`` (``HEADER_BYTES`` long) states, if it is
    intact (version 3, or 2) and describes exactly this block (key, namespace, raw length, a
    known codec and, when given, ``expected`` as the checksum a read yields); else None.
    ``keyed``: only a keyed value (version 3), whose ``mac`` the caller must verify."""
    if len(head) != HEADER_BYTES:
        return None
    view = memoryview(head)
    if bytes(view[4:5]) == b"\x02" and not keyed:
        fields = view[: _FIELDS_V2.size]
        if _U64.unpack_from(view, _FIELDS_V2.size)[0] != xxhash.xxh3_64_intdigest(fields):
            return None
        magic, version, codec, flags, h_length, h_checksum, h_key, h_ns = _FIELDS_V2.unpack(fields)
        stated = ValueHeader(V2_HEADER_BYTES, codec, h_length, h_checksum, h_checksum)
    else:
        fields = view[: _FIELDS.size]
        if _U64.unpack_from(view, _FIELDS.size)[0] != xxhash.xxh3_64_intdigest(fields):
            return None
        magic, version, codec, flags, h_length, h_checksum, s_len, s_sum, h_key, h_ns = (
            _FIELDS.unpack(fields)
        )
        stated = ValueHeader(HEADER_BYTES, codec, s_len, s_sum, h_checksum)
        if keyed:  # an unkeyed value is what anyone who can write to Redis could forge
            if flags != KEYED:
                return None
            stated, flags, h_ns = stated._replace(mac=h_ns), 0, namespace
        if version != VERSION or codec not in codecs.NAME_OF or not 0 < s_len <= h_length:
            return None
        if codec == CODEC_NONE and (s_len, s_sum) != (h_length, h_checksum):
            return None
    if (magic, flags) != (MAGIC, 0) or (version == 2 and codec != CODEC_NONE):
        return None
    if h_key != key or h_ns != namespace or h_length != length:
        return None
    if expected is not None and h_checksum != expected:
        return None
    return stated


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
