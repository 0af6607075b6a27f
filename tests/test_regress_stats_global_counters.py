"""Stats showed every caller the tiers' global counters (blocks, bytes used, hits, misses,
evictions) and the daemon's leases and handles: a tenant could watch the others' activity (a
hit count that moves when another tenant's prompt is looked up), and a reader of a shared
tenant saw that namespace's hits, every reader's together. A caller without operator rights now
sees the tiers' names and capacities and its own tenants' namespaces and books only; the
operator sees everything, and ``kvstore stat`` works for it as before.

Real daemon, real clients under other uids (``setpriv``).
"""

from __future__ import annotations

import json
import subprocess
import sys

from test_security import (
    ALICE,
    BOB,
    LAYOUT,
    OPS,
    POLICY,
    needs_root,
    run_as,
)

from kvstore import KVStoreClient


@needs_root
def test_a_tenant_sees_only_its_own_counters(open_daemon_factory) -> None:
    d = open_daemon_factory(cpu_capacity="32MiB", extra=POLICY)
    address = d.address
    run_as(
        OPS,
        address,
        """
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="prompts")
        kv.put(kv.hash_tokens(list(range(64))), blocks(4, 1))
        print(json.dumps({}))
        """,
    )
    run_as(
        ALICE,
        address,
        """
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="alice")
        keys = kv.hash_tokens(list(range(128)))
        kv.put(keys, blocks(8, 2))
        kv.lookup(keys)
        shared = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="prompts")
        shared.lookup(shared.hash_tokens(list(range(64))))
        print(json.dumps({}))
        """,
    )
    bob = run_as(
        BOB,
        address,
        """
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="bob")
        kv.put(kv.hash_tokens(list(range(16))), blocks(1, 3))
        shared = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="prompts")
        st = kv.stats()
        print(json.dumps({
            "tiers": [[t.name, t.capacity_bytes, t.used_bytes, t.blocks, t.hits, t.misses]
                      for t in st.tiers],
            "namespaces": sorted((n.name, n.blocks) for n in st.namespaces),
            "tenants": sorted(t.name for t in st.tenants),
            "handles": st.open_handles, "leases": st.active_leases,
        }))
        """,
    )
    assert bob["tiers"] and all(t[1] > 0 for t in bob["tiers"]), bob  # capacities stay
    assert all(t[2:] == [0, 0, 0, 0] for t in bob["tiers"]), bob  # alice's activity is hidden
    assert bob["namespaces"] == [["m/bob", 1]], bob  # not alice's, not the shared prompts'
    assert bob["tenants"] == ["bob"], bob
    assert bob["handles"] == 0 and bob["leases"] == 0, bob
    # The operator (this test, uid 0) sees everything.
    with KVStoreClient(address, layout=LAYOUT, model="m", tenant="root") as kv:
        st = kv.stats()
        cpu = {t.name: t for t in st.tiers}["cpu"]
        assert cpu.blocks == 4 + 8 + 1 and cpu.hits >= 8
        names = {n.name for n in st.namespaces}
        assert {"m/alice", "m/bob", "m/prompts"} <= names
    out = subprocess.run(
        [sys.executable, "-m", "kvstore", "stat", "--address", address, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "m/alice" in out.stdout and json.loads(out.stdout)
