"""SGLang host-pool pages as kvstore blocks: which pieces of host memory a page is, and the
copies between them and the daemon's shared memory (``kvstore.integrations.sglang``).

A page is stored as SGLang's own flat page holds it (``host_pool.get_data_page(index,
flat=True)``): the elements of the page's tensors in C order, one tensor after the other. A KV
page is one tensor, ``get_data_page(index, flat=False)``; a Mamba state page is several (its
temporal state, conv states and slot states, as ``MambaPoolHost`` walks them). Their contiguous
runs are the pieces a copy goes in; for every KV host layout they are the runs SGLang's
``get_page_buffer_meta`` names (one or two per page for ``page_first``, ``page_first_direct``
and ``page_head``; one per layer and K/V for ``layer_first``), in flat-page order. A pool whose
pages are not views of its memory goes through its flat-page copies. Nothing here imports
SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from kvstore.client._parallel import each_block
from kvstore.errors import KVStoreError
from kvstore.keys import KEY_BYTES
from kvstore.layout import KVLayout

PIECE_HASH_BYTES = 256 << 10
"""Copies are hashed in pieces of at most this size, each right before (write) or after (read)
its copy, while it is in cache: one pass over memory, not two."""


def page_key(key: object) -> bytes | None:
    """The 32-byte kvstore key of an SGLang page key (64 hex digits), or None for any other
    key (a miss on reads, False on writes)."""
    if not isinstance(key, str) or len(key) != 2 * KEY_BYTES:
        return None
    try:
        return bytes.fromhex(key)
    except ValueError:
        return None


def _storage_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of the whole storage under ``t`` (bounds every piece taken of it)."""
    storage = t.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8)
    whole.set_(storage, 0, (storage.nbytes(),), (1,))
    return whole.numpy()


def _runs(view: torch.Tensor) -> tuple[int, list[int]]:
    """Contiguous runs of a strided ``view``, in C order: (elements per run, each run's
    element offset from the view's storage offset)."""
    shape, strides = list(view.shape), list(view.stride())
    run, k = 1, len(shape)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == run):
        run *= shape[k - 1]
        k -= 1
    starts = [0]
    for size, stride in zip(shape[:k], strides[:k], strict=True):
        starts = [s + i * stride for s in starts for i in range(size)]
    return run, starts


@dataclass(frozen=True)
class PagePart:
    """One tensor of a page (a view of the pool's memory, or of a copy): its shape and strides,
    and its contiguous runs in C order (bytes each, and each one's byte offset from the part's
    first element)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    run_bytes: int
    run_offsets: tuple[int, ...]

    @classmethod
    def of(cls, view: torch.Tensor) -> PagePart:
        run, starts = _runs(view)
        itemsize = view.element_size()
        return cls(
            shape=tuple(view.shape),
            strides=tuple(view.stride()),
            itemsize=itemsize,
            run_bytes=run * itemsize,
            run_offsets=tuple(s * itemsize for s in starts),
        )

    @property
    def nbytes(self) -> int:
        return self.run_bytes * len(self.run_offsets)


@dataclass(frozen=True)
class PageFormat:
    """How one SGLang page lies in the host pool, and what it is in kvstore."""

    page_size: int  # tokens (or state slots) a page: the stride of host indices between pages
    page_bytes: int
    parts: tuple[PagePart, ...]  # the page's tensors, in the order of its flat page
    zero_copy: bool  # the parts are views of the pool's memory: pieces are copied in place
    description: str  # the page format, written into the namespace's revision

    @property
    def layout(self) -> KVLayout:
        """The raw-bytes kvstore layout of one page: ``page_bytes`` of uint8."""
        return KVLayout(1, 1, self.page_bytes // 2, 1, torch.uint8)


def _pool_memory(pool: Any) -> dict[int, torch.Tensor]:
    """The CPU tensors a host pool holds (its attributes, and lists of them), by the address of
    their storage: the only memory a page's pieces may lie in."""
    found: dict[int, torch.Tensor] = {}
    for value in vars(pool).values():
        items = value if isinstance(value, (list, tuple)) else (value,)
        for t in items:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel():
                found.setdefault(t.untyped_storage().data_ptr(), t)
    return found


def _page_views(pool: Any) -> Any:
    """How to get the tensors of a page at a host index. A pool whose flat page is the bytes of
    several tensors (SGLang's ``MambaPoolHost``: temporal state, conv states, slot states) names
    them in ``_iter_page_tensors``, what its own ``get_data_page``/``set_from_flat_data_page``
    walk; any other pool's page is ``get_data_page(index, flat=False)``."""
    each = getattr(pool, "_iter_page_tensors", None)
    if callable(each):
        return lambda index: list(each(index))
    return lambda index: [pool.get_data_page(index, flat=False)]


def _flat_page_bytes(pool: Any) -> int:
    page = pool.get_dummy_flat_data_page()
    return int(page.numel() * page.element_size())


def describe_pool(pool: Any, *, side: bool = False) -> PageFormat:
    """The page format of an SGLang host pool; ValueError when its pages cannot be stored.

    The anchor (KV) pool's page is ``get_data_page(index, flat=False)``, and its index stride the
    logical page size (DCP widens it); a side pool's (``side=True``) may be several tensors
    (``_page_views``), its stride the pool's own ``page_size`` (what SGLang's controller sizes
    a side pool's host indices by). The pages are copied in place (``zero_copy``) when every
    part is a view of memory the pool holds, and pages at two indices are two places; else
    through the pool's flat-page copies."""
    if side:
        page_size = int(getattr(pool, "page_size", 1) or 1)
        views_of = _page_views(pool)
    else:
        page_size = int(getattr(pool, "logical_page_size", None) or pool.page_size)
        views_of = lambda index: [pool.get_data_page(index, flat=False)]  # noqa: E731
    views = views_of(0)
    if not views or not all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in views):
        raise ValueError(f"{type(pool).__name__}: pages are not CPU tensors")
    parts = tuple(PagePart.of(v) for v in views)
    page_bytes = sum(p.nbytes for p in parts)
    if page_bytes == 0 or page_bytes % 2:
        raise ValueError(f"{type(pool).__name__}: a page of {page_bytes} bytes")
    if side and _flat_page_bytes(pool) != page_bytes:
        raise ValueError(
            f"{type(pool).__name__}: its flat page has {_flat_page_bytes(pool)} bytes, its "
            f"page tensors {page_bytes}"
        )
    memory = _pool_memory(pool)
    zero_copy = all(v.untyped_storage().data_ptr() in memory for v in views)
    if zero_copy and side and int(getattr(pool, "size", 0) or 0) >= 2 * page_size:
        other = views_of(page_size)
        zero_copy = [(v.data_ptr()) for v in other] != [v.data_ptr() for v in views]
    parts_text = "+".join("x".join(str(d) for d in v.shape) for v in views)
    dtypes = "+".join(dict.fromkeys(str(v.dtype).removeprefix("torch.") for v in views))
    desc = [type(pool).__name__, str(getattr(pool, "layout", "")), dtypes, parts_text]
    desc.append(f"p{page_size}")
    tag = getattr(pool, "storage_format_tag", None)
    if tag:
        desc.append(str(tag))
    return PageFormat(
        page_size=page_size,
        page_bytes=page_bytes,
        parts=parts,
        zero_copy=zero_copy,
        description=":".join(desc),
    )


class HostPages:
    """The pages of one SGLang host pool: as numpy pieces over its memory (``pieces``, for a
    ``zero_copy`` format), or as flat pages through the pool's own copies (``flat_page``,
    ``set_flat_page``). Owns nothing; reads the pool's buffers only through views bounded by
    their storage."""

    def __init__(self, pool: Any, fmt: PageFormat, *, side: bool = False) -> None:
        self.pool = pool
        self.fmt = fmt
        self._views_of = (
            _page_views(pool) if side else (lambda i: [pool.get_data_page(i, flat=False)])
        )
        self._memory = (
            {ptr: _storage_bytes(t) for ptr, t in _pool_memory(pool).items()}
            if fmt.zero_copy
            else {}
        )

    def pieces(self, index: int) -> list[np.ndarray]:
        """The pieces of the page starting at host index ``index``, in the order of its flat
        page. ValueError if the pool gives a page of another shape, or one outside its memory."""
        fmt = self.fmt
        views = self._views_of(index)
        if len(views) != len(fmt.parts):
            raise ValueError(f"host page {index} has {len(views)} parts, expected {len(fmt.parts)}")
        out: list[np.ndarray] = []
        for view, part in zip(views, fmt.parts, strict=True):
            if tuple(view.shape) != part.shape or tuple(view.stride()) != part.strides:
                raise ValueError(f"host page {index} is {tuple(view.shape)}, expected {part.shape}")
            memory = self._memory.get(view.untyped_storage().data_ptr())
            if memory is None or view.element_size() != part.itemsize:
                raise ValueError(f"host page {index} is not in the pool's memory")
            base = view.storage_offset() * part.itemsize
            n = part.run_bytes
            for o in part.run_offsets:
                piece = memory[base + o : base + o + n]
                if len(piece) != n:
                    raise ValueError(f"host page {index} runs past the pool's memory")
                out.append(piece)
        return out

    def flat_page(self, index: int) -> torch.Tensor:
        """A copy of the page at ``index`` as ``page_bytes`` of uint8 (the pool's flat page)."""
        page = self.pool.get_data_page(index, flat=True)
        row = page.contiguous().view(torch.uint8).reshape(-1)
        if row.numel() != self.fmt.page_bytes:
            raise ValueError(f"host page {index} has {row.numel()} bytes")
        return row

    def set_flat_page(self, index: int, row: torch.Tensor) -> None:
        """Write ``row`` (``page_bytes`` of uint8) into the page at ``index``, through the pool's
        ``set_from_flat_data_page``."""
        dummy = self.pool.get_dummy_flat_data_page()
        dummy.view(torch.uint8).view(-1).copy_(row)
        self.pool.set_from_flat_data_page(index, dummy)


def copy_in_hashing(dst: np.ndarray, pieces: Sequence[np.ndarray], seed: int) -> int:
    """Copy the pieces of a page one after the other into ``dst`` (one slot); the seeded xxh3
    of the source, each part hashed right before its copy (the checksum vouches for what was
    meant to be stored, whatever writes into the slot meanwhile)."""
    h = xxhash.xxh3_64(seed=seed)
    at = 0
    for piece in pieces:
        n = len(piece)
        for start in range(0, n, PIECE_HASH_BYTES):
            part = piece[start : start + PIECE_HASH_BYTES]
            h.update(part.data)
            np.copyto(dst[at + start : at + start + len(part)], part)
        at += n
    return h.intdigest()


def copy_out_hashing(src: np.ndarray, pieces: Sequence[np.ndarray], seed: int) -> int:
    """Copy one slot into the pieces of a page; the seeded xxh3 of the copy, each part hashed
    right after its copy (a slot that changes under the copy fails the check)."""
    h = xxhash.xxh3_64(seed=seed)
    at = 0
    for piece in pieces:
        n = len(piece)
        for start in range(0, n, PIECE_HASH_BYTES):
            part = piece[start : start + PIECE_HASH_BYTES]
            np.copyto(part, src[at + start : at + start + len(part)])
            h.update(part.data)
        at += n
    return h.intdigest()


def slot_array(arena: Any, address: int, nbytes: int, write: bool) -> np.ndarray:
    """A numpy view of one arena slot, checked against its slab (and, to write, refused
    unless the slab is mapped writable)."""
    slab, offset = arena._where(address, nbytes)
    if write and not slab.writable:
        raise KVStoreError("the daemon reserved a slot in memory this client may only read")
    array: np.ndarray = slab.np[offset : offset + nbytes]
    return array


@dataclass(frozen=True)
class Written:
    """What a write of a batch of pages did: ``stored`` leading pages are in the store (new or
    there before), ``committed`` of them were new, ``present`` were there already."""

    stored: int
    committed: int
    present: int


def write_pages(client: Any, pages: HostPages, kv: list[bytes], starts: list[int]) -> Written:
    """Store the page at host index ``starts[i]`` under ``kv[i]``: slots reserved in the daemon's
    shared memory, each page copied straight into its slot with its checksum (bound by the slot's
    seed to key and namespace), committed. Raises what the client raises."""
    reservation = client.reserve(kv)
    try:
        if reservation.indices:
            _fill(reservation, pages, starts)
    except BaseException:
        reservation.abort()
        raise
    new = len(reservation.indices)
    committed = int(reservation.commit())
    present = len(kv) - new
    if committed < new or reservation.pending:
        # Not all stored by this call: some were another writer's, still unfinished when the
        # daemon stopped waiting (it may yet abort). Only what is there now counts.
        return Written(min(len(kv), int(client.lookup(kv))), committed, present)
    return Written(len(kv), committed, present)


def _fill(reservation: Any, pages: HostPages, starts: list[int]) -> None:
    """Copy the pages a reservation asks for into its slots, with their checksums."""
    nbytes = pages.fmt.page_bytes
    if reservation.codec or not pages.fmt.zero_copy:
        # Slots that take an encoded payload (a ``cpu`` codec), or a pool whose pages are not
        # views: the page through a flat copy, then the client's own fill.
        rows = torch.empty((len(starts), nbytes), dtype=torch.uint8)
        for i in reservation.indices:
            rows[i] = pages.flat_page(starts[i])
        reservation.fill_from(rows)
        return
    arena = reservation.arena
    work = [
        (pages.pieces(starts[i]), slot_array(arena, address, nbytes, write=True), seed)
        for i, address, seed in zip(
            reservation.indices, reservation.offsets_new, reservation.seeds_new, strict=True
        )
    ]
    sums = [0] * len(work)

    def copy(j: int) -> None:
        pieces, slot, seed = work[j]
        sums[j] = copy_in_hashing(slot, pieces, seed)

    each_block(len(work), len(work) * nbytes, copy)
    reservation.use_checksums(sums)


def read_pages(client: Any, pages: HostPages, kv: list[bytes], starts: list[int]) -> int:
    """Fill the page at host index ``starts[i]`` from ``kv[i]``, copied straight out of the
    daemon's shared memory, each copy checked against the checksum bound to its key and
    namespace; how many leading pages were filled intact. Only those target pages are written;
    one after the first miss may hold partial bytes. Raises what the client raises."""
    nbytes = pages.fmt.page_bytes
    lease = client.acquire(kv)
    try:
        n = len(lease)
        if not n:
            return 0
        if lease.codecs or any(lease.on_gpu) or not pages.fmt.zero_copy:
            rows = torch.empty((n, nbytes), dtype=torch.uint8)
            intact = int(lease.copy_into(rows))
            for i in range(intact):
                pages.set_flat_page(starts[i], rows[i])
            return intact
        work = [
            (
                slot_array(lease.arena, lease.offsets[i], nbytes, write=False),
                pages.pieces(starts[i]),
                lease.seeds[i],
                lease.checksums[i],
            )
            for i in range(n)
        ]
        ok = [True] * n

        def copy(j: int) -> None:
            slot, pieces, seed, expected = work[j]
            ok[j] = copy_out_hashing(slot, pieces, seed) == expected

        each_block(n, n * nbytes, copy)
        return ok.index(False) if False in ok else n
    finally:
        lease.release()


@dataclass(frozen=True, eq=False)
class Space:
    """One namespace the backend keeps pages in: the KV pool's (``name`` empty) or one side
    pool's. ``revision`` and the TP shard (``tp_rank`` of ``tp_size``) are what the namespace
    adds to the model; the page format (``pages.fmt``) gives its raw-bytes layout."""

    name: str
    pages: HostPages
    revision: str
    tp_rank: int
    tp_size: int

    @property
    def fmt(self) -> PageFormat:
        return self.pages.fmt


MAX_BATCH_BYTES = 64 << 20
"""Pages per reservation or lease are bounded by bytes: a batch of SGLang's 128 pages of
several MiB each goes in parts, so no call pins more of the CPU tier than this at once."""


def batch_bounds(n: int, page_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each part of ``n`` pages of ``page_bytes`` a call moves at once."""
    per = max(1, MAX_BATCH_BYTES // max(1, page_bytes))
    return [(i, min(n, i + per)) for i in range(0, n, per)]


def page_starts(host_indices: Any, pages: int, page_size: int) -> list[int] | None:
    """The host index of each of ``pages`` pages (``host_indices[i * page_size]``), or None if
    ``host_indices`` is not ``pages * page_size`` long."""
    if host_indices is None:
        return None
    try:
        n = int(host_indices.numel())
    except AttributeError:
        n = len(host_indices)
    if n != pages * page_size:
        return None
    flat = host_indices.tolist() if hasattr(host_indices, "tolist") else list(host_indices)
    return [int(flat[i * page_size]) for i in range(pages)]
