"""Puts that do not wait (``put(..., wait=False)``): what their reply goes through before a
``flush`` reads it, against a real daemon.

A posted call's reply must reach ``flush`` whatever the client does meanwhile (a request that
carries a descriptor reads it first), later calls must see the put, and ``flush`` must count
what the daemon stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

import pytest
from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tokens

from kvstore import AsyncKVStoreClient, KVStoreClient
from kvstore.client import leases
from kvstore.errors import LeaseExpiredError

LONG_GRACE = "[limits]\npin_grace_s = 30.0\n"  # spare slots stay fresh whatever the load


def client(daemon, model: str = "posted", **kw) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model=model, **kw)


def stream_puts(kv: KVStoreClient, keys: list, blocks) -> None:
    """Two waiting puts in a row: the second asks for spare slots, so the next put binds."""
    kv.put(keys[:4], blocks[:4])
    kv.put(keys[4:8], blocks[4:8])


def test_a_bind_that_waits_for_another_writer_keeps_its_slots(daemon_factory) -> None:
    """Spare slots live 2 s (pin_grace_s); a Bind that meets a key another client is writing
    waits up to write_wait_s for it. A posted Bind lost every block when its slots expired
    during that wait, those of keys nobody else wrote included; a waiting put stores them."""
    d = daemon_factory(extra="[limits]\nwrite_wait_s = 4.0\n")
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=21)
    with client(d) as kv, client(d) as other:
        keys = kv.hash_tokens(tokens(12))
        stream_puts(kv, keys, blocks)
        writing = other.reserve([keys[8]])  # another engine is writing the shared block
        try:
            kv.put(keys[8:], blocks[8:], wait=False)
            assert kv._posted.current is not None and kv._posted.current.method == "Bind"
            flushed = kv.flush()
        finally:
            writing.abort()
        assert (flushed, flushed.dropped) == (3, 0)  # as put(wait=True) stores them
        assert same_bytes(kv.get(keys[9:]), blocks[9:])


def test_a_call_over_grpc_is_served_after_the_put_in_flight(daemon_factory) -> None:
    """A request too large for a local call goes over gRPC, which the daemon serves beside
    the session's calls, not after them: a delete of keys put without waiting was served
    before the put, and the keys were stored after it."""
    d = daemon_factory(extra="[limits]\npin_grace_s = 30.0\nwrite_wait_s = 1.5\n")
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=22)
    with client(d) as kv, client(d) as other:
        keys = kv.hash_tokens(tokens(12))
        fillers = kv.hash_tokens(tokens(2100, offset=100_000))  # past a local call's bound
        stream_puts(kv, keys, blocks)
        writing = other.reserve([keys[8]])  # holds the posted Bind in the daemon a while
        try:
            kv.put(keys[8:], blocks[8:], wait=False)
            kv.delete(keys[9:] + fillers)
            kv.flush()
        finally:
            writing.abort()
        assert kv.lookup(keys[9:]) == 0  # deleted after they were put


def test_flush_counts_the_keys_another_client_was_still_writing(daemon_factory) -> None:
    """A waiting put's count says how many keys another client was still writing when the
    daemon stopped waiting (``pending``); a posted Bind's reply said it too, and flush dropped
    it."""
    d = daemon_factory(extra="[limits]\npin_grace_s = 30.0\nwrite_wait_s = 0.3\n")
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=23)
    with client(d) as kv, client(d) as other:
        keys = kv.hash_tokens(tokens(12))
        stream_puts(kv, keys, blocks)
        writing = other.reserve([keys[8]])
        try:
            kv.put(keys[8:], blocks[8:], wait=False)
            flushed = kv.flush()
        finally:
            writing.abort()
        assert (flushed, flushed.pending) == (3, 1)


def test_flush_counts_puts_on_the_bytes_path(daemon_factory) -> None:
    """A client with no arena (another host, ``transport="grpc"``) stores at once; its put
    returned the count and flush said 0, where the documented contract is the other way."""
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 8, seed=24)
    with client(d, transport="grpc") as kv:
        keys = kv.hash_tokens(tokens(8))
        assert kv.put(keys, blocks, wait=False) == 0
        assert kv.flush() == 8


def test_a_cancelled_flush_leaves_the_put_to_the_next(daemon_factory) -> None:
    """asyncio: a flush cancelled while it waits for a posted put (a timeout around it)
    cancelled the put's call too, before it was even sent when another call held the
    session's turn, and forgot it: the next flush said 0 stored, 0 dropped, no error, and the
    blocks were never stored."""
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=25)

    async def run() -> None:
        async with AsyncKVStoreClient(d.address, layout=SMALL_LAYOUT, model="posted") as kv:
            keys = kv.hash_tokens(tokens(12))
            await kv.put(keys[:4], blocks[:4])
            await kv.put(keys[4:8], blocks[4:8])
            assert d.proc is not None
            d.proc.send_signal(signal.SIGSTOP)  # every call now waits for its reply
            try:
                busy = asyncio.ensure_future(kv.prefetch(keys[:4]))
                await asyncio.sleep(0)  # it holds the session's turn
                await kv.put(keys[8:], blocks[8:], wait=False)  # its call waits for the turn
                flushing = asyncio.ensure_future(kv.flush())
                await asyncio.sleep(0)
                flushing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await flushing
            finally:
                d.proc.send_signal(signal.SIGCONT)
            await busy
            flushed = await kv.flush()
            assert (flushed, flushed.dropped) == (4, 0)
            assert same_bytes(await kv.get(keys[8:]), blocks[8:])

    asyncio.run(run())


def test_a_second_flush_waits_for_the_put_too(daemon_factory) -> None:
    """asyncio, two tasks of one client: a flush while another task's flush waits for the
    posted put returned at once, before the daemon had served it."""
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=26)

    async def run() -> None:
        async with AsyncKVStoreClient(d.address, layout=SMALL_LAYOUT, model="posted") as kv:
            keys = kv.hash_tokens(tokens(12))
            await kv.put(keys[:4], blocks[:4])
            await kv.put(keys[4:8], blocks[4:8])
            assert d.proc is not None
            d.proc.send_signal(signal.SIGSTOP)  # the put cannot be served meanwhile
            try:
                await kv.put(keys[8:], blocks[8:], wait=False)
                first = asyncio.ensure_future(kv.flush())
                await asyncio.sleep(0)
                second = asyncio.ensure_future(kv.flush())
                for _ in range(3):
                    await asyncio.sleep(0)
                returned_unserved = second.done()
            finally:
                d.proc.send_signal(signal.SIGCONT)
            a, b = await asyncio.gather(first, second)
            assert not returned_unserved
            assert a + b == 4

    asyncio.run(run())


def test_a_descriptor_request_reads_the_posted_reply_first(daemon_factory) -> None:
    """The presence table is asked for while a put's Bind is in flight: its reply is read and
    kept for flush, and the lookup is answered from the table."""
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=27)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(12))
        kv.put(keys[:4], blocks[:4])
        kv.put(keys[4:8], blocks[4:8])  # asks for spare slots: the next put binds
        kv._presence.close()  # the next lookup maps the table anew
        kv._presence._called = time.monotonic() + 3600  # and answers from it, however slow
        kv.put(keys[8:], blocks[8:], wait=False)
        assert kv._posted.current is not None and kv._posted.current.method == "Bind"
        answered = kv._presence.answered
        assert kv.lookup(keys[:4]) == 4
        assert kv._presence.answered == answered + 1  # from the table, mapped meanwhile
        assert kv.flush() == 4
        with client(d) as reader:
            assert same_bytes(reader.get(keys), blocks)


def test_asyncio_a_call_over_grpc_is_served_after_the_put_in_flight(daemon_factory) -> None:
    """The asyncio face: a delete too large for a local call, made while a posted Bind waits
    in the daemon, is served after it (the keys it names are gone at the end)."""
    d = daemon_factory(extra="[limits]\npin_grace_s = 30.0\nwrite_wait_s = 1.5\n")
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=28)

    async def run() -> None:
        async with AsyncKVStoreClient(d.address, layout=SMALL_LAYOUT, model="posted") as kv:
            keys = kv.hash_tokens(tokens(12))
            fillers = kv.hash_tokens(tokens(2100, offset=100_000))  # past a local call's bound
            await kv.put(keys[:4], blocks[:4])
            await kv.put(keys[4:8], blocks[4:8])
            with client(d) as other:
                writing = other.reserve([keys[8]])  # holds the posted Bind in the daemon
                try:
                    await kv.put(keys[8:], blocks[8:], wait=False)
                    await kv.delete(keys[9:] + fillers)
                    await kv.flush()
                finally:
                    writing.abort()
            assert await kv.lookup(keys[9:]) == 0  # deleted after they were put

    asyncio.run(run())


def _late_commit(daemon_factory, monkeypatch):
    """A daemon whose reservations live 0.3 s, and a client whose copy into a reservation
    takes 1.5 s: the Commit a put without waiting sends then finds its reservation expired."""
    d = daemon_factory(reservation_ttl_s=0.3)
    original = leases._ReservationState.fill_from

    def slow_fill(self, rows):
        original(self, rows)
        time.sleep(1.5)

    monkeypatch.setattr(leases._ReservationState, "fill_from", slow_fill)
    return d


def test_flush_raises_what_a_put_that_did_not_wait_met(daemon_factory, monkeypatch) -> None:
    d = _late_commit(daemon_factory, monkeypatch)
    blocks = random_blocks(SMALL_LAYOUT, 4, seed=29)
    with client(d) as kv:
        keys = kv.hash_tokens(tokens(4))
        assert kv.put(keys, blocks, wait=False) == 0  # a lone put: Reserve, then Commit
        with pytest.raises(LeaseExpiredError):
            kv.flush()
        assert kv.flush() == 0  # raised once
        monkeypatch.undo()
        assert kv.put(keys, blocks) == 4  # the client goes on


def test_close_logs_an_error_no_flush_reported(daemon_factory, monkeypatch, caplog) -> None:
    """close raises nothing, so an error of a put made with wait=False that no flush reported
    is logged: it was lost silently."""
    d = _late_commit(daemon_factory, monkeypatch)
    blocks = random_blocks(SMALL_LAYOUT, 4, seed=30)
    with caplog.at_level(logging.WARNING, logger="kvstore.client.posted_puts"), client(d) as kv:
        kv.put(kv.hash_tokens(tokens(4)), blocks, wait=False)
    assert any("no flush reported it" in r.getMessage() for r in caplog.records)


def test_a_put_copied_ahead_of_a_waiting_bind_is_not_dropped(daemon_factory) -> None:
    """A put that does not wait copies into slots it holds before it reads the reply to the
    put in flight. When that put's Bind waited (another client writing one of its keys) past
    the slots' window, the daemon reclaimed them and the later put was dropped; it now goes
    through a reservation, and stores."""
    d = daemon_factory(extra="[limits]\nwrite_wait_s = 3.0\n")  # spare slots live 2 s
    blocks = random_blocks(SMALL_LAYOUT, 16, seed=26)
    with client(d) as kv, client(d) as other:
        keys = kv.hash_tokens(tokens(16))
        # A run of puts: the client then holds two puts' worth, granted by two replies.
        for i in range(0, 10, 2):
            kv.put(keys[i : i + 2], blocks[i : i + 2], wait=False)
        assert kv.flush() == 10  # (4 slots held, of two reservations, on a quiet machine)
        writing = other.reserve([keys[10]])  # the next Bind waits write_wait_s for it
        try:
            kv.put(keys[10:12], blocks[10:12], wait=False)
            kv.put(keys[12:14], blocks[12:14], wait=False)  # copied before that wait
            flushed = kv.flush()
        finally:
            writing.abort()
        assert (flushed, flushed.pending, flushed.dropped) == (3, 1, 0)
        assert same_bytes(kv.get(keys[11:14]), blocks[11:14])


def test_flush_counts_the_keys_another_client_was_still_writing_at_a_reserve(
    daemon_factory,
) -> None:
    """A put that does not wait and holds no spare slots (a lone put, or one whose slots
    copied ahead went stale) goes through a reservation: the keys another client was still
    writing when that Reserve stopped waiting went to the put's own count, which a caller of
    ``put(..., wait=False)`` reads as 0, and flush said none."""
    d = daemon_factory(extra="[limits]\nwrite_wait_s = 0.3\n")
    blocks = random_blocks(SMALL_LAYOUT, 8, seed=27)
    with client(d) as kv, client(d) as other:
        keys = kv.hash_tokens(tokens(8))
        writing = other.reserve([keys[0], keys[4]])
        try:
            assert kv.put(keys[:4], blocks[:4], wait=False) == 0  # some keys new: a Commit
            assert kv.put(keys[4:5], blocks[4:5], wait=False) == 0  # none new: no Commit
            flushed = kv.flush()
        finally:
            writing.abort()
        assert (flushed, flushed.pending, flushed.dropped) == (3, 2, 0)
        assert same_bytes(kv.get(keys[1:4]), blocks[1:4])


def test_a_put_cancelled_after_its_call_was_sent_is_still_counted(daemon_factory) -> None:
    """asyncio: a put that does not wait, sent while another task's put became the one in
    flight, settles that one first; cancelled while it waited for that reply (a timeout
    around it), its own call, already sent, was forgotten: the daemon stored its blocks and
    flush neither counted them nor would have raised its error."""
    d = daemon_factory(extra=LONG_GRACE)
    blocks = random_blocks(SMALL_LAYOUT, 12, seed=28)

    async def run() -> None:
        async with AsyncKVStoreClient(d.address, layout=SMALL_LAYOUT, model="posted") as kv:
            keys = kv.hash_tokens(tokens(12))
            await kv.put(keys[:4], blocks[:4])
            await kv.put(keys[4:8], blocks[4:8])  # asks for 4 spare slots: 2 puts bind
            assert len(kv._spare._slots) == 4  # (else a put would wait for a Reserve below)
            assert d.proc is not None
            d.proc.send_signal(signal.SIGSTOP)  # every reply now waits
            try:
                puts = [
                    asyncio.ensure_future(kv.put(keys[i : i + 2], blocks[i : i + 2], wait=False))
                    for i in (8, 10)
                ]
                done, waiting = await asyncio.wait(puts, return_when=asyncio.FIRST_COMPLETED)
                assert len(done) == 1 and len(waiting) == 1
                (late,) = waiting
                for _ in range(8):  # it waits for the reply to the other put, sent first
                    await asyncio.sleep(0)
                assert not late.done()
                late.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await late
            finally:
                d.proc.send_signal(signal.SIGCONT)
            flushed = await kv.flush()
            assert (flushed, flushed.dropped) == (4, 0)
            assert same_bytes(await kv.get(keys[8:]), blocks[8:])

    asyncio.run(run())
