"""Puts that do not wait (``put(..., wait=False)``): their reply reaches ``flush`` whatever
the client does while it is in flight, against a real daemon.

A session request that carries a descriptor (a slab, the presence table) made while a posted
call's reply is unread must not lose that reply: it is read and kept for ``flush``.
"""

from __future__ import annotations

import time

from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tokens

from kvstore import KVStoreClient

LONG_GRACE = "[limits]\npin_grace_s = 30.0\n"  # spare slots stay fresh whatever the load


def client(daemon, model: str = "posted", **kw) -> KVStoreClient:
    return KVStoreClient(daemon.address, layout=SMALL_LAYOUT, model=model, **kw)


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
