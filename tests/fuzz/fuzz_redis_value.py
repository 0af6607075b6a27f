"""Fuzz target: a value read back from Redis (``kvstore.tiers.redis_tier.value``), through the
steps the Redis tier's read takes (``RedisTier.get_into_checked``): the header parsed for the
block asked for, the value's length checked against it, a keyed value's MAC verified, the
payload checked and decoded (``tier._decode_values``: lz4, fp8, fp8+lz4), the block verified
against the header's checksum.

Whoever can write to Redis can compute xxh3: the input's first byte asks for fix-ups that make
its header's and payload's checksums (and, for a keyed reader, the MAC) right, so the payload
decoders meet arbitrary payloads that pass every checksum. The second byte picks the block
length and whether the reader is keyed or expects a checksum.

Contract: nothing raises; a value accepted is the block its header describes: the header is
the one the encoder writes for that block (``pack_header``/``pack_header_v2`` of its fields,
byte for byte), its checksum is the block's, and the block is its payload decoded."""

from __future__ import annotations

import _harness
import atheris

with atheris.instrument_imports(include=["kvstore"]):
    from kvstore.checksum import block_checksum
    from kvstore.tiers import codecs
    from kvstore.tiers.redis_tier import tier
    from kvstore.tiers.redis_tier import value as fmt

import xxhash

KEY = bytes(range(32))
NAMESPACE = bytes(range(100, 116))
MAC_KEY = fmt.mac_key(b"fuzzing secret, sixteen bytes or more")
# Block lengths a reader asks for: the fp8 blocks of FP8_FORMAT, and a few others.
FP8_FORMAT = codecs.BlockFormat("bfloat16", (1, 2, 16, 1, 64))
LENGTHS = (4096, 256, 96, 1, 8192)
FIX_HEADER_SUM, FIX_STORED_SUM, FIX_NAMES, FIX_MAC, FIX_LENGTH = 1, 2, 4, 8, 16


def fixed(value: bytearray, flags: int, length: int, keyed: bool) -> None:
    """Make the checksums (and names, lengths, MAC) the value's fields state right."""
    v2 = len(value) > 4 and value[4] == 2 and not keyed
    head = fmt.V2_HEADER_BYTES if v2 else fmt.HEADER_BYTES
    fields = head - 8
    if len(value) < head:
        return
    if flags & FIX_NAMES:
        key_at = fields - 48
        value[key_at : key_at + 32] = KEY
        if not (keyed and not v2):
            value[key_at + 32 : key_at + 48] = NAMESPACE
    if flags & FIX_LENGTH:
        value[8:16] = length.to_bytes(8, "little")
    payload = bytes(value[head:])
    if flags & FIX_STORED_SUM and not v2:
        value[24:32] = len(payload).to_bytes(8, "little")
        value[32:40] = block_checksum(payload, NAMESPACE, KEY).to_bytes(8, "little")
    if flags & FIX_MAC and keyed and not v2:
        value[fields - 16 : fields] = fmt.mac(MAC_KEY, NAMESPACE, bytes(value[:fields]), payload)
    if flags & FIX_HEADER_SUM:
        value[fields:head] = xxhash.xxh3_64_intdigest(bytes(value[:fields])).to_bytes(8, "little")


def read(value: bytes, length: int, expected: int | None, keyed: bool) -> bytes | None:
    """The block the Redis tier's read yields for ``value``, or None for a miss."""
    head = memoryview(bytearray(fmt.HEADER_BYTES))
    out = memoryview(bytearray(length))
    n = len(value)
    if not fmt.HEADER_BYTES <= n <= fmt.HEADER_BYTES + length:
        return None  # the RESP reader skips it (``read_value_into``)
    head[:] = value[: fmt.HEADER_BYTES]
    out[: n - fmt.HEADER_BYTES] = value[fmt.HEADER_BYTES :]
    h = fmt.parse_header(head, KEY, NAMESPACE, length, expected, keyed)
    if h is None:
        return None
    assert h.header_bytes in (fmt.HEADER_BYTES, fmt.V2_HEADER_BYTES), h
    assert h.codec in codecs.NAME_OF and 0 < h.stored_length <= length, h
    if n != h.header_bytes + h.stored_length:
        return None
    if keyed and not tier._check_macs(MAC_KEY, NAMESPACE, [head], [out], [(0, h)])[0]:
        return None
    if h.codec != codecs.CODEC_NONE or h.header_bytes != fmt.HEADER_BYTES:
        decoded = tier._decode_values(NAMESPACE, [(KEY, expected, out)], [head], [out], [(0, h)])
        if decoded[0] is None:
            return None
        out[:] = decoded[0]
    if block_checksum(out, NAMESPACE, KEY) != h.checksum:
        return None
    # Accepted: the value must be exactly what the encoder writes for this block.
    payload = value[h.header_bytes :]
    if h.header_bytes == fmt.V2_HEADER_BYTES:
        assert value[: h.header_bytes] == fmt.pack_header_v2(KEY, NAMESPACE, length, h.checksum)
        assert payload == bytes(out)
    else:
        want = fmt.pack_header(
            KEY,
            NAMESPACE,
            length,
            h.checksum,
            h.codec,
            h.stored_length,
            h.stored_checksum,
            (MAC_KEY, payload) if keyed else None,
        )
        assert value[: fmt.HEADER_BYTES] == want, "an accepted header the encoder never writes"
        assert block_checksum(payload, NAMESPACE, KEY) == h.stored_checksum
    if h.codec == codecs.CODEC_NONE:
        assert payload == bytes(out)
    if expected is not None:
        assert h.checksum == expected
    return bytes(out)


def TestOneInput(data: bytes) -> None:
    if len(data) < 2:
        return
    flags, pick = data[0], data[1]
    length = LENGTHS[pick % len(LENGTHS)]
    keyed = bool(pick & 0x10)
    value = bytearray(data[2:])
    fixed(value, flags, length, keyed)
    block = read(bytes(value), length, None, keyed)
    if block is not None and pick & 0x20:
        # Asked again with the checksum the host expects: the same block.
        assert read(bytes(value), length, block_checksum(block, NAMESPACE, KEY), keyed) == block


if __name__ == "__main__":
    _harness.main(TestOneInput)
