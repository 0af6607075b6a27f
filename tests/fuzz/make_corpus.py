"""Writes the committed seed corpora, ``tests/fuzz/corpus/<target>/``: real inputs made by the
project's own encoders (request messages, frames, Redis values, tier files, config files),
plus a few edge cases. Deterministic; run it again after a format changes:

    .venv/bin/python tests/fuzz/make_corpus.py
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _harness import chunk  # noqa: E402

CORPUS = HERE / "corpus"
ROOT = HERE.parent.parent
SEEDS: dict[str, Callable[[], dict[str, bytes]]] = {}


def seeds(fn: Callable[[], dict[str, bytes]]) -> Callable[[], dict[str, bytes]]:
    SEEDS[fn.__name__] = fn
    return fn


@seeds
def config() -> dict[str, bytes]:
    out = {f"{p.stem}.toml": p.read_bytes() for p in sorted((ROOT / "configs").glob("*.toml"))}
    out["empty.toml"] = b""
    out["sizes.toml"] = (
        b'[cpu]\ncapacity = "4GiB"\nslab_size = 1048576\n[limits]\nchunk_bytes = 65536\n'
    )
    out["bad_type.toml"] = b'[daemon]\nlease_ttl_s = "10"\n'
    out["nan.toml"] = b"[daemon]\nlease_ttl_s = nan\n"
    out["access.toml"] = (
        b'[[access]]\nname = "a"\nuids = [1000]\ntenants = ["t"]\nrole = "operator"\n'
        b'tokens = ["0123456789abcdef0123456789abcdef"]\n'
        b'[tenants.t]\ncpu_bytes = "1GiB"\n'
        b'[[codecs]]\nmodel = "*"\ncpu = "fp8"\n'
    )
    out["nested.toml"] = b"a = [[[[[[1]]]]]]\nb = {c = {d = {e = 1}}}\n"
    return out


@seeds
def resp() -> dict[str, bytes]:
    replies = {
        "ok": b"+OK\r\n",
        "int": b":12345\r\n:-1\r\n",
        "bulk": b"$5\r\nhello\r\n$0\r\n\r\n",
        "null": b"$-1\r\n*-1\r\n",
        "array": b"*3\r\n$1\r\na\r\n:5\r\n*2\r\n+x\r\n$-1\r\n",
        "error": b"-ERR wrong type\r\n-LOADING Redis is loading\r\n",
        "zpop": b"*4\r\n$32\r\n" + bytes(range(32)) + b"\r\n$1\r\n1\r\n$2\r\nab\r\n$3\r\n1.5\r\n",
    }
    out = {f"read_reply_{k}": b"\x00" + v for k, v in replies.items()}
    value = b"V" * 96 + b"P" * 64
    out["get_value"] = b"\x03" + b"$160\r\n" + value + b"\r\n"
    out["get_miss"] = b"\x03$-1\r\n"
    out["get_error"] = b"\x03-ERR x\r\n"
    out["get_wrong_length"] = b"\x03$3\r\nabc\r\n"
    out["deep"] = b"\x00" + b"*1\r\n" * 12 + b":1\r\n"
    out["huge_bulk"] = b"\x00$99999999999999\r\nabc"
    return out


@seeds
def redis_value() -> dict[str, bytes]:
    import fuzz_redis_value as target
    import torch

    from kvstore.checksum import block_checksum
    from kvstore.tiers import codecs
    from kvstore.tiers.redis_tier import tier
    from kvstore.tiers.redis_tier import value as fmt

    key, ns = target.KEY, target.NAMESPACE
    gen = torch.Generator().manual_seed(0)
    floats = torch.randn(target.FP8_FORMAT.elements, generator=gen).to(torch.bfloat16)
    blocks = {
        "bf16": floats.view(torch.uint8).numpy().tobytes(),
        "runs": bytes(i // 64 % 4 for i in range(4096)),
    }
    out = {}
    for name, data in blocks.items():
        view = memoryview(data)
        checksum = block_checksum(data, ns, key)
        for codec in ("none", "lz4", "fp8", "fp8+lz4"):
            planned = codecs.plan(codec, target.FP8_FORMAT, len(data))[0]
            for keyed in (False, True):
                mac_key = target.MAC_KEY if keyed else None
                ((head, payload),) = tier._encode_values(
                    ns, [(key, view, checksum)], [planned], target.FP8_FORMAT, mac_key
                )
                pick = (0x10 if keyed else 0) | 0x20  # length 4096, asked again by checksum
                out[f"{name}_{codec}_{'keyed' if keyed else 'plain'}"] = (
                    bytes([0, pick]) + bytes(head) + bytes(payload)
                )
        out[f"{name}_v2"] = bytes([0, 0]) + fmt.pack_header_v2(key, ns, len(data), checksum) + data
    out["fixups_short"] = bytes([0x1F, 0x03]) + fmt.pack_header(key, ns, 96, 0) + b"x" * 96
    return out


def _nvme_patches(patches: list[tuple[int, int, bytes]]) -> bytes:
    return b"".join(bytes([f]) + struct.pack("<I", off) + chunk(b) for f, off, b in patches)


@seeds
def nvme_superblock() -> dict[str, bytes]:
    import _nvme
    import fuzz_nvme_superblock as t

    from kvstore.tiers.nvme import ondisk as fmt

    geo = _nvme.GEO
    first = _nvme.RECORDS[0][0]
    old = bytearray(4096)
    fmt._OLD_SUPER.pack_into(old, 0, fmt._OLD_SUPER_MAGIC, 2, 0, 0, 0, 0, 0)
    fmt._U64.pack_into(old, fmt._OLD_SUPER.size, fmt._sum(old, fmt._OLD_SUPER.size))
    return {
        "pristine": b"",
        "meta_a_damaged": _nvme_patches([(0, 100, b"\xff" * 8)]),
        "meta_both_damaged": _nvme_patches([(0, 100, b"\xff"), (0, geo.meta_bytes + 100, b"\xff")]),
        "meta_a_newer_gen": _nvme_patches([(t.FIX_META_A, 48, struct.pack("<Q", 99))]),
        "meta_page_count": _nvme_patches([(0, 12, struct.pack("<I", 1 << 16))]),
        "meta_slab_map": _nvme_patches([(t.FIX_META_A, fmt._META.size, struct.pack("<I", 1))]),
        "meta_geometry": _nvme_patches(
            [(t.FIX_META_A | t.FIX_META_B, 24, struct.pack("<Q", 1 << 30))]
        ),
        "descriptor_damaged": _nvme_patches([(0, geo.slab_start(0) + 20, b"\x00")]),
        "descriptor_slot_size": _nvme_patches(
            [(t.FIX_DESCRIPTOR, geo.slab_start(1) + 12, struct.pack("<I", 2))]
        ),
        "all_damaged": _nvme_patches(
            [(0, 0, b"\0" * 8), (0, geo.meta_bytes, b"\0" * 8)]
            + [(0, geo.slab_start(s), b"\0" * 8) for s in range(3)]
        ),
        "truncated_tiny": _nvme_patches([(t.TRUNCATE, 8, b"")]),
        "truncated_mid": _nvme_patches([(t.TRUNCATE, first + 4096 + 100, b"")]),
        "old_superblock": _nvme_patches([(0, 0, bytes(old)), (0, geo.meta_bytes, b"\0" * 8)]),
        "header_length_2p33": _nvme_patches(
            [(t.FIX_HEADER, first + 88, struct.pack("<Q", 1 << 33))]
        ),
        "header_seq_max": _nvme_patches(
            [(t.FIX_HEADER, first + 2 * 8192 + 10, b"\xff" * 25 + b"\x00\x01")]
        ),
        "header_length_4gib": _nvme_patches(
            [(t.FIX_HEADER, first + 88, struct.pack("<Q", 0xFF003000))]
        ),
        "header_payload": _nvme_patches([(t.FIX_STORED, first + 4096, b"garbage")]),
        "tombstone_revived": _nvme_patches(
            [(t.FIX_HEADER, _nvme.GEO.data_start + 4096 + 2 * 8192 + 10, b"\x01")]
        ),
    }


@seeds
def nvme_records() -> dict[str, bytes]:
    import _nvme
    import fuzz_nvme_records as t

    out = {}
    for r in range(len(_nvme.RECORDS)):
        out[f"record{r}"] = bytes([r])
        out[f"record{r}_payload"] = (
            bytes([r])
            + bytes([t.FIX_STORED | t.FIX_HEADER])
            + struct.pack("<H", 4096 + 10)
            + chunk(b"\xaa" * 16)
        )
        out[f"record{r}_length"] = (
            bytes([r])
            + bytes([t.FIX_HEADER])
            + struct.pack("<H", 88)
            + chunk(struct.pack("<Q", 5000))
        )
        out[f"record{r}_codec"] = (
            bytes([r]) + bytes([t.FIX_HEADER]) + struct.pack("<H", 11) + chunk(b"\x01")
        )
        out[f"record{r}_v3"] = (
            bytes([r]) + bytes([t.FIX_HEADER]) + struct.pack("<H", 8) + chunk(b"\x03\x00")
        )
    return out


def _requests() -> tuple[object, dict[str, bytes]]:
    from _daemon import KEYS, LAYOUT, NS

    from kvstore.checksum import block_checksum
    from kvstore.keys import pack_keys
    from kvstore.v1 import kvstore_pb2 as pb

    keys = pack_keys(KEYS[:2])
    lay = pb.Layout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype="bfloat16")
    data = bytes([7]) * LAYOUT.block_bytes
    checksum = block_checksum(data, NS.fingerprint, KEYS[9])
    bodies = {
        "OpenNamespace": pb.OpenNamespaceRequest(model="fuzz", layout=lay),
        "OpenNamespaceOther": pb.OpenNamespaceRequest(model="other", tenant="t", layout=lay),
        "Lookup": pb.LookupRequest(keys=keys, table_keys=3, table_found=1),
        "Reserve": pb.ReserveRequest(keys=pack_keys(KEYS[8:10]), priority=1),
        "Commit": pb.CommitRequest(checksums=[1, 2], spare_wanted=1),
        "Abort": pb.AbortRequest(),
        "Bind": pb.BindRequest(keys=pack_keys(KEYS[10:11]), slots=[0], checksums=[0]),
        "Acquire": pb.AcquireRequest(keys=keys, lookup=True, table_reads=keys),
        "AcquirePrefetch": pb.AcquireRequest(keys=keys, prefetch=True),
        "Release": pb.ReleaseRequest(release_leases=[1]),
        "GetBlocks": pb.GetBlocksRequest(keys=keys),
        "Prefetch": pb.PrefetchRequest(keys=keys),
        "Delete": pb.DeleteRequest(keys=pack_keys(KEYS[8:9])),
        "Stats": pb.StatsRequest(),
        "PutBlocks": pb.PutBlocksRequest(key=KEYS[9], data=data[:2048], checksum=checksum),
        "PutBlocksRest": pb.PutBlocksRequest(data=data[2048:]),
    }
    return pb, {k: v.SerializeToString() for k, v in bodies.items()}


@seeds
def grpc_requests() -> dict[str, bytes]:
    from _daemon import FIX_CHECKSUMS, FIX_HANDLE, FIX_IDS, FIX_KEYS, encode_call

    _, b = _requests()
    h, hk = FIX_HANDLE, FIX_HANDLE | FIX_KEYS
    out = {}
    for name in ("Lookup", "Reserve", "Acquire", "GetBlocks", "Prefetch", "Delete", "Stats"):
        out[name] = encode_call(name, h, b"", [b[name]])
        out[name + "_stored_keys"] = encode_call(name, hk, b"\x00\x03", [b[name]])
    out["OpenNamespace"] = encode_call("OpenNamespace", 0, b"", [b["OpenNamespace"]])
    out["OpenNamespaceOther"] = encode_call("OpenNamespace", 0, b"", [b["OpenNamespaceOther"]])
    out["put_get"] = encode_call(
        "PutBlocks", h, b"", [b["PutBlocks"], b["PutBlocksRest"]]
    ) + encode_call("GetBlocks", hk, b"\x09\x01", [b["GetBlocks"]])
    out["reserve_commit_acquire_release"] = (
        encode_call("Reserve", hk, b"\x08\x02", [b["Reserve"]])
        + encode_call("Commit", h | FIX_IDS | FIX_CHECKSUMS, b"\x00\x00\x05", [b["Commit"]])
        + encode_call("Acquire", hk, b"\x08\x02", [b["Acquire"]])
        + encode_call("Release", h | FIX_IDS, b"", [b["Release"]])
        + encode_call("Delete", hk, b"\x08\x02", [b["Delete"]])
    )
    out["reserve_abort"] = encode_call("Reserve", hk, b"\x0a\x03", [b["Reserve"]]) + encode_call(
        "Abort", h | FIX_IDS, b"", [b["Abort"]]
    )
    out["commit_spare_bind"] = (
        encode_call("Reserve", hk, b"\x0b\x01", [b["Reserve"]])
        + encode_call("Commit", h | FIX_IDS | FIX_CHECKSUMS, b"\x00\x00\x01", [b["Commit"]])
        + encode_call("Bind", hk | FIX_IDS | FIX_CHECKSUMS, b"\x0c\x01\x03", [b["Bind"]])
    )
    out["acquire_prefetch"] = encode_call("Acquire", hk, b"\x00\x08", [b["AcquirePrefetch"]])
    out["undecodable"] = encode_call("Lookup", h, b"", [b"\xff\xff\xff"])
    return out


@seeds
def local_call() -> dict[str, bytes]:
    from _daemon import FIX_CHECKSUMS, FIX_HANDLE, FIX_IDS, FIX_KEYS, encode_frame

    from kvstore import local_calls as wire

    _, b = _requests()
    h, hk = FIX_HANDLE, FIX_HANDLE | FIX_KEYS

    def frame(name: str, body: bytes, call_id: int = 7, timeout: float = 1.0) -> bytes:
        return wire.encode_request(wire.METHOD_INDEX[name], call_id, timeout, body)

    out = {}
    for name in wire.METHODS:
        body = b.get(name, b"")
        out[name] = encode_frame(hk, b"\x00\x03", frame(name, body))
    out["reserve_commit_acquire_release"] = (
        encode_frame(hk, b"\x08\x02", frame("Reserve", b["Reserve"]))
        + encode_frame(h | FIX_IDS | FIX_CHECKSUMS, b"\x00\x00\x05", frame("Commit", b["Commit"]))
        + encode_frame(hk, b"\x08\x02", frame("Acquire", b["Acquire"]))
        + encode_frame(h | FIX_IDS, b"", frame("Release", b["Release"]))
    )
    out["bad_method"] = encode_frame(0, b"", bytes([0, 200]) + struct.pack("<If", 5, 1.0))
    out["nan_deadline"] = encode_frame(h, b"", frame("Lookup", b["Lookup"], timeout=float("nan")))
    out["inf_deadline"] = encode_frame(h, b"", frame("Lookup", b["Lookup"], timeout=float("inf")))
    out["short"] = encode_frame(0, b"", b"\x00\x01")
    out["json"] = encode_frame(0, b"", b'{"op": "map"}')
    out["undecodable_body"] = encode_frame(h, b"", frame("Acquire", b"\xff\xff\xff\x0f"))
    return out


@seeds
def session_op() -> dict[str, bytes]:
    msgs = {
        "map": {"op": "map", "slab": 1},
        "map_big": {"op": "map", "slab": 2**64 - 1},
        "map_negative": {"op": "map", "slab": -1},
        "map_bool": {"op": "map", "slab": True},
        "map_float": {"op": "map", "slab": 1.5},
        "presence": {"op": "presence", "handle": "00" * 16},
        "presence_odd": {"op": "presence", "handle": "abc"},
        "unknown": {"op": "other"},
        "list": [1, 2],
    }
    out = {k: b"\x00" + json.dumps(v).encode() for k, v in msgs.items()}
    out["real_slab"] = b"\x01"
    out["real_presence"] = b"\x03"
    out["nested"] = b"\x00" + b"[" * 50 + b"]" * 50
    out["not_utf8"] = b'\x00{"op": "\xff"}'
    return out


def main() -> None:
    import logging

    logging.disable(logging.CRITICAL)
    wanted = sys.argv[1:] or list(SEEDS)
    for name in wanted:
        folder = CORPUS / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for file, data in SEEDS[name]().items():
            (folder / file).write_bytes(data)
        total = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{name}: {len(list(folder.iterdir()))} seeds, {total} bytes")


if __name__ == "__main__":
    main()
