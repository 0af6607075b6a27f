"""Write reservations and read leases: the zero-copy handles of the client library.

A ``WriteReservation`` names the arena slots reserved for the keys that were not yet stored; the
caller writes them (through ``views`` or ``fill_from``) and commits. A ``ReadLease`` names the
slots of the leading run of stored blocks; the caller copies out, verifies and releases. The
sync and async flavours differ only in whether commit/abort/release are awaited: each runs the
same operation (``_commit_op``, ``_abort_op``, ``_release_op``, generators of the client's core,
``kvstore.client.core``) through its client's face.

A client that maps the daemon's GPU pool (a CUDA worker on the daemon's GPU) may get its slots
there instead: a reservation with ``on_gpu`` names pool slots and commits device checksums; a
lease names, per block, a pool slot (``on_gpu[i]``, verified by device checksum) or an arena slot.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any

import torch

from kvstore import kernels
from kvstore.checksum import seeded_checksum
from kvstore.client import payloads
from kvstore.client._common import MappedArena
from kvstore.errors import KVStoreError
from kvstore.layout import KVLayout
from kvstore.tiers.gpu import MappedDevicePool

Op = Generator[Any, Any, Any]
"""An operation of the client's core (``kvstore.client.core``): steps for a face to perform."""


def _run_inline(op: Op) -> Any:
    """Run an operation that performs no step (a reservation or lease made by hand)."""
    try:
        step = next(op)
    except StopIteration as stop:
        return stop.value
    raise KVStoreError(f"no client to perform {step!r}")


class _ReservationState:
    def __init__(
        self,
        arena: MappedArena,
        layout: KVLayout,
        reservation_id: int,
        offsets: list[int],
        seeds: list[int],
        pool: MappedDevicePool | None = None,
    ) -> None:
        self.arena = arena
        # Spare slots its commit asks for, and ahead (``kvstore.client.spare_slots``).
        self.spare_wanted = (0, 0)
        self.posted = False  # its commit is sent without waiting (``kvstore.client.posted_puts``)
        self.pool = pool
        """Set when the slots are in the daemon's GPU pool (``offsets`` are pool offsets)."""
        self._pool_held = pool is not None
        if pool is not None:
            pool.retain()  # mapped until this reservation is finished
        self.layout = layout
        self.reservation_id = reservation_id
        self.offsets = offsets
        self.indices = [i for i, off in enumerate(offsets) if off >= 0]
        """Positions (in the keys passed to reserve) of the keys this reservation must write."""
        self.offsets_new = [offsets[i] for i in self.indices]
        self.seeds = seeds
        """Checksum seed of every key passed to reserve (namespace and key; the client's own)."""
        self.committed = 0
        self.pending = 0
        """Keys another client was still writing when the daemon stopped waiting for them."""
        self.done = not self.indices
        self._checksums: list[int] | None = None
        self.codec = 0
        """What the arena slots take (``ReserveResponse.codec``): 0 the block, else its fp8
        payload of ``payload_bytes`` (a ``cpu = "fp8"`` namespace; ``kvstore.client.payloads``)."""
        self.payload_bytes = 0
        self.payload_sums: list[int] | None = None
        """With ``codec``: each payload's checksum, committed beside its decoded form's."""
        self._commit_step: Callable[[list[int]], Any] = lambda checksums: iter(())
        self._abort_step: Callable[[], Any] = lambda: iter(())

    @property
    def on_gpu(self) -> bool:
        return self.pool is not None

    @property
    def views(self) -> list[torch.Tensor]:
        """A ``[*block_shape]`` tensor over shared memory (or, ``on_gpu``, over the GPU pool)
        per key to write (``indices`` order). Writes on a CUDA stream must be complete (the
        stream synchronized) before ``commit``, which checksums what the slots hold then.
        With ``codec``: a ``[payload_bytes]`` uint8 tensor per slot, for the payload."""
        if self.codec:
            return [self.arena.slot(off, self.payload_bytes) for off in self.offsets_new]
        nbytes = self.layout.block_bytes
        space: MappedArena | MappedDevicePool = self.pool if self.pool is not None else self.arena
        return [
            space.slot(off, nbytes).view(self.layout.dtype).view(self.layout.block_shape)
            for off in self.offsets_new
        ]

    def fill_from(self, rows: torch.Tensor) -> None:
        """Copy ``rows[i]`` (``[n, block_bytes]`` uint8, one per key passed to reserve) into the
        slots of the keys to write (with ``codec``, each row's fp8 payload)."""
        if self.codec:
            self._checksums, self.payload_sums = payloads.encode_into(
                self.arena, self.layout, rows, self.offsets, self.seeds, self.payload_bytes
            )
            return
        if self.pool is None:
            self._checksums = self.arena.copy_in(rows, self.offsets, self.seeds)
            return
        nbytes = self.layout.block_bytes
        for i, off in zip(self.indices, self.offsets_new, strict=True):
            self.pool.slot(off, nbytes).copy_(rows[i])

    def gather_payloads(self, kv_caches: list[torch.Tensor], block_ids: list[int]) -> list[int]:
        """Fill payload slots (``codec``) from physical blocks ``block_ids`` of a paged cache
        with the quantizing gather kernel; returns the checksums the commit carries."""
        self._checksums, self.payload_sums = payloads.gather_into_slots(
            kv_caches,
            block_ids,
            self.arena,
            self.layout,
            self.offsets_new,
            self.seeds_new,
            self.payload_bytes,
        )
        return self._checksums

    def use_checksums(self, checksums: list[int]) -> None:
        """Checksums the writer took from its source as it copied (one per block to write)."""
        if len(checksums) != len(self.indices):
            raise ValueError(f"{len(checksums)} checksums for {len(self.indices)} blocks")
        self._checksums = checksums

    @property
    def seeds_new(self) -> list[int]:
        """The checksum seed of each key to write (``indices`` order)."""
        return [self.seeds[i] for i in self.indices]

    def checksums(self) -> list[int]:
        """What the commit carries, bound to namespace and key: after ``fill_from``, the
        checksums of the source blocks taken as they were copied; after writes through
        ``views`` (the zero-copy path, where this client's own kernels filled the slots), the
        checksum of each arena slot, or, ``on_gpu``, the device checksum of each pool slot."""
        if self._checksums is not None:
            return self._checksums
        if self.codec:  # the decoded forms' (and, in ``payload_sums``, the payloads')
            self._checksums, self.payload_sums = payloads.slot_checksums(
                self.arena, self.layout, self.offsets_new, self.seeds_new, self.payload_bytes
            )
            return self._checksums
        nbytes = self.layout.block_bytes
        seeds = [self.seeds[i] for i in self.indices]
        if self.pool is not None:
            raw = kernels.device_checksums([self.pool.slot(o, nbytes) for o in self.offsets_new])
            return [r ^ seed for r, seed in zip(raw, seeds, strict=True)]
        return [
            self.arena.checksum(off, nbytes, seed)
            for off, seed in zip(self.offsets_new, seeds, strict=True)
        ]

    def _drop_pool(self) -> None:
        if self._pool_held and self.pool is not None:
            self._pool_held = False
            self.pool.release()

    def _check_open(self) -> bool:
        """True if there is something to finish; False if this reservation holds no slot."""
        if self.done and self.indices:
            raise KVStoreError(
                f"reservation {self.reservation_id} was already committed or aborted"
            )
        return not self.done

    def _commit_op(self, checksums: list[int] | None) -> Op:
        """Commit (``checksums``: the caller's, computed off the event loop, else
        ``checksums()``); the number of blocks stored."""
        if not self._check_open():
            return 0
        self.done = True
        try:
            sums = self.checksums() if checksums is None else checksums
            self.committed = yield from self._commit_step(sums)
        finally:
            self._drop_pool()
        return self.committed

    def _abort_op(self) -> Op:
        if self._check_open():
            self.done = True
            try:
                yield from self._abort_step()
            finally:
                self._drop_pool()


class WriteReservation(_ReservationState):
    def __init__(
        self,
        arena: MappedArena,
        layout: KVLayout,
        reservation_id: int,
        offsets: list[int],
        seeds: list[int],
        commit_op: Callable[[list[int]], Any],
        abort_op: Callable[[], Any],
        pool: MappedDevicePool | None = None,
        run: Callable[[Op], Any] = _run_inline,
    ) -> None:
        super().__init__(arena, layout, reservation_id, offsets, seeds, pool)
        self._commit_step = commit_op
        self._abort_step = abort_op
        self._run = run

    def commit(self) -> int:
        """Make the written blocks visible; returns how many were stored."""
        return int(self._run(self._commit_op(None)))

    def abort(self) -> None:
        self._run(self._abort_op())

    def __enter__(self) -> WriteReservation:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if self.done:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class AsyncWriteReservation(_ReservationState):
    def __init__(
        self,
        arena: MappedArena,
        layout: KVLayout,
        reservation_id: int,
        offsets: list[int],
        seeds: list[int],
        commit_op: Callable[[list[int]], Any],
        abort_op: Callable[[], Any],
        pool: MappedDevicePool | None = None,
        run: Callable[[Op], Awaitable[Any]] | None = None,
    ) -> None:
        super().__init__(arena, layout, reservation_id, offsets, seeds, pool)
        self._commit_step = commit_op
        self._abort_step = abort_op
        self._run = run

    async def _perform(self, op: Op) -> Any:
        return _run_inline(op) if self._run is None else await self._run(op)

    async def commit(self, checksums: list[int] | None = None) -> int:
        """As ``WriteReservation.commit``; ``checksums`` when the caller computed them already
        (off the event loop)."""
        return int(await self._perform(self._commit_op(checksums)))

    async def abort(self) -> None:
        await self._perform(self._abort_op())

    async def __aenter__(self) -> AsyncWriteReservation:
        return self

    async def __aexit__(self, exc_type: Any, *rest: Any) -> None:
        if self.done:
            return
        if exc_type is None:
            await self.commit()
        else:
            await self.abort()


class _LeaseState:
    def __init__(
        self,
        arena: MappedArena,
        layout: KVLayout,
        offsets: list[int],
        checksums: list[int],
        seeds: list[int],
        on_gpu: list[bool] | None = None,
        pool: MappedDevicePool | None = None,
    ) -> None:
        self.arena = arena
        self.layout = layout
        self.offsets = offsets
        self.checksums = checksums
        self.seeds = seeds[: len(offsets)]
        """Checksum seed of the key asked at each position: a block is verified against the key
        this client asked for, never against whatever the daemon says the slot holds."""
        self.on_gpu = on_gpu if on_gpu else [False] * len(offsets)
        """Per block: its slot is in the GPU pool (and its checksum a device checksum)."""
        if any(self.on_gpu) and pool is None:
            raise KVStoreError("the daemon served GPU pool slots to a client that has no pool")
        self.pool = pool
        if pool is not None:
            pool.retain()  # mapped until this lease is released
        self.released = False
        self._release_step: Callable[[], Any] = lambda: iter(())
        self.codecs: list[int] = []
        """Per block, where any slot holds an fp8 payload (``AcquireResponse.codecs``; empty:
        every slot holds its block): its codec; ``checksums`` are then the decoded forms'."""
        self.payload_checksums: list[int] = []
        self.payload_bytes = 0
        self.found: int | None = None
        """With ``acquire(..., lookup=True)``: how many leading keys are stored in any tier
        (what ``lookup`` answers), which may be more than the leased run."""

    def _release_op(self) -> Op:
        if not self.released:
            self.released = True
            try:
                yield from self._release_step()
            finally:
                self._drop_pool()

    def _drop_pool(self) -> None:
        if self.pool is not None:
            self.pool.release()

    def __len__(self) -> int:
        return len(self.offsets)

    def _slot(self, i: int) -> torch.Tensor:
        nbytes = self.layout.block_bytes
        if self.on_gpu[i]:
            assert self.pool is not None
            return self.pool.slot(self.offsets[i], nbytes)
        return self.arena.slot(self.offsets[i], nbytes)

    @property
    def views(self) -> list[torch.Tensor]:
        """One read-only-by-contract ``[*block_shape]`` tensor per block, over shared memory or,
        where ``on_gpu``, over the GPU pool (where ``codecs``: a ``[payload_bytes]`` uint8
        tensor per slot, the payload)."""
        if self.codecs:
            return [self.arena.slot(off, self.payload_bytes) for off in self.offsets]
        return [
            self._slot(i).view(self.layout.dtype).view(self.layout.block_shape)
            for i in range(len(self.offsets))
        ]

    @property
    def any_on_host(self) -> bool:
        return not all(self.on_gpu)

    def intact(self) -> int:
        """How many leading blocks still hold the bytes their checksums name (checked after a
        copy out: a slot that changed under the copy fails here)."""
        gpu = [i for i, g in enumerate(self.on_gpu) if g]
        sums = kernels.device_checksums([self._slot(i) for i in gpu]) if gpu else []
        device_sums = dict(zip(gpu, sums, strict=True))
        nbytes = self.payload_bytes if self.codecs else self.layout.block_bytes
        expected = self.payload_checksums if self.codecs else self.checksums
        for i, offset in enumerate(self.offsets):
            if self.on_gpu[i]:
                ok = device_sums[i] ^ self.seeds[i] == self.checksums[i]
            else:
                ok = self.arena.checksum(offset, nbytes, self.seeds[i]) == expected[i]
            if not ok:
                return i
        return len(self.offsets)

    def verify(self, i: int, copy: torch.Tensor) -> bool:
        """True if ``copy`` (a copy of block i taken under this lease) matches its checksum."""
        flat = copy.contiguous().view(torch.uint8).reshape(-1)
        return seeded_checksum(flat.numpy(), self.seeds[i]) == self.checksums[i]

    def copy_into(self, rows: torch.Tensor, verify: bool = True) -> int:
        """Copy the leased blocks into ``rows`` (``[>= n, block_bytes]`` uint8); returns how many
        leading blocks arrived intact (a checksum mismatch ends the run)."""
        if any(self.on_gpu):
            raise KVStoreError("copy_into reads the arena; this lease holds GPU pool slots")
        if self.codecs:
            return payloads.decode_out(
                self.arena,
                self.offsets,
                self.checksums,
                self.payload_checksums,
                self.seeds,
                self.payload_bytes,
                rows,
                verify,
            )
        return self.arena.copy_out(self.offsets, self.checksums, self.seeds, rows, verify)


class ReadLease(_LeaseState):
    def __init__(
        self,
        arena: MappedArena,
        layout: KVLayout,
        offsets: list[int],
        checksums: list[int],
        seeds: list[int],
        release_op: Callable[[], Any],
        on_gpu: list[bool] | None = None,
        pool: MappedDevicePool | None = None,
        run: Callable[[Op], Any] = _run_inline,
    ) -> None:
        super().__init__(arena, layout, offsets, checksums, seeds, on_gpu, pool)
        self._release_step = release_op
        self._run = run

    def release(self) -> None:
        self._run(self._release_op())

    def __enter__(self) -> ReadLease:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class AsyncReadLease(_LeaseState):
    def __init__(
        self,
        arena: MappedArena,
        layout: KVLayout,
        offsets: list[int],
        checksums: list[int],
        seeds: list[int],
        release_op: Callable[[], Any],
        on_gpu: list[bool] | None = None,
        pool: MappedDevicePool | None = None,
        run: Callable[[Op], Awaitable[Any]] | None = None,
    ) -> None:
        super().__init__(arena, layout, offsets, checksums, seeds, on_gpu, pool)
        self._release_step = release_op
        self._run = run

    async def release(self) -> None:
        if self._run is None:
            _run_inline(self._release_op())
        else:
            await self._run(self._release_op())

    async def __aenter__(self) -> AsyncReadLease:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()
