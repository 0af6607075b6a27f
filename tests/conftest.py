"""Test harness: real daemon processes on temporary unix sockets.

``daemon_factory(**config)`` starts ``python -m kvstore serve`` with a config file written for
the test and waits until its health check answers; every daemon is stopped (SIGTERM, then
SIGKILL) and its socket directory removed when the test ends. A daemon given a Redis tier is
keyed with the session's secret (``redis_mac_key_file``) unless the test passes its own, None,
or ``redis_allow_unkeyed=True``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import torch
from hypothesis import settings
from redis_binary import NOT_INSTALLED, redis_server_binary

from kvstore import KVLayout
from kvstore.client._common import wait_for_daemon

# Every run takes each property test's same examples (a test that fails by chance blocks every
# landing; CI may not say it is CI); KVSTORE_EXPLORE=1 explores new ones, to look for bugs.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile("explore" if os.environ.get("KVSTORE_EXPLORE") else "ci")

SMALL_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16)
"""8 KiB bf16 blocks: fast tests that still exercise every shape dimension."""


def random_blocks(layout: KVLayout, n: int, seed: int = 0) -> torch.Tensor:
    """Random blocks of ``layout``; for any dtype, including float8, via random bytes."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, layout.block_bytes), dtype=torch.uint8, generator=g)
    if layout.dtype.is_floating_point and layout.itemsize >= 2:
        # Avoid NaN payloads so tensors compare equal by value as well as by bytes.
        values = torch.randn((n, *layout.block_shape), generator=g)
        return values.to(layout.dtype)
    return raw.view(layout.dtype).reshape(n, *layout.block_shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def wait_healthy(
    address: str, timeout_s: float = 120.0, proc: subprocess.Popen | None = None
) -> None:
    # A hang guard, not a speed check: on two busy cores a daemon's start (imports, tier
    # recovery) has taken over 30 s.
    wait_for_daemon(address, timeout_s, proc)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (made here): a real filesystem that fills up.
    Needs root (mount): the test is skipped without it."""
    path.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def tokens(n_blocks: int, offset: int = 0, block_size: int = 16) -> list[int]:
    """Token ids of ``n_blocks`` full blocks starting at ``offset``."""
    return list(range(offset, offset + n_blocks * block_size))


def tiers(kv) -> dict:
    """The daemon's tier stats by name."""
    return {t.name: t for t in kv.stats().tiers}


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def smaps_kib(field: str, start: int, end: int | None = None) -> int:
    """``field`` (``Rss``, ``ShmemPmdMapped``) in KiB of this process's mapping that starts at
    ``start``, or with ``end``, summed over its mappings inside ``[start, end)`` (an arena's
    header and slab files). AssertionError when no mapping is there."""
    total, inside, seen = 0, False, 0
    with open("/proc/self/smaps", encoding="ascii") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo == start if end is None else start <= lo and hi <= end
                seen += inside
            elif inside and head == f"{field}:":
                total += int(line.split()[1])
    assert seen, (
        f"no mapping at {start:#x}" if end is None else f"no mapping in [{start:#x}, {end:#x})"
    )
    return total


@dataclass
class DaemonProcess:
    """A real ``kvstore serve`` process owned by a test."""

    directory: Path
    config_text: str
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def socket_path(self) -> Path:
        return self.directory / "kv.sock"

    @property
    def address(self) -> str:
        return f"unix:{self.socket_path}"

    def start(self) -> DaemonProcess:
        config = self.directory / "daemon.toml"
        config.write_text(self.config_text)
        self.log = open(self.directory / "daemon.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstore",
                "serve",
                "--address",
                self.address,
                "--config",
                str(config),
                *self.extra_args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_healthy(self.address, proc=self.proc)
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def logs(self) -> str:
        return (self.directory / "daemon.log").read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def config_toml(
    cpu_capacity: str = "16MiB",
    redis_url: str | None = None,
    redis_mac_key_file: str | Path | None = None,
    redis_allow_unkeyed: bool = False,
    slab: str = "1MiB",
    policy: str = "lru",
    lease_ttl_s: float = 30.0,
    reservation_ttl_s: float = 30.0,
    reaper_interval_s: float = 0.2,
    high_watermark: float = 0.9,
    nvme_path: str | Path | None = None,
    nvme_capacity: str = "1MiB",
    nvme_codec: str = "none",
    write_through: bool = False,
    gpu: str = "off",
    gpu_capacity: str = "64MiB",
    gpu_high_watermark: float = 0.8,
    extra: str = "",
) -> str:
    # The GPU tier is off unless a test asks for it: on a CUDA host every other daemon of the
    # suite would otherwise make a device pool (and a CUDA context) it does not use.
    text = f"""
[daemon]
lease_ttl_s = {lease_ttl_s}
reservation_ttl_s = {reservation_ttl_s}
reaper_interval_s = {reaper_interval_s}

[gpu]
enabled = "{gpu}"
capacity = "{gpu_capacity}"
slab = "{slab}"
high_watermark = {gpu_high_watermark}

[cpu]
capacity = "{cpu_capacity}"
slab = "{slab}"
policy = "{policy}"
high_watermark = {high_watermark}
"""
    if redis_url is not None:
        text += f"""
[redis]
url = "{redis_url}"
timeout_s = 0.5
"""
        if redis_mac_key_file is not None:
            text += f'mac_key_file = "{redis_mac_key_file}"\n'
        if redis_allow_unkeyed:
            text += "allow_unkeyed = true\n"
    if nvme_path is not None:
        text += f"""
[nvme]
path = "{nvme_path}"
capacity = "{nvme_capacity}"
codec = "{nvme_codec}"
write_through = {"true" if write_through else "false"}
"""
    return text + extra


SUITE_REDIS_SECRET = "the test suite's redis mac secret, shared by its daemons\n"


@pytest.fixture(scope="session")
def redis_mac_key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A secret file (mode 0600) every daemon of the session shares unless a test says
    otherwise: a daemon with a Redis tier and no secret refuses to start, and daemons sharing a
    Redis read each other's values only with the same secret."""
    path = Path(tmp_path_factory.mktemp("redis-secret")) / "redis.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(SUITE_REDIS_SECRET)
    return path


def keyed_by_default(kwargs: dict[str, object], secret: Path) -> dict[str, object]:
    """``config_toml`` keyword arguments with the suite's Redis secret where a test gives a
    Redis tier but neither a secret of its own (``redis_mac_key_file``, None for none) nor
    ``redis_allow_unkeyed``."""
    if (
        kwargs.get("redis_url") is not None
        and "redis_mac_key_file" not in kwargs
        and not kwargs.get("redis_allow_unkeyed")
    ):
        return {**kwargs, "redis_mac_key_file": secret}
    return kwargs


@pytest.fixture
def daemon_factory(tmp_path_factory: pytest.TempPathFactory, redis_mac_key_file: Path) -> Iterator:
    started: list[DaemonProcess] = []

    def start(**kwargs: object) -> DaemonProcess:
        # Short paths: a unix socket path must fit in 108 bytes.
        directory = Path(tmp_path_factory.mktemp("kvd", numbered=True))
        kwargs = keyed_by_default(kwargs, redis_mac_key_file)
        d = DaemonProcess(directory, config_toml(**kwargs))  # type: ignore[arg-type]
        started.append(d)
        return d.start()

    yield start
    for d in started:
        if d.alive():
            d.stop()


@pytest.fixture
def open_daemon_factory(redis_mac_key_file: Path) -> Iterator:
    """Like ``daemon_factory``, for tests whose clients run under other uids: the daemon's
    directory is under a /tmp directory others may traverse (pytest's are owner-only)."""
    started: list[tuple[DaemonProcess, Path]] = []

    def start(**kwargs: object) -> DaemonProcess:
        base = Path(tempfile.mkdtemp(prefix="kvopen-", dir="/tmp"))
        base.chmod(0o711)
        kwargs = keyed_by_default(kwargs, redis_mac_key_file)
        d = DaemonProcess(base / "d", config_toml(**kwargs))  # type: ignore[arg-type]
        d.directory.mkdir()
        started.append((d, base))
        return d.start()

    yield start
    for d, base in started:
        if d.alive():
            d.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    return daemon_factory()


@pytest.fixture(autouse=True)
def _short_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    # Keep socket paths short and out of the user's runtime dir.
    monkeypatch.delenv("KVSTORE_ADDRESS", raising=False)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


@dataclass
class RedisProcess:
    """A real ``redis-server`` on a unix socket (no TCP port, no persistence)."""

    directory: Path
    proc: subprocess.Popen | None = None

    @property
    def socket_path(self) -> Path:
        return self.directory / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self) -> RedisProcess:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError(NOT_INSTALLED)
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                "0",
                "--unixsocket",
                str(self.socket_path),
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(200):
            if self.socket_path.exists():
                return self
            time.sleep(0.025)
        raise RuntimeError("redis-server did not create its socket")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.socket_path.exists():
            self.socket_path.unlink()

    def cli(self, *args: str) -> str:
        """One command's reply as ``redis-cli`` prints it to a pipe (the dev extra's server
        comes without ``redis-cli``, so redis-py sends it)."""
        with redis.Redis(unix_socket_path=str(self.socket_path), protocol=2) as client:
            reply = client.execute_command(*args)
        return (reply.decode() if isinstance(reply, bytes) else str(reply)) + "\n"


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    if redis_server_binary() is None:
        pytest.skip(NOT_INSTALLED)
    server = RedisProcess(Path(tmp_path_factory.mktemp("redis"))).start()
    yield server
    server.stop()


def smollm2_missing() -> str | None:
    """Why SmolLM2-135M cannot be loaded here, or None."""
    import importlib.util

    for module in ("transformers", "gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            return (
                f"the package {module!r} is not installed "
                "(make setup installs it: pip install -e '.[model]')"
            )
    from kvstore.models import find_smollm2

    try:
        find_smollm2()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def smollm2_fp32() -> tuple:
    """(model, tokenizer) of SmolLM2-135M-Instruct in float32, loaded once per test session
    (loading takes 15-30 s here); tests only read it."""
    missing = smollm2_missing()
    if missing is not None:
        pytest.skip(f"needs SmolLM2-135M: {missing}")
    from kvstore.models import load_smollm2

    return load_smollm2(torch.float32)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run a module's model code on one torch thread. Two OpenMP threads spin-waiting against
    the daemon and other processes on these 2-core VMs made small forward passes 5-15x slower
    (measured); results are compared within one process, so they are identical either way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def kv_channel(kv):
    """A raw gRPC channel to ``kv``'s daemon whose calls carry ``kv``'s credentials (its
    session): raw stubs then act as that client, and may use its handle."""
    from kvstore.client._common import call_metadata, make_channel

    return make_channel(
        kv.address, kv._credentials, lambda: call_metadata(kv._credentials, kv._session)
    )
