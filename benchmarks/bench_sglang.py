"""kvstore as SGLang's HiCache L3 backend, beside SGLang's own ``HiCacheFile``, on the same pages.

Runs in ``.venv-sglang`` (``make sglang-env``: SGLang 0.5.23, CPU only). Both backends are made
by SGLang's own factory (``StorageBackendFactory.create_backend``: ``"dynamic"`` with kvstore's
extra config, ``"file"`` for ``HiCacheFile`` in a temp dir) over one real SGLang host pool
(``MHATokenToKVPool`` on ``cpu`` and its ``MHATokenToKVPoolHost``, ``pin_memory=False``), and
are driven as SGLang's cache controller drives them:

* kvstore through the zero-copy calls (``"interface_v1": 1``): ``batch_set_v1`` of a batch of
  pages from the host pool, ``batch_get_v1`` into other host pages;
* ``HiCacheFile`` (no v1 calls) through the controller's generic path: ``batch_set`` of
  ``get_data_page(i)`` per page, ``batch_get`` into ``get_dummy_flat_data_page()`` buffers
  then ``set_from_flat_data_page``;
* ``batch_exists`` of a batch of stored keys (the prefetch thread's query).

Per host layout (``page_first``, the layout the zero-copy path suits, and ``layer_first``):
pages/s and GB/s each way and the ``batch_exists`` latency, medians over the rounds, both
backends in the same run, interleaved round by round; every page read back is compared with
what was written. Writes always store new keys (each round writes a fresh batch, deleted after
the round so the next one writes into the slots it freed: a long-running server's steady state,
where the daemon evicts to make room). Two untimed batches first touch those slots (a process's
first write into a slot also maps the slab and faults its pages in): reported on their own as
"first write". The memcpy row is a single-thread ``np.copyto`` of the same bytes between
preallocated buffers, the limit of one copy; kvstore's ratio to it says how close its one copy
each way comes.

``--smoke``: tiny pages, two rounds; figures mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import KVStoreDaemon, Reporter, emit, expect, parse_args, print_header, run_main, skip

VENV = ".venv-sglang"  # the environment this script runs in (make sglang-env)
SMOKE_TIMEOUT_S = 600
LAYOUTS = ("page_first", "layer_first")
RATES = ("kv_set", "kv_get", "file_set", "file_get")


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 7, quick 3)")


def _torchvision_ops() -> None:
    """The PyPI torchvision wheel fails to import under CPU torch unless its op schemas exist;
    SGLang imports it, HiCache never calls them."""
    import torch

    try:
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _torchvision_ops.lib = lib  # type: ignore[attr-defined]  # keep it alive
    except RuntimeError:
        pass  # defined already (torchvision's own, or an earlier call)


def _host_pool(layout: str, shape: dict[str, int]) -> Any:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    dev = MHATokenToKVPool(
        shape["tokens"],
        shape["page"],
        torch.bfloat16,
        shape["heads"],
        shape["dim"],
        shape["layers"],
        "cpu",
        False,
    )
    info = dev.get_device_pool_infos()[0].buffer_info
    return get_mha_host_pool_cls(info)(
        info,
        2.0,
        0,
        shape["page"],
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev.size,
        start_layer=dev.start_layer,
        end_layer=dev.end_layer,
    )


def _backend(name: str, extra: dict[str, Any], pool: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=pool.layout == "page_first",
        model_name="bench-model",
        extra_config=extra,
    )
    backend = StorageBackendFactory.create_backend(name, config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def _keys(tag: str, n: int) -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


def _indices(pool: Any, first_page: int, n: int) -> Any:
    import torch

    start = first_page * pool.page_size
    return torch.arange(start, start + n * pool.page_size, dtype=torch.int64)


def _file_set(backend: Any, pool: Any, keys: list[str], idx: Any) -> bool:
    ps = pool.page_size
    data = [pool.get_data_page(int(idx[i * ps])) for i in range(len(keys))]
    return bool(backend.batch_set(keys, data))


def _file_get(backend: Any, pool: Any, keys: list[str], idx: Any) -> int:
    ps = pool.page_size
    dummies = [pool.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get(keys, dummies)
    n = 0
    for i, page in enumerate(got):
        if page is None:
            break
        pool.set_from_flat_data_page(int(idx[i * ps]), page)
        n += 1
    return n


def _same(pool: Any, src: Any, dst: Any, n: int) -> bool:
    """Whether host pages ``dst`` hold the bytes of pages ``src``."""
    import torch

    ps = pool.page_size

    def page(idx: Any, i: int) -> Any:
        return pool.get_data_page(int(idx[i * ps])).contiguous().view(torch.uint8)

    return all(torch.equal(page(src, i), page(dst, i)) for i in range(n))


def _wipe(pool: Any, idx: Any, n: int) -> None:
    """Zero host pages ``idx`` (so a read that copies nothing cannot pass)."""
    zeros = pool.get_dummy_flat_data_page()
    for i in range(n):
        pool.set_from_flat_data_page(int(idx[i * pool.page_size]), zeros)


def _measure(layout: str, shape: dict[str, int], rounds: int, address: str, tmp: str) -> dict:
    import numpy as np
    import torch

    pool = _host_pool(layout, shape)
    batch = shape["batch"]
    page_bytes = pool.get_data_page(0, flat=True).numel() * 2
    expect(pool.page_num >= 2 * batch + 1, "host pool too small for two batches")
    gen = torch.Generator().manual_seed(7)
    pool.kv_buffer.view(torch.int16).copy_(
        torch.randint(-(2**15), 2**15, pool.kv_buffer.shape, generator=gen, dtype=torch.int16)
    )
    src, dst = _indices(pool, 1, batch), _indices(pool, 1 + batch, batch)
    extra = {
        "backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang",
        "class_name": "KVStoreHiCacheStorage",
        "interface_v1": 1,
        "address": address,
    }
    kv = _backend("dynamic", extra, pool)
    fdir = os.path.join(tmp, f"hicache-{layout}")
    hf = _backend("file", {"file_storage_path": fdir}, pool)
    times: dict[str, list[float]] = {
        k: [] for k in ("kv_set", "kv_get", "kv_exists", "file_set", "file_get", "file_exists")
    }

    def timed(name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        out = fn()
        times[name].append(time.perf_counter() - t0)
        return out

    # A long-running server writes into slots the daemon's arena has handed out before (it
    # evicts to make room): its steady state. The first write into a slot this process has
    # never touched also maps the slab and faults its pages in; measured once, on its own.
    warm = [_keys(f"{layout}/warm/{r}", batch) for r in range(2)]
    first = []
    for keys in warm:
        t0 = time.perf_counter()
        expect(all(kv.batch_set_v1(keys, src)), "kvstore warm-up write failed")
        first.append(time.perf_counter() - t0)
    for keys in warm:
        kv.delete(keys)

    for r in range(rounds):
        keys = _keys(f"{layout}/{r}", batch)
        ok = timed("kv_set", lambda k=keys: kv.batch_set_v1(k, src))
        expect(all(ok), f"kvstore batch_set_v1 stored {sum(ok)} of {batch}")
        _wipe(pool, dst, batch)
        got = timed("kv_get", lambda k=keys: kv.batch_get_v1(k, dst))
        expect(all(got), f"kvstore batch_get_v1 found {sum(got)} of {batch}")
        expect(_same(pool, src, dst, batch), "kvstore returned other bytes")
        n = timed("kv_exists", lambda k=keys: kv.batch_exists(k))
        expect(n == batch, f"kvstore batch_exists {n} of {batch}")

        ok2 = timed("file_set", lambda k=keys: _file_set(hf, pool, k, src))
        expect(ok2, "HiCacheFile batch_set failed")
        _wipe(pool, dst, batch)
        n = timed("file_get", lambda k=keys: _file_get(hf, pool, k, dst))
        expect(n == batch, f"HiCacheFile batch_get found {n} of {batch}")
        expect(_same(pool, src, dst, batch), "HiCacheFile returned other bytes")
        n = timed("file_exists", lambda k=keys: hf.batch_exists(k))
        expect(n == batch, f"HiCacheFile batch_exists {n} of {batch}")
        kv.delete(keys)  # its slots go to the next round's writes

    a = np.random.default_rng(1).integers(0, 255, batch * page_bytes, dtype=np.uint8)
    b = np.empty_like(a)
    memcpy = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(b, a)
        memcpy.append(time.perf_counter() - t0)
    kv.close()
    shutil.rmtree(fdir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    med["memcpy"] = statistics.median(memcpy)
    med["kv_first_set"] = statistics.median(first)
    nbytes = batch * page_bytes
    return {
        "layout": layout,
        "page_bytes": page_bytes,
        "batch_pages": batch,
        "median_s": med,
        "pages_per_s": {k: batch / med[k] for k in ("kv_set", "kv_get", "file_set", "file_get")},
        "gbps": {k: nbytes / med[k] / 1e9 for k in (*RATES, "memcpy", "kv_first_set")},
        "exists_us": {"kvstore": med["kv_exists"] * 1e6, "HiCacheFile": med["file_exists"] * 1e6},
        "kv_vs_memcpy": {
            "set": med["memcpy"] / med["kv_set"],
            "get": med["memcpy"] / med["kv_get"],
        },
        "kv_vs_file": {
            "set": med["file_set"] / med["kv_set"],
            "get": med["file_get"] / med["kv_get"],
            "exists": med["file_exists"] / med["kv_exists"],
        },
    }


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], _options)
    if importlib.util.find_spec("sglang") is None:
        return skip(args, "module:sglang", "runs in .venv-sglang (make sglang-env)")
    _torchvision_ops()
    print_header("bench_sglang", args)
    if args.smoke:
        shape = {"layers": 2, "heads": 2, "dim": 16, "page": 4, "batch": 8, "tokens": 256}
    elif args.quick:
        shape = {"layers": 8, "heads": 8, "dim": 128, "page": 16, "batch": 64, "tokens": 4096}
    else:
        shape = {"layers": 8, "heads": 8, "dim": 128, "page": 16, "batch": 128, "tokens": 4096}
    rounds = args.rounds or (2 if args.smoke else 3 if args.quick else 7)
    page_bytes = 2 * shape["layers"] * shape["page"] * shape["heads"] * shape["dim"] * 2
    capacity = max(64 << 20, 4 * shape["batch"] * page_bytes)
    report = Reporter(args.json)
    results = []
    tmp = tempfile.mkdtemp(prefix="kvbench-sglang-")
    try:
        with KVStoreDaemon(capacity) as daemon:
            for layout in LAYOUTS:
                results.append(_measure(layout, shape, rounds, daemon.address, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for r in results:
        p, g = r["pages_per_s"], r["gbps"]
        rows.append(
            [
                r["layout"],
                f"{p['kv_set']:.0f} ({g['kv_set']:.2f})",
                f"{p['file_set']:.0f} ({g['file_set']:.2f})",
                f"{p['kv_get']:.0f} ({g['kv_get']:.2f})",
                f"{p['file_get']:.0f} ({g['file_get']:.2f})",
                f"{r['exists_us']['kvstore']:.0f}",
                f"{r['exists_us']['HiCacheFile']:.0f}",
                f"{r['kv_vs_memcpy']['set']:.2f} / {r['kv_vs_memcpy']['get']:.2f}",
                f"{g['kv_first_set']:.2f}",
            ]
        )
    report.table(
        f"pages/s (GB/s), batches of {shape['batch']} pages of {results[0]['page_bytes']} bytes, "
        f"medians of {rounds} rounds",
        [
            "layout",
            "kvstore set",
            "HiCacheFile set",
            "kvstore get",
            "HiCacheFile get",
            "kvstore exists us",
            "HiCacheFile exists us",
            "kvstore/memcpy set/get",
            "kvstore first-write GB/s",
        ],
        rows,
    )
    emit({"shape": shape, "rounds": rounds, "results": results}, args)
    return 0


if __name__ == "__main__":
    run_main(main)
