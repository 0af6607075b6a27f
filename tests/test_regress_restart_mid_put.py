"""A daemon restart between a put's Reserve and its Commit (found by the soak with faults).

A ``put`` (or an ``offload``) that goes through a reservation makes two calls. When the daemon
was killed and restarted between them, the Commit named a handle the new daemon never issued:
the client reopened its namespace and retried the Commit, still on the old handle (a
reservation belongs to the handle it was made on), and the put failed with
``UnknownNamespaceError``, while every single call survives a restart transparently. The
caller still holds its blocks, so the client now writes them again on the new handle.

Real daemons; the restart is made to fall inside the put by a hook on the client's copy step.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SMALL_LAYOUT, random_blocks, same_bytes, tokens

from kvstore import KVStoreClient
from kvstore.client import leases, paged_io
from kvstore.errors import UnknownNamespaceError

NO_SPARE = '[limits]\nmax_spare = "0"\n'  # every put goes through Reserve and Commit


def restart_during(
    monkeypatch: pytest.MonkeyPatch, owner: object, name: str, daemon, before: bool = False
) -> list:
    """Replace ``owner.name`` by a wrapper that restarts ``daemon`` on its first call: after
    the original has run (between the copy and the Commit), or ``before`` it."""
    original = getattr(owner, name)
    restarts: list[int] = []

    def restart() -> None:
        daemon.stop()
        daemon.start()
        restarts.append(1)

    def wrapped(*args, **kwargs):
        first = not restarts
        if first and before:
            restart()
        result = original(*args, **kwargs)
        if first and not before:
            restart()
        return result

    monkeypatch.setattr(owner, name, wrapped)
    return restarts


@pytest.mark.parametrize("before", [False, True], ids=["before-commit", "before-copy"])
def test_a_put_survives_a_restart_between_reserve_and_commit(
    daemon_factory, monkeypatch, before: bool
) -> None:
    d = daemon_factory(extra=NO_SPARE)
    blocks = random_blocks(SMALL_LAYOUT, 6, seed=31)
    with KVStoreClient(d.address, layout=SMALL_LAYOUT, model="restart-mid-put") as kv:
        assert kv.uses_shared_memory
        keys = kv.hash_tokens(tokens(6))
        restarts = restart_during(monkeypatch, leases.WriteReservation, "fill_from", d, before)
        assert kv.put(keys, blocks) == 6
        assert restarts == [1]
        assert kv.lookup(keys) == 6
        assert same_bytes(kv.get(keys), blocks)


def test_an_offload_survives_a_restart_between_reserve_and_commit(
    daemon_factory, monkeypatch
) -> None:
    d = daemon_factory(extra=NO_SPARE)
    lay = SMALL_LAYOUT
    shape = (2, 4, lay.block_size, lay.num_kv_heads, lay.head_dim)
    g = torch.Generator().manual_seed(32)
    src = [torch.randn(shape, generator=g).to(lay.dtype) for _ in range(lay.num_layers)]
    dst = [torch.zeros(shape, dtype=lay.dtype) for _ in range(lay.num_layers)]
    with KVStoreClient(d.address, layout=lay, model="restart-mid-offload") as kv:
        assert kv.uses_shared_memory
        keys = kv.hash_tokens(tokens(4))
        restarts = restart_during(monkeypatch, paged_io, "gather_with_checksums", d)
        assert kv.offload(src, [0, 1, 2, 3], keys) == 4
        assert restarts == [1]
        assert kv.load(dst, [3, 2, 1, 0], keys) == 4
        for i, slot in enumerate([3, 2, 1, 0]):
            assert all(torch.equal(a[:, slot], b[:, i]) for a, b in zip(dst, src, strict=True))


def test_a_reservation_held_across_a_restart_is_refused_clearly(daemon_factory) -> None:
    """The zero-copy API gives the caller the reservation: its Commit after a restart is an
    error naming the cause (nothing to write again: the caller filled the slots), and the
    client goes on working on the new handle."""
    d = daemon_factory(extra=NO_SPARE)
    blocks = random_blocks(SMALL_LAYOUT, 2, seed=33)
    with KVStoreClient(d.address, layout=SMALL_LAYOUT, model="restart-mid-reserve") as kv:
        keys = kv.hash_tokens(tokens(2))
        res = kv.reserve(keys)
        for i, view in zip(res.indices, res.views, strict=True):
            view.copy_(blocks[i])
        d.stop()
        d.start()
        with pytest.raises(UnknownNamespaceError, match="restarted"):
            res.commit()
        assert kv.lookup(keys) == 0
        assert kv.put(keys, blocks) == 2
        assert same_bytes(kv.get(keys), blocks)
