"""The ``kvstore`` command: ``serve`` runs the daemon, ``stat`` shows tier occupancy, ``hash``
prints the keys of a token sequence so operators can check them against an engine's,
``redis-secret`` writes the secret every daemon sharing a Redis keys its values with.

Every command that talks to a daemon takes ``--address``; sizes are written ``512MiB``, ``4GiB``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import secrets
import sys
from collections.abc import Sequence
from typing import Any

from kvstore.address import default_address
from kvstore.stats_table import render_stats, stats_to_dict
from kvstore.units import parse_size


def _size(text: str) -> int:
    """A size flag (``4GiB``): argparse reports a bad one as a usage error naming the flag."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    except OverflowError:  # digits past a float's range
        raise argparse.ArgumentTypeError(f"size {text!r} is too large") from None


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=None,
        help="daemon address: unix:/path.sock or host:port (default: $KVSTORE_ADDRESS, "
        "else the user's runtime-directory socket)",
    )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvstore", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    _add_address(serve)
    serve.add_argument("--config", help="TOML config file (default: the embedded default)")
    serve.add_argument("--cpu-capacity", type=_size, help="size of the CPU tier, e.g. 4GiB")
    serve.add_argument("--cpu-policy", choices=("lru", "priority", "prefix"))
    serve.add_argument("--nvme-path", help="directory for the NVMe tier's slab files (enables it)")
    serve.add_argument("--nvme-capacity", type=_size, help="size of the NVMe tier, e.g. 64GiB")
    serve.add_argument(
        "--nvme-codec",
        choices=("none", "lz4", "fp8", "fp8+lz4"),
        help="default codec on disk (fp8 ones are lossy); [[codecs]] in the config per namespace",
    )
    serve.add_argument(
        "--write-through", action="store_true", help="write every put to the NVMe tier at once"
    )
    serve.add_argument(
        "--redis-url",
        help="shared tier: redis://host:port/db, rediss://, unix:///path.sock, redis+cluster://",
    )
    serve.add_argument(
        "--redis-mac-key-file",
        metavar="PATH",
        help="the secret shared by every daemon of the Redis (kvstore redis-secret PATH writes "
        "one); a Redis tier needs it unless --redis-allow-unkeyed",
    )
    serve.add_argument(
        "--redis-allow-unkeyed",
        action="store_true",
        help="run a Redis tier without a secret: anyone who can write to Redis can then make "
        "every host serve forged blocks (logged at start)",
    )
    serve.add_argument(
        "--gpu",
        choices=("auto", "on", "off"),
        help="GPU tier: auto (on where CUDA and CuPy are), on (refuse to start without), off",
    )
    serve.add_argument("--gpu-capacity", type=_size, help="size of the GPU tier, e.g. 8GiB")
    serve.add_argument("--gpu-device", type=int, help="CUDA device of the GPU tier")
    serve.add_argument(
        "--metrics-address",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (and /healthz), e.g. "
        "127.0.0.1:9464; empty: off (default: $KVSTORE_METRICS_ADDRESS, else off)",
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback TCP address without TLS and credentials (logged at start)",
    )
    serve.add_argument("--log-level", default="WARNING")

    stat = sub.add_parser("stat", help="tier occupancy, hits, evictions")
    _add_address(stat)
    stat.add_argument("--json", action="store_true", help="machine-readable output")
    stat.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")

    secret = sub.add_parser(
        "redis-secret",
        help="write a new secret for redis.mac_key_file (32 random bytes, hex, mode 0600)",
    )
    secret.add_argument("path", metavar="PATH", help="the file to create")
    secret.add_argument(
        "--force",
        action="store_true",
        help="replace an existing file (a rotation: values keyed with the old secret become "
        "misses on every host given the new one)",
    )

    sub.add_parser(
        "demo",
        help="start a daemon and serve a multi-tenant chat workload with a real model through it"
        " (--synthetic: a model-free workload)",
        add_help=False,
    )

    chk = sub.add_parser(
        "check",
        help="verify an NVMe tier directory against its records (daemon stopped); reads only,"
        " unless --fix",
    )
    chk.add_argument("--nvme-path", required=True)
    chk.add_argument(
        "--nvme-capacity",
        type=_size,
        required=True,
        help="the tier's configured capacity; a file of another size is an error, never changed",
    )
    chk.add_argument(
        "--nvme-slab-bytes",
        type=_size,
        default=None,
        help="the tier's slab size, if not the default (the daemon uses the default)",
    )
    chk.add_argument(
        "--fix",
        action="store_true",
        help="open read-write: repair damaged metadata, free corrupt, torn and orphan records",
    )
    chk.add_argument("--json", action="store_true")

    hsh = sub.add_parser("hash", help="print the block keys of a token sequence")
    hsh.add_argument("--model", required=True)
    hsh.add_argument("--revision", default="")
    hsh.add_argument("--tenant", default="")
    hsh.add_argument("--layers", type=int, required=True)
    hsh.add_argument("--kv-heads", type=int, required=True)
    hsh.add_argument("--head-dim", type=int, required=True)
    hsh.add_argument("--block-size", type=int, default=16)
    hsh.add_argument("--dtype", default="bfloat16")
    hsh.add_argument("--tp-rank", type=int, default=0)
    hsh.add_argument("--tp-size", type=int, default=1)
    hsh.add_argument(
        "tokens", nargs="*", help="token ids (comma or space separated); read from stdin if none"
    )
    return parser.parse_args(argv)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvstore.config import load_config
    from kvstore.daemon.server import print_ready, run_daemon

    try:
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    except ValueError as exc:  # "Unknown level: 'BOGUS'"
        print(f"kvstore serve: --log-level: {exc}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config)
        cpu = cfg.cpu
        if args.cpu_capacity is not None:
            cpu = dataclasses.replace(cpu, capacity_bytes=args.cpu_capacity)
        if args.cpu_policy is not None:
            cpu = dataclasses.replace(cpu, policy=args.cpu_policy)
        nvme = cfg.nvme
        if args.nvme_path is not None:
            nvme = dataclasses.replace(nvme, path=args.nvme_path)
        if args.nvme_capacity is not None:
            nvme = dataclasses.replace(nvme, capacity_bytes=args.nvme_capacity)
        if args.nvme_codec is not None:
            nvme = dataclasses.replace(nvme, codec=args.nvme_codec)
        if args.write_through:
            nvme = dataclasses.replace(nvme, write_through=True)
        redis = cfg.redis
        if args.redis_url is not None:
            redis = dataclasses.replace(redis, url=args.redis_url)
        if args.redis_mac_key_file is not None:
            redis = dataclasses.replace(redis, mac_key_file=args.redis_mac_key_file)
        if args.redis_allow_unkeyed:
            redis = dataclasses.replace(redis, allow_unkeyed=True)
        redis.check_keyed()  # every layer applied: file, KVSTORE_* and flags
        gpu = cfg.gpu
        if args.gpu is not None:
            gpu = dataclasses.replace(gpu, enabled=args.gpu)
        if args.gpu_capacity is not None:
            gpu = dataclasses.replace(gpu, capacity_bytes=args.gpu_capacity)
        if args.gpu_device is not None:
            gpu = dataclasses.replace(gpu, device=args.gpu_device)
        metrics_address = cfg.metrics_address
        if args.metrics_address is not None:
            metrics_address = args.metrics_address
        auth = cfg.auth
        if args.insecure:
            auth = dataclasses.replace(auth, insecure=True)
        cfg = dataclasses.replace(
            cfg,
            auth=auth,
            gpu=gpu,
            cpu=cpu,
            nvme=nvme,
            redis=redis,
            address=args.address or cfg.address,
            metrics_address=metrics_address,
        )
    except (OSError, ValueError, TypeError, OverflowError) as exc:
        # A bad value in the file, a KVSTORE_* variable or a flag: one line naming it, no
        # traceback, and nothing served (config.py names the key; TypeError and OverflowError
        # only in case a check there missed one).
        print(f"kvstore serve: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run_daemon(cfg, on_ready=print_ready))
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"kvstore serve: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    import grpc

    from kvstore.client._common import (
        Credentials,
        call_metadata,
        make_channel,
        open_session,
        translate_error,
    )
    from kvstore.errors import KVStoreError
    from kvstore.v1 import kvstore_pb2 as pb
    from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

    address = args.address or default_address()
    credentials = Credentials.resolve()
    try:
        # On the unix socket the kernel vouches for this process (a session); over TCP the
        # token or certificate in KVSTORE_TOKEN / KVSTORE_TLS_* does.
        session = open_session(address, args.timeout)
    except KVStoreError as exc:
        print(f"kvstore stat: {address}: {exc}", file=sys.stderr)
        return 1
    try:
        with make_channel(address, credentials, lambda: call_metadata(credentials, session)) as ch:
            reply = pb_grpc.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"kvstore stat: {address}: {translate_error(err)}", file=sys.stderr)
        return 1
    finally:
        if session is not None:
            session.close()
    d = stats_to_dict(reply)
    print(json.dumps(d, indent=2) if args.json else render_stats(d))
    return 0


def cmd_hash(args: argparse.Namespace) -> int:
    from kvstore.keys import Namespace, block_hashes
    from kvstore.layout import KVLayout, dtype_from_name

    text = " ".join(args.tokens) if args.tokens else sys.stdin.read()
    try:
        tokens = [int(t) for t in text.replace(",", " ").split()]
        layout = KVLayout(
            args.layers, args.kv_heads, args.head_dim, args.block_size, dtype_from_name(args.dtype)
        )
        ns = Namespace(
            model=args.model,
            layout=layout,
            revision=args.revision,
            tenant=args.tenant,
            tp_rank=args.tp_rank,
            tp_size=args.tp_size,
        )
    except ValueError as exc:
        print(f"kvstore hash: {exc}", file=sys.stderr)
        return 2
    print(f"# namespace {ns.name}  seed {ns.seed.hex()}")
    for i, key in enumerate(block_hashes(ns.seed, tokens, layout.block_size)):
        print(f"{i}\t{key.hex()}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Without ``--fix`` the file is opened read-only and nothing is written. A file of another
    geometry, of another format version, or missing is an error (exit 2), never formatted."""
    from kvstore.tiers.nvme import NvmeTier

    async def run() -> Any:
        slab = {} if args.nvme_slab_bytes is None else {"slab_bytes": args.nvme_slab_bytes}
        tier = NvmeTier(args.nvme_path, args.nvme_capacity, direct_io=False, **slab)
        await tier.open(read_only=not args.fix, create=False)
        try:
            return tier.check(fix=args.fix)
        finally:
            await tier.close()

    try:
        report = asyncio.run(run())
    except (OSError, ValueError, RuntimeError) as exc:  # NvmeFormatError is a ValueError
        print(f"kvstore check: {exc}", file=sys.stderr)
        return 2
    data = report if isinstance(report, dict) else dataclasses.asdict(report)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        for key, value in data.items():
            print(f"{key:<24} {value}")
    problems = sum(len(v) if isinstance(v, list) else 0 for v in data.values())
    return 0 if problems == 0 or args.fix else 1


SECRET_BYTES = 32


def cmd_redis_secret(args: argparse.Namespace) -> int:
    """Write ``SECRET_BYTES`` random bytes as hex (what ``redis.mac_key_file`` reads: the text
    is the secret) to a new file of mode 0600. An existing file is left alone unless
    ``--force``: replacing a secret hosts still use makes every value they wrote a miss."""
    path = os.path.abspath(args.path)
    text = (secrets.token_hex(SECRET_BYTES) + "\n").encode()
    try:
        if args.force:
            # A new file beside it, renamed over it: never a half-written secret, and the old
            # file's mode and owner are not inherited.
            tmp = f"{path}.tmp-{os.getpid()}"
            _write_new(tmp, text)
            try:
                os.replace(tmp, path)
            except OSError:
                os.unlink(tmp)
                raise
        else:
            _write_new(path, text)
    except FileExistsError:
        print(
            f"kvstore redis-secret: {path} exists; pass --force to replace it (every host must "
            "then get the new file: values keyed with the old secret become misses)",
            file=sys.stderr,
        )
        return 2
    except OSError as exc:
        print(f"kvstore redis-secret: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote a new Redis MAC secret to {path} (mode 0600).\n"
        "Copy this same file to every host whose daemon shares the Redis, readable only by the "
        "daemon's user, and set in each daemon's config:\n\n"
        f"    [redis]\n    mac_key_file = {json.dumps(path)}\n\n"
        f"(or kvstore serve --redis-mac-key-file {path}, or KVSTORE_REDIS_MAC_KEY_FILE={path})."
    )
    return 0


def _write_new(path: str, data: bytes) -> None:
    """Create ``path`` (never an existing file or a link's target), mode 0600, holding ``data``
    on disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        from kvstore.chat_demo import main as demo_main

        return demo_main(argv[1:])
    args = _parse_args(argv)
    handler = {
        "serve": cmd_serve,
        "stat": cmd_stat,
        "hash": cmd_hash,
        "check": cmd_check,
        "redis-secret": cmd_redis_secret,
    }[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
