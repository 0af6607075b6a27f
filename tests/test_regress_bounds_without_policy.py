"""Regression: the per-caller bounds hold without a tenant policy too.

A single-user daemon (no ``[[access]]``) took every caller for one principal, "owner", and the
per-caller bounds were skipped for it: one process could open every namespace handle, and,
naming a new tenant each time (without a policy the tenant is whatever a client says), fill
every namespace with blocks. Now a caller is its uid (on the unix socket; a token or
certificate on TCP) and holds at most a quarter of ``limits.max_handles`` open handles, a
quarter of ``limits.max_namespaces`` namespaces holding blocks, and half of
``connections.max_sessions`` sessions, policy or not.
"""

from __future__ import annotations

import time

import pytest
from conftest import SMALL_LAYOUT, random_blocks, tokens

from kvstore import KVStoreClient
from kvstore.client.session import ClientSession
from kvstore.errors import CapacityError


def client(address: str, model: str, tenant: str = "") -> KVStoreClient:
    return KVStoreClient(address, layout=SMALL_LAYOUT, model=model, tenant=tenant, timeout_s=10)


def test_one_caller_holds_at_most_a_quarter_of_the_handles(daemon_factory) -> None:
    """``max_handles = 8``: one uid opens 2, the third is refused with a message naming the
    bound (before the fix it got all 8), and a handle closed makes room again."""
    d = daemon_factory(extra="\n[limits]\nmax_handles = 8\n")
    clients = [client(d.address, f"m{i}") for i in range(2)]
    try:
        with pytest.raises(CapacityError, match=r"uid 0 holds 2 .*a quarter of limits\.max_han"):
            client(d.address, "m2")
        clients.pop().close()
        deadline = time.monotonic() + 20
        while True:  # the daemon reclaims the closed handle when it sees its stream end
            try:
                clients.append(client(d.address, "m3"))
                break
            except CapacityError:
                assert time.monotonic() < deadline, "the closed handle was never reclaimed"
                time.sleep(0.05)
    finally:
        for kv in clients:
            kv.close()


def test_one_caller_fills_at_most_a_quarter_of_the_namespaces(daemon_factory) -> None:
    """``max_namespaces = 8``: one uid stores blocks under two tenants it names, and a third
    namespace's first put is refused (before the fix every namespace could be taken so); once
    it deletes the blocks of one, another may take blocks."""
    d = daemon_factory(extra="\n[limits]\nmax_namespaces = 8\n")
    blocks = random_blocks(SMALL_LAYOUT, 1)
    first = client(d.address, "m", tenant="t0")
    second = client(d.address, "m", tenant="t1")
    third = client(d.address, "m", tenant="t2")
    try:
        keys = [kv.hash_tokens(tokens(1)) for kv in (first, second, third)]
        assert first.put(keys[0], blocks) == 1
        assert second.put(keys[1], blocks) == 1
        with pytest.raises(CapacityError, match="uid 0 has 2 namespaces holding blocks"):
            third.put(keys[2], blocks)
        assert first.delete(keys[0]) == 1
        assert third.put(keys[2], blocks) == 1
        assert third.lookup(keys[2]) == 1
    finally:
        for kv in (first, second, third):
            kv.close()


def test_one_uid_holds_at_most_half_the_sessions(daemon_factory) -> None:
    """``max_sessions = 4``: one uid holds 2 sessions, the third is refused with a message
    naming the bound; closing one makes room (at most one descriptor is in flight per
    session, so this bounds the caller's descriptors in flight as well)."""
    d = daemon_factory(extra="\n[connections]\nmax_sessions = 4\n")
    sessions = [ClientSession(str(d.socket_path), 10.0) for _ in range(2)]
    try:
        with pytest.raises(CapacityError, match=r"2 of uid 0.*half of it"):
            ClientSession(str(d.socket_path), 10.0)
        sessions.pop().close()
        deadline = time.monotonic() + 20
        while True:
            try:
                sessions.append(ClientSession(str(d.socket_path), 10.0))
                break
            except CapacityError:
                assert time.monotonic() < deadline, "the closed session was never freed"
                time.sleep(0.05)
    finally:
        for session in sessions:
            session.close()
