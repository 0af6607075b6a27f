"""The tiers' sections: ``[gpu]``, ``[cpu]``, ``[nvme]``, ``[redis]``, and the per-namespace
codec rules of the tiers below the CPU tier (``[[codecs]]``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.config.checks import check_finite

POLICIES = ("lru", "priority", "prefix")


@dataclass(frozen=True)
class CpuTierConfig:
    capacity_bytes: int = 2 << 30
    slab_bytes: int = 64 << 20
    prefault: bool = True
    policy: str = "lru"
    # Background write-back keeps at least (1 - high_watermark) of the tier free or clean
    # (already on the tier below), so a put rarely waits for a demotion.
    high_watermark: float = 0.9

    def __post_init__(self) -> None:
        check_finite("cpu.high_watermark", self.high_watermark)
        if self.capacity_bytes <= 0:
            raise ValueError(f"cpu capacity must be positive, got {self.capacity_bytes}")
        if self.slab_bytes <= 0:
            raise ValueError(f"cpu slab size must be positive, got {self.slab_bytes}")
        if self.policy not in POLICIES:
            raise ValueError(f"cpu policy {self.policy!r} unknown; choose one of {POLICIES}")
        if not 0.0 < self.high_watermark <= 1.0:
            raise ValueError(f"cpu high_watermark must be in (0, 1], got {self.high_watermark}")


CODECS = ("none", "lz4", "fp8", "fp8+lz4")
"""Codecs of the tiers below the CPU tier (``kvstore.tiers.codecs``); the fp8 ones are lossy."""
LOSSY_CODECS = ("fp8", "fp8+lz4")


@dataclass(frozen=True)
class NvmeTierConfig:
    """The local-disk tier. Off unless ``path`` is set."""

    path: str = ""
    capacity_bytes: int = 16 << 30
    codec: str = "none"
    write_through: bool = False
    # True: a put is acknowledged only once its blocks are on disk and fdatasync'd (it then
    # survives kill -9 and power loss); False: a put is acknowledged once it is in memory.
    durable_puts: bool = False
    direct_io: bool = True
    io_threads: int = 4
    policy: str = "lru"

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"nvme capacity must be positive, got {self.capacity_bytes}")
        if self.codec not in CODECS:
            raise ValueError(f"nvme codec {self.codec!r} unknown; choose one of {CODECS}")
        if self.policy not in POLICIES:
            raise ValueError(f"nvme policy {self.policy!r} unknown; choose one of {POLICIES}")
        if self.io_threads <= 0:
            raise ValueError(f"nvme io_threads must be positive, got {self.io_threads}")


@dataclass(frozen=True)
class RedisTierConfig:
    """The tier shared by every host's daemon. Off unless ``url`` is set."""

    url: str = ""
    timeout_s: float = 0.5
    # True: every put is written to Redis at once (what sharing across hosts needs); False:
    # blocks reach Redis when they leave the last local tier.
    write_through: bool = True
    ttl_s: float = 0.0  # 0: no expiry
    max_bytes_per_namespace: int = 0  # 0: no per-namespace bound (use Redis's maxmemory)
    key_prefix: str = "kvs"
    codec: str = "none"  # of the values this host writes; [[codecs]] overrides per namespace
    # A file holding a secret shared by every daemon of the Redis (``kvstore redis-secret``
    # writes one): values carry a keyed MAC and only values with a right one are read.
    mac_key_file: str = ""
    # Serve a Redis tier without a secret: xxh3 checksums only, which anyone who can write to
    # Redis can compute, so every host would serve their forged blocks. Off: such a daemon
    # refuses to start (``check_keyed``); on: it starts with a warning.
    allow_unkeyed: bool = False

    @property
    def keyed(self) -> bool:
        return bool(self.mac_key_file)

    def check_keyed(self) -> None:
        """Refuse a Redis tier without a MAC secret unless the operator allowed it. Checked once
        every layer (file, ``KVSTORE_*``, flags) is applied: any of them may add the secret."""
        if self.url and not self.mac_key_file and not self.allow_unkeyed:
            raise ValueError(
                "redis.mac_key_file is not set: without a secret anyone who can write to this "
                "Redis can make every host serve forged KV blocks. Run `kvstore redis-secret "
                "PATH` once, copy the file to every host and set redis.mac_key_file = PATH "
                "(--redis-mac-key-file, KVSTORE_REDIS_MAC_KEY_FILE), or accept the risk with "
                "redis.allow_unkeyed = true (--redis-allow-unkeyed, KVSTORE_REDIS_ALLOW_UNKEYED)"
            )

    def __post_init__(self) -> None:
        if self.allow_unkeyed and self.mac_key_file:
            # A keyed daemon reads keyed values only: "allow unkeyed" would not do what it says
            # (read old unkeyed values during a move to a secret), so the pair is a mistake.
            raise ValueError(
                "redis.allow_unkeyed = true and redis.mac_key_file both set: a daemon with a "
                "secret writes and reads keyed values only; drop allow_unkeyed"
            )
        if self.codec not in CODECS:
            raise ValueError(f"redis codec {self.codec!r} unknown; choose one of {CODECS}")
        check_finite("redis.timeout_s", self.timeout_s)
        check_finite("redis.ttl_s", self.ttl_s)
        if self.timeout_s <= 0:
            raise ValueError(f"redis timeout_s must be positive, got {self.timeout_s}")
        if self.ttl_s < 0 or self.max_bytes_per_namespace < 0:
            raise ValueError("redis ttl_s and max_bytes_per_namespace must be >= 0")


@dataclass(frozen=True)
class CodecRule:
    """``[[codecs]]``: the codecs of the namespaces whose model and tenant match (an empty
    ``model`` or ``tenant`` matches any) in the NVMe and Redis tiers; an empty codec keeps that
    tier's default (``nvme.codec``, ``redis.codec``). The first matching rule applies. A lossy
    codec (fp8) applies only where an operator names it here or as a tier's default.

    ``cpu = "fp8"`` (opt-in; default lossless) lets the matching namespaces' CPU-tier entries
    hold the fp8 payload of a block instead of the block: slots of ~0.5x, filled by the
    writer (on the GPU path by the quantizing gather kernel, so only the payload crosses PCIe)
    and written down to NVMe as they are. Every reader gets the block's deterministic fp8 form.
    It needs the NVMe tier to keep that form (an ``nvme`` codec of fp8 or fp8+lz4) and is not
    built for the Redis tier (the daemon refuses such a configuration) nor the GPU pool (such
    a namespace's blocks stay in the CPU arena)."""

    model: str = ""
    tenant: str = ""
    nvme: str = ""
    redis: str = ""
    cpu: str = ""

    def __post_init__(self) -> None:
        if self.cpu not in CPU_CODECS:
            raise ValueError(
                f"codecs rule (model {self.model!r}, tenant {self.tenant!r}): cpu codec "
                f"{self.cpu!r} unknown; choose one of {CPU_CODECS}"
            )
        for tier in ("nvme", "redis"):
            codec = getattr(self, tier)
            if codec and codec not in CODECS:
                raise ValueError(
                    f"codecs rule (model {self.model!r}, tenant {self.tenant!r}): {tier} codec "
                    f"{codec!r} unknown; choose one of {CODECS}"
                )

    def matches(self, model: str, tenant: str) -> bool:
        return self.model in ("", model) and self.tenant in ("", tenant)


CPU_CODECS = ("", "none", "fp8")
"""What a ``[[codecs]]`` rule's ``cpu`` may name ("" and "none": the block itself)."""

GPU_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class GpuTierConfig:
    """The device-memory tier, shared with workers on the same GPU through CUDA IPC.

    ``enabled``: "auto" turns it on where torch sees a CUDA device and CuPy is installed (and
    off elsewhere, silently); "on" makes a daemon without them refuse to start; "off" never.
    """

    enabled: str = "auto"
    device: int = 0
    capacity_bytes: int = 4 << 30
    slab_bytes: int = 256 << 20
    policy: str = "lru"
    # Background write-back keeps at least (1 - high_watermark) of the pool free or clean
    # (already in the CPU tier or below), so a worker's offload rarely waits for PCIe.
    high_watermark: float = 0.8

    def __post_init__(self) -> None:
        if self.enabled not in GPU_MODES:
            raise ValueError(f"gpu enabled {self.enabled!r} unknown; choose one of {GPU_MODES}")
        check_finite("gpu.high_watermark", self.high_watermark)
        if self.device < 0:
            raise ValueError(f"gpu device must be >= 0, got {self.device}")
        if self.capacity_bytes <= 0:
            raise ValueError(f"gpu capacity must be positive, got {self.capacity_bytes}")
        if self.slab_bytes <= 0:
            raise ValueError(f"gpu slab size must be positive, got {self.slab_bytes}")
        if self.policy not in POLICIES:
            raise ValueError(f"gpu policy {self.policy!r} unknown; choose one of {POLICIES}")
        if not 0.0 < self.high_watermark <= 1.0:
            raise ValueError(f"gpu high_watermark must be in (0, 1], got {self.high_watermark}")
