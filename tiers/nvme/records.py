"""Records of the NVMe tier: the values it hands out (``NvmeRecord``, ``CheckReport``), the
per-slot state and record identity it keeps, in flat arrays (``RecordTable``), and the sequence
numbers its pages take (``SeqCounter``)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.errors import KVStoreError
from kvstore.keys import KEY_BYTES


class NvmeFormatError(KVStoreError, ValueError):
    """The slab file is not a tier this configuration may open: another geometry (capacity or
    slab size), or a newer format. The message names what the file holds and what was asked.
    Nothing was written."""


@dataclass(frozen=True)
class NvmeRecord:
    """A committed block on disk. ``slot`` is the byte offset of its header in the slab file;
    ``length`` is the raw block size, ``stored_length`` the bytes stored (encoded or not);
    ``checksum`` is that of the block a read yields (for a lossy codec, the decoded block)."""

    slot: int
    key: bytes
    namespace: bytes
    length: int
    stored_length: int
    checksum: int
    seq: int


@dataclass(frozen=True)
class CheckProblem:
    """``kind``: "torn" (a live slot's header is not a valid header, or its payload is cut
    short), "corrupt" (payload checksum or decompression failed), "mismatch" (a valid header
    naming another record), "orphan" (a valid record header in a slot the tier holds free: it
    would come back at the next open), "io_error", "metadata" (a tier opened read-only only:
    a damaged metadata copy or slab descriptor, or a truncated file; ``slot`` is the offset of
    the damage, and a read-write open repairs it, losing no more than ``detail`` says)."""

    slot: int
    kind: str
    key: bytes | None
    detail: str


@dataclass(frozen=True)
class CheckReport:
    slots_checked: int
    records_ok: int
    problems: list[CheckProblem]
    fixed: bool

    @property
    def ok(self) -> bool:
        return not self.problems


FREE, ALLOCATED, WRITING, LIVE = 0, 1, 2, 3
FREE_AFTER_WRITE = 0x80
"""Flag on a WRITING slot: ``free`` was called (or the write cancelled); free it when it ends."""


class Ident(NamedTuple):
    """What a slot's header must say for its record to be the one the tier committed."""

    key: bytes
    namespace: bytes
    length: int
    stored_length: int
    codec: int
    checksum: int
    seq: int


class SeqCounter:
    """The tier's sequence numbers: every record header, tombstone and slab descriptor it writes
    takes the next one; the metadata records ``next``, and recovery resumes past the highest
    found on disk. One per tier, shared by the parts that write pages; loop-only."""

    def __init__(self) -> None:
        self.next = 1

    def take(self) -> int:
        seq = self.next
        self.next += 1
        return seq


class NamespaceIds:
    """Namespace fingerprints interned as small ints, shared by every ``RecordTable``."""

    def __init__(self) -> None:
        self.names: list[bytes] = []
        self._ids: dict[bytes, int] = {}

    def id(self, namespace: bytes) -> int:
        ns_id = self._ids.get(namespace)
        if ns_id is None:
            ns_id = self._ids[namespace] = len(self.names)
            self.names.append(namespace)
        return ns_id


class RecordTable:
    """State and committed-record identity of every slot of one carved slab, indexed by the
    slot's index in the slab; made when the slab is carved, dropped when it is uncarved.
    Arrays, not an object per slot: ~70 bytes a slot where an object, its boxed ints and a dict
    entry cost ~380, and the NVMe tier holds the most blocks of any tier. Snapshots (``ident``)
    go to IO threads; the arrays are touched on the loop only."""

    def __init__(self, n: int, namespaces: NamespaceIds) -> None:
        self.state = bytearray(n)  # every slot FREE
        self.codec = bytearray(n)
        self.length = array("I", bytes(4 * n))
        self.stored_length = array("I", bytes(4 * n))
        self.seq = array("Q", bytes(8 * n))
        self.checksum = array("Q", bytes(8 * n))
        # The checksum the block was committed with: ``checksum`` (what a read yields) unless a
        # lossy codec wrote the record. Kept in memory only; a record recovered at open has
        # only its decoded form.
        self.committed = array("Q", bytes(8 * n))
        self.ns = array("I", bytes(4 * n))
        self._keys = bytearray(n * KEY_BYTES)
        self._namespaces = namespaces
        assert self.length.itemsize == 4 and self.seq.itemsize == 8

    def __len__(self) -> int:
        return len(self.state)

    def set_record(self, i: int, ident: Ident, committed: int | None = None) -> None:
        self._keys[i * KEY_BYTES : (i + 1) * KEY_BYTES] = ident.key
        self.ns[i] = self._namespaces.id(ident.namespace)
        self.length[i], self.stored_length[i] = ident.length, ident.stored_length
        self.codec[i], self.checksum[i], self.seq[i] = ident.codec, ident.checksum, ident.seq
        self.committed[i] = ident.checksum if committed is None else committed

    def key(self, i: int) -> bytes:
        return bytes(self._keys[i * KEY_BYTES : (i + 1) * KEY_BYTES])

    def ident(self, i: int) -> Ident:
        return Ident(
            self.key(i),
            self._namespaces.names[self.ns[i]],
            self.length[i],
            self.stored_length[i],
            self.codec[i],
            self.checksum[i],
            self.seq[i],
        )
