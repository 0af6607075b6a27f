"""Who may reach which blocks: the namespaces the daemon knows and the handles clients hold.

``NamespaceTable`` owns both. A namespace record lives while a handle names it or an entry of
the index belongs to it (``entries``); then it is forgotten and its small id recycled, so a
client that opens and closes namespaces forever fills nothing. A handle is 16 random bytes,
known only to this daemon instance, made for one client's open stream; the reservations and
leases that client makes live in it, so nothing but that handle reaches them.

Invariants (kept here; ``kvstore.daemon.invariants`` checks them with the rest):
- every open handle is in the table under its token and names a live record;
- ``record.handles`` counts the open handles naming it; a record with no handle and no entry
  is not in the table;
- ``by_identity`` and ``by_fingerprint`` index live records only.

A namespace's identity (``identity``: model, revision, tenant, tensor-parallel rank and size, as
a tuple) is what the registry is keyed by, never its human-readable ``name``, which is
ambiguous (model "m@r" vs model "m" revision "r"; tenant "" vs "-"; "/" in a model or tenant):
keyed by the name, an opener could register a name another tenant's namespace also prints as,
and that tenant's own open was then refused. The name is for display only.

Event-loop only. Block state (what a closed handle's reservations and leases held) is the
store's: it reclaims those before calling ``release``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvstore.config import LimitsConfig
from kvstore.daemon.auth import Principal, caller_key
from kvstore.errors import CapacityError, NamespaceMismatchError, UnknownNamespaceError
from kvstore.keys import Namespace
from kvstore.layout import KVLayout

HANDLE_BYTES = 16
MAX_NAMESPACE_ID = 0xFFFF  # the index stores namespace ids as uint16


@dataclass(eq=False)
class NamespaceRecord:
    """A namespace the daemon knows. ``namespace`` is None for one recovered from disk whose
    client has not opened it yet (only its fingerprint and block size are known)."""

    ns_id: int
    namespace: Namespace | None
    fingerprint: bytes
    block_bytes: int
    priority: int
    domain: int = 0  # memory domain of its CPU slabs: its tenant's with a policy, else 0
    blocks: int = 0  # COMMITTED entries
    entries: int = 0  # keyed entries (reserved or committed) and orphans
    writing: int = 0  # keyed RESERVED entries: blocks some client is writing now
    handles: int = 0
    # A caller that may write it opened it: only then does it hold its identity against an
    # open with another layout (a reader of a shared tenant cannot squat the owner's).
    claimed: bool = False
    lookup_hits: int = 0
    lookup_misses: int = 0
    # Whose share of namespaces holding blocks it counts toward (``check_share``): the caller
    # that gave it its first block (with a tenant policy, its tenant's regardless).
    holder: str = ""
    # Its books and its tenant's (``kvstore.daemon.quotas.Usage``), given by the store's
    # quotas when the record is made.
    usage: Any = None
    owner: Any = None
    # What its CPU-tier entries hold (``[[codecs]]`` cpu; decided when a client first opens
    # it, for the daemon's life): the block (``codecs.CODEC_NONE``) or its fp8 payload, of
    # ``cpu_payload_bytes``. A recovered record holds no CPU copy before that.
    cpu_codec: int = 0
    cpu_payload_bytes: int = 0
    cpu_codec_set: bool = False
    # Its committed keys for same-host clients (``kvstore.presence``): made when a client
    # first asks, kept by the store from then on, retired when the record is freed.
    presence: Any = None

    @property
    def cpu_bytes(self) -> int:
        """Bytes of one of its CPU-tier entries (a slot's length, what the CPU tier counts)."""
        return self.cpu_payload_bytes if self.cpu_codec else self.block_bytes

    @property
    def name(self) -> str:
        return self.namespace.name if self.namespace else f"(recovered {self.fingerprint.hex()})"


@dataclass
class Reservation:
    """RESERVED entries a client is writing (in key order of its Reserve call)."""

    eids: list[int]
    expires_at: float
    gpu: bool = False  # the slots are in the GPU pool (the commit carries device checksums)
    pin: Any = None  # its charge in the quotas' books (``kvstore.daemon.quotas.Pin``)
    # Its expiry was brought forward to make room for another handle (``pin_grace_s``): its
    # slots are quarantined for that long, not ``reservation_ttl_s``, once it expires.
    shortened: bool = False
    # Spare slots reserved ahead of a put (``BlockStore.grant_spare``): its entries have no
    # key until a Bind gives each its key and commits it. Always ``shortened``.
    spare: bool = False
    addresses: list[int] = field(default_factory=list)  # a spare one's, in ``eids`` order


@dataclass
class Lease:
    """The entries a read lease pins, each with the key it was leased for (distinct entries)."""

    eids: list[int]
    keys: list[bytes]
    expires_at: float
    pin: Any = None  # its charge in the quotas' books (``kvstore.daemon.quotas.Pin``)
    # Blocks ``cut`` on expire at ``cut_expires_at``, before the rest: the part that took its
    # handle past its pinned bound when another handle opened (``BlockStore``). The leading
    # part, a usable prefix, keeps the lease's own expiry.
    cut: int | None = None
    cut_expires_at: float = 0.0

    def shorten(self, cut: int, until: float) -> None:
        """Let blocks ``cut`` on expire by ``until`` (never later than they would have)."""
        if cut == 0:
            self.expires_at = min(self.expires_at, until)
        elif cut < len(self.eids):
            if self.cut is None or cut < self.cut:
                old = self.cut_expires_at if self.cut is not None else self.expires_at
                self.cut, self.cut_expires_at = cut, min(old, until)
            else:
                self.cut_expires_at = min(self.cut_expires_at, until)


@dataclass(eq=False)
class Handle:
    """One open namespace of one client: the capability every other call presents.

    ``token`` is what the client holds; the reservations and leases it made live here, so no
    other handle can commit, abort or release them."""

    token: bytes
    record: NamespaceRecord
    reservations: dict[int, Reservation] = field(default_factory=dict)
    leases: dict[int, Lease] = field(default_factory=dict)
    closed: bool = False
    # Who opened it (``kvstore.daemon.auth.Principal``): no other caller may present it.
    principal: object = None
    writable: bool = True  # False: a reader of a shared namespace
    # What its leases and reservations pin (``kvstore.daemon.quotas.Usage``), where handles
    # have a pinned bound of their own; None otherwise.
    books: Any = None
    # The books its keys per second and leases are charged to when its caller is not of the
    # namespace's tenant (``Quotas.payer``); None: the namespace's and its tenant's.
    payer: Any = None
    # Spare slot reservations granted and not yet handed to the client, and whether a grant
    # is under way (``BlockStore.grant_spare_soon``).
    spare_ready: list[int] = field(default_factory=list)
    spare_granting: bool = False
    spare_granting_slots: int = 0  # slots of grants under way (inline or in the background)
    # The address of each of its spare slots -> (reservation id, entry): what a Bind may name.
    spare_slots: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def ns_id(self) -> int:
        return self.record.ns_id

    def new_id(self, table: dict[int, Reservation] | dict[int, Lease]) -> int:
        """A random reservation or lease id, unused in ``table``."""
        while True:
            rid = secrets.randbits(63) or 1
            if rid not in table:
                return rid


Identity = tuple[str, str, str, int, int]


def identity(namespace: Namespace) -> Identity:
    """What names a namespace unambiguously, short of its layout (which clients that claim one
    namespace must agree on): the registry's key."""
    ns = namespace
    return (ns.model, ns.revision, ns.tenant, ns.tp_rank, ns.tp_size)


def describe(layout: KVLayout) -> str:
    return (
        f"{layout.num_layers}x{layout.num_kv_heads}x{layout.head_dim} "
        f"block {layout.block_size} {layout.dtype_name}"
        + (f" scales {layout.scale_format}" if layout.scaled else "")
    )


class NamespaceTable:
    """See the module docstring."""

    def __init__(self, limits: LimitsConfig, tenant_domains: bool = False) -> None:
        self.limits = limits
        # With a tenant policy each tenant's blocks live in slabs of their own (its memory
        # domain, numbered from 1), so a client can be handed exactly its tenants' memory.
        self._tenant_domains = tenant_domains
        self._domains: dict[str, int] = {}
        self._tenants: dict[int, str] = {}  # the reverse of _domains
        self._records: dict[int, NamespaceRecord] = {}
        self._free_ids: list[int] = []
        self._by_identity: dict[Identity, NamespaceRecord] = {}
        self._by_fingerprint: dict[bytes, NamespaceRecord] = {}
        self._handles: dict[bytes, Handle] = {}

    # ----------------------------------------------------------------- handles
    def open(self, namespace: Namespace, priority: int, writer: bool = True) -> Handle:
        """A new handle to ``namespace``, registering or joining it. An identity already
        registered with another fingerprint is refused (clients that claim to share blocks must
        compute the same keys) once a ``writer`` (a caller that may write it) opened that
        record or it holds blocks; one only readers hold gives way to the new layout."""
        if not 0 <= priority <= 255:
            raise ValueError(f"priority must be in [0, 255], got {priority}")
        if len(self._handles) >= self.limits.max_handles:
            raise CapacityError(
                f"too many open namespace handles ({self.limits.max_handles}, limits.max_handles)"
            )
        record = self._record_for(namespace, priority)
        record.claimed = record.claimed or writer
        token = secrets.token_bytes(HANDLE_BYTES)
        while token in self._handles:  # pragma: no cover - 2^-128
            token = secrets.token_bytes(HANDLE_BYTES)
        handle = Handle(token, record)
        record.handles += 1
        self._handles[token] = handle
        return handle

    def handle(self, token: bytes) -> Handle:
        """The open handle ``token`` names; UnknownNamespaceError for anything else (a closed
        handle, another daemon instance's, a guess)."""
        handle = self._handles.get(bytes(token)) if len(token) == HANDLE_BYTES else None
        if handle is None:
            raise UnknownNamespaceError(
                "unknown namespace handle (closed, or the daemon restarted): open the namespace "
                "again"
            )
        return handle

    def release(self, handle: Handle) -> None:
        """Forget a closed handle (the store reclaimed what it held) and, with it, a namespace
        nothing else keeps."""
        assert handle.closed and not handle.reservations and not handle.leases
        del self._handles[handle.token]
        handle.record.handles -= 1
        self.maybe_free(handle.record)

    def handles(self) -> list[Handle]:
        return list(self._handles.values())

    def is_open(self, handle: Handle) -> bool:
        return self._handles.get(handle.token) is handle

    def __len__(self) -> int:
        """Open handles."""
        return len(self._handles)

    # ----------------------------------------------------------------- records
    def _record_for(self, namespace: Namespace, priority: int) -> NamespaceRecord:
        block_bytes = namespace.layout.block_bytes
        fingerprint = namespace.fingerprint
        key = identity(namespace)
        existing = self._by_identity.get(key)
        if existing is not None and existing.fingerprint == fingerprint:
            return existing
        if existing is not None and (existing.claimed or existing.entries):
            assert existing.namespace is not None
            raise NamespaceMismatchError(
                f"namespace {namespace.name!r} is registered with layout "
                f"{describe(existing.namespace.layout)}; this client claims "
                f"{describe(namespace.layout)} (hash version {namespace.hash_version})"
            )
        recovered = self._by_fingerprint.get(fingerprint)
        if recovered is not None and recovered.namespace is not None:
            # Live, and given way by readers' records of another layout since: it again.
            self._by_identity[key] = recovered
            return recovered
        if recovered is not None:
            # Blocks of this namespace were found on disk at start-up: bind them to it.
            if recovered.block_bytes != block_bytes:
                raise NamespaceMismatchError(
                    f"blocks on disk for {namespace.name!r} are {recovered.block_bytes} bytes, "
                    f"the layout gives {block_bytes}"
                )
            self.check_share(namespace.tenant)
            recovered.namespace = namespace
            recovered.priority = priority
            recovered.domain = self.domain_for(namespace.tenant)
            self._by_identity[key] = recovered
            return recovered
        self.check_share(namespace.tenant)
        record = self._new(namespace, fingerprint, block_bytes, priority)
        record.domain = self.domain_for(namespace.tenant)
        self._by_identity[key] = record
        return record

    def check_share(
        self, tenant: str, caller: object = None, record: NamespaceRecord | None = None
    ) -> None:
        """Refuse one more namespace holding blocks to whoever already holds a quarter of
        ``limits.max_namespaces`` with blocks: such a namespace outlives its handles, so
        without a share one holder could fill the table for everyone. With a tenant policy the
        holder is the namespace's tenant; without one (where the tenant is whatever a client
        says) it is the caller (``kvstore.daemon.auth.caller_key`` of ``caller``, a
        ``Principal``: the owner's uid, root's, a token's name), so one runaway process cannot
        take every namespace either. ``record``: the empty namespace about to take its first
        block (the store's check), which then counts toward that holder. Namespaces without
        blocks do not count: they go with their handles, which are bounded per caller, and a
        reader of a shared tenant (which cannot write) must not use up that tenant's share.
        Without a policy the check is made only at that first block (the caller is known
        there). A scan of the table: opening a namespace, or filling an empty one, is rare
        next to other calls."""
        if self._tenant_domains:
            holder = f"tenant {tenant!r}"
        elif isinstance(caller, Principal):
            holder = caller_key(caller)
        else:
            return  # no caller to charge (the store's own, or a test's, callers of everything)
        share = max(1, min(self.limits.max_namespaces, MAX_NAMESPACE_ID) // 4)
        held = sum(
            1
            for r in self._records.values()
            if r.entries and r is not record and self._holder_of(r) == holder
        )
        if held >= share:
            raise CapacityError(
                f"{holder} has {held} namespaces holding blocks, a quarter of "
                f"limits.max_namespaces ({self.limits.max_namespaces}): delete the blocks of "
                "some first"
            )
        if record is not None and not self._tenant_domains:
            record.holder = holder

    def _holder_of(self, record: NamespaceRecord) -> str:
        if self._tenant_domains:
            tenant = record.namespace.tenant if record.namespace is not None else None
            return f"tenant {tenant!r}" if tenant is not None else ""
        return record.holder

    def domain_for(self, tenant: str) -> int:
        """The memory domain of a tenant's namespaces (0 for all without a tenant policy)."""
        if not self._tenant_domains:
            return 0
        domain = self._domains.get(tenant)
        if domain is None:
            domain = self._domains[tenant] = len(self._domains) + 1
            self._tenants[domain] = tenant
        return domain

    def tenant_of_domain(self, domain: int) -> str | None:
        """The tenant whose memory ``domain`` is (None: domain 0, or unknown)."""
        return self._tenants.get(domain)

    def _new(
        self,
        namespace: Namespace | None,
        fingerprint: bytes,
        block_bytes: int,
        priority: int,
        limit: int | None = None,
    ) -> NamespaceRecord:
        limit = min(self.limits.max_namespaces, MAX_NAMESPACE_ID) if limit is None else limit
        if len(self._records) >= limit:
            raise CapacityError(
                f"too many namespaces ({len(self._records)}, limits.max_namespaces)"
            )
        ns_id = self._free_ids.pop() if self._free_ids else len(self._records) + 1
        record = NamespaceRecord(ns_id, namespace, fingerprint, block_bytes, priority)
        self._records[ns_id] = record
        self._by_fingerprint[fingerprint] = record
        return record

    def recovered(self, fingerprint: bytes, block_bytes: int) -> NamespaceRecord:
        """The record of blocks found on disk at start-up, by fingerprint. ``max_namespaces``
        bounds what clients open, not what the disk already holds (a limit lowered since must
        not stop the daemon from starting): only the index's id range does (CapacityError)."""
        record = self._by_fingerprint.get(fingerprint)
        if record is None:
            record = self._new(None, fingerprint, block_bytes, 0, limit=MAX_NAMESPACE_ID)
        return record

    def maybe_free(self, record: NamespaceRecord) -> None:
        """Forget a namespace no handle names and no entry belongs to; recycle its id."""
        if record.handles or record.entries or self._records.get(record.ns_id) is not record:
            return
        del self._records[record.ns_id]
        if record.presence is not None:
            # Before the id is reused: a client still mapping this table must never see
            # another namespace's keys in it.
            record.presence.retire()
            record.presence = None
        self._free_ids.append(record.ns_id)
        self._by_fingerprint.pop(record.fingerprint, None)
        key = identity(record.namespace) if record.namespace is not None else None
        if key is not None and self._by_identity.get(key) is record:
            del self._by_identity[key]

    def __getitem__(self, ns_id: int) -> NamespaceRecord:
        return self._records[ns_id]

    def get(self, ns_id: int) -> NamespaceRecord | None:
        return self._records.get(ns_id)

    def records(self) -> Iterator[NamespaceRecord]:
        return iter(list(self._records.values()))

    def check(self) -> None:
        """Assert the invariants of the module docstring."""
        counts: dict[int, int] = {}
        for token, handle in self._handles.items():
            assert handle.token == token and not handle.closed, "a closed handle is still open"
            assert self._records.get(handle.ns_id) is handle.record, "a handle's record is gone"
            counts[handle.ns_id] = counts.get(handle.ns_id, 0) + 1
        for ns_id, record in self._records.items():
            assert record.ns_id == ns_id
            assert record.handles == counts.get(ns_id, 0), f"{record.name}: handle count"
            assert record.handles or record.entries, f"namespace {record.name} not freed"
        for record in self._by_fingerprint.values():
            assert self._records.get(record.ns_id) is record, "by_fingerprint names a dead record"
        for key, record in self._by_identity.items():
            assert self._records.get(record.ns_id) is record, "by_identity names a dead record"
            assert record.namespace is not None and identity(record.namespace) == key
