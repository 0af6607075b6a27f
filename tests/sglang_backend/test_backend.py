"""kvstore's SGLang HiCache backend against SGLang's real code and a real daemon.

The backend is made by SGLang's own factory (``StorageBackendFactory``, ``"dynamic"``) over
SGLang's real host pools (MHA in every layout, MLA), and called as SGLang's cache controller
calls it: ``batch_set_v1``/``batch_get_v1`` with host indices, ``batch_exists`` of a batch of
page hashes. A real ``kvstore serve`` keeps the pages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs SGLang (make sglang-env)", allow_module_level=True)


def _torchvision_ops() -> None:
    # The PyPI torchvision wheel fails to import under CPU torch unless its op schemas exist;
    # SGLang imports it, HiCache never calls them.
    try:
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _LIBS.append(lib)
    except RuntimeError:
        pass  # defined already


_LIBS: list[Any] = []
_torchvision_ops()

from conftest import DaemonProcess, config_toml  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402

from kvstore.integrations.sglang import KVStoreHiCacheStorage  # noqa: E402

from .conftest import kvstore_config, storage_config  # noqa: E402

PAGE = 4  # tokens a page
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def mha_pool(layout: str, dtype: Any = None, heads: int = 2) -> Any:
    """SGLang's MHA host pool as its ``build_kv_host_pool`` builds it (unpinned: no CUDA)."""
    dev = MHATokenToKVPool(64, PAGE, dtype or torch.bfloat16, heads, 8, 3, "cpu", False)
    info = dev.get_device_pool_infos()[0].buffer_info
    return get_mha_host_pool_cls(info)(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=dev.start_layer,
        end_layer=dev.end_layer,
    )


def mla_pool(layout: str) -> Any:
    dev = MLATokenToKVPool(64, PAGE, torch.bfloat16, 16, 8, 3, "cpu", False)
    info = dev.get_device_pool_infos()[0].buffer_info
    return MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        override_kv_cache_dim=dev.kv_cache_dim,
        device_capacity_tokens=dev.size,
        start_layer=dev.start_layer,
        end_layer=dev.end_layer,
        target_layer_num=dev.layer_num,
    )


def fill_random(pool: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def make_backend(
    pool: Any,
    address: str,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    model: str = "test-model",
    **more: Any,
) -> Any:
    """The backend as SGLang's cache controller makes it: the factory, then the pool."""
    config = storage_config(
        model,
        kvstore_config(address, **more),
        mla=mla,
        tp=(tp_rank, tp_size),
        page_first=pool.layout == "page_first",
        metrics=True,
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def keys_of(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def pages(first: int, n: int) -> Any:
    """Host indices of ``n`` pages from page ``first``, as the controller passes them."""
    return torch.arange(first * PAGE, (first + n) * PAGE, dtype=torch.int64)


def page_bytes(pool: Any, page: int) -> Any:
    return pool.get_data_page(page * PAGE).contiguous().view(torch.uint8).clone()


def target_mask(pool: Any, targets: list[int]) -> Any:
    """True over the elements of the host buffer that pages ``targets`` cover (found by
    writing ones through SGLang's own ``set_from_flat_data_page`` into a zeroed copy)."""
    saved = pool.kv_buffer
    pool.kv_buffer = torch.zeros_like(saved)
    try:
        ones = torch.ones_like(pool.get_dummy_flat_data_page())
        for page in targets:
            pool.set_from_flat_data_page(page * PAGE, ones)
        return pool.kv_buffer != 0
    finally:
        pool.kv_buffer = saved


def test_the_factory_loads_the_backend_by_name(daemon: DaemonProcess) -> None:
    backend = make_backend(mha_pool("page_first"), daemon.address)
    try:
        assert type(backend) is KVStoreHiCacheStorage
        assert backend.fmt is not None and backend.fmt.zero_copy
    finally:
        backend.close()


@pytest.mark.parametrize(
    "kind,layout", [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]
)
def test_pages_round_trip_bit_exact_into_other_pages(
    daemon: DaemonProcess, kind: str, layout: str
) -> None:
    pool = mha_pool(layout) if kind == "mha" else mla_pool(layout)
    fill_random(pool, seed=len(layout))
    backend = make_backend(pool, daemon.address, mla=kind == "mla", model=f"rt-{kind}-{layout}")
    try:
        keys = keys_of(f"rt/{kind}/{layout}", 5)
        src, dst = pages(1, 5), pages(8, 5)
        wanted = [page_bytes(pool, 1 + i) for i in range(5)]
        assert backend.batch_set_v1(keys, src) == [True] * 5
        assert backend.batch_exists(keys) == 5

        # Wipe the targets; everything else must come out of the read untouched.
        zeros = pool.get_dummy_flat_data_page()
        for i in range(5):
            pool.set_from_flat_data_page(8 * PAGE + i * PAGE, zeros)
        before = pool.kv_buffer.clone()
        dst_pages = [8 + i for i in range(5)]
        assert backend.batch_get_v1(keys, dst) == [True] * 5
        for i in range(5):
            assert torch.equal(page_bytes(pool, 8 + i), wanted[i]), f"page {i}"
        changed = pool.kv_buffer.view(torch.int16) != before.view(torch.int16)
        assert not (changed & ~target_mask(pool, dst_pages)).any(), "wrote outside its pages"
        counters = backend.counters()
        assert counters["hits"] == 5 and counters["pages_written"] == 5
        stats = backend.get_stats()
        assert stats.prefetch_pgs == [5] and stats.backup_pgs == [5]
    finally:
        backend.close()


def test_batch_exists_counts_the_leading_run_and_a_gap_is_false(daemon: DaemonProcess) -> None:
    pool = mha_pool("page_first")
    fill_random(pool, seed=3)
    backend = make_backend(pool, daemon.address, model="runs")
    try:
        keys = keys_of("runs", 6)
        stored = [0, 1, 2, 4, 5]
        for i in stored:
            assert backend.batch_set_v1([keys[i]], pages(1 + i, 1)) == [True]
        assert backend.batch_exists(keys) == 3
        assert backend.batch_exists(keys[3:]) == 0
        assert backend.batch_exists(keys[4:]) == 2
        assert [backend.exists(k) for k in keys] == [True, True, True, False, True, True]
        got = backend.batch_get_v1(keys, pages(10, 6))
        assert got[:3] == [True] * 3 and got[3] is False
        assert backend.counters()["misses"] == 3  # the gap and the pages after it
    finally:
        backend.close()


def test_two_tp_ranks_never_see_each_others_pages(daemon: DaemonProcess) -> None:
    pool = mha_pool("page_first")
    fill_random(pool, seed=4)
    rank0 = make_backend(pool, daemon.address, tp_rank=0, tp_size=2, model="tp")
    rank1 = make_backend(pool, daemon.address, tp_rank=1, tp_size=2, model="tp")
    solo = make_backend(pool, daemon.address, tp_rank=0, tp_size=1, model="tp")
    other_model = make_backend(pool, daemon.address, tp_rank=0, tp_size=2, model="tp-other")
    other_tenant = make_backend(pool, daemon.address, tp_size=2, model="tp", tenant="t2")
    try:
        keys = keys_of("tp", 3)
        assert rank0.batch_set_v1(keys, pages(1, 3)) == [True] * 3
        assert rank0.batch_exists(keys) == 3
        for other in (rank1, solo, other_model, other_tenant):
            assert other.batch_exists(keys) == 0
            assert other.batch_get_v1(keys, pages(10, 3)) == [False] * 3
    finally:
        for b in (rank0, rank1, solo, other_model, other_tenant):
            b.close()


def test_mla_ranks_share_one_namespace(daemon: DaemonProcess) -> None:
    pool = mla_pool("page_first")
    fill_random(pool, seed=5)
    writer = make_backend(pool, daemon.address, tp_rank=0, tp_size=2, mla=True, model="mla")
    reader = make_backend(pool, daemon.address, tp_rank=1, tp_size=2, mla=True, model="mla")
    try:
        keys = keys_of("mla-share", 2)
        assert writer.batch_set_v1(keys, pages(1, 2)) == [True, True]
        assert reader.batch_get_v1(keys, pages(6, 2)) == [True, True]
        for i in range(2):
            assert torch.equal(page_bytes(pool, 1 + i), page_bytes(pool, 6 + i))
    finally:
        writer.close()
        reader.close()


def test_two_host_layouts_never_mix(daemon: DaemonProcess) -> None:
    first, layer = mha_pool("page_first"), mha_pool("layer_first")
    fill_random(first, seed=6)
    a = make_backend(first, daemon.address, model="layouts")
    b = make_backend(layer, daemon.address, model="layouts")
    try:
        keys = keys_of("layouts", 2)
        assert a.batch_set_v1(keys, pages(1, 2)) == [True, True]
        assert b.batch_exists(keys) == 0
    finally:
        a.close()
        b.close()


def test_a_fresh_backend_finds_what_the_last_one_stored(daemon: DaemonProcess) -> None:
    pool = mha_pool("page_head")
    fill_random(pool, seed=7)
    keys = keys_of("restart", 4)
    wanted = [page_bytes(pool, 1 + i) for i in range(4)]
    first = make_backend(pool, daemon.address, model="restart")
    assert first.batch_set_v1(keys, pages(1, 4)) == [True] * 4
    first.close()

    fresh_pool = mha_pool("page_head")  # a new SGLang process: new memory
    second = make_backend(fresh_pool, daemon.address, model="restart")
    try:
        assert second.batch_exists(keys) == 4
        assert second.batch_get_v1(keys, pages(2, 4)) == [True] * 4
        for i in range(4):
            assert torch.equal(page_bytes(fresh_pool, 2 + i), wanted[i])
    finally:
        second.close()


def test_the_flat_page_calls_match_the_zero_copy_ones(daemon: DaemonProcess) -> None:
    """``get``/``set``/``batch_*`` (the controller's path without ``interface_v1``) store and
    return the same bytes as the v1 calls: a page written one way reads back the other."""
    pool = mha_pool("layer_first")
    fill_random(pool, seed=8)
    backend = make_backend(pool, daemon.address, model="flat")
    try:
        keys = keys_of("flat", 3)
        assert backend.batch_set_v1(keys[:1], pages(1, 1)) == [True]
        page = backend.get(keys[0], pool.get_dummy_flat_data_page())
        assert page is not None
        assert torch.equal(page.view(torch.uint8), page_bytes(pool, 1))
        assert backend.set(keys[1], pool.get_data_page(2 * PAGE))
        assert backend.batch_set(keys[2:], [pool.get_data_page(3 * PAGE)])
        assert backend.batch_get_v1(keys[1:], pages(9, 2)) == [True, True]
        assert torch.equal(page_bytes(pool, 9), page_bytes(pool, 2))
        assert torch.equal(page_bytes(pool, 10), page_bytes(pool, 3))
        dummies = [pool.get_dummy_flat_data_page() for _ in keys]
        got = backend.batch_get(keys, dummies)
        assert all(g is not None for g in got)
    finally:
        backend.close()


def test_bad_input_is_a_miss_or_false_never_an_exception(
    daemon: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    pool = mha_pool("page_first")
    fill_random(pool, seed=9)
    backend = make_backend(pool, daemon.address, model="bad")
    try:
        good = keys_of("bad", 2)
        with caplog.at_level(logging.WARNING, logger="kvstore.integrations.sglang"):
            # Keys that are not 64 hex digits: nothing stored, nothing found.
            for key in ("not-hex", good[0][:-1], good[0] + "00", "zz" * 32):
                assert backend.batch_set_v1([key], pages(1, 1)) == [False]
                assert backend.batch_exists([key]) == 0
                assert backend.batch_get_v1([key], pages(5, 1)) == [False]
                assert backend.get(key, pool.get_dummy_flat_data_page()) is None
            # A bad key in a batch ends the run there.
            assert backend.batch_set_v1([good[0], "bad", good[1]], pages(1, 3)) == [
                True,
                False,
                False,
            ]
            assert backend.batch_exists([good[0], "bad"]) == 1
            # Host indices that are not one page per key.
            assert backend.batch_set_v1(good, pages(1, 1)) == [False, False]
            assert backend.batch_get_v1(good, pages(1, 3)) == [False, False]
            # A page of the wrong size.
            short = torch.zeros(7, dtype=torch.bfloat16)
            assert backend.set(good[1], short) is False
            assert backend.get(good[0], short) is None
            assert backend.batch_set(good, [short, short]) is False
            assert backend.batch_get(good, [short, short]) == [None, None]
        warned = [r.getMessage() for r in caplog.records]
        assert len([m for m in warned if "64 hex digits" in m]) == 1  # once
        assert any("host indices" in m for m in warned)
        assert any("a page of 14 bytes" in m for m in warned)
    finally:
        backend.close()


def test_a_bad_batch_is_a_miss_for_itself_and_not_an_outage(daemon: DaemonProcess) -> None:
    """Regression: any failure of a batch (here host indices past the pool's end) made the
    backend treat the daemon as down, so every page of every thread was a miss for
    ``retry_after_s``."""
    pool = mha_pool("page_first")
    fill_random(pool, seed=13)
    backend = make_backend(pool, daemon.address, model="outage")
    try:
        keys = keys_of("outage", 2)
        assert backend.batch_set_v1(keys, pages(1, 2)) == [True, True]
        past_the_end = torch.arange(10**6, 10**6 + 2 * PAGE, dtype=torch.int64)
        assert backend.batch_set_v1(keys_of("other", 2), past_the_end) == [False, False]
        assert backend.batch_get_v1(keys, past_the_end) == [False, False]
        # The very next batch is served: the daemon was never down.
        assert backend.batch_get_v1(keys, pages(5, 2)) == [True, True]
        assert backend.batch_exists(keys) == 2
    finally:
        backend.close()


def test_a_daemon_that_is_down_is_a_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pool = mha_pool("page_first")
    fill_random(pool, seed=10)
    address = f"unix:{tmp_path / 'nobody.sock'}"
    with caplog.at_level(logging.WARNING, logger="kvstore.integrations.sglang"):
        backend = make_backend(pool, address, model="down", timeout_s=0.5, retry_after_s=0)
        keys = keys_of("down", 2)
        try:
            for _ in range(2):
                assert backend.batch_set_v1(keys, pages(1, 2)) == [False, False]
                assert backend.batch_exists(keys) == 0
                assert backend.batch_get_v1(keys, pages(4, 2)) == [False, False]
                assert backend.get(keys[0], pool.get_dummy_flat_data_page()) is None
                assert backend.set(keys[0], pool.get_data_page(PAGE)) is False
                backend.clear()
        finally:
            backend.close()
    assert len([r for r in caplog.records if "pages are misses" in r.getMessage()]) == 1
    assert backend.counters()["errors"] > 0


def test_a_daemon_that_stops_and_comes_back(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, config_toml(cpu_capacity="16MiB", slab="1MiB")).start()
    pool = mha_pool("page_first")
    fill_random(pool, seed=11)
    backend = make_backend(pool, d.address, model="back", timeout_s=1.0, retry_after_s=0)
    try:
        keys = keys_of("back", 2)
        assert backend.batch_set_v1(keys, pages(1, 2)) == [True, True]
        d.stop()
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get_v1(keys, pages(4, 2)) == [False, False]
        d.start()  # empty: the CPU tier does not outlive the daemon
        assert backend.batch_exists(keys) == 0
        assert backend.batch_set_v1(keys, pages(1, 2)) == [True, True]
        assert backend.batch_get_v1(keys, pages(4, 2)) == [True, True]
    finally:
        backend.close()
        d.stop()


def test_clear_deletes_every_page_of_its_namespace_and_no_other(daemon: DaemonProcess) -> None:
    pool = mha_pool("page_first")
    fill_random(pool, seed=12)
    earlier = make_backend(pool, daemon.address, model="clear")
    other = make_backend(pool, daemon.address, model="not-cleared")
    keys = keys_of("clear", 3)
    try:
        assert earlier.batch_set_v1(keys, pages(1, 3)) == [True] * 3
        assert other.batch_set_v1(keys, pages(1, 3)) == [True] * 3
    finally:
        earlier.close()
    backend = make_backend(pool, daemon.address, model="clear")  # a later SGLang process
    try:
        assert backend.batch_exists(keys) == 3
        backend.clear()
        assert backend.batch_exists(keys) == 0
        assert other.batch_exists(keys) == 3
    finally:
        backend.close()
        other.close()
