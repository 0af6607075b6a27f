"""Arena slots that hold fp8 payloads: a namespace whose ``[[codecs]]`` rule says
``cpu = "fp8"`` gets CPU-tier slots of ``codecs.fp8_payload_bytes`` (~0.5x of a bf16 block).

Writers fill them with the block's fp8 payload: a paged cache through
``kernels.gather_fp8_payloads``, which quantizes in the kernel (on CUDA straight into the
pinned arena, so only the payload crosses PCIe), a plain put with ``codecs.fp8_encode`` on the
host. A commit carries each payload's checksum and its decoded form's. Readers get the decoded
form: a paged cache through ``kernels.scatter_fp8_payloads`` (dequantized in the kernel), a
plain get with ``codecs.fp8_decode`` on the host. Every check is the key's: a payload that does
not match its checksum, or does not decode to its decoded form's checksum, is a miss.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvstore import kernels
from kvstore.checksum import seeded_checksum
from kvstore.client._common import MappedArena
from kvstore.client.session import SlabUnavailable
from kvstore.layout import KVLayout
from kvstore.tiers import codecs


def _format(layout: KVLayout) -> codecs.BlockFormat:
    fmt = codecs.block_format_of(layout)
    if fmt is None:
        raise ValueError(f"a {layout.dtype} block has no fp8 payload")
    return fmt


def decoded_checksum(payload: memoryview, block_bytes: int, seed: int) -> int | None:
    """The checksum of a payload's decoded form (None: it does not decode to a block of
    ``block_bytes``)."""
    out = memoryview(bytearray(block_bytes))
    if not codecs.fp8_decode(payload, out):
        return None
    return seeded_checksum(out, seed)


def payload_checksums(payload: memoryview, block_bytes: int, seed: int) -> tuple[int, int]:
    """(its decoded form's checksum, its own) of a payload this client just wrote."""
    decoded = decoded_checksum(payload, block_bytes, seed)
    if decoded is None:
        raise AssertionError("a fresh fp8 payload failed to decode")
    return decoded, seeded_checksum(payload, seed)


def encode_into(
    arena: MappedArena,
    layout: KVLayout,
    rows: torch.Tensor,
    offsets: Sequence[int],
    seeds: Sequence[int],
    payload_bytes: int,
) -> tuple[list[int], list[int]]:
    """Encode ``rows[i]`` (``[n, block_bytes]`` uint8) into the payload slot at ``offsets[i]``
    (skipping -1): (checksums of the decoded forms, checksums of the payloads), in order. Each
    payload is encoded into private memory and hashed there before it is copied into the slot,
    so the checksums vouch for what this client wrote, whatever writes into the slot."""
    fmt = _format(layout)
    block_bytes = layout.block_bytes
    private = memoryview(bytearray(payload_bytes))
    decoded_sums, payload_sums = [], []
    rows_np = rows.numpy()
    for i, address in enumerate(offsets):
        if address < 0:
            continue
        codecs.fp8_encode(memoryview(rows_np[i]).cast("B"), fmt, private)
        decoded, own = payload_checksums(private, block_bytes, seeds[i])
        decoded_sums.append(decoded)
        payload_sums.append(own)
        arena.slot(address, payload_bytes).numpy()[:] = np.frombuffer(private, dtype=np.uint8)
    return decoded_sums, payload_sums


def slot_checksums(
    arena: MappedArena,
    layout: KVLayout,
    offsets: Sequence[int],
    seeds: Sequence[int],
    payload_bytes: int,
) -> tuple[list[int], list[int]]:
    """(decoded-form checksums, payload checksums) of payloads written into slots (by the
    gather kernel), each taken from one private copy of its slot."""
    decoded_sums, payload_sums = [], []
    for address, seed in zip(offsets, seeds, strict=True):
        private = memoryview(arena.slot(address, payload_bytes).numpy().tobytes())
        decoded, own = payload_checksums(private, layout.block_bytes, seed)
        decoded_sums.append(decoded)
        payload_sums.append(own)
    return decoded_sums, payload_sums


def decode_out(
    arena: MappedArena,
    offsets: Sequence[int],
    checksums: Sequence[int],
    payload_checksums: Sequence[int],
    seeds: Sequence[int],
    payload_bytes: int,
    rows: torch.Tensor,
    verify: bool = True,
) -> int:
    """Decode payload slots into ``rows`` (``[>= n, block_bytes]`` uint8); how many leading
    blocks arrived intact. Each payload is copied out once and checked there (its checksum),
    decoded from that copy, and the block checked against its decoded form's checksum: a slot
    scribbled on, reused or not decoding is a miss, and so is everything after it."""
    rows_np = rows.numpy()
    for i, address in enumerate(offsets):
        try:
            private = memoryview(arena.slot(address, payload_bytes).numpy().tobytes())
        except SlabUnavailable:
            return i
        if verify and seeded_checksum(private, seeds[i]) != payload_checksums[i]:
            return i
        out = memoryview(rows_np[i]).cast("B")
        if not codecs.fp8_decode(private, out):
            return i
        if verify and seeded_checksum(out, seeds[i]) != checksums[i]:
            return i
    return len(offsets)


def gather_into_slots(
    kv_caches: Sequence[torch.Tensor],
    block_ids: list[int],
    arena: MappedArena,
    layout: KVLayout,
    offsets: Sequence[int],
    seeds: Sequence[int],
    payload_bytes: int,
) -> tuple[list[int], list[int]]:
    """Quantize physical blocks into their payload slots with the gather kernel: (decoded-form
    checksums, payload checksums). CPU caches are gathered into private memory, hashed there
    and then copied into the slot, so the checksums vouch for the engine's blocks whatever
    writes into the slots; CUDA caches are gathered straight into the pinned slots (the kernel
    writes across PCIe, payload bytes only) and hashed from them after the kernel, as the
    lossless CUDA path is."""
    if kv_caches and kv_caches[0].device.type == "cuda":
        for block, address in zip(block_ids, offsets, strict=True):
            out = arena.slot(address, payload_bytes).view(1, payload_bytes)
            kernels.gather_fp8_payloads(kv_caches, [block], out)
        torch.cuda.current_stream(kv_caches[0].device).synchronize()
        return slot_checksums(arena, layout, offsets, seeds, payload_bytes)
    private = torch.empty((1, payload_bytes), dtype=torch.uint8)
    view = memoryview(private.numpy().data).cast("B")
    decoded_sums, payload_sums = [], []
    for block, address, seed in zip(block_ids, offsets, seeds, strict=True):
        kernels.gather_fp8_payloads(kv_caches, [block], private)
        decoded, own = payload_checksums(view, layout.block_bytes, seed)
        decoded_sums.append(decoded)
        payload_sums.append(own)
        arena.slot(address, payload_bytes).copy_(private[0])
    return decoded_sums, payload_sums


def scatter_from_slots(
    arena: MappedArena,
    offsets: Sequence[int],
    payload_checksums: Sequence[int],
    seeds: Sequence[int],
    payload_bytes: int,
    kv_caches: Sequence[torch.Tensor],
    block_ids: list[int],
) -> int:
    """Dequantize payload slots into physical blocks with the scatter kernel; how many leading
    blocks arrived intact. Each slot is checked before the kernel reads it and again after (a
    slot that changed under the copy fails); a payload whose header does not state this
    cache's blocks is a miss, and the copy stops at the first miss."""
    cuda = bool(kv_caches) and kv_caches[0].device.type == "cuda"
    for i, (address, block) in enumerate(zip(offsets, block_ids, strict=True)):
        try:
            slot = arena.slot(address, payload_bytes)
        except SlabUnavailable:
            return i
        if seeded_checksum(slot.numpy(), seeds[i]) != payload_checksums[i]:
            return i
        try:
            kernels.scatter_fp8_payloads(slot.view(1, payload_bytes), kv_caches, [block])
        except ValueError:
            return i
        if cuda:
            torch.cuda.current_stream(kv_caches[0].device).synchronize()
        if seeded_checksum(slot.numpy(), seeds[i]) != payload_checksums[i]:
            return i
    return len(offsets)
