"""The harness itself drives a storage backend through SGLang's real code: with SGLang's own
``HiCacheFile`` backend, loaded by its factory, pages the cache controller's backup thread
writes from the real host pool come back bit-exact through its prefetch threads into other
host pages, for every MHA layout and for MLA, and nothing else in the pool moves."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "SGLang is not installed (make test-sglang builds .venv-sglang)", allow_module_level=True
    )

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from .conftest import MHA_LAYOUTS, MLA_LAYOUTS, Controller

pytestmark = pytest.mark.timeout(300)

PAGES = 5


def _round_trip(c: Controller, seed: int) -> None:
    page = c.page_size
    tokens = [seed * 10_000 + i for i in range(PAGES * page)]
    src = c.alloc(PAGES)
    written = c.fill_random(src, seed)
    assert c.read_pages(src) == written  # the pool holds what was written

    assert c.backup(src, tokens) == PAGES * page

    before = c.snapshot()
    got = c.prefetch(tokens)
    assert got.hashes == c.hashes(tokens)
    assert got.hit_tokens == PAGES * page
    assert got.completed_tokens == PAGES * page
    dst_starts = c.page_starts(got.host_indices)
    assert not set(dst_starts) & set(c.page_starts(src)), "prefetch must land in other pages"
    assert c.read_pages(got.host_indices) == written
    assert not c.changed_outside(before, got.host_indices)


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_mha_pages_round_trip_through_the_controller(
    layout: str, make_pools: Any, make_controller: Any, hicache_file_config: dict[str, Any]
) -> None:
    c = make_controller(make_pools(layout), hicache_file_config)
    assert type(c.backend).__name__ == "HiCacheFile"
    _round_trip(c, seed=1)


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_pages_round_trip_through_the_controller(
    layout: str, make_pools: Any, make_controller: Any, hicache_file_config: dict[str, Any]
) -> None:
    c = make_controller(make_pools(layout, mla=True), hicache_file_config)
    assert c.backend.config_suffix == "_test-model"  # one namespace for every MLA rank
    _round_trip(c, seed=2)


def test_the_legacy_controller_and_the_builtin_name_drive_the_same_backend(
    make_pools: Any, make_controller: Any, hicache_file_config: dict[str, Any]
) -> None:
    config = {"file_storage_path": hicache_file_config["file_storage_path"]}
    c = make_controller(make_pools("page_first"), config, storage_backend="file", kind="legacy")
    assert type(c.backend).__name__ == "HiCacheFile"
    _round_trip(c, seed=3)


def test_a_miss_loads_nothing_and_a_gap_ends_the_hit(
    make_pools: Any, make_controller: Any, hicache_file_config: dict[str, Any]
) -> None:
    c = make_controller(make_pools("layer_first"), hicache_file_config)
    page = c.page_size
    tokens = list(range(PAGES * page))
    assert c.prefetch(tokens).hit_tokens == 0

    # Only the first two pages are stored: the query's leading run stops there.
    src = c.alloc(2)
    written = c.fill_random(src, 4)
    assert c.backup(src, tokens[: 2 * page]) == 2 * page
    got = c.prefetch(tokens)
    assert got.hit_tokens == got.completed_tokens == 2 * page
    assert c.read_pages(got.host_indices) == written


def test_a_wrong_byte_is_seen(
    make_pools: Any, make_controller: Any, hicache_file_config: dict[str, Any]
) -> None:
    """The checks the round trips rest on fail on one flipped byte, in or outside the pages."""
    c = make_controller(make_pools("page_head"), hicache_file_config)
    src = c.alloc(2)
    written = c.fill_random(src, 5)
    before = c.snapshot()
    start = c.page_starts(src)[1]
    page = c.host.get_data_page(start, flat=True).clone()
    flipped = page.view(-1).view(torch.uint8)
    flipped[7] ^= 0x40
    c.host.set_from_flat_data_page(start, page)
    assert c.read_pages(src) != written
    assert c.changed_outside(before, src[: c.page_size])
    assert not c.changed_outside(before, src)


class PagesInADict(HiCacheStorage):
    """The smallest zero-copy (``interface_v1``) backend: pages kept in a dict, copied from and
    to the registered host pool at ``host_indices[i * page_size]``. The flat-page calls fail, so
    a test using it shows the controller took the v1 path."""

    def __init__(self, storage_config: Any, kwargs: Any) -> None:
        self.pages: dict[str, Any] = {}
        self.v1_calls: list[str] = []

    def batch_set_v1(self, keys: Any, host_indices: Any, extra_info: Any = None) -> list[bool]:
        host, step = self.mem_pool_host, self.mem_pool_host.page_size
        for i, key in enumerate(keys):
            self.pages[key] = host.get_data_page(host_indices[i * step], flat=True).clone()
        self.v1_calls.append("batch_set_v1")
        return [True] * len(keys)

    def batch_get_v1(self, keys: Any, host_indices: Any, extra_info: Any = None) -> list[bool]:
        host, step = self.mem_pool_host, self.mem_pool_host.page_size
        found = []
        for i, key in enumerate(keys):
            if key in self.pages:
                host.set_from_flat_data_page(host_indices[i * step], self.pages[key])
            found.append(key in self.pages)
        self.v1_calls.append("batch_get_v1")
        return found

    def batch_exists(self, keys: Any, extra_info: Any = None) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    def exists(self, key: str) -> bool:
        return key in self.pages

    def get(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the flat-page path was taken")

    batch_get = set = batch_set = get


@pytest.mark.parametrize("kind", ["hybrid", "legacy"])
def test_the_zero_copy_path_reaches_a_dynamic_backend(
    kind: str, make_pools: Any, make_controller: Any
) -> None:
    config = {
        "backend_name": "pages-in-a-dict",
        "module_path": __name__,
        "class_name": "PagesInADict",
        "interface_v1": 1,
    }
    c = make_controller(make_pools("page_first_direct"), config, kind=kind)
    assert type(c.backend).__name__ == "PagesInADict"
    assert c.backend.mem_pool_host is c.host
    _round_trip(c, seed=6)
    assert c.backend.v1_calls == ["batch_set_v1", "batch_get_v1"]
