"""What the sync and async clients share: argument checks, the mapped arena, the copies.

Nothing here performs an RPC, so both clients run the same checks and the same copy code and
differ only in how they call the daemon. How they reach it (channels, credentials, the session,
waiting for it to serve) is ``kvstore.client.channels``, whose names are importable from here too.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Iterator, Sequence

import grpc
import numpy as np
import torch
import xxhash

from kvstore.checksum import seeded_checksum
from kvstore.client import channels
from kvstore.client._parallel import SPLIT_MIN_BYTES, each_block
from kvstore.client.session import ClientSession, SlabUnavailable
from kvstore.errors import ERRORS_BY_NAME, InvalidRequestError, KVStoreError, UnavailableError
from kvstore.keys import Namespace, pack_keys
from kvstore.layout import KVLayout
from kvstore.tiers.gpu import MappedDevicePool, PoolInfo
from kvstore.v1 import kvstore_pb2 as pb

# How a client reaches the daemon lives in ``channels``; importable from here as before.
MAX_MESSAGE_BYTES = channels.MAX_MESSAGE_BYTES
Credentials = channels.Credentials
MetadataInterceptor = channels.MetadataInterceptor
call_metadata = channels.call_metadata
channel_options = channels.channel_options
make_aio_channel = channels.make_aio_channel
make_channel = channels.make_channel
open_session = channels.open_session
wait_for_daemon = channels.wait_for_daemon

TRANSPORTS = ("auto", "shm", "grpc")


class PutCount(int):
    """How many blocks a put newly stored; ``pending``: keys another client was still writing
    when the daemon stopped waiting for that commit (a get may miss them for a while);
    ``dropped`` (``flush``): blocks of puts that did not wait that were not stored (their
    spare slots reclaimed first, or the daemon restarted), as if evicted at once."""

    pending: int
    dropped: int

    def __new__(cls, stored: int, pending: int = 0, dropped: int = 0) -> PutCount:
        value = super().__new__(cls, stored)
        value.pending = pending
        value.dropped = dropped
        return value


def check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")


def check_keys(keys: Sequence[bytes]) -> bytes:
    """Validate keys and pack them for the wire; raises ValueError naming the bad key."""
    if isinstance(keys, bytes | bytearray):
        raise ValueError("keys must be a sequence of 32-byte keys, not one bytes object")
    return pack_keys(keys)


def check_distinct(keys: Sequence[bytes], what: str) -> None:
    """Refuse a read whose keys repeat one, as the daemon does on every read path
    (``InvalidRequestError``, the daemon's words): answered from a presence table too, the
    answer is the one a call would get. A prefix chain never repeats a key."""
    if len(set(keys)) != len(keys):
        raise InvalidRequestError(f"{what}: a key is repeated (a prefix chain never repeats a key)")


def check_priority(priority: int | None) -> int:
    if priority is None:
        return -1
    if not isinstance(priority, int) or not 0 <= priority <= 255:
        raise ValueError(f"priority must be an int in [0, 255], got {priority!r}")
    return priority


def check_put(layout: KVLayout, keys: Sequence[bytes], blocks: torch.Tensor) -> torch.Tensor:
    """Validate a put and return the blocks as a contiguous CPU byte tensor ``[n, block_bytes]``."""
    layout.check_blocks(blocks)
    if blocks.shape[0] != len(keys):
        raise ValueError(f"{len(keys)} keys but {blocks.shape[0]} blocks")
    if blocks.device.type != "cpu":
        blocks = blocks.cpu()
    blocks = blocks.contiguous()
    return blocks.view(torch.uint8).reshape(len(keys), layout.block_bytes)


def check_out(layout: KVLayout, n: int, out: torch.Tensor | None) -> None:
    if out is None:
        return
    layout.check_blocks(out, n, what="out")
    if out.device.type != "cpu":
        raise ValueError(f"out must be a CPU tensor, got device {out.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")


def byte_rows(layout: KVLayout, blocks: torch.Tensor) -> torch.Tensor:
    return blocks.view(torch.uint8).reshape(blocks.shape[0], layout.block_bytes)


def open_request(namespace: Namespace, priority: int) -> pb.OpenNamespaceRequest:
    lay = namespace.layout
    return pb.OpenNamespaceRequest(
        model=namespace.model,
        revision=namespace.revision,
        tenant=namespace.tenant,
        priority=priority,
        layout=pb.Layout(
            num_layers=lay.num_layers,
            num_kv_heads=lay.num_kv_heads,
            head_dim=lay.head_dim,
            block_size=lay.block_size,
            dtype=lay.dtype_name,
            scale_format=lay.scale_format,
            tp_rank=namespace.tp_rank,
            tp_size=namespace.tp_size,
            hash_version=namespace.hash_version,
        ),
    )


def seeds_for(namespace: Namespace, keys: Sequence[bytes]) -> list[int]:
    """The checksum seed of each key in this namespace (``kvstore.checksum``): what every block
    read or written under that key is verified against, computed here, never taken from the
    daemon."""
    # ``checksum_seed(fingerprint, k)`` of each key, with the per-call work done once: the
    # fingerprint is computed once per namespace and the seed's formula inlined (~48 -> ~15 us
    # for 32 keys); ``test_seeds_are_checksum_seed_of_each_key`` holds the two equal.
    fingerprint, digest = namespace.fingerprint, xxhash.xxh3_64_intdigest
    return [digest(fingerprint + bytes(k)) for k in keys]


def check_open_reply(namespace: Namespace, reply: pb.OpenNamespaceResponse) -> None:
    if len(reply.handle) != 16:
        raise KVStoreError("daemon sent no namespace handle: it speaks another protocol version")
    if reply.fingerprint != namespace.fingerprint:
        raise KVStoreError(
            f"daemon computes another fingerprint for namespace {namespace.name!r}: "
            "client and daemon disagree on the key encoding"
        )
    if reply.seed != namespace.seed:
        raise KVStoreError(
            f"daemon computes another key seed for namespace {namespace.name!r}: "
            "client and daemon disagree on the key encoding"
        )
    if reply.block_bytes != namespace.layout.block_bytes:
        raise KVStoreError(
            f"daemon expects {reply.block_bytes}-byte blocks, "
            f"layout gives {namespace.layout.block_bytes}"
        )


def translate_error(err: grpc.RpcError) -> KVStoreError:
    """Turn a gRPC error into the kvstore exception the daemon raised (by the trailer)."""
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else str(err)
    name = None
    trailers = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == "kvstore-error":
            name = value
    if name in ERRORS_BY_NAME:
        return ERRORS_BY_NAME[name](details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return UnavailableError(f"kvstore daemon unreachable ({code.name}): {details}")
    return KVStoreError(f"{code.name if code else 'error'}: {details}")


class PendingReleases:
    """Read leases this client is done with and has not released yet. The next control call of
    their handle carries them (``release_leases``) and the daemon releases them before that call
    runs, so a get never waits for a Release of its own. Until then their blocks stay pinned:
    at most what the client read since its last call, and for no longer than the lease's TTL;
    closing the client (its handle) releases them at once. ``MAX`` of them at most: past that
    the client sends them in a Release of their own."""

    MAX = 64

    def __init__(self) -> None:
        self._handle = b""
        self._ids: list[int] = []

    def add(self, handle: bytes, lease_id: int) -> bool:
        """Note one; True when ``MAX`` are waiting (release them now: ``take``)."""
        if handle != self._handle:  # a lease of a handle since reopened: gone with it
            self._handle, self._ids = handle, []
        self._ids.append(lease_id)
        return len(self._ids) >= self.MAX

    def waiting(self, handle: bytes) -> bool:
        """Whether any of ``handle``'s are waiting for a call to carry them."""
        return handle == self._handle and bool(self._ids)

    def take(self, handle: bytes) -> list[int]:
        """The ids to send with a call of ``handle`` (they are then the daemon's to release)."""
        if handle != self._handle or not self._ids:
            return []
        ids, self._ids = self._ids, []
        return ids


PASS_CHUNK_BYTES = 256 << 10
"""Copies of larger blocks go in pieces of this size, each hashed while it is in cache (L2 is
2 MiB a core here: a piece and its copy fit with room): one pass over memory, not two."""


def copy_hashing_source(dst: np.ndarray, src: np.ndarray, seed: int) -> int:
    """Copy ``src`` into ``dst`` (1-D uint8, same length); return the seeded xxh3 of ``src``,
    each piece hashed just before its copy (so the copy reads it from cache). The checksum is
    of what this client meant to store, whatever writes into ``dst`` meanwhile."""
    n = len(src)
    if n <= PASS_CHUNK_BYTES:
        checksum = seeded_checksum(src, seed)
        # One thread, through numpy: torch's copy_ splits a block over its thread pool and
        # stalls whenever another process holds a core (measured 20x slower under load).
        np.copyto(dst, src)
        return checksum
    h = xxhash.xxh3_64(seed=seed)  # streaming xxh3 gives the one-shot digest
    for start in range(0, n, PASS_CHUNK_BYTES):
        piece = src[start : start + PASS_CHUNK_BYTES]
        h.update(piece.data)
        np.copyto(dst[start : start + PASS_CHUNK_BYTES], piece)
    return h.intdigest()


def _copy_runs_hashing_source(
    rows: np.ndarray, places: list[tuple[int, _Slab, int]], seeds: Sequence[int], nbytes: int
) -> list[int]:
    """``copy_in`` of small blocks: ``rows[i]`` into each place (row, slab, offset); the seeded
    xxh3 of each source row, in order. Back-to-back rows bound for back-to-back slots (a
    batch's slots mostly are) go in one copy of up to ``PASS_CHUNK_BYTES``, and each block is
    then hashed from the source, which that copy has just brought into cache: a view, a copy
    call and a pass over memory saved per block."""
    digest, copyto = xxhash.xxh3_64_intdigest, np.copyto
    per_run = max(1, PASS_CHUNK_BYTES // nbytes)
    sums = []
    j, n = 0, len(places)
    while j < n:
        i0, slab, offset = places[j]
        k = 1
        while k < per_run and j + k < n:
            i, other, at = places[j + k]
            if i != i0 + k or other is not slab or at != offset + k * nbytes:
                break
            k += 1
        if k == 1:
            copyto(slab.np[offset : offset + nbytes], rows[i0])
        else:
            copyto(slab.np[offset : offset + k * nbytes], rows[i0 : i0 + k].reshape(-1))
        for i in range(i0, i0 + k):
            sums.append(digest(rows[i], seed=seeds[i]))
        j += k
    return sums


def _copy_small_hashing_copy(
    rows: np.ndarray,
    sources: list[np.ndarray],
    checksums: Sequence[int],
    seeds: Sequence[int],
    verify: bool,
) -> int:
    """``copy_out`` of small blocks (each at most ``PASS_CHUNK_BYTES``): ``sources[i]`` into
    ``rows[i]``, each copy hashed right after it is made, from cache (``copy_hashing_copy``);
    how many leading blocks arrived intact."""
    digest, copyto = xxhash.xxh3_64_intdigest, np.copyto
    for i, src in enumerate(sources):
        dst = rows[i]
        copyto(dst, src)
        if verify and digest(dst, seed=seeds[i]) != checksums[i]:
            return i  # the run ends here: the caller drops the rest
    return len(sources)


def copy_hashing_copy(dst: np.ndarray, src: np.ndarray, seed: int) -> int:
    """Copy ``src`` into ``dst``; return the seeded xxh3 of ``dst``, each piece hashed right
    after its copy, from cache: it vouches for the copy the caller keeps, so a source that
    changes during the copy fails the check rather than slipping through."""
    n = len(src)
    if n <= PASS_CHUNK_BYTES:
        np.copyto(dst, src)
        return seeded_checksum(dst, seed)
    h = xxhash.xxh3_64(seed=seed)
    for start in range(0, n, PASS_CHUNK_BYTES):
        piece = dst[start : start + PASS_CHUNK_BYTES]
        np.copyto(piece, src[start : start + PASS_CHUNK_BYTES])
        h.update(piece.data)
    return h.intdigest()


class MappedArena:
    """The daemon's CPU-tier memory as this client maps it: slab files, each handed over as a
    descriptor by the session (``ClientSession.slab``) the first time a reply names it, and
    mapped then (so opening a client maps nothing, whatever the tier's size).

    A slot address is ``(slab uid << 32) | offset in the slab``; uids are never reused, so an
    address never reaches memory other than the file it names. Slabs of a namespace this
    client may only read come read-only. ``KVStoreError`` when the daemon hands out an address
    outside its slab; ``SlabUnavailable`` when it will not hand over the slab.
    """

    MAX_MAPPED = 4096  # slab mappings kept; the oldest go first (retired slabs age out)

    def __init__(self, session: ClientSession) -> None:
        self._session = session
        self._slabs: dict[int, _Slab] = {}
        self.pinned = False  # registered with CUDA as pinned memory (see paged_io.ensure_pinned)

    def _slab(self, uid: int) -> _Slab:
        slab = self._slabs.get(uid)
        if slab is None:
            fd, size, writable = self._session.slab(uid)
            try:
                slab = _Slab(_map_slab(fd, size, writable), writable)
            finally:
                os.close(fd)
            if self.pinned:
                slab.pin()
            if len(self._slabs) >= self.MAX_MAPPED:
                self._slabs.pop(next(iter(self._slabs))).close()
            self._slabs[uid] = slab
        return slab

    def _where(self, address: int, nbytes: int) -> tuple[_Slab, int]:
        slab = self._slab(address >> 32)
        offset = address & 0xFFFFFFFF
        if address < 0 or offset + nbytes > slab.size:
            raise KVStoreError(f"daemon handed out slot {address:#x}+{nbytes} outside its slab")
        return slab, offset

    def slot(self, address: int, nbytes: int) -> torch.Tensor:
        slab, offset = self._where(address, nbytes)
        return slab.bytes[offset : offset + nbytes]

    def checksum(self, address: int, nbytes: int, seed: int) -> int:
        slab, offset = self._where(address, nbytes)
        return seeded_checksum(slab.np[offset : offset + nbytes], seed)

    def copy_in(
        self, rows: torch.Tensor, offsets: Sequence[int], seeds: Sequence[int]
    ) -> list[int]:
        """Copy ``rows[i]`` into the slot at ``offsets[i]`` (skipping -1; ``seeds[i]`` is key
        i's checksum seed); return the checksums of the written blocks, in order. Each checksum
        is of the source, taken piece by piece as it is copied (``copy_hashing_source``): it
        vouches for what this client meant to store, and nothing that writes into the slot
        meanwhile can make it vouch for other bytes."""
        nbytes = rows.shape[1]
        rows_np = rows.numpy()
        places = []  # (row, slab, offset in it): every slot resolved before any copy
        uid, slab = -1, None  # the slab of the previous slot: most of a batch's share one
        for i, address in enumerate(offsets):
            if address < 0:
                continue
            if address >> 32 != uid:
                slab, _ = self._where(address, nbytes)
                if not slab.writable:
                    raise KVStoreError(
                        "the daemon reserved a slot in memory this client may only read"
                    )
                uid = address >> 32
            assert slab is not None
            offset = address & 0xFFFFFFFF
            if offset + nbytes > slab.size:
                raise KVStoreError(f"daemon handed out slot {address:#x}+{nbytes} outside its slab")
            places.append((i, slab, offset))
        if nbytes <= PASS_CHUNK_BYTES and len(places) * nbytes < SPLIT_MIN_BYTES:
            # Small blocks, one thread (as ``each_block`` would run them).
            return _copy_runs_hashing_source(rows_np, places, seeds, nbytes)
        todo = [(rows_np[i], slab.np[o : o + nbytes], seeds[i]) for i, slab, o in places]
        checksums = [0] * len(todo)

        def copy(j: int) -> None:
            src, dst, seed = todo[j]
            checksums[j] = copy_hashing_source(dst, src, seed)

        each_block(len(todo), len(todo) * nbytes, copy)
        return checksums

    def copy_out(
        self,
        offsets: Sequence[int],
        checksums: Sequence[int],
        seeds: Sequence[int],
        rows: torch.Tensor,
        verify: bool,
    ) -> int:
        """Copy slots into ``rows``; return how many leading blocks arrived intact. Each copy is
        verified against the checksum of the key it was asked for (``seeds``), from the copy,
        piece by piece as it is made (``copy_hashing_copy``): a slot reused after a lease
        expired, or scribbled on, or holding another key's block is a miss, and so is
        everything after it."""
        nbytes = rows.shape[1]
        rows_np = rows.numpy()
        sources = []  # every slot resolved before any copy, up to one that is gone
        uid, slab = -1, None  # the slab of the previous slot: most of a batch's share one
        for address in offsets:
            if address >> 32 != uid or address < 0:
                try:
                    slab, _ = self._where(address, nbytes)
                except SlabUnavailable:  # retired since the lease was granted: a miss
                    break
                uid = address >> 32
            assert slab is not None
            offset = address & 0xFFFFFFFF
            if offset + nbytes > slab.size:
                raise KVStoreError(f"daemon handed out slot {address:#x}+{nbytes} outside its slab")
            sources.append(slab.np[offset : offset + nbytes])
        if nbytes <= PASS_CHUNK_BYTES and len(sources) * nbytes < SPLIT_MIN_BYTES:
            # Small blocks, one thread (as ``each_block`` would run them), no call per block.
            return _copy_small_hashing_copy(rows_np, sources, checksums, seeds, verify)
        intact = [True] * len(sources)

        def copy(i: int) -> None:
            if not verify:
                np.copyto(rows_np[i], sources[i])
            elif copy_hashing_copy(rows_np[i], sources[i], seeds[i]) != checksums[i]:
                intact[i] = False

        each_block(len(sources), len(sources) * nbytes, copy)
        return intact.index(False) if False in intact else len(sources)

    def intact(
        self, offsets: Sequence[int], checksums: Sequence[int], seeds: Sequence[int], nbytes: int
    ) -> int:
        """How many leading slots still hold the bytes their checksums name."""
        for i, address in enumerate(offsets):
            try:
                ok = self.checksum(address, nbytes, seeds[i]) == checksums[i]
            except SlabUnavailable:
                ok = False
            if not ok:
                return i
        return len(offsets)

    def pin(self) -> None:
        """Register every slab, now and as it is mapped, as pinned host memory for CUDA."""
        if not self.pinned:
            self.pinned = True
            for slab in self._slabs.values():
                slab.pin()

    @property
    def mapped_slabs(self) -> int:
        return len(self._slabs)

    def close(self) -> None:
        slabs, self._slabs = self._slabs, {}
        for slab in slabs.values():
            slab.close()


FAULT_STRIDE = 64 << 10
"""A read every this many bytes maps a new slab: the kernel's fault-around (``fault_around_bytes``,
64 KiB by default) maps the 16 pages around each faulting read at once."""


def _map_slab(fd: int, size: int, writable: bool) -> mmap.mmap:
    """Map a slab file with its page tables built, so no copy into it faults.

    One read per 64 KiB (``FAULT_STRIDE``) rather than ``MAP_POPULATE``: a read fault maps the
    page's 64 KiB neighbourhood (fault-around, pages of shared memory come writable, it keeps no
    dirty accounting), where the populate walks and faults each 4 KiB page: 0.05 against
    0.07-0.09 ms per MiB here, once the daemon has cleared the pages
    (``kvstore.tiers.cpu_arena.ZeroAhead``; a page it has not cleared yet is cleared by this
    read, as by the populate). Huge pages (``shmem_enabled``) are mapped whole either way. A
    kernel without fault-around faults the rest at the first copy: slower, never wrong."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    if size:
        # A mapping is page aligned, not 64 KiB aligned: the reads hit every 64 KiB window but
        # the last, which the last byte does.
        pages = np.frombuffer(mm, dtype=np.uint8)
        pages[::FAULT_STRIDE].max()
        pages[-1].item()
        del pages
    return mm


class _Slab:
    """One mapped slab file. Tensors over it come from a numpy view, which holds the mapping's
    buffer: a tensor (a lease's view, a traceback's frame) that outlives ``close`` keeps the
    mapping alive instead of pointing at unmapped memory (torch.frombuffer does not hold it)."""

    def __init__(self, mm: mmap.mmap, writable: bool) -> None:
        self.mm = mm
        self.size = len(mm)
        self.writable = writable
        self.np = np.frombuffer(mm, dtype=np.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only slabs: never written
            self.bytes = torch.from_numpy(self.np)
        self.pinned = False

    def pin(self) -> None:
        if self.pinned:
            return
        err = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.size, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of a shared-memory slab failed: {err}")
        self.pinned = True

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False
        del self.bytes
        del self.np
        try:
            self.mm.close()
        except BufferError:
            pass  # a tensor view still exists; the mapping goes when it is collected


class PoolLink:
    """The daemon's GPU pool as one client reaches it: described by OpenNamespace, mapped on
    first use by CUDA caches on the pool's GPU (``for_device``). A client whose GPU is another
    one, or that cannot open the handle, uses the CPU arena as before (a warning says why)."""

    def __init__(self) -> None:
        self.info: PoolInfo | None = None
        self.pool: MappedDevicePool | None = None
        self._failed = False

    def reset(self, reply: pb.OpenNamespaceResponse | None) -> None:
        """Forget the old pool (the daemon restarted, or first open) and note the new one."""
        self.close()
        self._failed = False
        self.info = None
        if reply is not None and reply.HasField("gpu") and reply.gpu.ipc_handle:
            g = reply.gpu
            self.info = PoolInfo(g.device_uuid, g.ipc_handle, g.size_bytes, g.token)

    def for_device(self, device: torch.device | None) -> MappedDevicePool | None:
        if device is None or device.type != "cuda" or self.info is None or self._failed:
            return None
        if self.pool is None:
            try:
                self.pool = MappedDevicePool.open(self.info)
            except Exception as exc:  # CUDA or CuPy refused: the CPU path still works
                warnings.warn(
                    f"cannot open the daemon's GPU pool ({exc}); using the CPU tier",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self.pool = None
            if self.pool is None:
                self._failed = True
                return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        return self.pool if self.pool.device.index == index else None

    def device_for(self, kv_caches: Sequence[torch.Tensor]) -> torch.device | None:
        """The caches' device if the pool is reachable from it (mapping it on first use)."""
        device = cuda_device(kv_caches)
        return device if self.for_device(device) is not None else None

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()


def commit_request(
    reply: pb.ReserveResponse,
    checksums: list[int],
    handle: bytes,
    release: Sequence[int] = (),
    payload_checksums: Sequence[int] = (),
    spare_wanted: tuple[int, int] = (0, 0),
) -> pb.CommitRequest:
    """The commit of a reservation: GPU pool slots carry device checksums, arena slots xxh3
    (both bound to namespace and key); payload slots (``reply.codec``) name their codec and
    length, the decoded forms' checksums and the payloads'. ``spare_wanted``: the spare
    slots to ask for, and those ahead of them (``SpareSlots.wanted``)."""
    if reply.gpu:
        return pb.CommitRequest(
            reservation_id=reply.reservation_id,
            device_checksums=checksums,
            handle=handle,
            release_leases=release,
        )
    return pb.CommitRequest(
        reservation_id=reply.reservation_id,
        checksums=checksums,
        handle=handle,
        release_leases=release,
        codec=reply.codec,
        payload_bytes=reply.payload_bytes,
        payload_checksums=payload_checksums,
        spare_wanted=spare_wanted[0],
        spare_ahead=spare_wanted[1],
    )


def put_messages(
    handle: bytes,
    keys: Sequence[bytes],
    seeds: Sequence[int],
    rows: np.ndarray,
    priority: int,
    chunk_bytes: int,
) -> Iterator[pb.PutBlocksRequest]:
    """The bytes path's put: each block as chunks of at most ``chunk_bytes``; its first message
    carries the key and the checksum of the source bytes (the daemon verifies what it stored)."""
    for i, key in enumerate(keys):
        row = rows[i]
        view = memoryview(row)
        checksum = seeded_checksum(row, seeds[i])
        yield pb.PutBlocksRequest(
            handle=handle if i == 0 else b"",
            key=bytes(key),
            data=view[:chunk_bytes].tobytes(),
            priority=priority,
            checksum=checksum,
        )
        for start in range(chunk_bytes, len(view), chunk_bytes):
            yield pb.PutBlocksRequest(data=view[start : start + chunk_bytes].tobytes())


def cuda_device(kv_caches: Sequence[torch.Tensor]) -> torch.device | None:
    """The CUDA device of an engine's caches, or None for CPU caches."""
    if kv_caches and kv_caches[0].device.type == "cuda":
        return kv_caches[0].device
    return None


def empty_blocks(layout: KVLayout, n: int) -> torch.Tensor:
    """A new ``[n, *block_shape]`` tensor. Allocated through numpy, whose large allocations get
    transparent huge pages: first touch of ``torch.empty`` memory faults 4 KiB pages and ran at
    a tenth of the speed here."""
    if n == 0:
        return torch.empty((0, *layout.block_shape), dtype=layout.dtype)
    raw = np.empty(n * layout.block_bytes, dtype=np.uint8)
    return torch.from_numpy(raw).view(layout.dtype).view(n, *layout.block_shape)


class StreamAssembler:
    """Places blocks received on the bytes path, chunk by chunk, into ``out`` (or a new tensor).

    The run ends at the first block whose key is not the one asked for at its position, whose
    length is wrong, or whose bytes do not match the checksum of the key asked for (the seed is
    computed here, from the client's own namespace): fail closed, a miss, never bad data."""

    def __init__(
        self,
        layout: KVLayout,
        keys: Sequence[bytes],
        seeds: Sequence[int],
        out: torch.Tensor | None,
    ) -> None:
        self.layout = layout
        self.keys = keys
        self.seeds = seeds
        self._out = out
        self._dest = empty_blocks(layout, len(keys)) if out is None else out
        self._rows = byte_rows(layout, self._dest).numpy()
        self.complete = 0  # leading blocks received and verified
        self._filled = 0
        self._checksum = 0
        self._failed = False

    def add(self, message: pb.BlockData) -> bool:
        """Take one message; False once the run has ended (stop reading)."""
        if self._failed:
            return False
        i, size = self.complete, self.layout.block_bytes
        if message.key:
            if self._filled or i >= len(self.keys) or message.key != self.keys[i]:
                self._failed = True
                return False
            self._checksum = message.checksum
        elif not self._filled:
            self._failed = True  # data without a key
            return False
        end = self._filled + len(message.data)
        if end > size:
            self._failed = True
            return False
        row = self._rows[i]
        row[self._filled : end] = np.frombuffer(message.data, dtype=np.uint8)
        self._filled = end
        if end == size:
            self._filled = 0
            if seeded_checksum(row, self.seeds[i]) != self._checksum:
                self._failed = True
                return False
            self.complete += 1
        return True

    def result(self) -> torch.Tensor:
        return self._dest[: self.complete]
