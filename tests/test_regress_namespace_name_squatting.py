"""The daemon's namespace registry was keyed by the namespace's human-readable name, which is
ambiguous: model "m@r" and model "m" revision "r" both print as "m@r/TENANT" (and tenant ""
and "-" both as "-"). An opener could register such a name first, under another fingerprint,
and the legitimate owner's open was then refused (FAILED_PRECONDITION, "registered with
layout") for as long as the squatter kept its handle. The registry is now keyed by the
identity as a tuple; the name is for display only. A record held only by readers of a shared
tenant no longer holds its identity against the owner's layout either.

Real daemon, real clients under other uids (``setpriv``): alice may read the shared tenant.
"""

from __future__ import annotations

from test_security import ALICE, OPS, POLICY, needs_root, policy_daemon_address, run_as, start_as

OWNER_OPENS = """
kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", revision="r", tenant="prompts")
keys = kv.hash_tokens(list(range(32)))
stored = kv.put(keys, blocks(2, 5))
print(json.dumps({"stored": int(stored), "same": bool(torch.equal(kv.get(keys), blocks(2, 5)))}))
"""


@needs_root
def test_an_ambiguous_name_cannot_squat_another_namespace(open_daemon_factory) -> None:
    address = policy_daemon_address(open_daemon_factory, POLICY)
    squatter = start_as(
        ALICE,
        address,
        """
        # "m@r/prompts" by name, the owner's model "m" revision "r" in another identity.
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m@r", tenant="prompts")
        print(json.dumps({"found": kv.lookup(kv.hash_tokens(list(range(32))))}), flush=True)
        sys.stdin.read()  # holds its handle until the test is done
        """,
    )
    try:
        assert squatter.result == {"found": 0}
        assert run_as(OPS, address, OWNER_OPENS) == {"stored": 2, "same": True}
    finally:
        squatter.finish()


@needs_root
def test_a_reader_cannot_hold_the_owners_namespace_with_another_layout(
    open_daemon_factory,
) -> None:
    address = policy_daemon_address(open_daemon_factory, POLICY)
    squatter = start_as(
        ALICE,
        address,
        """
        other = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16,
                         dtype=torch.float16)
        kv = KVStoreClient(ADDRESS, layout=other, model="m", revision="r", tenant="prompts")
        print(json.dumps({"found": kv.lookup(kv.hash_tokens(list(range(32))))}), flush=True)
        sys.stdin.read()
        """,
    )
    try:
        assert squatter.result == {"found": 0}
        assert run_as(OPS, address, OWNER_OPENS) == {"stored": 2, "same": True}
        # Once the owner holds it, a reader with the wrong layout is told so.
        late = run_as(
            ALICE,
            address,
            """
            from kvstore.errors import NamespaceMismatchError
            other = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, block_size=16,
                             dtype=torch.float16)
            print(json.dumps({"error": error(lambda: KVStoreClient(
                ADDRESS, layout=other, model="m", revision="r", tenant="prompts"))}))
            """,
        )
        assert late == {"error": "NamespaceMismatchError"}
    finally:
        squatter.finish()
