"""Quotas and fairness: what each tenant and each namespace holds, against what the config's
``[tenants.NAME]`` tables allow, and the decisions that follow from it.

``Quotas`` owns the books: one ``Usage`` per tenant and one per namespace record (CPU and NVMe
bytes, pinned CPU bytes and the slabs they pin, leases and reservations outstanding, a token
bucket of keys per second). The store charges them at every transition that changes them
(``charge_cpu``, ``charge_nvme``, ``pin``/``unpin``) and asks before it pins or allocates:

- ``take_keys``: lookup, acquire and reserve spend one token per key; past the bucket the call
  is refused (CapacityError, RESOURCE_EXHAUSTED) naming ``keys_per_s``;
- ``check_pin``: a lease or reservation may not take a tenant past its leases, reservations or
  ``max_pinned`` (default ``limits.max_pinned_share`` of the CPU tier), nor pin so much that the
  unpinned rest of the tier no longer covers the other tenants' guaranteed shares. So one
  tenant's leases or reservations never leave the others without evictable room;
- ``cpu_room`` / ``nvme_over``: how far a put (or promotion, or write-down) would take a tenant
  or namespace past a byte quota; the mover then evicts that tenant's own coldest blocks first;
- ``guard``: room-making for one tenant may evict another tenant's block only while that tenant
  stays at or above its guaranteed share of the tier.

Why the guarantees hold (block granularity): the tenants' guarantees add up to at most the tier
(config check), and pins keep ``sum(max(guaranteed, pinned))`` over tenants within the tier. A
tenant under its guarantee can then always find room: what the others hold beyond
``max(guaranteed, pinned)`` is neither protected nor pinned. With a tenant policy each tenant's
blocks live in slabs of their own and room for another tenant is made a slab at a time, so a
tenant's pinned footprint is counted in whole slabs (a lease on one block of a slab keeps the
whole slab from being drained).

Who pays: byte quotas, reservations and guarantees are the namespace's tenant's (the blocks
are its). Keys per second and leases are the caller's: a caller whose rules do not name the
namespace's tenant (a reader or writer of a shared tenant) spends its own tenant's budget
(``payer``: the one the ``[shared.NAME]`` declaration names), never the owner's, so the
readers of a shared prompt cannot throttle or starve the tenant that owns it. A lease's pinned
bytes count in the payer's ``max_pinned`` and guarantee room: pinning another tenant's blocks
narrows only the pinner's own room.

Tenants the config does not name get no byte quota, no guarantee and the default pinned share.
Without a tenant policy the tenant is what the client says, so these bounds order fairness
between cooperating clients; with one they bind every authenticated tenant. Event-loop only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.config import DaemonConfig, Quota, TenantQuota
from kvstore.errors import CapacityError
from kvstore.units import format_size

if TYPE_CHECKING:
    from kvstore.daemon.namespaces import NamespaceRecord


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.at = now

    def refill(self, now: float) -> None:
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
        self.at = now


@dataclass(eq=False)
class Usage:
    """What one tenant (or one namespace) holds. ``slabs``: CPU slab -> blocks of this holder
    pinned in it (leases, reservations, quarantined slots)."""

    name: str
    quota: Quota
    guaranteed_cpu_bytes: int = 0
    guaranteed_nvme_bytes: int = 0
    cpu_bytes: int = 0
    nvme_bytes: int = 0
    nvme_writing: int = 0  # block bytes being written down now (counted against quota_nvme)
    pinned_bytes: int = 0
    leases: int = 0
    reservations: int = 0
    slabs: dict[int, int] = field(default_factory=dict)
    bucket: TokenBucket | None = None
    refused_keys: int = 0  # keys refused by the rate limit (Stats)
    records: int = 0  # namespace records whose tenant books these are
    payers: int = 0  # open handles of other tenants' namespaces paying from these (``payer``)
    # Entries these books' leases pin -> how many of those leases name each: a block leased
    # many times is pinned (and counted in ``pinned_bytes``) once.
    leased: dict[int, int] = field(default_factory=dict)


@dataclass(eq=False)
class Pin:
    """One lease's or reservation's charge: bytes, the slab of each pinned block, and the
    books it was charged to (the namespace's and its tenant's)."""

    nbytes: int  # a reservation's bytes; 0 for a lease, whose blocks count once (``leased``)
    slabs: list[int]
    books: tuple[Usage, ...]
    kind: str  # "leases" or "reservations" (None-counted for quarantined slots)
    counted: bool = True
    eids: tuple[int, ...] = ()  # a lease's entries in the CPU tier, each ``block_bytes``
    block_bytes: int = 0


def _count(leased: dict[int, int], eids: tuple[int, ...] | list[int], step: int) -> int:
    """Add ``step`` (+1, -1) to the lease count of each of ``eids``; returns how many became
    leased (+1) or unleased (-1) by it."""
    changed = 0
    for e in eids:
        n = leased.get(e, 0) + step
        if n:
            leased[e] = n
        else:
            del leased[e]
        if n == (1 if step > 0 else 0):
            changed += 1
    return changed


def _drop_slabs(books: Usage, slabs: list[int]) -> None:
    """One pinned block fewer in each of ``slabs`` for ``books``."""
    for s in slabs:
        left = books.slabs[s] - 1
        if left:
            books.slabs[s] = left
        else:
            del books.slabs[s]


class Quotas:
    """See the module docstring. ``slab_of``: a CPU offset's slab; ``domains``: tenants have
    slabs of their own (a tenant policy), so pins are counted in slabs too."""

    def __init__(
        self,
        config: DaemonConfig,
        slab_of: Callable[[int], int],
        slab_bytes: int,
        clock: Callable[[], float],
        domains: bool,
    ) -> None:
        self.capacity = config.cpu.capacity_bytes
        self._share = config.pinned_share
        self.default_pinned = max(1, int(self._share * self.capacity))
        # What one handle may pin, 0: no bound of its own (``DaemonConfig.handle_pinned_share``).
        self.handle_pinned = int(config.handle_pinned_share * self.capacity)
        self._policy: dict[str, TenantQuota] = {t.name: t for t in config.tenants}
        self._slab_of = slab_of
        self.slab_bytes = slab_bytes
        self._clock = clock
        self.domains = domains
        self._tenants: dict[str, Usage] = {}
        # Books of callers whose rules name no tenant (they read shared tenants only).
        self._callers: dict[str, Usage] = {}
        # Blocks of namespaces recovered from disk and not opened yet (tenant unknown).
        self.unowned = Usage("(recovered)", Quota())
        self.total_pinned = 0
        self._leased: dict[int, int] = {}  # entries leased by anyone -> their leases
        self.guaranteed_cpu = [t.name for t in config.tenants if t.guaranteed_cpu_bytes]
        self.guaranteed_nvme = [t.name for t in config.tenants if t.guaranteed_nvme_bytes]

    # ----------------------------------------------------------------- books
    def tenant(self, name: str) -> Usage:
        usage = self._tenants.get(name)
        if usage is None:
            spec = self._policy.get(name)
            quota = spec.tenant if spec else Quota()
            usage = self._tenants[name] = Usage(
                name,
                quota,
                spec.guaranteed_cpu_bytes if spec else 0,
                spec.guaranteed_nvme_bytes if spec else 0,
            )
        return usage

    def tenants(self) -> list[Usage]:
        return list(self._tenants.values())

    def callers(self) -> list[Usage]:
        """Books of callers whose rules name no tenant (``payer``)."""
        return list(self._callers.values())

    def new_books(self, record: NamespaceRecord) -> None:
        """Give a record its namespace books and its tenant's (``unowned`` until a client
        opens a recovered namespace)."""
        ns = record.namespace
        spec = self._policy.get(ns.tenant) if ns is not None else None
        record.usage = Usage(record.name, spec.namespace if spec else Quota())
        record.owner = self.tenant(ns.tenant) if ns is not None else self.unowned
        record.owner.records += 1

    def payer(self, record: NamespaceRecord, principal: object) -> Usage | None:
        """The books a handle's keys per second and leases are charged to, when its caller's
        rules do not name the namespace's tenant (a reader or writer of a shared tenant): those
        of its own tenant through which the policy lets it reach that one
        (``Principal.paying_tenant``), or books of the caller alone if its rules name no
        tenant. None: the namespace's and its tenant's, as for the tenant's own callers (a
        caller of several tenants pays, in each, from that one). Held (``payers``) until
        ``unpay``, so the books and their bucket stay."""
        ns = record.namespace
        own: frozenset[str] | None = getattr(principal, "own", None)
        if ns is None or own is None or ns.tenant in own:
            return None
        tenant = principal.paying_tenant(ns.tenant)  # type: ignore[attr-defined]
        if tenant is not None:
            books = self.tenant(tenant)
        else:
            name = f"({getattr(principal, 'name', 'caller')})"
            books = self._callers.setdefault(name, Usage(name, Quota()))
        books.payers += 1
        return books

    def unpay(self, books: Usage | None) -> None:
        """A handle that paid from ``books`` (``payer``) is closed."""
        if books is not None:
            books.payers -= 1
            self._drop_if_idle(books)

    def handle_books(self) -> Usage | None:
        """The books of a new handle's pins, when handles have a pinned bound of their own."""
        return Usage("handle", Quota()) if self.handle_pinned else None

    def forget(self, record: NamespaceRecord) -> None:
        """A record is gone. The books of a tenant the config does not name go with its last
        record once they hold nothing, so clients naming ever new tenants (no policy) fill
        nothing; a configured tenant's books (its rate bucket) stay."""
        if record.owner is None or record.usage is None:
            return
        owner: Usage = record.owner
        record.owner = None
        owner.records -= 1
        self._drop_if_idle(owner)

    def _drop_if_idle(self, owner: Usage) -> None:
        if (
            owner.records == 0
            and owner.payers == 0
            and owner is not self.unowned
            and owner.name not in self._policy
            and not (owner.cpu_bytes or owner.nvme_bytes or owner.pinned_bytes)
        ):
            if self._tenants.get(owner.name) is owner:
                del self._tenants[owner.name]
            elif self._callers.get(owner.name) is owner:
                del self._callers[owner.name]

    def bind(self, record: NamespaceRecord) -> None:
        """A recovered namespace was opened: its blocks move to its tenant's books."""
        ns = record.namespace
        if ns is None or record.owner is not self.unowned:
            return
        old, new, mine = self.unowned, self.tenant(ns.tenant), record.usage
        old.records -= 1
        new.records += 1
        old.cpu_bytes -= mine.cpu_bytes
        old.nvme_bytes -= mine.nvme_bytes
        new.cpu_bytes += mine.cpu_bytes
        new.nvme_bytes += mine.nvme_bytes
        spec = self._policy.get(ns.tenant)
        if spec is not None:
            mine.quota = spec.namespace
        mine.name = record.name
        record.owner = new

    def charge_cpu(self, record: NamespaceRecord, delta: int) -> None:
        record.usage.cpu_bytes += delta
        record.owner.cpu_bytes += delta

    def charge_nvme(self, record: NamespaceRecord, delta: int) -> None:
        record.usage.nvme_bytes += delta
        record.owner.nvme_bytes += delta

    # ----------------------------------------------------------------- keys per second
    def _charged(
        self, record: NamespaceRecord, payer: Usage | None
    ) -> tuple[tuple[Usage, str], ...]:
        """The books a call's keys and leases are charged to (``payer``)."""
        if payer is None:
            return ((record.usage, "namespace"), (record.owner, "tenant"))
        return ((payer, "tenant"),)

    def take_keys(self, record: NamespaceRecord, n: int, payer: Usage | None = None) -> None:
        """Spend ``n`` keys from the namespace's and the tenant's buckets (``payer``'s alone
        for a caller from another tenant), or refuse the call (nothing is spent then)."""
        buckets = []
        now = 0.0
        for books, where in self._charged(record, payer):
            rate = books.quota.keys_per_s
            if not rate:
                continue
            now = now or self._clock()
            if books.bucket is None:
                books.bucket = TokenBucket(rate, books.quota.burst, now)
            bucket = books.bucket
            bucket.refill(now)
            if n > bucket.burst or bucket.tokens < n:
                books.refused_keys += n
                raise CapacityError(
                    f"{where} {books.name!r} is over its keys_per_s ({rate:g} keys/s, burst "
                    f"{bucket.burst}): {n} keys asked, {int(bucket.tokens)} available now"
                    + ("; the request is larger than the burst" if n > bucket.burst else "")
                )
            buckets.append(bucket)
        for bucket in buckets:
            bucket.tokens -= n

    # ----------------------------------------------------------------- pins
    def pinned_cap(self, books: Usage) -> int:
        return books.quota.pinned_bytes or self.default_pinned

    def _cap_name(self, books: Usage) -> str:
        if books.quota.pinned_bytes:
            return f"max_pinned ({format_size(books.quota.pinned_bytes)})"
        return (
            f"max_pinned ({format_size(self.default_pinned)}: limits.max_pinned_share "
            f"{self._share:g} of the cpu tier)"
        )

    def footprint(self, books: Usage, nbytes: int, slabs: list[int]) -> int:
        """Pinned bytes of ``books`` with ``nbytes`` more in ``slabs``: with memory domains
        the whole slab of each pinned block, since that slab cannot be drained for others."""
        pinned = books.pinned_bytes + nbytes
        if self.domains:
            held = len(books.slabs) + len({s for s in slabs if s not in books.slabs})
            pinned = max(pinned, held * self.slab_bytes)
        return pinned

    def check_pin(
        self,
        record: NamespaceRecord,
        kind: str,
        nbytes: int,
        slabs: list[int] = (),  # type: ignore[assignment]
        handle: Usage | None = None,
        eids: list[int] | None = None,
        payer: Usage | None = None,
    ) -> None:
        """Refuse (CapacityError naming the bound) a lease or reservation of ``nbytes`` CPU
        bytes in ``slabs`` that would take its namespace or tenant (a lease: its ``payer``)
        past a bound, or its ``handle`` (its books, ``handle_books``) past the share one
        handle may pin. A lease gives its ``eids`` (of ``nbytes / len(eids)`` bytes each):
        only the blocks the books do not already lease count."""
        if kind != "leases":
            payer = None
        bb = nbytes // len(eids) if eids else 0

        def new(books: Usage | None) -> int:
            if books is None or eids is None:
                return nbytes
            return bb * sum(1 for e in eids if e not in books.leased)

        if nbytes and handle is not None and handle.pinned_bytes + new(handle) > self.handle_pinned:
            after = handle.pinned_bytes + new(handle)
            raise CapacityError(
                f"this handle would pin {format_size(after)} of the cpu "
                f"tier (leased, reserved and quarantined), more than one client may "
                f"({format_size(self.handle_pinned)}: half the tier on a single-user daemon, "
                "unless limits.max_pinned_share is set): release leases or commit reservations "
                "first, or ask for fewer blocks at once"
            )
        for books, where in self._charged(record, payer):
            limit = getattr(books.quota, kind)
            if limit and getattr(books, kind) >= limit:
                raise CapacityError(
                    f"{where} {books.name!r} holds {getattr(books, kind)} {kind}, its "
                    f"max_{kind} ({limit}): release, commit or abort some first"
                )
            if not nbytes:
                continue
            after = self.footprint(books, new(books), slabs if where == "tenant" else [])
            cap = self.pinned_cap(books) if where == "tenant" or books.quota.pinned_bytes else 0
            if cap and after > cap:
                # Its other clients may hold the pins (one user's clients share one tenant).
                mine = (
                    ""
                    if handle is None
                    else f"; this handle pins {format_size(handle.pinned_bytes)}"
                )
                raise CapacityError(
                    f"{where} {books.name!r} would pin {format_size(after)} of the cpu tier "
                    f"(leased, reserved and quarantined), more than its {self._cap_name(books)}"
                    f"{mine}: its clients must release leases or commit reservations first"
                )
        if nbytes and self.guaranteed_cpu:
            owner = payer or record.owner
            more = new(owner)  # an entry is leased through one tenant's books only
            floor = self.total_pinned + more
            for name in self.guaranteed_cpu:
                other = self.tenant(name)
                pinned = other.pinned_bytes + (more if other is owner else 0)
                floor += max(0, other.guaranteed_cpu_bytes - pinned)
            if floor > self.capacity:
                raise CapacityError(
                    f"tenant {owner.name!r} cannot pin {format_size(more)} more: the cpu tier "
                    "must keep room for the other tenants' guaranteed_cpu shares"
                )

    def pin(
        self,
        record: NamespaceRecord,
        kind: str,
        nbytes: int,
        slabs: list[int],
        handle: Usage | None = None,
        eids: list[int] | None = None,
        payer: Usage | None = None,
    ) -> Pin:
        """Charge a reservation of ``nbytes``, or a lease of ``eids`` (``nbytes`` together:
        each block counts once per books however many leases name it), in ``slabs``; a lease
        to its ``payer``'s books where it has one."""
        charged = self._charged(record, payer if kind == "leases" else None)
        books = tuple(b for b, _ in charged) + ((handle,) if handle is not None else ())
        bb = nbytes // len(eids) if eids else 0
        for b in books:
            setattr(b, kind, getattr(b, kind) + 1)
            if eids is None:
                b.pinned_bytes += nbytes
            else:
                b.pinned_bytes += bb * _count(b.leased, eids, +1)
            for s in slabs:
                b.slabs[s] = b.slabs.get(s, 0) + 1
        if eids is None:
            self.total_pinned += nbytes
            return Pin(nbytes, list(slabs), books, kind)
        self.total_pinned += bb * _count(self._leased, eids, +1)
        return Pin(0, list(slabs), books, kind, eids=tuple(eids), block_bytes=bb)

    def uncount(self, pin: Pin) -> None:
        """A reservation expired: it no longer counts as outstanding, but its slots stay
        pinned (quarantined) until ``unpin``."""
        if pin.counted:
            for b in pin.books:
                setattr(b, pin.kind, getattr(b, pin.kind) - 1)
            pin.counted = False

    def unpin(self, pin: Pin, nbytes: int | None = None, slabs: list[int] | None = None) -> None:
        """Undo ``pin`` (or, with ``nbytes``/``slabs``, part of it: quarantined slots leave
        one by one)."""
        nbytes = pin.nbytes if nbytes is None else nbytes
        slabs = pin.slabs if slabs is None else slabs
        if nbytes == pin.nbytes:
            self.uncount(pin)
        if pin.eids:  # a lease: its blocks no other lease of the books names are unpinned
            for b in pin.books:
                b.pinned_bytes -= pin.block_bytes * _count(b.leased, pin.eids, -1)
            self.total_pinned -= pin.block_bytes * _count(self._leased, pin.eids, -1)
            pin.eids = ()
        for b in pin.books:
            b.pinned_bytes -= nbytes
            _drop_slabs(b, slabs)
        pin.nbytes -= nbytes
        self.total_pinned -= nbytes

    def unpin_part(self, pin: Pin, nbytes: int, slabs: list[int]) -> None:
        """Part of a reservation's slots left it (spare slots a Bind committed): their bytes
        and slabs leave its charge and the pin, which then covers only the rest."""
        self.unpin(pin, nbytes, slabs)
        if slabs:
            left = list(pin.slabs)
            for s in slabs:
                left.remove(s)
            pin.slabs = left

    def unpin_leased(self, pin: Pin, eids: list[int]) -> None:
        """Part of a lease ended (``Lease.cut``): those of ``eids`` it pinned in the CPU tier
        leave its charge, with their slabs; the lease itself stays outstanding."""
        gone = set(eids)
        mine = [e for e in pin.eids if e in gone]
        # A lease's slabs (where pins count slabs) are those of its CPU entries, in order.
        slabs = [s for e, s in zip(pin.eids, pin.slabs, strict=False) if e in gone]
        for b in pin.books:
            b.pinned_bytes -= pin.block_bytes * _count(b.leased, mine, -1)
            _drop_slabs(b, slabs)
        self.total_pinned -= pin.block_bytes * _count(self._leased, mine, -1)
        if pin.slabs:
            pin.slabs = [s for e, s in zip(pin.eids, pin.slabs, strict=True) if e not in gone]
        pin.eids = tuple(e for e in pin.eids if e not in gone)

    def slabs_of(self, offsets: list[int]) -> list[int]:
        """The CPU slabs of ``offsets`` where pins count slabs (memory domains), else none."""
        if not self.domains:
            return []
        return [self._slab_of(o) for o in offsets]

    # ----------------------------------------------------------------- byte quotas
    @staticmethod
    def over(books: Usage, tier: str, nbytes: int) -> int:
        """Bytes ``books`` must give up in ``tier`` before taking ``nbytes`` more (0: none)."""
        limit = getattr(books.quota, f"{tier}_bytes")
        if not limit:
            return 0
        return max(0, getattr(books, f"{tier}_bytes") + nbytes - limit)

    @staticmethod
    def quota_error(books: Usage, where: str, tier: str, nbytes: int) -> CapacityError:
        limit = getattr(books.quota, f"{tier}_bytes")
        used = format_size(getattr(books, f"{tier}_bytes"))
        return CapacityError(
            f"{where} {books.name!r} is at its quota_{tier} ({used} "
            f"of {format_size(limit)}) and its own blocks that could make room for "
            f"{format_size(nbytes)} are leased or being written"
        )

    # ----------------------------------------------------------------- guarantees
    def guard(
        self,
        requester: Usage | None,
        tier: str,
        owner_of: Callable[[int], Usage],
        bytes_of: Callable[[int], int],
    ) -> Callable[[], Callable[[int], bool]] | None:
        """For room-making on behalf of ``requester``: a factory of per-round checks, each
        True for a victim that may go with those granted before it in the round (its tenant
        stays at or above its guaranteed share). None when no tenant has a guarantee here."""
        if not (self.guaranteed_cpu if tier == "cpu" else self.guaranteed_nvme):
            return None
        attr = f"guaranteed_{tier}_bytes"
        held = f"{tier}_bytes"

        def fresh() -> Callable[[int], bool]:
            taken: dict[int, int] = {}

            def take(eid: int) -> bool:
                owner = owner_of(eid)
                floor = getattr(owner, attr)
                if owner is requester or not floor:
                    return True
                t = taken.get(id(owner), 0) + bytes_of(eid)
                if getattr(owner, held) - t < floor:
                    return False
                taken[id(owner)] = t
                return True

            return take

        return fresh

    def spared(self, requester: Usage | None, tier: str, owner: Usage, nbytes: int) -> bool:
        """Evicting ``nbytes`` of ``owner`` now would take it below its guaranteed share."""
        floor = getattr(owner, f"guaranteed_{tier}_bytes")
        return (
            bool(floor)
            and owner is not requester
            and getattr(owner, f"{tier}_bytes") - nbytes < floor
        )
