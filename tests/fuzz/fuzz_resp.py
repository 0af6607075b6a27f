"""Fuzz target: the Redis tier's RESP2 reader (``kvstore.tiers.redis_tier.resp``), on a real
socket: the input (after a mode byte) is what "Redis" sends, written into one end of a unix
socket pair, and the other end is read by a ``RespConnection`` until the stream ends.

Mode byte: even, replies read with ``read_reply`` (what every command but GET reads); odd,
GET replies with ``read_value_into`` into a header and a block buffer of sizes the byte picks.

Contract: each reply is one of the five RESP2 types (bytes, int, None, a list of them, an error
reply as ``ResponseError``/``BusyLoadingError``), the stream's end or bytes that make no sense
raise ``RespConnectionError`` (the connection is dropped), and nothing else escapes; memory
stays bounded by what was received (a stated length is not an allocation), and nesting is
bounded too. ``read_value_into`` returns a length within the buffers it was given, None, False
or an error reply."""

from __future__ import annotations

import asyncio
import socket

import _harness
import atheris

with atheris.instrument_imports(include=["kvstore"]):
    from kvstore.tiers.redis_tier import resp

from redis.exceptions import BusyLoadingError, ResponseError

_loop = asyncio.new_event_loop()
SIZES = ((96, 0), (96, 64), (8, 4096), (0, 16), (96, 70000))


def check_reply(reply: object, depth: int = 0) -> None:
    assert depth <= 64, "nesting past any bound"
    if isinstance(reply, list):
        for item in reply:
            check_reply(item, depth + 1)
        return
    assert reply is None or type(reply) in (bytes, int, ResponseError, BusyLoadingError), reply


async def consume(data: bytes, mode: int) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        theirs.sendall(data)
        theirs.shutdown(socket.SHUT_WR)
        ours.setblocking(False)
        conn = resp.RespConnection(ours)
        head_n, out_n = SIZES[(mode >> 1) % len(SIZES)]
        head, out = memoryview(bytearray(head_n)), memoryview(bytearray(out_n))
        for _ in range(len(data) + 1):  # every reply takes at least one byte
            try:
                if mode & 1:
                    got = await conn.read_value_into(head, out)
                    assert (
                        got is None
                        or got is False
                        or isinstance(got, ResponseError | BusyLoadingError)
                        or (type(got) is int and head_n <= got <= head_n + out_n)
                    ), got
                else:
                    check_reply(await conn.read_reply())
            except resp.RespConnectionError:
                return
        raise AssertionError("more replies than bytes")
    finally:
        ours.close()
        theirs.close()


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    _loop.run_until_complete(consume(data[1:], data[0]))


if __name__ == "__main__":
    _harness.main(TestOneInput)
