"""Keys and layouts: the encoding is pinned by known answers, so a change to it cannot slip by."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvstore import KVLayout, Namespace, block_hashes
from kvstore.keys import pack_keys, unpack_keys

LLAMA3_8B = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)
NS = Namespace(model="meta-llama/Llama-3-8B", layout=LLAMA3_8B)

# Known answers for hash version 1. Changing them breaks every stored key of every fleet.
SEED_HEX = "04ea4c44cb46cfd5644a18c649610ee84f5abe3c7f52c32ab59b6940577bc431"
FINGERPRINT_HEX = "f9a6c1ccf106991d2b230d0df7e2ddf3"
KEYS_0_TO_39 = [
    "30fb05eaab1ac0a2c01d0d4359ad131ac79ab0505bb80fab9c724ab61ce2ede8",
    "c64bac2985eede84df5563cd9f7a7bbb8be133fe6e5df3e951320317158d5725",
]


def test_layout_shape_and_bytes() -> None:
    assert LLAMA3_8B.block_shape == (32, 2, 16, 8, 128)
    assert LLAMA3_8B.block_bytes == 2 << 20  # 2 MiB per 16-token block, 128 KiB per token
    assert LLAMA3_8B.bytes_per_token == 128 << 10
    fp8 = KVLayout(32, 8, 128, 16, torch.float8_e4m3fn)
    assert fp8.block_bytes == 1 << 20  # FP8 halves a block


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_layers": 0}, "num_layers"),
        ({"head_dim": -1}, "head_dim"),
        ({"block_size": 2.5}, "block_size"),
        ({"dtype": torch.int64}, "unsupported dtype"),
    ],
)
def test_layout_rejects_bad_values(kwargs: dict, message: str) -> None:
    args = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        KVLayout(**args)


def test_seed_and_fingerprint_known_answers() -> None:
    assert NS.seed.hex() == SEED_HEX
    assert NS.fingerprint.hex() == FINGERPRINT_HEX


def test_seed_follows_documented_encoding() -> None:
    fields = ["meta-llama/Llama-3-8B", "", "", "bfloat16", 32, 8, 128, 16, 0, 1, 1]
    enc = b"kvstore.ns.v1"
    for f in fields:
        data = str(f).encode()
        enc += struct.pack("<I", len(data)) + data
    assert hashlib.sha256(enc).digest() == NS.seed


def test_block_keys_known_answers_and_chain() -> None:
    keys = block_hashes(NS.seed, list(range(40)), 16)
    assert [k.hex() for k in keys] == KEYS_0_TO_39  # only the 2 full blocks get keys
    h1 = hashlib.sha256(NS.seed + np.arange(16, dtype="<i8").tobytes()).digest()
    h2 = hashlib.sha256(h1 + np.arange(16, 32, dtype="<i8").tobytes()).digest()
    assert keys == [h1, h2]


def test_inputs_of_every_kind_give_the_same_keys() -> None:
    ids = list(range(100, 164))
    a = block_hashes(NS.seed, ids)
    assert a == block_hashes(NS.seed, np.array(ids, dtype=np.int32))
    assert a == block_hashes(NS.seed, torch.tensor(ids))


def test_key_names_the_whole_prefix() -> None:
    base = list(range(64))
    other = [*base[:16], 999, *base[17:]]
    a, b = block_hashes(NS.seed, base), block_hashes(NS.seed, other)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))  # a change poisons the rest


def test_namespaces_never_share_keys() -> None:
    ids = list(range(32))
    variants = [
        NS,
        Namespace(model="meta-llama/Llama-3-8B", layout=LLAMA3_8B, tenant="acme"),
        Namespace(model="meta-llama/Llama-3-8B", layout=LLAMA3_8B, revision="v2"),
        Namespace(model="meta-llama/Llama-3-8B", layout=LLAMA3_8B, tp_rank=1, tp_size=2),
        Namespace(
            model="meta-llama/Llama-3-8B",
            layout=KVLayout(32, 8, 128, 16, torch.float8_e4m3fn),
        ),
    ]
    first_keys = {block_hashes(ns.seed, ids)[0] for ns in variants}
    assert len(first_keys) == len(variants)
    assert len({ns.fingerprint for ns in variants}) == len(variants)


def test_extra_keys_change_keys() -> None:
    ids = list(range(32))
    plain = block_hashes(NS.seed, ids)
    lora = block_hashes(NS.seed, ids, extra_keys=[b"lora:7", b"lora:7"])
    assert plain[0] != lora[0]
    with pytest.raises(ValueError, match="extra_keys"):
        block_hashes(NS.seed, ids, extra_keys=[b"x"])


def test_keys_are_the_same_in_another_process() -> None:
    code = (
        "from kvstore import KVLayout, Namespace, block_hashes;"
        "ns=Namespace(model='meta-llama/Llama-3-8B', layout=KVLayout(32,8,128,16));"
        "print(block_hashes(ns.seed, list(range(40)))[1].hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345"},
    ).stdout.strip()
    assert out == KEYS_0_TO_39[1]


def test_pack_and_unpack_validate_lengths() -> None:
    keys = block_hashes(NS.seed, list(range(48)))
    assert unpack_keys(pack_keys(keys)) == keys
    with pytest.raises(ValueError, match="key 1 must be 32 bytes"):
        pack_keys([keys[0], b"short"])
    with pytest.raises(ValueError, match="multiple of 32"):
        unpack_keys(b"x" * 33)


def test_pack_keys_takes_bytes_like_keys_of_32_bytes_and_names_any_other() -> None:
    # The fast check is one join and the set of lengths: a key of 32 items that is not 32
    # bytes (a 32-element uint16 array: 64 bytes), even beside one that makes the total come
    # out right, is still refused by its index; so are a str and a missing key.
    keys = block_hashes(NS.seed, list(range(32)))
    packed = pack_keys([bytearray(keys[0]), memoryview(keys[1])])
    assert packed == keys[0] + keys[1]
    wide = np.frombuffer(keys[0] + keys[1], dtype=np.uint16)  # 32 items, 64 bytes
    with pytest.raises(ValueError, match="key 0 must be 32 bytes, got ndarray"):
        pack_keys([wide, b""])
    with pytest.raises(ValueError, match="key 1 must be 32 bytes, got str"):
        pack_keys([keys[0], "x" * 32])
    with pytest.raises(ValueError, match="key 0 must be 32 bytes, got NoneType"):
        pack_keys([None])
    assert pack_keys([]) == b""


def test_bad_token_ids_raise() -> None:
    with pytest.raises(ValueError, match="1-D"):
        block_hashes(NS.seed, [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="integers"):
        block_hashes(NS.seed, [0.5] * 16)
    with pytest.raises(ValueError, match="seed"):
        block_hashes(b"short", list(range(16)))
