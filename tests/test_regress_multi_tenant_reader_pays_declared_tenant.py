"""A caller whose rules name several tenants paid for its reads of a shared tenant (keys per
second, leases) from the first of its tenants by name, whichever of them the ``[shared.NAME]``
declaration names: a chat frontend that also runs a batch tenant ("alpha-batch") spent the
batch tenant's budget on the chat prompts it read, and could throttle or starve it. It now pays
from the tenant through which the policy lets it read ("chat"); in a namespace of one of its
own tenants it pays from that tenant, as before.

Real daemon, a real client under another uid (``setpriv``).
"""

from __future__ import annotations

from test_security import ALICE, OPS, needs_root, run_as, start_as

# uid ALICE owns "alpha-batch" and "chat"; "prompts" (owned by uid OPS) may be read by "chat".
# alpha-batch's bucket does not refill within the test and it may hold one lease; chat has no
# rate bound and may hold three leases.
POLICY = """
[[access]]
name = "prompt-owner"
uids = [2003]
tenants = ["prompts"]

[[access]]
name = "frontend"
uids = [2001]
tenants = ["alpha-batch", "chat"]

[[access]]
name = "test-runner"
uids = [0]
tenants = ["root"]
role = "operator"

[shared.prompts]
readers = ["chat"]

[tenants.alpha-batch]
keys_per_s = 0.001
keys_burst = 16
max_leases = 1

[tenants.chat]
max_leases = 3
"""


@needs_root
def test_a_reader_of_several_tenants_pays_from_the_one_allowed_to_read(
    open_daemon_factory,
) -> None:
    address = open_daemon_factory(cpu_capacity="32MiB", extra=POLICY).address
    put = run_as(
        OPS,
        address,
        """
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="prompts")
        print(json.dumps({"stored": int(kv.put(kv.hash_tokens(list(range(64))), blocks(4, 7)))}))
        """,
    )
    assert put["stored"] == 4
    reader = start_as(
        ALICE,
        address,
        """
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="prompts")
        keys = kv.hash_tokens(list(range(64)))
        refused = sum(error(lambda: kv.lookup(keys[:1])) is not None for _ in range(40))
        held, errors = [], []
        for i in range(4):
            try:
                held.append(kv.acquire(keys[i : i + 1]))
            except KVStoreError as e:
                errors.append(str(e))
        print(json.dumps({"refused": refused, "held": len(held), "errors": errors}), flush=True)
        sys.stdin.read()  # the leases stay held until the test is done
        """,
    )
    try:
        # Charged to "chat" (no rate bound, three leases), not to "alpha-batch".
        assert reader.result["refused"] == 0, reader.result
        assert reader.result["held"] == 3, reader.result
        assert len(reader.result["errors"]) == 1 and "'chat'" in reader.result["errors"][0]
        # alpha-batch's budget is whole: its own namespace gets its one lease.
        own = run_as(
            ALICE,
            address,
            """
            kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="alpha-batch")
            keys = kv.hash_tokens(list(range(32)))
            stored = kv.put(keys, blocks(2, 3))
            lease = kv.acquire(keys)
            second = error(lambda: kv.acquire(keys[:1]))
            print(json.dumps({"stored": stored, "leased": len(lease), "second": second}))
            """,
        )
        assert own == {"stored": 2, "leased": 2, "second": "CapacityError"}, own
    finally:
        reader.finish()
