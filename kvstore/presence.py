"""Presence tables: which keys of one namespace are committed, readable by same-host clients
without a call.

A ``lookup`` over the session socket costs a round trip through the daemon's Python, ~200 us here
whatever the daemon does inside (``docs/architecture.md``: "The same-host data path"), and an
engine's scheduler pays one for every new request. So the daemon publishes, per namespace, a table
of its committed keys' fingerprints in a shared-memory file that same-host clients of that namespace
map read-only (handed over as a descriptor, like a slab) and probe: the first key on its own,
and a run that starts with a hit whole, with numpy. A lookup of 128 keys is then a few tens of
microseconds of the client's own CPU and no call at all, and one that misses at its first key
a few microseconds.

What a client may learn is exactly what ``lookup`` would tell it: which keys of its own
namespace are committed. A table is one namespace's (a namespace id that is recycled gets a new
table: the old one is *retired* first, see ``PresenceTable.retire``), is handed only to a
session whose principal holds an open handle of that namespace, as a read-only descriptor of
an owner-only file (``0600``, as the slabs: a client of another uid cannot reopen it writable).

The table is advisory, as ``lookup`` is (a block found may be evicted before it is read): a
fingerprint is the key's first 8 bytes, so two keys that share them are one entry (2**-64 for
honest keys, which are seeded hashes; a client forging keys only confuses its own namespace's
answers), and reads check the whole key and the block's checksum. A key the table cannot hold
(its probe window is full) sets ``overflow``: clients then ask the daemon about every key the
table does not have, so an answer is never a miss the daemon would call a hit.

A slot also says where its block's CPU copy is, and that copy's checksum (its *place*), so a
client can ``get`` a block with no call either: it copies the slot and verifies the copy
against the checksum, which is bound to the namespace and key (``kvstore.checksum``). The place
is a hint like the rest: the slot may be evicted, reused or rewritten during the copy, and
then the copy does not verify and the client calls. Nothing a client reads from the table is
trusted, only the bytes that verify: the promise is ``get``'s (a block's committed bytes, or a
miss), held by the check where the bytes are copied, as on every other path.

Layout (little endian, 8-byte words): a 64-byte header, then ``capacity + WINDOW`` slots,
then as many places (slot ``i``'s block's arena address plus one; 0: no CPU copy a client can
read, so ask), then as many checksums (of the block at slot ``i``'s place).

- header: magic ``b"KVPRESv3"``, ``capacity`` (a power of two), ``retired`` (nonzero: this
  table is no longer kept; ask for the current one), ``overflow``, ``count``, ``writing``
  (keys of the namespace some client is writing now: reserved, not committed yet; a get that
  misses while it is nonzero asks the daemon, which waits for those commits);
- a slot is ``EMPTY`` (0), ``GONE`` (1, a removed entry) or a fingerprint (>= 2). Slots come
  in buckets of ``BUCKET`` (64 bytes, a cache line); a key's *home* is the first slot of
  bucket ``fingerprint & (capacity / BUCKET - 1)``, and it lives in the first free slot of
  ``[home, home + WINDOW)`` (open addressing, linear probing, never wrapping: the table has
  ``WINDOW`` spare slots at its end), so a probe reads at most ``WINDOW`` slots, and nearly
  always just its home bucket: one cache line.

Concurrency: the daemon (one thread, its event loop) changes a table only by storing whole
aligned 8-byte words (a slot becomes a fingerprint after its place and checksum are stored, or
``GONE``; a place is cleared before its checksum changes), which readers on x86-64 and arm64
see whole; a reader may see each word before or after a concurrent store, so a lookup is
answered as of some moment during it, as a call's is. A place read with another block's
checksum (a slot reused between the two reads) fails the copy's verification: the reader
calls. A table is never reorganised in place: growing or compacting builds a new table and
retires the old one, which stays consistent.

Shared by ``kvstore.client`` and ``kvstore.daemon``.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sys
from array import array
from collections.abc import Iterable, Sequence

import numpy as np

from kvstore.keys import KEY_BYTES

MAGIC = int.from_bytes(b"KVPRESv3", "little")
HEADER_WORDS = 8
HEADER_BYTES = HEADER_WORDS * 8
# Header word indices.
_MAGIC, _CAPACITY, _RETIRED, _OVERFLOW, _COUNT, _WRITING = range(6)

EMPTY = 0
GONE = 1
_FIRST = 2  # the smallest fingerprint
_FIRST_U64 = np.uint64(_FIRST)
BUCKET = 8
"""Slots per bucket (a home is a bucket's first slot)."""
WINDOW = 4 * BUCKET
_WINDOW_STEPS = np.arange(WINDOW, dtype=np.int64)
"""Slots a key may sit past its home: the most any probe reads."""
WALK_KEYS = 1
"""Leading keys a client's probe walks one at a time before a run that still hits is probed
whole with numpy. Most gets of a request stream miss at their first key (81% of a FAST'25
trace replay's: its hits come in long runs), and walking a key costs a few microseconds where
a numpy pass costs tens once the caller's other work has left numpy's code cold in the caches
(~5 us a ufunc call, against under 1 us in a tight loop): such a get's probe of its 27 keys
took 77 us median by numpy alone, 6 us walked. Each key walked before a run goes on to numpy
is wasted, so the walk stops early."""
WALK_REMOVES = 64
"""An eviction's batch of fewer keys is removed one key at a time: in the daemon, between
calls that leave numpy's code cold in the caches, the numpy pass took 121-149 us for a
trace replay's typical 37 keys, the walk 84-88 us."""
MIN_CAPACITY = 1024
MAX_LOAD = 0.5
"""Entries plus removed slots per home position before the table is rebuilt bigger."""
MAX_SPARSENESS = 16
"""A table is not grown past this many home positions per entry to place a key: keys that
still crowd one window (forged ones) set ``overflow`` instead, so memory stays bounded."""

ARRAYS = 3
"""Word arrays of ``capacity + WINDOW`` after the header: slots, places, checksums."""

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def fingerprints(packed: bytes | memoryview) -> np.ndarray:
    """The table word of each 32-byte key of ``packed`` (their concatenation): its first 8
    bytes (little endian), at least 2 (off the two marks)."""
    return np.maximum(np.frombuffer(packed, dtype="<u8")[::4], _FIRST_U64)


def table_bytes(capacity: int) -> int:
    return HEADER_BYTES + ARRAYS * (capacity + WINDOW) * 8


def _capacity_for(entries: int, load: float = MAX_LOAD * 3 / 4) -> int:
    """The smallest capacity that holds ``entries`` at most ``load`` full. A table rebuilt
    (grown, or cleared of removed slots) is at most 3/8 full: a full one doubles, and the next
    rebuild is at least an eighth of its slots in adds or removes away. One built whole from a
    namespace's keys may be half full: it is rebuilt at its first add past that. (A quarter,
    as rebuilt tables once were, made a table grown past half full four times bigger: at a
    million keys 101 bytes a key instead of 50.)"""
    capacity = MIN_CAPACITY
    while entries > capacity * load:
        capacity *= 2
    return capacity


class PresenceTable:
    """The daemon's end of one namespace's table: it adds a key when its block is committed
    and removes it when the block is forgotten. Owned by the daemon's event loop."""

    def __init__(self, keys: Iterable[bytes] = ()) -> None:
        self._build(fingerprints(b"".join(keys)))

    @classmethod
    def of_fingerprints(
        cls, fps: np.ndarray, places: np.ndarray | None = None, sums: np.ndarray | None = None
    ) -> PresenceTable:
        """A table of these fingerprints (``fingerprints`` of the keys), with their blocks'
        ``places`` (arena address plus one, 0 for none) and checksums: no Python per key."""
        table = cls.__new__(cls)
        table._build(fps, places, sums)
        return table

    def _build(
        self, fps: np.ndarray, places: np.ndarray | None = None, sums: np.ndarray | None = None
    ) -> None:
        self._open(_capacity_for(len(fps), MAX_LOAD))
        self._fill(fps, places, sums)

    def _open(self, capacity: int) -> None:
        self.capacity = capacity
        size = table_bytes(capacity)
        fd = os.memfd_create("kvstore-presence", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            # Owner-only, as the slabs: a read-only descriptor handed to a client of another
            # uid cannot be reopened read-write through /proc/self/fd, nor mapped writable.
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            # A client cannot shrink it under another's mapping (SIGBUS). Not sealed against
            # writes (``F_SEAL_FUTURE_WRITE``): that would also forbid freeing a retired
            # table's pages, which a client keeping its descriptor would otherwise pin.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._words = memoryview(self._mmap).cast("Q")
        self._words[_MAGIC] = MAGIC
        self._words[_CAPACITY] = capacity
        self._mask = capacity // BUCKET - 1  # of the bucket number
        n = capacity + WINDOW
        self._places_at = HEADER_WORDS + n  # word index of slot 0's place
        self._sums_at = HEADER_WORDS + 2 * n
        words = np.frombuffer(self._mmap, dtype=np.uint64, offset=HEADER_BYTES)
        self._slots, self._places, self._sums = words[:n], words[n : 2 * n], words[2 * n :]
        self.count = 0
        self._gone = 0
        self.writing = 0

    def _fill(
        self, fps: np.ndarray, places: np.ndarray | None = None, sums: np.ndarray | None = None
    ) -> None:
        """Place ``fps`` (and their places) in an empty table at once: sorted by home, each
        takes the first free slot at or after it (a running maximum, in C)."""
        if not len(fps):
            return
        held = len(fps)
        fps, first = np.unique(fps, return_index=True)
        if len(fps) < held:
            # Keys that share their first 8 bytes became one entry: removing one would make
            # the others a miss the daemon calls a hit, so a miss is asked of the daemon.
            self._words[_OVERFLOW] = 1
        homes = (fps & np.uint64(self._mask)).astype(np.int64) * BUCKET
        order = np.argsort(homes, kind="stable")
        fps, homes, first = fps[order], homes[order], first[order]
        rank = np.arange(len(fps), dtype=np.int64)
        slots = rank + np.maximum.accumulate(homes - rank)
        fits = slots - homes < WINDOW
        if places is not None and sums is not None:
            # Keys that share a fingerprint are one entry: it keeps the first one's place
            # (another key's reads then fail verification and call).
            self._places[slots[fits]] = places[first[fits]]
            self._sums[slots[fits]] = sums[first[fits]]
        self._slots[slots[fits]] = fps[fits]
        self.count = int(fits.sum())
        self._words[_COUNT] = self.count
        if not fits.all():
            self._words[_OVERFLOW] = 1

    @property
    def size(self) -> int:
        return len(self._mmap)

    @property
    def overflow(self) -> bool:
        return bool(self._words[_OVERFLOW])

    @property
    def retired(self) -> bool:
        return bool(self._words[_RETIRED])

    def set_writing(self, n: int) -> None:
        """How many keys of the namespace are being written now (reserved, not committed)."""
        self.writing = n
        self._words[_WRITING] = n

    def export(self) -> int:
        """A new read-only descriptor of the table (the caller sends and closes it)."""
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    def add(self, key: bytes, place: int = 0, checksum: int = 0) -> PresenceTable:
        """Note ``key`` committed (with its block's ``place``, the arena address plus one, 0
        for none, and that copy's ``checksum``). Returns the table to keep: this one, or the
        bigger one that replaced it (this one is then retired)."""
        fp = max(int.from_bytes(key[:8], "little"), _FIRST)
        words, slot = self._words, HEADER_WORDS + (fp & self._mask) * BUCKET
        end = slot + WINDOW
        while slot < end:
            if words[slot] <= GONE:
                if words[slot] == GONE:
                    self._gone -= 1
                # The place before the fingerprint: a reader that sees the key sees its place.
                words[slot + self._places_at - HEADER_WORDS] = place
                words[slot + self._sums_at - HEADER_WORDS] = checksum
                words[slot] = fp
                self.count += 1
                words[_COUNT] = self.count
                if (self.count + self._gone) > self.capacity * MAX_LOAD:
                    return self._rebuilt(self.count)
                return self
            slot += 1
        # The window is full: a bigger table spreads honest keys; forged ones crowd any size.
        if self.capacity < MAX_SPARSENESS * max(self.count, MIN_CAPACITY // MAX_SPARSENESS):
            return self._rebuilt(self.count, extra=(fp, place, checksum))
        words[_OVERFLOW] = 1
        return self

    def add_many(
        self,
        keys: Iterable[bytes],
        places: Sequence[int] | None = None,
        sums: Sequence[int] | None = None,
    ) -> PresenceTable:
        """``add`` of each key (a commit's batch; ``places`` and ``sums`` as ``add``'s, one
        per key, or none): one tight loop while each finds a free slot and the table stays
        under ``MAX_LOAD``; what is left then goes through ``add``."""
        keys = list(keys)
        fps = array("Q", b"".join(keys))[::4]  # each key's first 8 bytes
        if sys.byteorder == "big":  # fingerprints read them little endian
            fps.byteswap()
        if places is None or sums is None:
            places = sums = [0] * len(keys)
        words, mask, limit = self._words, self._mask, self.capacity * MAX_LOAD
        to_place, to_sum = self._places_at - HEADER_WORDS, self._sums_at - HEADER_WORDS
        count, gone, done = self.count, self._gone, 0
        for fp, place, checksum in zip(fps, places, sums, strict=True):
            if fp < _FIRST:
                fp = _FIRST
            if count + gone >= limit:
                break
            slot = HEADER_WORDS + (fp & mask) * BUCKET
            end = slot + WINDOW
            while slot < end and words[slot] > GONE:
                slot += 1
            if slot == end:
                break
            if words[slot] == GONE:
                gone -= 1
            words[slot + to_place] = place
            words[slot + to_sum] = checksum
            words[slot] = fp
            count += 1
            done += 1
        self.count, self._gone = count, gone
        words[_COUNT] = count
        table = self
        try:
            for i in range(done, len(keys)):
                table = table.add(keys[i], places[i], sums[i])
        except BaseException:
            if table is not self:  # a replacement the caller never got: not left open
                table.retire()
            raise
        return table

    def _slots_of(self, key: bytes) -> list[int]:
        """The word indices of the slots holding ``key``'s fingerprint (more than one only for
        keys that share their first 8 bytes), in probe order."""
        fp = max(int.from_bytes(key[:8], "little"), _FIRST)
        slot = HEADER_WORDS + (fp & self._mask) * BUCKET
        # Past an EMPTY too: a table filled with ``overflow`` has gaps. One copy of the window
        # into a list, searched in C: an eviction calls this for every block it drops.
        window = self._words[slot : slot + WINDOW].tolist()
        if fp not in window:
            return []
        first = window.index(fp)
        if window.count(fp) == 1:
            return [slot + first]
        return [slot + i for i in range(first, WINDOW) if window[i] == fp]

    def _slot_of(self, key: bytes) -> int | None:
        """The word index of ``key``'s slot (the first holding its fingerprint), or None."""
        slots = self._slots_of(key)
        return slots[0] if slots else None

    def remove(self, key: bytes) -> None:
        """Note ``key`` no longer committed (evicted from its last tier, deleted, corrupt)."""
        slots = self._slots_of(key)
        if not slots:
            return
        words = self._words
        # Every slot of its fingerprint loses its place: the key's own may be any of them
        # (keys sharing their first 8 bytes), and a removed key's block is never read from
        # the table. The others' keys are read through a lease from now on.
        for slot in slots:
            words[slot + self._places_at - HEADER_WORDS] = 0
        words[slots[0]] = GONE
        self.count -= 1
        self._gone += 1
        words[_COUNT] = self.count

    def remove_many(self, keys: Sequence[bytes]) -> None:
        """``remove`` of each of ``keys`` (distinct; an eviction's batch): every window
        searched in one numpy pass, or, for fewer than ``WALK_REMOVES`` keys, one key at a
        time. A key whose fingerprint more than one slot holds goes through ``remove``."""
        if len(keys) < WALK_REMOVES:
            self._remove_walking(keys)
            return
        fps = fingerprints(b"".join(keys))
        homes = HEADER_WORDS + (fps & np.uint64(self._mask)).astype(np.int64) * BUCKET
        words = np.frombuffer(self._words, dtype=np.uint64)
        match = words[homes[:, None] + _WINDOW_STEPS] == fps[:, None]
        hits = match.sum(axis=1)
        slots = homes + match.argmax(axis=1)
        one = np.unique(slots[hits == 1])  # two keys of one fingerprint, one slot
        # As ``remove``: the places first (a reader that still sees the key reads no place).
        words[one + (self._places_at - HEADER_WORDS)] = 0
        words[one] = GONE
        del words  # no export of the mapping outlives the call
        for i in np.flatnonzero(hits > 1).tolist():
            self.remove(keys[i])
        self.count -= len(one)
        self._gone += len(one)
        self._words[_COUNT] = self.count

    def _remove_walking(self, keys: Sequence[bytes]) -> None:
        """``remove_many`` of a few keys, each window searched on its own (in C, as a list)."""
        words, mask = self._words, self._mask
        to_place = self._places_at - HEADER_WORDS
        removed = 0
        for key in keys:
            fp = int.from_bytes(key[:8], "little")
            if fp < _FIRST:
                fp = _FIRST
            slot = HEADER_WORDS + (fp & mask) * BUCKET
            window = words[slot : slot + WINDOW].tolist()
            if fp not in window:
                continue
            if window.count(fp) > 1:
                self.remove(key)  # every slot of its fingerprint loses its place
                continue
            slot += window.index(fp)
            words[slot + to_place] = 0  # as ``remove``: the place first
            words[slot] = GONE
            removed += 1
        self.count -= removed
        self._gone += removed
        words[_COUNT] = self.count

    def locate(self, key: bytes, place: int, checksum: int) -> None:
        """``key``'s block has a CPU copy a client can read at ``place`` (0: none now), whose
        checksum is ``checksum``. A key the table does not hold is left out."""
        slot = self._slot_of(key)
        if slot is None:
            return
        words, at = self._words, slot - HEADER_WORDS
        words[self._places_at + at] = 0  # never the new place with the old checksum
        words[self._sums_at + at] = checksum
        words[self._places_at + at] = place

    def unlocate(self, key: bytes, place: int) -> None:
        """The copy at ``place`` is no longer ``key``'s (its slot was freed): readers ask."""
        words, to_place = self._words, self._places_at - HEADER_WORDS
        for slot in self._slots_of(key):
            if words[slot + to_place] == place:
                words[slot + to_place] = 0

    def _rebuilt(self, entries: int, extra: tuple[int, int, int] | None = None) -> PresenceTable:
        """A new table holding this one's entries (and ``extra``: a fingerprint, its place
        and checksum); this one is retired."""
        held = self._slots > GONE
        fps, places, sums = self._slots[held], self._places[held], self._sums[held]
        if extra:
            fps, places, sums = (
                np.concatenate([a, np.array([x], dtype=np.uint64)])
                for a, x in zip((fps, places, sums), extra, strict=True)
            )
        new = PresenceTable.__new__(PresenceTable)
        # Sized for what it holds (removed slots are not carried over, so churn does not grow
        # it); twice as big at least when a window was full.
        added = 1 if extra else 0
        capacity = _capacity_for(entries + added)
        if extra:
            capacity = max(capacity, self.capacity * 2)
        new._open(capacity)
        new._fill(fps, places, sums)
        if self.overflow:  # a key dropped before is still missing
            new._words[_OVERFLOW] = 1
        new.set_writing(self.writing)
        self.retire()
        return new

    def retire(self) -> None:
        """Stop keeping this table: readers see ``retired`` and ask for the current one (or
        learn that their namespace is gone). Its memory goes with the last mapping."""
        if self._fd < 0:
            return
        self._words[_RETIRED] = 1
        # Free its pages past the first (the header stays, saying ``retired``): a client that
        # keeps the descriptor pins a page, not the table. A reader in the middle of a probe
        # then reads EMPTY slots: misses, as a lookup racing a rebuild may answer.
        if len(self._mmap) > mmap.PAGESIZE:
            try:
                self._mmap.madvise(mmap.MADV_REMOVE, mmap.PAGESIZE)
            except OSError:  # best effort: the pages then go with the last mapping
                pass
        os.close(self._fd)
        self._fd = -1

    def close(self) -> None:
        """Retire and unmap (the daemon is stopping)."""
        self.retire()
        self._slots = self._places = self._sums = np.empty(0, dtype=np.uint64)
        self._words.release()
        try:
            self._mmap.close()
        except BufferError:
            pass


class PresenceView:
    """A client's read-only mapping of a presence table (from a descriptor the daemon handed
    over). ``leading`` answers a lookup, ``places`` says where to read the leading blocks;
    ``retired`` says to ask for a new table."""

    def __init__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        if size < table_bytes(MIN_CAPACITY):
            raise ValueError(f"a presence table of {size} bytes is too small")
        self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        header = np.frombuffer(self._mmap, dtype=np.uint64, count=HEADER_WORDS)
        capacity = int(header[_CAPACITY])
        if int(header[_MAGIC]) != MAGIC or size != table_bytes(capacity):
            self._mmap.close()
            raise ValueError("not a presence table")
        self._mask = np.uint64(capacity // BUCKET - 1)
        self._home_mask = capacity // BUCKET - 1
        # The same words for the walk of a run's first keys (``_walk``): read one at a time,
        # as numpy reads them, from the header on.
        self._mv = memoryview(self._mmap).cast("Q")
        n = capacity + WINDOW
        words = np.frombuffer(self._mmap, dtype=np.uint64, offset=HEADER_BYTES)
        # Bucket by bucket: row b is bucket b's slots (rows past the last home are the spare
        # slots of the window).
        self._rows = words[:n].reshape(-1, BUCKET)
        self._places, self._sums = words[n : 2 * n], words[2 * n :]
        self._places_at, self._sums_at = HEADER_WORDS + n, HEADER_WORDS + 2 * n

    @property
    def retired(self) -> bool:
        return bool(self._mv[_RETIRED])

    @property
    def overflow(self) -> bool:
        return bool(self._mv[_OVERFLOW])

    @property
    def writing(self) -> bool:
        """Some key of the namespace is being written (``PresenceTable.set_writing``)."""
        return bool(self._mv[_WRITING])

    def _walk(self, packed: bytes, limit: int) -> list[int]:
        """The slots of the leading keys of ``packed`` the table holds, found one key at a
        time, at most ``limit`` keys: stops at the first key it does not hold. The probe of
        ``_probe``, key by key: a key is past its home bucket only if that bucket was full."""
        words, mask = self._mv, self._home_mask
        slots: list[int] = []
        for at in range(0, min(limit, len(packed) // KEY_BYTES) * KEY_BYTES, KEY_BYTES):
            fp = int.from_bytes(packed[at : at + 8], "little")
            if fp < _FIRST:
                fp = _FIRST
            home = (fp & mask) * BUCKET
            for bucket in range(home, home + WINDOW, BUCKET):
                row = words[HEADER_WORDS + bucket : HEADER_WORDS + bucket + BUCKET].tolist()
                if fp in row:
                    slots.append(bucket + row.index(fp))
                    break
                if EMPTY in row:
                    return slots
            else:
                return slots
        return slots

    def _short_run(self, packed: bytes) -> list[int] | None:
        """The slots of the leading keys of ``packed`` the table holds when the run ends
        within its first ``WALK_KEYS`` keys, walked (``_walk``); None when it may run on (the
        caller probes it whole with numpy, ``_probe``)."""
        slots = self._walk(packed, WALK_KEYS)
        if len(slots) < WALK_KEYS or len(packed) <= WALK_KEYS * KEY_BYTES:
            return slots
        return None

    def _leading(self, packed: bytes) -> tuple[np.ndarray, int]:
        """``_probe``'s slots of ``packed`` and the length of its leading run of held keys."""
        hit, slot = self._probe(packed)
        return slot, len(hit) if hit.all() else int(hit.argmin())

    def _words_at(self, base: int, slots: list[int]) -> list[int]:
        """The words at ``base`` + each of ``slots`` (``base``: where an array starts)."""
        words = self._mv
        return [words[base + slot] for slot in slots]

    def _probe(self, packed: bytes) -> tuple[np.ndarray, np.ndarray]:
        """(whether the table holds each key of ``packed``, the slot it holds it in)."""
        fps = fingerprints(packed)
        buckets = (fps & self._mask).astype(np.intp)
        rows = self._rows
        probe = rows[buckets]  # (keys, BUCKET): each key's home bucket
        same = probe == fps[:, None]
        hit = same.any(axis=1)
        slot = buckets * BUCKET + same.argmax(axis=1)
        if hit.all():
            return hit, slot
        # The others, one bucket further at a time: a key is past its home bucket only if
        # that bucket was full when it was placed, so a bucket with an EMPTY slot ends its
        # probe (where the table has gaps, ``overflow`` sends a miss to the daemon anyway).
        rest = np.flatnonzero(~hit & (probe != EMPTY).all(axis=1))
        step = 1
        while len(rest) and step < WINDOW // BUCKET:
            probe = rows[buckets[rest] + step]
            same = probe == fps[rest, None]
            found = same.any(axis=1)
            hit[rest[found]] = True
            slot[rest[found]] = (buckets[rest] + step)[found] * BUCKET + same[found].argmax(1)
            rest = rest[~found & (probe != EMPTY).all(axis=1)]
            step += 1
        return hit, slot

    def leading(self, packed: bytes) -> int:
        """How many leading keys of ``packed`` (32-byte keys, concatenated) the table holds."""
        slots = self._short_run(packed)
        return len(slots) if slots is not None else self._leading(packed)[1]

    def leading_in_cpu(self, packed: bytes) -> tuple[int, int]:
        """(how many leading keys of ``packed`` the table holds, how many of those had a place:
        a CPU copy) as of some moment during the call, for the tally's split by tier."""
        slots = self._short_run(packed)
        if slots is not None:
            places = self._words_at(self._places_at, slots)
            return len(slots), len(places) - places.count(0)
        slot, n = self._leading(packed)
        return n, int(np.count_nonzero(self._places[slot[:n]]))

    def places(self, packed: bytes) -> tuple[list[int], list[int], int]:
        """(arena addresses, checksums) of the blocks of the leading keys of ``packed`` that
        the table holds with a place: hints, to be copied and verified (module docstring);
        then how many leading keys the table holds, with a place or not."""
        slots = self._short_run(packed)
        if slots is not None:
            places = self._words_at(self._places_at, slots)  # after the slots, before the sums
            if 0 in places:
                places = places[: places.index(0)]
            sums = self._words_at(self._sums_at, slots[: len(places)])
            return [place - 1 for place in places], sums, len(slots)
        slot, held = self._leading(packed)
        at = self._places[slot[:held]]  # read after the slots, before the checksums
        sums_at = self._sums[slot[:held]]
        placed = at != 0
        n = held if placed.all() else int(placed.argmin())
        return (at[:n] - np.uint64(1)).tolist(), sums_at[:n].tolist(), held

    def close(self) -> None:
        self._rows = np.empty((0, BUCKET), dtype=np.uint64)
        self._places = self._sums = np.empty(0, dtype=np.uint64)
        self._mv.release()
        try:
            self._mmap.close()
        except BufferError:  # an array still views it: the mapping goes when collected
            pass
