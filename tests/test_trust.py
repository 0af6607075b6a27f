"""The store's promises under abuse, against a real daemon: one regression test per way the
promises were broken (issue "Integrity under concurrency and abuse").

Each test names the bug it pins. They use a real ``kvstore serve``, real shared memory and raw
gRPC stubs where a hostile or broken client would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from conftest import SMALL_LAYOUT, kv_channel, random_blocks, same_bytes, tokens, wait_for

from kvstore import KVLayout, KVStoreClient
from kvstore.checksum import block_checksum
from kvstore.client._common import MappedArena, StreamAssembler, seeds_for
from kvstore.keys import Namespace
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

BB = SMALL_LAYOUT.block_bytes  # 8 KiB


def client(daemon, tenant: str = "", **kw) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model="trust", tenant=tenant, **kw)


def layout_pb() -> pb.Layout:
    lay = SMALL_LAYOUT
    return pb.Layout(
        num_layers=lay.num_layers,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        block_size=lay.block_size,
        dtype=lay.dtype_name,
    )


def open_raw(stub, tenant: str = "", model: str = "trust"):
    call = stub.OpenNamespace(
        pb.OpenNamespaceRequest(model=model, tenant=tenant, layout=layout_pb())
    )
    return call, next(call)


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code()


# ----------------------------------------------------------------- wrong bytes
def test_a_slow_bytes_reader_never_gets_other_blocks_after_its_lease_expires(
    daemon_factory,
) -> None:
    """Bug 1: GetBlocks streamed read_block(entry id) after its lease expired; eviction had
    reused the entry ids, so the stream sent other tenants' blocks, with their own valid
    checksums, under the keys asked for. Each block is now checked against its key as it is
    copied; past the lease the stream ends."""
    big = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16)  # 128 KiB
    n = 64  # 8 MiB: far more than gRPC buffers ahead of a slow reader
    d = daemon_factory(cpu_capacity="24MiB", slab="4MiB", lease_ttl_s=0.3)
    alice = KVStoreClient(d.address, layout=big, model="trust", tenant="alice")
    bob = KVStoreClient(d.address, layout=big, model="trust", tenant="bob")
    with alice, bob:
        keys = alice.hash_tokens(tokens(n))
        mine = random_blocks(big, n, seed=1)
        assert alice.put(keys, mine) == n
        with kv_channel(alice) as ch:
            stream = pb_grpc.KVStoreStub(ch).GetBlocks(
                pb.GetBlocksRequest(handle=alice._handle, keys=b"".join(keys)), timeout=60
            )
            first = next(stream)  # the lease is taken; now read slowly
            time.sleep(1.0)  # the lease expires (reaper every 0.2 s)
            # Bob churns the whole tier: alice's blocks are evicted, their entries reused.
            for i in range(4):
                bkeys = bob.hash_tokens(tokens(24, offset=1000 + 24 * i))
                bob.put(bkeys, random_blocks(big, 24, seed=10 + i))
            rest = list(stream)
        got = StreamAssembler(big, keys, seeds_for(alice.namespace, keys), None)
        for message in [first, *rest]:
            assert got.add(message), "a message that is not alice's next block, intact"
        m = got.result().shape[0]
        assert same_bytes(got.result(), mine[:m])  # whatever arrived is alice's own bytes
        assert m < n  # the stream ended at the first block it could no longer vouch for


def test_a_block_served_under_the_wrong_key_fails_its_checksum() -> None:
    """Bug 1's second half: a checksum bound only the bytes, so a block sent under another key
    passed. Bound checksums make such a block a miss even when its bytes are intact."""
    ns = Namespace(model="trust", layout=SMALL_LAYOUT)
    keys = [bytes([i]) * 32 for i in range(2)]
    block = random_blocks(SMALL_LAYOUT, 1, seed=3).view(torch.uint8).reshape(BB).numpy()
    # The daemon (wrongly) serves key 1's block, with key 1's valid checksum, as key 0.
    message = pb.BlockData(
        key=keys[0], data=block.tobytes(), checksum=block_checksum(block, ns.fingerprint, keys[1])
    )
    got = StreamAssembler(SMALL_LAYOUT, keys, seeds_for(ns, keys), None)
    assert not got.add(message)
    assert got.result().shape[0] == 0
    # The same block under its own key passes.
    good = StreamAssembler(SMALL_LAYOUT, keys[1:], seeds_for(ns, keys[1:]), None)
    message.key = keys[1]
    assert good.add(message) and good.result().shape[0] == 1


def test_a_handle_of_a_restarted_daemon_reaches_nothing(daemon) -> None:
    """Bug 2: namespace ids were small integers reused across restarts: a stale client's
    PutBlocks landed in another tenant's namespace. Handles are random, per daemon instance."""
    with grpc.insecure_channel(daemon.address) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        call, old = open_raw(stub, tenant="stale")
        call.cancel()
    daemon.stop()
    daemon.start()
    with client(daemon, "victim") as victim, grpc.insecure_channel(daemon.address) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        key = victim.hash_tokens(tokens(1))[0]
        message = pb.PutBlocksRequest(handle=old.handle, key=key, data=b"\x00" * BB)
        assert code_of(lambda: stub.PutBlocks(iter([message]), timeout=5)) == (
            grpc.StatusCode.NOT_FOUND
        )
        assert victim.lookup([key]) == 0


def test_every_call_checks_its_handle(daemon) -> None:
    """Bug 2/3: only Reserve and Acquire checked the daemon's epoch; the others trusted any
    number. Every call with a handle that was never issued (or closed) is NOT_FOUND."""
    bogus = os.urandom(16)
    keys = b"\x01" * 32
    with grpc.insecure_channel(daemon.address) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        call, real = open_raw(stub)
        call.cancel()  # closed: as dead as a guess
        wait_for(
            lambda: (
                code_of(lambda: stub.Lookup(pb.LookupRequest(handle=real.handle), timeout=5))
                == grpc.StatusCode.NOT_FOUND
            ),
            what="the closed handle to be refused",
        )
        for handle in (bogus, real.handle, b""):
            calls = [
                lambda h=handle: stub.Lookup(pb.LookupRequest(handle=h, keys=keys), timeout=5),
                lambda h=handle: stub.Reserve(pb.ReserveRequest(handle=h, keys=keys), timeout=5),
                lambda h=handle: stub.Commit(
                    pb.CommitRequest(handle=h, reservation_id=1), timeout=5
                ),
                lambda h=handle: stub.Abort(pb.AbortRequest(handle=h, reservation_id=1), timeout=5),
                lambda h=handle: stub.Acquire(pb.AcquireRequest(handle=h, keys=keys), timeout=5),
                lambda h=handle: stub.Release(pb.ReleaseRequest(handle=h, lease_id=1), timeout=5),
                lambda h=handle: stub.Prefetch(pb.PrefetchRequest(handle=h, keys=keys), timeout=5),
                lambda h=handle: stub.Delete(pb.DeleteRequest(handle=h, keys=keys), timeout=5),
                lambda h=handle: list(
                    stub.GetBlocks(pb.GetBlocksRequest(handle=h, keys=keys), timeout=5)
                ),
                lambda h=handle: stub.PutBlocks(
                    iter([pb.PutBlocksRequest(handle=h, key=keys, data=b"x")]), timeout=5
                ),
            ]
            for fn in calls:
                assert code_of(fn) == grpc.StatusCode.NOT_FOUND


def test_reservations_and_leases_belong_to_their_handle(daemon) -> None:
    """Bug 3: reservation and lease ids were sequential and anyone could commit, abort or
    release another client's. Ids are random and only their own handle reaches them."""
    with (
        client(daemon, "a") as a,
        client(daemon, "b") as b,
        kv_channel(b) as ch,
        kv_channel(a) as ch_a,
    ):
        stub = pb_grpc.KVStoreStub(ch)  # b's calls, with b's own handle
        stub_a = pb_grpc.KVStoreStub(ch_a)
        keys = a.hash_tokens(tokens(2))
        reservation = a.reserve(keys)
        assert reservation.reservation_id > 1 << 20  # random, not 1, 2, 3...
        for request in (
            lambda: stub.Commit(
                pb.CommitRequest(
                    handle=b._handle, reservation_id=reservation.reservation_id, checksums=[1, 2]
                ),
                timeout=5,
            ),
            lambda: stub.Abort(
                pb.AbortRequest(handle=b._handle, reservation_id=reservation.reservation_id),
                timeout=5,
            ),
        ):
            assert code_of(request) == grpc.StatusCode.FAILED_PRECONDITION
        blocks = random_blocks(SMALL_LAYOUT, 2)
        reservation.fill_from(blocks.view(torch.uint8).reshape(2, BB))
        assert reservation.commit() == 2  # untouched by b's attempts
        lease = stub_a.Acquire(pb.AcquireRequest(handle=a._handle, keys=b"".join(keys)), timeout=5)
        assert lease.lease_id > 1 << 20
        # b cannot release a's lease, even knowing its id.
        release = pb.ReleaseRequest(handle=b._handle, lease_id=lease.lease_id)
        assert code_of(lambda: stub.Release(release, timeout=5)) == (
            grpc.StatusCode.FAILED_PRECONDITION
        )
        assert a.stats().active_leases == 1
        stub_a.Release(pb.ReleaseRequest(handle=a._handle, lease_id=lease.lease_id), timeout=5)
        # a's handle is a's alone: b's calls presenting it reach nothing.
        assert (
            code_of(
                lambda: stub.Lookup(pb.LookupRequest(handle=a._handle, keys=keys[0]), timeout=5)
            )
            == grpc.StatusCode.NOT_FOUND
        )
        assert a.stats().active_leases == 0
        assert same_bytes(a.get(keys), blocks)


def test_a_write_into_the_slot_after_the_copy_cannot_be_committed_as_valid(
    daemon, monkeypatch
) -> None:
    """Bug 4: the commit's checksum was computed by reading the slot back, so whatever else
    wrote into the slot between the copy and the checksum was committed as valid. The
    checksum is now of the source, as it is copied: such a write makes the block a miss."""
    real_copyto = np.copyto

    def copy_then_scribble(dst, src, *args, **kwargs):  # a concurrent writer lands right after
        real_copyto(dst, src, *args, **kwargs)
        if dst.nbytes % BB == 0:  # a block, or a run of back-to-back blocks copied at once
            for start in range(0, dst.nbytes, BB):
                dst.reshape(-1)[start : start + 16] = 0xAB

    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(2))
        blocks = random_blocks(SMALL_LAYOUT, 2)
        monkeypatch.setattr(np, "copyto", copy_then_scribble)
        try:
            assert kv.put(keys, blocks) == 2
        finally:
            monkeypatch.setattr(np, "copyto", real_copyto)
        assert kv.get(keys).shape[0] == 0  # the scribbled block is a miss, never data
        assert isinstance(kv._arena, MappedArena)


# ----------------------------------------------------------------- wedges and leaks
def test_repeated_keys_are_refused_and_pin_nothing(daemon) -> None:
    """Bug 5: Acquire with a key repeated 65,535 times overflowed a lease counter and left the
    leases taken before the error pinned forever. Bug 10: GetBlocks of one key repeated
    streamed the block once per repeat."""
    with client(daemon) as kv, kv_channel(kv) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        key = kv.hash_tokens(tokens(1))[0]
        kv.put([key], random_blocks(SMALL_LAYOUT, 1))
        for n in (2, 100, 65535):
            packed = key * n
            assert (
                code_of(
                    lambda p=packed: stub.Acquire(
                        pb.AcquireRequest(handle=kv._handle, keys=p), timeout=10
                    )
                )
                == grpc.StatusCode.INVALID_ARGUMENT
            )
            assert (
                code_of(
                    lambda p=packed: list(
                        stub.GetBlocks(pb.GetBlocksRequest(handle=kv._handle, keys=p), timeout=10)
                    )
                )
                == grpc.StatusCode.INVALID_ARGUMENT
            )
        assert kv.stats().active_leases == 0
        assert kv.delete([key]) == 1  # nothing pins it
        assert kv.lookup([key]) == 0


def test_prefetch_of_repeated_disk_only_keys_does_not_wedge_reads(daemon_factory, tmp_path):
    """Bug 6: Prefetch with duplicate keys of disk-only blocks crashed the promotion task; its
    futures were never resolved and every later get of those blocks hung."""
    d = daemon_factory(
        cpu_capacity="128KiB",
        slab="128KiB",
        nvme_path=tmp_path / "nvme",
        nvme_capacity="8MiB",
        write_through=True,
    )
    with client(d, timeout_s=20) as kv, kv_channel(kv) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        keys = kv.hash_tokens(tokens(4))
        blocks = random_blocks(SMALL_LAYOUT, 4)
        kv.put(keys, blocks)
        for i in range(8):  # push them out of the CPU tier: disk only now
            kv.put(kv.hash_tokens(tokens(16, offset=100 + 16 * i)), random_blocks(SMALL_LAYOUT, 16))
        stub.Prefetch(
            pb.PrefetchRequest(handle=kv._handle, keys=keys[0] * 3 + keys[1] * 3), timeout=5
        )
        start = time.monotonic()
        got = kv.get(keys)
        assert time.monotonic() - start < 15
        assert same_bytes(got, blocks[: got.shape[0]]) and got.shape[0] == 4


def test_names_tables_and_replies_are_bounded(daemon) -> None:
    """Bug 9: namespaces were never freed (65,535 opens exhausted the table) and five 55 MiB
    names made Stats fail for good. Names are bounded, closed handles free their namespace,
    Stats stays small."""
    with grpc.insecure_channel(daemon.address) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        huge = "m" * 100_000
        assert code_of(lambda: open_raw(stub, model=huge)) == grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(lambda: open_raw(stub, tenant=huge)) == grpc.StatusCode.INVALID_ARGUMENT
        for i in range(200):  # open and close: nothing accumulates
            call, _ = open_raw(stub, tenant=f"t{i}")
            call.cancel()
        wait_for(
            lambda: stub.Stats(pb.StatsRequest(), timeout=5).open_handles == 0,
            what="closed handles to go",
        )
        reply = stub.Stats(pb.StatsRequest(), timeout=5)
        assert len(reply.namespaces) == 0  # empty, unused namespaces are forgotten
        assert reply.ByteSize() < 64 << 10


def test_oversized_and_undecodable_requests_get_invalid_argument(daemon) -> None:
    """Bug 10: Reserve with millions of keys blocked the event loop and grew the daemon by GBs.
    Requests past max_keys_per_request (or the message limit) are refused before any work;
    bytes that do not decode are INVALID_ARGUMENT, not INTERNAL."""
    with client(daemon) as kv, kv_channel(kv) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        many = b"".join(os.urandom(32) for _ in range(16385))  # one past the limit
        assert (
            code_of(
                lambda: stub.Reserve(pb.ReserveRequest(handle=kv._handle, keys=many), timeout=10)
            )
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        millions = bytes(32 * 1_000_000)
        code = code_of(
            lambda: stub.Reserve(pb.ReserveRequest(handle=kv._handle, keys=millions), timeout=10)
        )
        assert code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
        raw = ch.unary_unary(
            "/kvstore.v1.KVStore/Lookup",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff\xff\x0f garbage", timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "does not decode" in err.value.details()
        keys = kv.hash_tokens(tokens(2))  # and the daemon keeps serving
        blocks = random_blocks(SMALL_LAYOUT, 2)
        assert kv.put(keys, blocks) == 2 and same_bytes(kv.get(keys), blocks)


READER_THAT_DIES = """
import os, sys
sys.path.insert(0, {tests!r})
from conftest import SMALL_LAYOUT, tokens
from kvstore import KVLayout, KVStoreClient
kv = KVStoreClient({address!r}, layout=SMALL_LAYOUT, model="trust")
lease = kv.acquire(kv.hash_tokens(tokens(2)))
print("leased", len(lease), flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_reader_killed_holding_a_lease_releases_it_at_once(daemon_factory) -> None:
    """Bug 8 (reads): a dead client's leases pinned its blocks until the TTL. Its closed
    connection releases them now."""
    d = daemon_factory(lease_ttl_s=600.0, reservation_ttl_s=600.0)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(2))
        kv.put(keys, random_blocks(SMALL_LAYOUT, 2))
        code = READER_THAT_DIES.format(tests=os.path.dirname(__file__), address=d.address)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == -9 and "leased 2" in proc.stdout
        wait_for(lambda: kv.stats().active_leases == 0, timeout_s=10, what="lease release")
        assert kv.delete(keys) == 2


# ----------------------------------------------------------------- read your writes
def test_a_put_meeting_another_clients_write_waits_for_its_commit(daemon) -> None:
    """A put returned 0 ("already present") while another client's reservation of the same
    keys was uncommitted, so an immediate get missed. It now waits for that commit."""
    with client(daemon) as writer, client(daemon) as other:
        keys = writer.hash_tokens(tokens(3))
        blocks = random_blocks(SMALL_LAYOUT, 3)
        reservation = writer.reserve(keys)

        def commit_later() -> None:
            time.sleep(0.5)
            reservation.fill_from(blocks.view(torch.uint8).reshape(3, BB))
            reservation.commit()

        t = threading.Thread(target=commit_later)
        t.start()
        stored = other.put(keys, random_blocks(SMALL_LAYOUT, 3, seed=9))
        t.join()
        assert stored == 0 and stored.pending == 0  # the other's write won, and was waited for
        assert same_bytes(other.get(keys), blocks)  # read your (the store's) writes


def test_a_put_stops_waiting_at_its_deadline_and_says_so(daemon_factory) -> None:
    d = daemon_factory(extra="\n[limits]\nwrite_wait_s = 0.3\n")
    with client(d) as writer, client(d) as other:
        keys = writer.hash_tokens(tokens(2))
        reservation = writer.reserve(keys)  # never committed while the other waits
        stored = other.put(keys, random_blocks(SMALL_LAYOUT, 2))
        assert stored == 0 and stored.pending == 2
        reservation.abort()
        assert other.put(keys, random_blocks(SMALL_LAYOUT, 2)) == 2  # free again: written


def test_an_abandoned_handle_cannot_be_used_by_another_connection(daemon) -> None:
    """A handle belongs to the stream that opened it: once that stream is gone, presenting the
    token elsewhere reaches nothing (no reuse of a dead client's reservations)."""
    with grpc.insecure_channel(daemon.address) as ch1:
        call, reply = open_raw(pb_grpc.KVStoreStub(ch1))
        reserve = pb_grpc.KVStoreStub(ch1).Reserve(
            pb.ReserveRequest(handle=reply.handle, keys=os.urandom(32)), timeout=5
        )
        assert reserve.reservation_id
        call.cancel()
    with grpc.insecure_channel(daemon.address) as ch2:
        stub = pb_grpc.KVStoreStub(ch2)
        wait_for(
            lambda: stub.Stats(pb.StatsRequest(), timeout=5).active_reservations == 0,
            what="the reservation to be reclaimed",
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.Commit(
                pb.CommitRequest(
                    handle=reply.handle, reservation_id=reserve.reservation_id, checksums=[1]
                ),
                timeout=5,
            )
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_offload_checksums_the_engines_blocks_not_the_slots(daemon, monkeypatch) -> None:
    """Bug 4 on the paged path: offload gathered into the slots and then checksummed the slots,
    so a write into a slot between the gather and the checksum was committed as valid. The
    checksum is now taken from the engine's cache as each piece is copied."""
    from kvstore.client import paged_io

    lay = SMALL_LAYOUT
    caches = [
        torch.randn(2, 8, lay.block_size, lay.num_kv_heads, lay.head_dim).to(lay.dtype)
        for _ in range(lay.num_layers)
    ]
    real = paged_io.gather_with_checksums

    def gather_then_scribble(kv_caches, ids, views, seeds):  # a writer lands after the copy
        sums = real(kv_caches, ids, views, seeds)
        for view in views:
            view.view(torch.uint8).reshape(-1)[:64] = 0xCD
        return sums

    with client(daemon) as kv:
        keys = kv.hash_tokens(tokens(4))
        monkeypatch.setattr(paged_io, "gather_with_checksums", gather_then_scribble)
        assert kv.offload(caches, [0, 1, 2, 3], keys) == 4
        monkeypatch.setattr(paged_io, "gather_with_checksums", real)
        assert kv.get(keys).shape[0] == 0  # scribbled slots are misses, never data
        other = kv.hash_tokens(tokens(4, offset=100))
        assert kv.offload(caches, [4, 5, 6, 7], other) == 4
        dest = [torch.zeros_like(c) for c in caches]
        assert kv.load(dest, [0, 1, 2, 3], other) == 4
        for src, got in zip(caches, dest, strict=True):
            assert torch.equal(src[:, 4:8].view(torch.int16), got[:, 0:4].view(torch.int16))


VIEW_AFTER_CLOSE = """
import sys
sys.path.insert(0, {tests!r})
from conftest import SMALL_LAYOUT, random_blocks, tokens
from kvstore import KVStoreClient
kv = KVStoreClient({address!r}, layout=SMALL_LAYOUT, model="trust")
keys = kv.hash_tokens(tokens(2))
kv.put(keys, random_blocks(SMALL_LAYOUT, 2))
lease = kv.acquire(keys)
views = lease.views
lease.release()
kv.close()
print("sum", float(views[0].float().sum()), repr(views[1])[:10], flush=True)
"""


def test_a_view_that_outlives_its_client_reads_mapped_memory(daemon) -> None:
    """A tensor over the arena kept past ``close()`` (a leftover lease view, a traceback frame
    that pytest prints) pointed at unmapped memory and crashed the process. The mapping now
    lives as long as any tensor over it."""
    code = VIEW_AFTER_CLOSE.format(tests=os.path.dirname(__file__), address=daemon.address)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sum" in proc.stdout
