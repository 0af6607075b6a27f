"""Guards, found by fuzzing the RESP reader (tests/fuzz/fuzz_resp.py): a reply stream from
"Redis" that states a huge bulk length, or nests arrays without end, drops the connection with
``RespConnectionError``; it never raises MemoryError or RecursionError, and a stated length is
not an allocation (memory follows the bytes that arrive)."""

from __future__ import annotations

import asyncio
import socket
import threading
import tracemalloc

import pytest

from kvstore.tiers.redis_tier import resp


async def replies(stream: bytes) -> list[object]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    got: list[object] = []

    def send() -> None:  # from a thread: the stream may be larger than the socket's buffer
        theirs.sendall(stream)
        theirs.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        ours.setblocking(False)
        conn = resp.RespConnection(ours)
        while True:
            got.append(await conn.read_reply())
    except resp.RespConnectionError as exc:
        got.append(exc)
    finally:
        sender.join()
        ours.close()
        theirs.close()
    return got


@pytest.mark.parametrize(
    "stream",
    [b"$99999999999999\r\nabc", b"$536870913\r\n", b"*1\r\n" * 5000 + b":1\r\n"],
    ids=["huge_bulk", "past_max_bulk", "deep_nesting"],
)
def test_a_reply_stream_past_any_bound_drops_the_connection(stream: bytes) -> None:
    got = asyncio.run(replies(stream))
    assert len(got) == 1 and isinstance(got[0], resp.RespConnectionError), got


def test_a_stated_bulk_length_is_not_an_allocation() -> None:
    tracemalloc.start()
    try:
        got = asyncio.run(replies(b"$400000000\r\n" + b"x" * 1000))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(got[-1], resp.RespConnectionError)
    assert peak < 16 << 20, f"{peak} bytes allocated for 1000 bytes received"


def test_replies_within_the_bounds_still_read() -> None:
    big = bytes(range(256)) * 1000  # past the read buffer: the bulk buffer grows
    nested = b"*1\r\n" * (resp.MAX_DEPTH - 1) + b"*2\r\n:1\r\n$-1\r\n"
    stream = b"$%d\r\n%s\r\n" % (len(big), big) + nested + b"$0\r\n\r\n+OK\r\n"
    got = asyncio.run(replies(stream))
    assert got[0] == big
    inner = got[1]
    for _ in range(resp.MAX_DEPTH - 1):
        assert isinstance(inner, list) and len(inner) == 1
        inner = inner[0]
    assert inner == [1, None]
    assert got[2:4] == [b"", b"OK"]
    assert isinstance(got[4], resp.RespConnectionError)
