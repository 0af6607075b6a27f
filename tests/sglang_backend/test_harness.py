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
    flipped = page.view(-1).view(__import__("torch").uint8)
    flipped[7] ^= 0x40
    c.host.set_from_flat_data_page(start, page)
    assert c.read_pages(src) != written
    assert c.changed_outside(before, src[: c.page_size])
    assert not c.changed_outside(before, src)
