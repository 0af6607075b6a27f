"""An in-process daemon for the request fuzz targets: a real ``BlockStore`` on a real
shared-memory arena, its real ``KVStoreServicer`` and ``LocalCalls``, on one event loop.

An input is a short sequence of calls. Each call names an RPC, some fix-ups and the serialized
request; the bytes go through the servicer's own decoder (gRPC's, ``service._decoder``, or the
local-call frame's), and the fix-ups then make a decoded request reach past the first check
(a fuzzer cannot guess a handle token, a reservation id or a checksum): the live handle, the
last reservation or lease, keys already stored, the right checksums of what the reservation's
slots hold. Then the contract, after every call:

- a call is answered or refused with a gRPC status other than INTERNAL and UNKNOWN (those mean
  an exception escaped the servicer's own handling), a message and an error name;
- a refused call leaves the store's state as it was (entries, tiers, leases, reservations,
  blocks per namespace), except the leases it asked to release first (``release_leases``);
- after the whole input, with its handle closed and the loop idle, the store passes its
  whole-state invariant checker (``BlockStore.check``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import atheris

with atheris.instrument_imports(include=["kvstore"]):
    from kvstore import KVLayout, Namespace, block_hashes
    from kvstore import local_calls as wire
    from kvstore.checksum import block_checksum
    from kvstore.config import CpuTierConfig, DaemonConfig, GpuTierConfig
    from kvstore.daemon import service
    from kvstore.daemon.local_calls import LocalAbort, LocalCalls, LocalContext
    from kvstore.daemon.service import KVStoreServicer
    from kvstore.daemon.store import BlockStore
    from kvstore.keys import pack_keys
    from kvstore.v1 import kvstore_pb2 as pb

import grpc

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16)  # 4 KiB blocks
NS = Namespace(model="fuzz", layout=LAYOUT)
STORED = 4
"""Blocks committed at start, under a handle kept open: keys a call may name and find."""
KEYS = block_hashes(NS.seed, list(range(16 * 16)))  # 16 block keys: STORED stored, then new
SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
RPCS = [m.name for m in SERVICE.methods]
REQUEST_TYPES = {m.name: getattr(pb, m.input_type.name) for m in SERVICE.methods}
BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
CALL_TIMEOUT_S = 0.08
"""A call's deadline: ``remaining_s`` leaves it no time to wait (a call that would wait for
room or for a writer is refused at once), so an input runs in milliseconds."""

# Fix-ups: bits of a call's flags byte.
FIX_HANDLE = 1  # the live handle
FIX_IDS = 2  # the last reservation id and lease id
FIX_KEYS = 4  # keys: stored ones, then new ones (count in the next byte)
FIX_CHECKSUMS = 8  # a Commit's checksums: of what its reservation's slots hold
FIX_SMALL = 16  # numbers that are ids or counts kept small (priority, spare slots asked)


def _config() -> DaemonConfig:
    return DaemonConfig(
        gpu=GpuTierConfig(enabled="off"),
        lease_ttl_s=30,
        reservation_ttl_s=30,
        cpu=CpuTierConfig(
            capacity_bytes=32 * LAYOUT.block_bytes,
            slab_bytes=4 * LAYOUT.block_bytes,
            prefault=False,
        ),
    )


class Daemon:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.store = BlockStore(_config())
        self.servicer = KVStoreServicer(self.store)
        self.decoders = {name: service._decoder(name, REQUEST_TYPES[name]) for name in RPCS}
        self.local = LocalCalls(self.servicer)
        self.loop.run_until_complete(self._seed())

    async def _seed(self) -> None:
        self.keeper = self.store.open_namespace(NS)
        keys = KEYS[:STORED]
        rid, offsets, _ = await self.store.reserve(self.keeper, keys)
        sums = []
        for i, (off, key) in enumerate(zip(offsets, keys, strict=True)):
            data = bytes([i + 1]) * LAYOUT.block_bytes
            self.store.arena.view[off : off + LAYOUT.block_bytes] = data
            sums.append(block_checksum(data, self.keeper.record.fingerprint, key))
        assert self.store.commit(self.keeper, rid, sums) == STORED

    # ---------------------------------------------------------------- state
    def snapshot(self) -> tuple[Any, ...]:
        """What a refused call must not change."""
        index, store = self.store.index, self.store
        # Entries in use only: the index may grow its arrays (free entries) as it pleases.
        entries = [
            (eid, index.state[eid], index.tier[eid], index.ns[eid], index.checksum[eid])
            for eid in range(index.capacity)
            if index.state[eid]
        ]
        return (
            entries,
            store.active_reservations,
            sorted((r.name, r.blocks, r.entries) for r in store.names.records()),
        )

    def leases(self) -> tuple[Any, ...]:
        index = self.store.index
        leases = [(eid, index.leases[eid]) for eid in range(index.capacity) if index.leases[eid]]
        return (self.store.active_leases, leases)

    # ---------------------------------------------------------------- one input
    def run(self, calls: list[tuple[str, int, bytes, list[bytes]]]) -> None:
        """``calls``: (RPC name, fix-up flags, fix-up argument bytes, request bodies: one per
        message, several for PutBlocks)."""
        self.loop.run_until_complete(self._run(calls, self._call))

    def run_frames(self, frames: list[tuple[int, bytes, bytes]]) -> None:
        """``frames``: (fix-up flags, fix-up argument bytes, local-call request frame)."""
        self.loop.run_until_complete(self._run(frames, self._local_call))

    async def _run(self, calls: list[Any], one: Any) -> None:
        opened = self.servicer.OpenNamespace(self._open_request(), self._context())
        reply = await opened.__anext__()
        self.handle = reply.handle
        self.reservation = self.lease = 0
        self.reserved: list[tuple[bytes, int]] = []  # (key, address) of the last reservation
        self.spare: list[int] = []  # addresses of the spare slots last granted
        try:
            for call in calls:
                await one(*call)
        finally:
            await opened.aclose()  # the stream ends: the store closes the handle
        for _ in range(4):  # background work a call started (spare grants) runs out
            await asyncio.sleep(0)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if pending:
            await asyncio.wait(pending, timeout=5)
        self.store.check()

    def _open_request(self) -> pb.OpenNamespaceRequest:
        lay = pb.Layout(
            num_layers=LAYOUT.num_layers,
            num_kv_heads=LAYOUT.num_kv_heads,
            head_dim=LAYOUT.head_dim,
            block_size=LAYOUT.block_size,
            dtype="bfloat16",
        )
        return pb.OpenNamespaceRequest(model=NS.model, layout=lay)

    def _context(self) -> LocalContext:
        return LocalContext("", CALL_TIMEOUT_S)

    def fix(self, name: str, request: Any, flags: int, arg: bytes) -> None:
        """Apply the fix-ups ``flags`` asks for to a decoded request."""
        fields = {f.name for f in request.DESCRIPTOR.fields}
        if flags & FIX_HANDLE and "handle" in fields:
            request.handle = self.handle
        if flags & FIX_IDS:
            if "reservation_id" in fields:
                request.reservation_id = self.reservation
            if "lease_id" in fields:
                request.lease_id = self.lease
            if "slots" in fields:  # Bind: the spare slots granted, one per key
                request.slots[:] = self.spare[: max(1, len(request.keys) // 32)]
            if "release_leases" in fields and request.release_leases:
                request.release_leases[:] = [self.lease] * min(len(request.release_leases), 2)
        if flags & FIX_KEYS and "keys" in fields:
            start = arg[0] % len(KEYS) if arg else 0
            count = (arg[1] if len(arg) > 1 else 1) % 9
            request.keys = pack_keys(KEYS[start : start + count])
        if flags & FIX_SMALL:
            for field in ("priority", "spare_wanted", "spare_ahead"):
                if field in fields:
                    setattr(request, field, getattr(request, field) % 4)
        if flags & FIX_CHECKSUMS and name == "Commit":
            request.checksums[:] = self._checksums(self.reserved, arg[2] if len(arg) > 2 else 0)
        if flags & FIX_CHECKSUMS and name == "Bind":
            keys = [bytes(request.keys[i : i + 32]) for i in range(0, len(request.keys), 32)]
            slots = list(zip(keys, request.slots, strict=False))
            request.checksums[:] = self._checksums(slots, arg[2] if len(arg) > 2 else 0)

    def _checksums(self, slots: list[tuple[bytes, int]], fill: int) -> list[int]:
        """Fill the slots (key, address) as a client would, and give their checksums."""
        arena, bb = self.store.arena, LAYOUT.block_bytes
        fingerprint = NS.fingerprint
        sums = []
        for key, address in slots:
            if address < 0:
                continue
            found = arena.file(address >> 32)
            if found is None:
                sums.append(0)
                continue
            offset = found[0] + (address & 0xFFFFFFFF)
            data = bytes([fill]) * bb
            arena.view[offset : offset + bb] = data
            sums.append(block_checksum(data, fingerprint, key))
        return sums

    async def _call(self, name: str, flags: int, arg: bytes, bodies: list[bytes]) -> None:
        decode = self.decoders[name]
        requests = [decode(b) for b in bodies]
        for r in requests:
            if not isinstance(r, service.Undecodable):
                self.fix(name, r, flags, arg)
                flags &= ~FIX_KEYS  # PutBlocks: the fix-ups apply to its first message only
        request = requests[0]
        releases = bool(getattr(request, "release_leases", None))
        before, leases_before = self.snapshot(), self.leases()
        context = self._context()
        try:
            reply = await self._invoke(name, requests, context)
        except LocalAbort as refused:
            assert refused.code not in BAD_CODES, f"{name}: {refused.code}: {refused.details}"
            assert refused.details and refused.name, f"{name}: refusal without a message/name"
            if name == "OpenNamespace":
                return
            assert self.snapshot() == before, f"{name} refused ({refused.details}) changed state"
            if not releases:
                assert self.leases() == leases_before, f"{name} refused, leases changed"
            return
        self._note(name, request, reply)

    async def _local_call(self, flags: int, arg: bytes, frame: bytes) -> None:
        """One local-call frame through ``LocalCalls.serve``, as the session socket's reader
        hands it over; a frame that decodes gets the fix-ups, and a deadline past
        ``CALL_TIMEOUT_S`` is cut to it (a call may wait as long as its client asks)."""
        name, request, releases = "?", None, False
        try:
            index, call_id, timeout_s, body = wire.decode_request(frame)
        except ValueError as exc:  # FrameError: its call id where the header was readable
            call_id = getattr(exc, "call_id", 0)
        else:
            name = wire.METHODS[index]
            request = self.decoders[name](bytes(body))
            if not isinstance(request, service.Undecodable):
                self.fix(name, request, flags, arg)
                releases = bool(getattr(request, "release_leases", ()))
                body = request.SerializeToString()
            frame = wire.encode_request(index, call_id, min(timeout_s, CALL_TIMEOUT_S), body)
        before, leases_before = self.snapshot(), self.leases()
        served = self.local.serve("", frame)
        reply = served if isinstance(served, bytes) else await served
        assert len(reply) <= wire.MAX_REPLY_BYTES, f"{name}: a reply of {len(reply)} bytes"
        status, got_id, body = wire.decode_reply(memoryview(reply))
        assert got_id == call_id, f"{name}: reply to call {got_id}, not {call_id}"
        if status == wire.STATUS_OK:
            reply_type = getattr(pb, SERVICE.methods_by_name[name].output_type.name)
            self._note(name, request, reply_type.FromString(bytes(body)))
            return
        code = next(c for c in grpc.StatusCode if c.value[0] == status)
        error, message = wire.decode_error(body)
        assert code not in BAD_CODES, f"{name}: {code}: {error}: {message}"
        assert message, f"{name}: {code} without a message"
        assert self.snapshot() == before, f"{name} refused ({message}) changed state"
        if not releases:
            assert self.leases() == leases_before, f"{name} refused, leases changed"

    async def _invoke(self, name: str, requests: list[Any], context: LocalContext) -> Any:
        method = getattr(self.servicer, name)
        if name == "PutBlocks":

            async def stream() -> AsyncIterator[Any]:
                for r in requests:
                    yield r

            return await method(stream(), context)
        if SERVICE.methods_by_name[name].server_streaming:
            replies = []
            stream = method(requests[0], context)
            try:
                async for reply in stream:
                    replies.append(reply)
                    if name == "OpenNamespace":
                        break  # the handle lives while the stream does: closed right here
                    if name == "WatchBlocks" and reply.snapshot_end:
                        break  # it waits for changes from here on: the first snapshot will do
            finally:
                await stream.aclose()
            return replies
        return await method(requests[0], context)

    def _note(self, name: str, request: Any, reply: Any) -> None:
        """Remember what later fix-ups name: the reservation, the lease."""
        if name == "Reserve" and reply.reservation_id:
            self.reservation = reply.reservation_id
            keys = [bytes(request.keys[i : i + 32]) for i in range(0, len(request.keys), 32)]
            self.reserved = list(zip(keys, reply.offsets, strict=False))
        elif name == "Acquire" and reply.lease_id:
            self.lease = reply.lease_id
        if name in ("Commit", "Bind") and reply.spare:
            self.spare = list(reply.spare)


def cut_calls(data: bytes, max_calls: int = 6) -> list[tuple[str, int, bytes, list[bytes]]]:
    """An input as calls: per call, the RPC (a byte), fix-up flags (a byte), three fix-up
    argument bytes, a message count (a byte, PutBlocks only) and u16-length-prefixed bodies."""
    from _harness import Cut

    cut = Cut(data)
    calls = []
    while cut.left and len(calls) < max_calls:
        name = RPCS[cut.u8() % len(RPCS)]
        flags = cut.u8()
        arg = cut.take(3)
        count = 1 + cut.u8() % 4 if name == "PutBlocks" else 1
        bodies = [cut.chunk(2 * LAYOUT.block_bytes) for _ in range(count)]
        calls.append((name, flags, arg, bodies))
    return calls


def cut_frames(data: bytes, max_calls: int = 6) -> list[tuple[int, bytes, bytes]]:
    """An input as local-call frames: per frame, fix-up flags (a byte), three fix-up argument
    bytes and the u16-length-prefixed frame."""
    from _harness import Cut

    cut = Cut(data)
    frames = []
    while cut.left and len(frames) < max_calls:
        flags = cut.u8()
        arg = cut.take(3)
        frames.append((flags, arg, cut.chunk(wire.MAX_REQUEST_BYTES)))
    return frames


def encode_frame(flags: int, arg: bytes, frame: bytes) -> bytes:
    from _harness import chunk

    return bytes([flags]) + arg.ljust(3, b"\0")[:3] + chunk(frame)


def encode_call(name: str, flags: int, arg: bytes, bodies: list[bytes]) -> bytes:
    """The input bytes of one call (seed corpora)."""
    from _harness import chunk

    head = bytes([RPCS.index(name), flags]) + arg.ljust(3, b"\0")[:3]
    if name == "PutBlocks":
        head += bytes([len(bodies) - 1])
    return head + b"".join(chunk(b) for b in bodies)


os.environ.setdefault("KVSTORE_LOG_LEVEL", "ERROR")
