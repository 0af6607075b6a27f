"""Puts that do not wait for their reply (``put(..., wait=False)``), against a real daemon.

What users rely on: bytes round-trip exactly; the caller may reuse its buffer as soon as the
put returns; a client reads its own writes at once (from the presence table too); others see
them after ``flush()``, which says how many were stored; a daemon that dies before serving the
put drops those blocks (counted), never corrupts, and the client keeps working.
"""

from __future__ import annotations

import asyncio
import signal

from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tokens

from kvstore import AsyncKVStoreClient, KVStoreClient

LONG_GRACE = "[limits]\npin_grace_s = 30.0\n"  # spare slots stay fresh whatever the load


def client(daemon, model: str = "posted", **kw) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model=model, **kw)


def test_puts_that_do_not_wait_round_trip_and_flush_counts_them(daemon_factory) -> None:
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 48, seed=5)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(48))
        for i in range(0, 48, 4):
            assert kv.put(keys[i : i + 4], blocks[i : i + 4], wait=False) == 0
        assert kv._spare.binds >= 9  # after the first two, every put binds in one call
        stored = kv.flush()
        assert stored == 48 and stored.dropped == 0
        assert kv.flush() == 0  # counted once
        with client(d) as other:
            assert other.lookup(keys) == 48
            assert same_bytes(other.get(keys), blocks)
        # Present keys are not stored again, and flush says so.
        kv.put(keys[:4], blocks[:4], wait=False)
        assert kv.flush() == 0


def test_a_client_reads_its_own_writes_before_any_flush(daemon_factory) -> None:
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 24, seed=6)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(24))
        for i in range(0, 24, 8):  # through Reserve and posted Commits, then through Bind
            src = blocks[i : i + 8].clone()
            kv.put(keys[i : i + 8], src, wait=False)
            src.fill_(7)  # the caller's buffer is its own again once put returns
            assert kv.lookup(keys[i : i + 8]) == 8
            assert same_bytes(kv.get(keys[i : i + 8]), blocks[i : i + 8])
        assert same_bytes(kv.get(keys), blocks)
        assert kv.flush() == 24


def test_close_serves_a_put_that_did_not_wait(daemon_factory) -> None:
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 8, seed=7)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(8))
        kv.put(keys[:4], blocks[:4])
        kv.put(keys[4:], blocks[4:], wait=False)
    with client(d) as other:
        assert same_bytes(other.get(keys), blocks)


def test_without_local_calls_a_put_that_does_not_wait_is_made_at_once(
    daemon_factory, monkeypatch
) -> None:
    monkeypatch.setenv("KVSTORE_LOCAL_CALLS", "0")  # every call over gRPC
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 16, seed=8)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(16))
        for i in range(0, 16, 4):
            kv.put(keys[i : i + 4], blocks[i : i + 4], wait=False)
        assert kv.flush() == 16
        assert same_bytes(kv.get(keys), blocks)


def test_a_daemon_that_dies_before_serving_the_put_drops_it_and_the_client_goes_on(
    daemon_factory,
) -> None:
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=9)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(12))
        kv.put(keys[:4], blocks[:4])
        kv.put(keys[4:8], blocks[4:8])  # asks for spare slots: the next put binds
        assert kv.flush() == 0  # nothing went without waiting yet
        assert d.proc is not None
        d.proc.send_signal(signal.SIGSTOP)  # the daemon cannot serve what comes now
        try:
            assert kv.put(keys[8:], blocks[8:], wait=False) == 0
        finally:
            d.stop(signal.SIGKILL)
        d.start()
        flushed = kv.flush()
        assert flushed == 0 and flushed.dropped == 4
        assert kv.get(keys).shape[0] == 0  # a new daemon, an empty CPU tier
        assert kv.put(keys, blocks) == 12
        assert same_bytes(kv.get(keys), blocks)


def test_the_asyncio_face_puts_without_waiting_too(daemon_factory) -> None:
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 32, seed=10)

    async def run() -> None:
        async with AsyncKVStoreClient(d.address, layout=SMALL_LAYOUT, model="posted") as kv:
            keys = kv.hash_tokens(tokens(32))
            for i in range(0, 32, 4):
                assert await kv.put(keys[i : i + 4], blocks[i : i + 4], wait=False) == 0
                assert same_bytes(await kv.get(keys[i : i + 4]), blocks[i : i + 4])
            assert await kv.flush() == 32
            async with AsyncKVStoreClient(d.address, layout=SMALL_LAYOUT, model="posted") as o:
                assert same_bytes(await o.get(keys), blocks)

    asyncio.run(run())


def test_asyncio_tasks_putting_at_once_without_waiting_are_all_counted(daemon_factory) -> None:
    """Concurrent calls on one asyncio client are safe for distinct keys: puts of several
    tasks that do not wait may be sent back to back, and flush counts every one."""
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 64, seed=11)

    async def run() -> None:
        async with AsyncKVStoreClient(d.address, layout=SMALL_LAYOUT, model="posted") as kv:
            keys = kv.hash_tokens(tokens(64))

            async def putter(lo: int) -> None:
                for i in range(lo, lo + 16, 4):
                    await kv.put(keys[i : i + 4], blocks[i : i + 4], wait=False)

            await asyncio.gather(*(putter(lo) for lo in range(0, 64, 16)))
            assert await kv.flush() == 64
            assert same_bytes(await kv.get(keys), blocks)

    asyncio.run(run())
