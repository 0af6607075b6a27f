"""The block store's checker: every invariant the ledger, the store and the tiers keep, at once.

The tests call it after every step (``BlockStore.check``); it reads everything and changes
nothing. What it asserts is stated where each invariant is kept: the ledger's module docstring
(entries, reservations, leases, policies, byte totals), ``namespaces`` (handles and records),
``cpu_tier`` and ``pool_slots`` (slot owners and bytes) and
``kvstore.tiers.cpu.SlabAllocator.check`` (slabs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.index import IN_CPU, IN_GPU, IN_NVME, State

if TYPE_CHECKING:
    from kvstore.daemon.ledger import Ledger


@dataclass
class SpareBooks:
    """The store's books of spare slots (``BlockStore.grant_spare``), checked beside the
    ledger's: bytes held, bytes quarantined (with their heap of (until, bytes)) and the bound."""

    reserved_bytes: int
    quarantined_bytes: int
    quarantine: list[tuple[float, int]]
    tier_bytes: int


def check_store(store: Ledger, spare_books: SpareBooks, io_idle: bool = True) -> None:
    """AssertionError naming the first invariant broken. ``io_idle``: no IO is in flight."""
    index = store.index
    leased: dict[int, int] = {}
    reserved: dict[int, int] = {}
    for handle in store.names.handles():
        assert not handle.closed and store.names.is_open(handle)
        assert store.names.get(handle.ns_id) is handle.record, "handle's record gone"
        for reservation in handle.reservations.values():
            for eid in reservation.eids:
                reserved[eid] = reserved.get(eid, 0) + 1
                assert index.state[eid] == State.RESERVED, f"reservation of {eid} not RESERVED"
                assert index.ns[eid] == handle.ns_id, f"reservation of {eid}: other namespace"
        for lease in handle.leases.values():
            assert len(set(lease.eids)) == len(lease.eids), "a lease names an entry twice"
            for eid, key in zip(lease.eids, lease.keys, strict=True):
                leased[eid] = leased.get(eid, 0) + 1
                state = index.state[eid]
                assert state in (State.COMMITTED, State.ORPHAN), f"leased {eid} is {state}"
                if state == State.COMMITTED:
                    assert index.has_key(eid, handle.ns_id, key), f"lease of {eid}: key moved"
    entries: dict[int, int] = {}
    blocks: dict[int, int] = {}
    in_cpu: set[int] = set()
    in_nvme: set[int] = set()
    in_gpu: set[int] = set()
    pool = store.gpu_slots
    gpu_bytes = 0
    cpu_bytes = clean = savings = 0
    n_reserved = 0
    writing: dict[int, int] = {}
    for eid in range(index.capacity):
        state = index.state[eid]
        if state == State.FREE:
            assert not index.leases[eid], f"free entry {eid} is leased"
            continue
        ns = index.ns[eid]
        assert store.names.get(ns) is not None, f"entry {eid} of unknown namespace {ns}"
        entries[ns] = entries.get(ns, 0) + 1
        bb = store.names[ns].cpu_bytes
        tier = index.tier[eid]
        if tier & IN_NVME:
            assert store.disk_owner(index.disk[eid]) == eid, f"disk slot owner of {eid}"
        if tier & IN_GPU:
            assert eid in pool.offset, f"entry {eid} in the GPU tier without a pool slot"
            assert pool.owner(pool.offset[eid]) == eid, f"pool slot owner of {eid}"
            gpu_bytes += store.names[ns].block_bytes
        else:
            assert eid not in pool.offset, f"entry {eid} holds a pool slot without its GPU bit"
        if tier & IN_CPU:
            assert index.offset[eid] >= 0, f"entry {eid} in the CPU tier without a slot"
            assert store.cpu_slots.owner(index.offset[eid]) == eid, f"slot owner of {eid}"
            cpu_bytes += bb
            savings += store.names[ns].block_bytes - bb
            if tier & IN_NVME:
                clean += bb
        if state == State.RESERVED:
            n_reserved += 1
            assert reserved.get(eid, 0) <= 1, f"entry {eid} in two reservations"
            if index.is_keyed(eid):
                writing[ns] = writing.get(ns, 0) + 1
        elif state == State.COMMITTED:
            blocks[ns] = blocks.get(ns, 0) + 1
            assert eid not in reserved, f"committed entry {eid} still reserved"
            if tier & IN_CPU:
                in_cpu.add(eid)
            if tier & IN_NVME:
                in_nvme.add(eid)
            if tier & IN_GPU and eid in pool.dsum:
                in_gpu.add(eid)
        else:
            assert state == State.ORPHAN and index.leases[eid], f"orphan {eid} not leased"
        if io_idle:
            assert index.leases[eid] == leased.get(eid, 0), (
                f"entry {eid}: {index.leases[eid]} leases counted, {leased.get(eid, 0)} held"
            )
        else:
            assert index.leases[eid] >= leased.get(eid, 0), f"entry {eid}: leases lost"
    for record in store.names.records():
        ns = record.ns_id
        assert record.ns_id == ns
        assert record.entries == entries.get(ns, 0), (
            f"namespace {record.name}: {record.entries} entries counted, {entries.get(ns, 0)} held"
        )
        assert record.blocks == blocks.get(ns, 0), f"namespace {record.name}: blocks count"
        assert record.writing == writing.get(ns, 0), f"namespace {record.name}: writing count"
        if record.presence is not None and not record.presence.retired:
            assert record.presence.writing == record.writing, (
                f"namespace {record.name}: its presence table's writing count"
            )
        assert record.handles or record.entries, f"namespace {record.name} not freed"
    assert n_reserved == store.reserved_blocks, "reserved count"
    spare = sum(
        len(r.eids) * h.record.cpu_bytes
        for h in store.names.handles()
        for r in h.reservations.values()
        if r.spare
    )
    assert spare == spare_books.reserved_bytes, "spare slot bytes"
    quarantined = sum(nbytes for _, nbytes in spare_books.quarantine)
    assert quarantined == spare_books.quarantined_bytes, "quarantined spare slot bytes"
    assert spare + quarantined <= spare_books.tier_bytes, "spare slots past the tier's bound"
    assert store.cpu_slots.owned() == sum(
        1 for e in range(index.capacity) if index.state[e] and index.tier[e] & IN_CPU
    ), "a CPU slot owner without its entry"
    assert len(pool.owners()) == len(pool.offset), "a pool slot owner without its entry"
    assert set(pool.dsum) <= set(pool.offset), "a device checksum without a pool slot"
    store.allocator.check()
    if pool.allocator is not None:
        pool.allocator.check()
    store.names.check()
    if io_idle:
        assert set(store.policy.order()) == in_cpu, "cpu policy != committed CPU entries"
        assert set(store.nvme_policy.order()) == in_nvme, "nvme policy != committed disk ones"
        assert set(store.gpu_policy.order()) == in_gpu, "gpu policy != complete GPU copies"
        assert all(index.state[e] != State.RESERVED for e in pool.dsum), (
            "a reserved GPU copy counted complete"
        )
        assert pool.used_bytes == gpu_bytes + pool.quarantined_bytes, (
            f"gpu used {pool.used_bytes} != {gpu_bytes} in entries + "
            f"{pool.quarantined_bytes} quarantined"
        )
        slots = store.cpu_slots
        assert slots.payload_savings == savings, (
            f"cpu payload savings {slots.payload_savings}, entries' {savings}"
        )
        for eid in store.payload_sums:  # only payload copies in the CPU tier have one
            assert index.tier[eid] & IN_CPU and store.names[index.ns[eid]].cpu_codec, (
                f"entry {eid} has a payload checksum but no payload in the CPU tier"
            )
        assert slots.used_bytes == cpu_bytes + slots.quarantined_bytes, (
            f"cpu used {slots.used_bytes} != {cpu_bytes} in entries + "
            f"{slots.quarantined_bytes} quarantined"
        )
        assert slots.clean_bytes == clean, f"cpu clean {slots.clean_bytes} != {clean}"
        if store.nvme is not None:
            assert store.disk.blocks == len(in_nvme) + sum(
                1
                for e in range(index.capacity)
                if index.state[e] == State.ORPHAN and index.tier[e] & IN_NVME
            ), "nvme block count"
    _check_quotas(store)


def _check_quotas(store: Ledger) -> None:
    """The quotas' books match the index: each namespace's and tenant's CPU and NVMe bytes
    are those of its entries (plus its quarantined slots), its pins those of its live leases,
    reservations and quarantined slots."""
    index, quotas = store.index, store.quotas
    cpu: dict[int, int] = {}
    nvme: dict[int, int] = {}
    pinned: dict[int, int] = {}
    for eid in range(index.capacity):
        if index.state[eid] == State.FREE:
            continue
        record = store.names[index.ns[eid]]
        for books in (record.usage, record.owner):
            if index.tier[eid] & IN_CPU:
                cpu[id(books)] = cpu.get(id(books), 0) + record.cpu_bytes
            if index.tier[eid] & IN_NVME:
                nvme[id(books)] = nvme.get(id(books), 0) + record.block_bytes
    pins = [r.pin for h in store.names.handles() for r in h.reservations.values()]
    pins += [lease.pin for h in store.names.handles() for lease in h.leases.values()]
    quarantined = [q[4] for q in store.quarantine if q[4] is not None]
    leased: dict[int, dict[int, int]] = {}  # books -> entry -> block bytes (a lease's)
    everyone: dict[int, int] = {}
    for pin in pins:
        for books in pin.books:
            pinned[id(books)] = pinned.get(id(books), 0) + pin.nbytes
            for e in pin.eids:  # a leased block counts once per books
                leased.setdefault(id(books), {})[e] = pin.block_bytes
        for e in pin.eids:
            everyone[e] = pin.block_bytes
    for key, blocks in leased.items():
        pinned[key] = pinned.get(key, 0) + sum(blocks.values())
    for pin in dict.fromkeys(quarantined):
        for books in pin.books:
            pinned[id(books)] = pinned.get(id(books), 0) + pin.nbytes
    for q in store.quarantine:
        if q[4] is not None:
            for books in q[4].books:
                cpu[id(books)] = cpu.get(id(books), 0) + q[3]
    owners: dict[int, int] = {}
    for record in store.names.records():
        assert record.owner is not None, f"namespace {record.name} has no tenant books"
        owners[id(record.owner)] = owners.get(id(record.owner), 0) + 1
    paying: dict[int, int] = {}
    for handle in store.names.handles():
        if handle.payer is not None:
            paying[id(handle.payer)] = paying.get(id(handle.payer), 0) + 1
    for books in [*quotas.tenants(), quotas.unowned, *quotas.callers()]:
        assert books.records == owners.get(id(books), 0), f"tenant {books.name}: record count"
        assert books.payers == paying.get(id(books), 0), f"tenant {books.name}: payer count"
    books_all = [r.usage for r in store.names.records()] + quotas.tenants() + [quotas.unowned]
    books_all += quotas.callers()
    for books in books_all:
        assert books.cpu_bytes == cpu.get(id(books), 0), (
            f"quota books of {books.name}: {books.cpu_bytes} cpu bytes counted, "
            f"{cpu.get(id(books), 0)} held"
        )
        assert books.nvme_bytes == nvme.get(id(books), 0), f"quota books of {books.name}: nvme"
        assert books.pinned_bytes == pinned.get(id(books), 0), f"quota books of {books.name}: pins"
    assert quotas.total_pinned == sum(p.nbytes for p in pins) + sum(everyone.values()) + sum(
        p.nbytes for p in dict.fromkeys(quarantined)
    ), "total pinned bytes"
