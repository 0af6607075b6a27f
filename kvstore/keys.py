"""Block keys: chained SHA-256 over a namespace seed and the token ids of each full block.

Encoding (hash version 1), pinned by known-answer tests in tests/test_keys.py:

* The namespace seed ``h0 = SHA-256(b"kvstore.ns.v1" || field_1 || ... || field_n)`` where each
  field is its UTF-8 text prefixed by its byte length as a little-endian uint32, in the order
  model, revision, tenant, dtype, num_layers, num_kv_heads, head_dim, block_size, tp_rank,
  tp_size, hash_version (integers written in decimal), then, for a scaled layout only (FP8 KV,
  ``KVLayout.scale_format != "none"``), its scale format. Length prefixes make the encoding
  unambiguous; no field can run into the next. Unscaled layouts keep the eleven fields, so
  their keys are those of every earlier build; FP8 blocks with and without scales (and bf16
  blocks) never share a key or a fingerprint.
* ``h_i = SHA-256(h_{i-1} || token ids of block i as little-endian int64 || extra_i)``, where
  ``extra_i`` are optional bytes that must also match for reuse (a LoRA id, an image hash).
* Only full blocks get keys. A key names the whole prefix up to its block: a hit on key i means
  the prefix through block i matches. Python's ``hash()`` is never used, so every process, host
  and Python version computes the same keys.

The namespace fingerprint stored with every block in every tier is the first 16 bytes of
``SHA-256(b"kvstore.fp.v1" || h0)``.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType, cast

import numpy as np
import torch

from kvstore.layout import KVLayout

BlockKey = NewType("BlockKey", bytes)
"""32 bytes: SHA-256 of the namespace seed and every token of the prefix through this block."""

KEY_BYTES = 32
FINGERPRINT_BYTES = 16
HASH_VERSION = 1


def _field(value: str | int) -> bytes:
    data = str(value).encode("utf-8")
    return struct.pack("<I", len(data)) + data


@dataclass(frozen=True)
class Namespace:
    """Model identity + layout fingerprint + tenant salt. Seeds the key chain, so blocks of two
    namespaces never share a key."""

    model: str
    layout: KVLayout
    revision: str = ""
    tenant: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    hash_version: int = HASH_VERSION

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("Namespace.model must be a non-empty model id")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} out of range for tp_size {self.tp_size}")
        if self.hash_version != HASH_VERSION:
            raise ValueError(
                f"hash_version {self.hash_version} unsupported (this build: {HASH_VERSION})"
            )

    @property
    def name(self) -> str:
        """Human-readable identity; two clients with one name must share one fingerprint."""
        name = self.model + (f"@{self.revision}" if self.revision else "")
        name += f"/{self.tenant or '-'}"
        if self.tp_size > 1:
            name += f"/tp{self.tp_rank}of{self.tp_size}"
        return name

    # Computed once per instance (it is frozen): every checksum seed of a batch, on both sides,
    # starts from the fingerprint, two SHA-256s away (~7 us).
    @functools.cached_property
    def seed(self) -> bytes:
        lay = self.layout
        fields = (
            self.model,
            self.revision,
            self.tenant,
            lay.dtype_name,
            lay.num_layers,
            lay.num_kv_heads,
            lay.head_dim,
            lay.block_size,
            self.tp_rank,
            self.tp_size,
            self.hash_version,
        ) + ((lay.scale_format,) if lay.scaled else ())
        return hashlib.sha256(b"kvstore.ns.v1" + b"".join(_field(f) for f in fields)).digest()

    @functools.cached_property
    def fingerprint(self) -> bytes:
        return hashlib.sha256(b"kvstore.fp.v1" + self.seed).digest()[:FINGERPRINT_BYTES]


def _token_bytes(token_ids: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        arr = token_ids.detach().cpu().numpy()
    else:
        arr = np.asarray(token_ids)
        if arr.ndim != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype="<i8").tobytes()


def block_hashes(
    seed: bytes,
    token_ids: Sequence[int] | np.ndarray | torch.Tensor,
    block_size: int = 16,
    extra_keys: Sequence[bytes] | None = None,
) -> list[BlockKey]:
    """One 32-byte key per full block of ``token_ids``, chained from ``seed`` (see module doc)."""
    if len(seed) != KEY_BYTES:
        raise ValueError(f"seed must be {KEY_BYTES} bytes, got {len(seed)}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = _token_bytes(token_ids)
    n_blocks = len(data) // 8 // block_size
    if extra_keys is not None and len(extra_keys) < n_blocks:
        raise ValueError(
            f"extra_keys has {len(extra_keys)} entries, {n_blocks} blocks need one each"
        )
    stride = block_size * 8
    keys: list[BlockKey] = []
    prev = seed
    for i in range(n_blocks):
        h = hashlib.sha256(prev)
        h.update(data[i * stride : (i + 1) * stride])
        if extra_keys is not None and extra_keys[i]:
            h.update(extra_keys[i])
        prev = h.digest()
        keys.append(BlockKey(prev))
    return keys


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """Concatenate keys for the wire, checking each is exactly 32 bytes."""
    # The common case checked in C, in two passes (join, then the set of lengths): every key
    # has 32 items and all of them together 32 bytes each, so each is 32 bytes (an item is at
    # least a byte). A lookup of 128 keys pays ~6 us; one more pass for the types cost ~10.
    try:
        packed = b"".join(keys)
    except TypeError:
        packed = b""
    if len(packed) == KEY_BYTES * len(keys) and set(map(len, keys)) <= {KEY_BYTES}:
        return packed
    for i, k in enumerate(keys):
        if not isinstance(k, bytes | bytearray) or len(k) != KEY_BYTES:
            got = len(k) if isinstance(k, bytes | bytearray) else type(k).__name__
            raise ValueError(f"key {i} must be {KEY_BYTES} bytes, got {got}")
    raise AssertionError("unreachable: the keys passed one check and failed the other")


class SplitKeys(list):  # type: ignore[type-arg]  # list[BlockKey]; generic list at run time
    """Keys split from a packed field by ``unpack_keys``: each is 32 bytes by construction,
    so a bound check that a request's keys are (``BlockStore.check_keys``) may skip them."""

    __slots__ = ()


def unpack_keys(packed: bytes) -> list[BlockKey]:
    """Split a packed key field; raises ValueError if its length is not a multiple of 32."""
    if len(packed) % KEY_BYTES:
        raise ValueError(f"packed keys are {len(packed)} bytes, not a multiple of {KEY_BYTES}")
    # BlockKey is bytes at run time: split in C by a struct of n 32-byte fields (128 keys:
    # ~5 us, against ~17 us for a list of slices); every request with keys pays this.
    return cast(list[BlockKey], SplitKeys(_key_struct(len(packed) // KEY_BYTES).unpack(packed)))


@functools.lru_cache(maxsize=64)
def _key_struct(n: int) -> struct.Struct:
    return struct.Struct(f"{KEY_BYTES}s" * n)
