"""Readers of a shared tenant spent that tenant's budget: every lookup, acquire and prefetch of
a shared namespace was charged to the namespace's tenant (its ``keys_per_s`` bucket and its
``max_leases``), whoever called. A reader the operator allowed to read a shared system prompt
could therefore throttle the tenant owning it (its lookups RESOURCE_EXHAUSTED) or starve it of
leases. Keys per second and leases are now charged to the caller's own tenant; the owner's
budget is spent by the owner's callers alone.

Real daemon, real clients under other uids (``setpriv``).
"""

from __future__ import annotations

from test_security import (
    ALICE,
    OPS,
    TEST_RUNNER,
    access,
    needs_root,
    policy_daemon_address,
    run_as,
    start_as,
)

# alice reads the shared tenant "prompts", owned by uid OPS. The owner's keys-per-second
# bucket does not refill within the test; it may hold two leases. alice's own tenant has no
# rate bound and three leases.
POLICY = (
    access("prompt-owner", OPS, "prompts")
    + access("alice-app", ALICE, "alice")
    + TEST_RUNNER
    + """[shared.prompts]
readers = ["alice"]

[tenants.prompts]
keys_per_s = 0.001
keys_burst = 64
max_leases = 2

[tenants.alice]
max_leases = 3
"""
)


@needs_root
def test_a_reader_of_a_shared_tenant_cannot_spend_the_owners_budget(open_daemon_factory) -> None:
    address = policy_daemon_address(open_daemon_factory, POLICY)
    put = run_as(
        OPS,
        address,
        """
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="prompts")
        print(json.dumps({"stored": int(kv.put(kv.hash_tokens(list(range(64))), blocks(4, 7)))}))
        """,
    )
    assert put["stored"] == 4  # 4 of the owner's 64 keys spent
    reader = start_as(
        ALICE,
        address,
        """
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="prompts")
        keys = kv.hash_tokens(list(range(64)))
        refused = sum(error(lambda: kv.lookup(keys[:1])) is not None for _ in range(80))
        prefetch = error(lambda: kv.prefetch(keys))
        held, errors = [], []
        for i in range(4):
            try:
                held.append(kv.acquire(keys[i : i + 1]))
            except KVStoreError as e:
                errors.append(str(e))
        print(json.dumps({"refused": refused, "prefetch": prefetch, "held": len(held),
                          "errors": errors}), flush=True)
        sys.stdin.read()  # the leases stay held until the test is done
        """,
    )
    try:
        # alice's 80 keys and her leases were charged to her own tenant.
        assert reader.result["refused"] == 0, reader.result
        assert reader.result["prefetch"] is None, reader.result
        assert reader.result["held"] == 3, reader.result
        assert len(reader.result["errors"]) == 1 and "'alice'" in reader.result["errors"][0]
        owner = run_as(
            OPS,
            address,
            """
            kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="prompts")
            keys = kv.hash_tokens(list(range(64)))
            found = error(lambda: kv.lookup(keys[:4])) or kv.lookup(keys[:4])
            got = kv.get(keys[:4])  # a lease of its own
            held = [kv.acquire(keys[i : i + 1]) for i in range(2)]
            print(json.dumps({"found": found, "same": bool(torch.equal(got, blocks(4, 7))),
                              "leases": len(held)}))
            """,
        )
        assert owner == {"found": 4, "same": True, "leases": 2}, owner
    finally:
        reader.finish()
