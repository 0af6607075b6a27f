"""KV events a router can use, through vLLM's own publisher: a real engine with the connector
and ``--kv-events-config`` publishing on ZMQ, a subscriber decoding the batches with vLLM's own
event classes, and a daemon whose small CPU tier evicts most of what the workload stores. The
index the subscriber builds (block hash -> media) must be what the daemon holds, block for
block: evictions are told, not only stores."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here (make vllm-env)", allow_module_level=True)

from conftest import DaemonProcess, config_toml

from .harness import BLOCK, Engine, prompt
from .harness import engine_spec as base_spec

PROMPTS = 24
PROMPT_TOKENS = 640  # 20 blocks each: 480 blocks stored into a tier that holds 64


class Subscriber:
    """Decodes vLLM's published batches (``KVEventBatch``) into hash -> media, on a thread.
    It binds ``endpoint`` (vLLM's publisher connects to an address without a wildcard)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:*") -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.index: dict[object, set[str]] = {}
        self.counts: dict[str, int] = {}
        self.errors: list[str] = []
        self.stored: dict[object, tuple] = {}  # hash -> (parent, tokens, block size, locality)
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            try:
                batch = self._decoder.decode(payload)
            except Exception as exc:  # reported by the test
                self.errors.append(repr(exc))
                continue
            with self.lock:
                for event in batch.events:
                    name = type(event).__name__
                    medium = getattr(event, "medium", None)
                    self.counts[f"{name}:{medium}"] = self.counts.get(f"{name}:{medium}", 0) + 1
                    if isinstance(event, AllBlocksCleared):
                        self.index.clear()
                    elif isinstance(event, BlockStored):
                        for h in event.block_hashes:
                            self.index.setdefault(h, set()).add(event.medium)
                        if event.medium == "CPU":
                            self.stored[event.block_hashes[0]] = (
                                event.parent_block_hash,
                                list(event.token_ids),
                                event.block_size,
                                getattr(event, "locality", "LOCAL"),
                            )
                    elif isinstance(event, BlockRemoved):
                        for h in event.block_hashes:
                            media = self.index.get(h, set())
                            media.discard(event.medium)
                            if not media:
                                self.index.pop(h, None)

    def store_index(self) -> dict[bytes, set[str]]:
        """What the subscriber believes the store holds: blocks in the store's media."""
        with self.lock:
            return {
                h: m & {"CPU", "STORAGE"}  # type: ignore[misc]
                for h, m in self.index.items()
                if m & {"CPU", "STORAGE"}
            }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        self._ctx.term()


def _published_hash_to_key(prompts: list[list[int]]) -> dict[object, tuple]:
    """vLLM's block hash of every full block of ``prompts``, as its events publish it ->
    (the connector's store key of that block, what its BlockStored must say: parent hash,
    token ids, block size, locality)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu

    from kvstore.integrations.vllm import store_key

    kcu.init_none_hash(sha256)
    out: dict[object, tuple] = {}
    for tokens in prompts:
        parent = None
        for i in range(len(tokens) // BLOCK):
            block = tokens[i * BLOCK : (i + 1) * BLOCK]
            published_parent = None if parent is None else kcu.maybe_convert_block_hash(parent)
            parent = kcu.hash_block_tokens(sha256, parent, block)
            out[kcu.maybe_convert_block_hash(parent)] = (
                store_key(parent),
                (published_parent, block, BLOCK, "LOCAL"),
            )
    return out


def test_a_routers_index_from_vllm_events_is_what_the_daemon_holds(
    model: Path, work: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import torch

    from kvstore.client.sync import KVStoreClient
    from kvstore.layout import KVLayout

    daemon = DaemonProcess(
        Path(tmp_path_factory.mktemp("kvd-events")), config_toml(cpu_capacity="8MiB")
    ).start()
    subscriber = Subscriber()
    try:
        prompts = [{"ids": prompt(PROMPT_TOKENS, seed=500 + i)} for i in range(PROMPTS)]
        connector = {"address": daemon.address, "timeout_s": 20, "lookup_timeout_s": 20}
        phases = [
            {"prompts": prompts, "max_tokens": 2},
            # Saves finish after their requests: wait, then step the engine so the events of
            # the last commits and evictions are published.
            {"sleep_s": 3, "prompts": [{"ids": prompt(8, seed=1)}], "max_tokens": 2},
            {"sleep_s": 1, "prompts": [{"ids": prompt(8, seed=2)}], "max_tokens": 2},
        ]
        spec = base_spec(model, connector, phases, kv_events=subscriber.endpoint)
        Engine(spec, work, "events").result()

        told = subscriber.store_index()
        assert not subscriber.errors, subscriber.errors[:3]
        # The daemon's own picture of the engine's namespace: the snapshot a fresh watch opens
        # with (built from its index, not from the stream of changes).
        layout = KVLayout(4, 2, 64, BLOCK, dtype=torch.float32)
        with KVStoreClient(daemon.address, layout=layout, model="probe") as probe:
            names = [ns.name for ns in probe.stats().namespaces if "vllm-cpu" in ns.name]
            evictions = sum(t.evictions for t in probe.stats().tiers)
        assert len(names) == 1, names
        revision = names[0].split("@", 1)[1].rsplit("/", 1)[0]
        view = KVStoreClient(daemon.address, layout=layout, model=str(model), revision=revision)
        with view, view.watch_blocks() as watch:
            first = next(iter(watch))
        held = {key: tiers for key, tiers in first.blocks if tiers}
        assert evictions > 100, "the workload did not force eviction"
        assert 0 < len(held) < PROMPTS * PROMPT_TOKENS // BLOCK
        # The published hashes are vLLM's own (as its events publish them: 64-bit ints by
        # default), so a router matches them with the engine's GPU blocks.
        truth = _published_hash_to_key([p["ids"] for p in prompts])
        assert set(told) <= set(truth), "a published hash is not one of vLLM's block hashes"
        assert {truth[h][0]: m for h, m in told.items()} == {key: {"CPU"} for key in held}, (
            subscriber.counts
        )
        # Each store names its block as vLLM does: parent hash, token ids, size, locality. (A
        # block stored and evicted between two engine steps is told neither: events are states.)
        assert len(subscriber.stored) >= len(held)
        assert all(subscriber.stored[h] == truth[h][1] for h in subscriber.stored)
        # Evictions were told (a block evicted before its store was told is told neither).
        assert subscriber.counts.get("BlockRemoved:CPU", 0) > 0
        assert not any(k.startswith("AllBlocksCleared") for k in subscriber.counts)
    finally:
        subscriber.close()
        daemon.stop()


def test_the_relay_tells_tier_moves_resets_and_only_its_own_blocks() -> None:
    from types import SimpleNamespace

    from kvstore.client.block_watch import BlockEvents
    from kvstore.integrations.vllm.events import EventRelay

    relay = EventRelay(block_size=BLOCK, max_infos=2)
    info = {
        k: SimpleNamespace(block_hash=i, parent=None, tokens=[i], lora=None, extra_keys=None)
        for i, k in enumerate((b"a" * 32, b"b" * 32, b"c" * 32))
    }
    a, b, c = info
    for key in (a, b):
        relay.remember(key, info[key], "t")

    def told(*blocks: tuple[bytes, set[str]], reset: bool = False) -> list[tuple]:
        relay.push("t", BlockEvents(reset, [(k, frozenset(t)) for k, t in blocks], 0))
        return [
            (type(e).__name__, e.block_hashes[0], e.medium, getattr(e, "locality", None))
            for e in relay.take()
        ]

    assert told((a, {"cpu"}), (c, {"cpu"})) == [("BlockStored", 0, "CPU", "LOCAL")]  # c: not ours
    # Written to disk, then dropped from memory: a store in STORAGE, a removal from CPU.
    assert told((a, {"cpu", "nvme"})) == [("BlockStored", 0, "STORAGE", "LOCAL")]
    assert told((a, {"nvme", "redis"})) == [
        ("BlockStored", 0, "STORAGE", "REMOTE"),
        ("BlockRemoved", 0, "CPU", "LOCAL"),
    ]
    assert told((b, {"cpu"})) == [("BlockStored", 1, "CPU", "LOCAL")]
    # A reset (the watch fell behind, or the daemon restarted): the difference is told,
    # removals included, and no AllBlocksCleared (it would wipe the engine's GPU blocks too).
    assert told((b, {"cpu"}), reset=True) == [
        ("BlockRemoved", 0, "STORAGE", "LOCAL"),
        ("BlockRemoved", 0, "STORAGE", "REMOTE"),
    ]
    assert told((b, set())) == [("BlockRemoved", 1, "CPU", "LOCAL")]
    assert told((b, {"cpu"})) == []  # gone and forgotten: never told again without a save


def test_the_relay_holds_a_bounded_backlog_and_tells_blocks_remembered_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regressions: an idle engine's relay queued every batch of a busy namespace without
    bound; a block the daemon told of before the scheduler remembered it (a load of a block
    stored before this engine started) was never told."""
    from types import SimpleNamespace

    from kvstore.client.block_watch import BlockEvents
    from kvstore.integrations.vllm import events as events_module
    from kvstore.integrations.vllm.events import EventRelay

    monkeypatch.setattr(events_module, "MAX_PENDING_CHANGES", 4)
    dropped: list[int] = []
    relay = EventRelay(block_size=BLOCK, max_infos=8, on_dropped=dropped.append)

    def info(i: int) -> SimpleNamespace:
        return SimpleNamespace(block_hash=i, parent=None, tokens=[i], lora=None, extra_keys=None)

    def batch(keys: range, tiers: set[str], reset: bool = False) -> BlockEvents:
        return BlockEvents(reset, [(bytes([k]) * 32, frozenset(tiers)) for k in keys], 0)

    # Another engine's blocks, changed over and over while this one takes nothing.
    assert relay.push("t", batch(range(3), {"cpu"}))
    assert relay.push("t", batch(range(3), {"cpu", "nvme"}))  # the same blocks: kept once
    assert not relay.push("t", batch(range(3, 9), {"cpu"}))  # past the bound: watch again
    assert not relay.push("t", batch(range(9, 12), {"cpu"}))  # waits for the snapshot
    assert relay.push("t", batch(range(0, 2), {"cpu"}, reset=True))
    assert relay.push("t", batch(range(20, 24), {"cpu"}))  # joins the snapshot that waits
    assert relay.take() == []  # none of them this engine's
    # Block 1 was told before this engine remembered it: told once remembered.
    relay.remember(bytes([1]) * 32, info(1), "t")
    told = relay.take()
    assert [(type(e).__name__, e.block_hashes[0], e.medium) for e in told] == [
        ("BlockStored", 1, "CPU")
    ]
    relay.remember(bytes([1]) * 32, info(1), "t")  # remembered again (a second load)
    assert relay.take() == [] and dropped == []  # nothing told twice, nothing counted lost
