"""kvstore's SGLang backend driven by SGLang's real cache controller (``conftest.py`` here):
its backup thread writes pages from the real host pool through ``batch_set_v1``, its prefetch
threads query ``batch_exists`` and load through ``batch_get_v1`` into other host pages, against a
real daemon, for every host layout and MLA, in ``HybridCacheController`` (what SGLang 0.5.23
servers run) and ``HiCacheController``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonProcess

from .conftest import HAVE_SGLANG, MHA_LAYOUTS, MLA_LAYOUTS, kvstore_config

if not HAVE_SGLANG:
    pytest.skip("needs SGLang (make sglang-env)", allow_module_level=True)


CASES = [("mha", lay, "hybrid") for lay in MHA_LAYOUTS] + [
    ("mla", lay, "hybrid") for lay in MLA_LAYOUTS
]
CASES += [("mha", "page_first", "legacy"), ("mla", "layer_first", "legacy")]


@pytest.mark.parametrize("kind,layout,controller", CASES)
def test_backed_up_pages_come_back_bit_exact_through_prefetch(
    daemon: DaemonProcess,
    make_pools: Any,
    make_controller: Any,
    kind: str,
    layout: str,
    controller: str,
) -> None:
    from kvstore.integrations.sglang import KVStoreHiCacheStorage

    pools = make_pools(layout, mla=kind == "mla")
    c = make_controller(
        pools,
        kvstore_config(daemon.address),
        kind=controller,
        model_name=f"ctl-{kind}-{layout}-{controller}",
    )
    assert type(c.backend) is KVStoreHiCacheStorage
    ps = c.page_size
    tokens = [1000 + 7 * i for i in range(3 * ps)]
    src = c.alloc(3)
    written = c.fill_random(src, seed=len(layout) + len(controller))
    assert c.backup(src, tokens) == 3 * ps

    before = c.snapshot()
    got = c.prefetch(tokens + [5] * ps)  # a fourth page that was never stored
    assert got.hit_tokens == 3 * ps
    assert got.completed_tokens == 3 * ps
    assert set(c.page_starts(got.host_indices)).isdisjoint(c.page_starts(src))
    assert c.read_pages(got.host_indices) == written
    assert not c.changed_outside(before, got.host_indices)
    counters = c.backend.counters()
    assert counters["pages_written"] == 3 and counters["hits"] == 3


def test_a_new_controller_finds_what_the_last_one_backed_up(
    daemon: DaemonProcess, make_pools: Any, make_controller: Any
) -> None:
    tokens = list(range(500, 500 + 8))
    first = make_controller(make_pools("page_first"), kvstore_config(daemon.address))
    src = first.alloc(len(tokens) // first.page_size)
    written = first.fill_random(src, seed=42)
    assert first.backup(src, tokens) == len(tokens)
    first.close()

    second = make_controller(make_pools("page_first"), kvstore_config(daemon.address))
    got = second.prefetch(tokens)
    assert got.completed_tokens == len(tokens)
    assert second.read_pages(got.host_indices) == written


def test_tp_ranks_and_a_daemon_that_is_down_through_the_controller(
    tmp_path: Path, make_pools: Any, make_controller: Any
) -> None:
    """A controller whose daemon is not there: backups report nothing written, prefetches
    find nothing, and its threads keep running (the next backup still gets its ack)."""
    config = kvstore_config(f"unix:{tmp_path / 'none.sock'}")
    config.update(timeout_s=0.5, retry_after_s=0)
    c = make_controller(make_pools("page_first"), config)
    tokens = list(range(900, 908))
    src = c.alloc(len(tokens) // c.page_size)
    c.fill_random(src, seed=1)
    assert c.backup(src, tokens) == 0
    assert c.prefetch(tokens).hit_tokens == 0
    assert c.backup(src, tokens) == 0
