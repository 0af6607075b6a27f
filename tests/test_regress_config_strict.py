"""Regression: config values of the wrong type or out of range were accepted silently.

The loader applied bare ``bool``/``float``/``int`` converters and checked durations only with
``<= 0``: ``[auth] insecure = "false"`` read as true (``bool("false")``) and served a public
address with neither TLS nor credentials; NaN and infinite durations passed (nothing reclaimed,
a reaper that never runs, an OverflowError at start); ``drain_timeout_s = -1`` made every
graceful stop write nothing down; ``3.7`` became 3 and ``true`` one byte; and some errors named
no key or escaped as a traceback. Each bad value must now be refused with a ValueError naming
its key, ``section.key: what is wrong (got value)``, and ``kvstore serve`` must exit non-zero
with that line, never serving.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from kvstore import cli
from kvstore.config import (
    ConnectionsConfig,
    DaemonConfig,
    LimitsConfig,
    Quota,
    RedisTierConfig,
    load_config,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
HUGE_DIGITS = "1" + "0" * 400  # float() of it is inf; int(inf) raises OverflowError


def load_text(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> DaemonConfig:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return load_config(path, env={} if env is None else env)


BAD_VALUES = [
    # Booleans: only a TOML bool. The string "false" is truthy in Python.
    ('[auth]\ninsecure = "false"\n', "auth.insecure"),
    ("[auth]\ninsecure = 1\n", "auth.insecure"),
    ('[auth]\nreflection = "false"\n', "auth.reflection"),
    ('[nvme]\ndurable_puts = "false"\n', "nvme.durable_puts"),
    ('[nvme]\nwrite_through = "no"\n', "nvme.write_through"),
    ('[nvme]\ndirect_io = "false"\n', "nvme.direct_io"),
    ('[cpu]\nprefault = "false"\n', "cpu.prefault"),
    ('[redis]\nwrite_through = "false"\n', "redis.write_through"),
    # Durations: finite, and positive where zero means nothing sensible.
    ("[daemon]\ndrain_timeout_s = -1\n", "daemon.drain_timeout_s"),
    ("[daemon]\ndrain_timeout_s = 0\n", "daemon.drain_timeout_s"),
    ("[daemon]\ndrain_timeout_s = nan\n", "daemon.drain_timeout_s"),
    ("[daemon]\ndrain_timeout_s = inf\n", "daemon.drain_timeout_s"),
    ("[daemon]\nlease_ttl_s = nan\n", "daemon.lease_ttl_s"),
    ("[daemon]\nlease_ttl_s = inf\n", "daemon.lease_ttl_s"),
    ('[daemon]\nlease_ttl_s = "abc"\n', "daemon.lease_ttl_s"),
    ('[daemon]\nlease_ttl_s = "30"\n', "daemon.lease_ttl_s"),
    ("[daemon]\nreservation_ttl_s = nan\n", "daemon.reservation_ttl_s"),
    ("[daemon]\nreaper_interval_s = nan\n", "daemon.reaper_interval_s"),
    ("[daemon]\nreaper_interval_s = inf\n", "daemon.reaper_interval_s"),
    ("[limits]\nwrite_wait_s = nan\n", "limits.write_wait_s"),
    ("[limits]\nwrite_wait_s = inf\n", "limits.write_wait_s"),
    ("[limits]\npin_grace_s = nan\n", "limits.pin_grace_s"),
    ("[limits]\npin_grace_s = inf\n", "limits.pin_grace_s"),
    ("[connections]\nidle_timeout_s = nan\n", "connections.idle_timeout_s"),
    ("[connections]\nidle_timeout_s = inf\n", "connections.idle_timeout_s"),
    ("[connections]\nidle_timeout_s = 1e7\n", "connections.idle_timeout_s"),  # > gRPC's int ms
    ("[redis]\ntimeout_s = nan\n", "redis.timeout_s"),
    ("[redis]\ntimeout_s = inf\n", "redis.timeout_s"),
    ("[redis]\nttl_s = nan\n", "redis.ttl_s"),
    ("[redis]\nttl_s = inf\n", "redis.ttl_s"),
    ('[cpu]\nhigh_watermark = "0.9"\n', "cpu.high_watermark"),
    # Sizes: an int of bytes or a size string, never a bool or a float.
    ("[nvme]\ncapacity = 1.5\n", "nvme.capacity"),
    ("[cpu]\ncapacity = true\n", "cpu.capacity"),
    ("[gpu]\ncapacity = 4096.0\n", "gpu.capacity"),
    (f'[cpu]\ncapacity = "{HUGE_DIGITS}"\n', "cpu.capacity"),
    ('[daemon]\nmax_message_bytes = "8GiB"\n', "daemon.max_message_bytes"),  # > gRPC's int
    # Whole numbers: an int, never a bool, a float (3.7 became 3) or a string.
    ("[limits]\nmax_keys_per_request = 3.7\n", "limits.max_keys_per_request"),
    ("[limits]\nmax_keys_per_request = true\n", "limits.max_keys_per_request"),
    ('[limits]\nmax_keys_per_request = "lots"\n', "limits.max_keys_per_request"),
    ('[gpu]\ndevice = "1"\n', "gpu.device"),
    ("[nvme]\nio_threads = 4.0\n", "nvme.io_threads"),
    ("[connections]\nmax_connections = 2147483648\n", "connections.max_connections"),
    # Strings: a TOML string, not a number made into one.
    ("[nvme]\npath = 5\n", "nvme.path"),
    # Tenants, access rules: the same converters.
    ("[tenants.a]\nmax_leases = true\n", "tenants.a.max_leases"),
    ("[tenants.a]\nkeys_per_s = nan\n", "tenants.a.keys_per_s"),
    ("[tenants.a]\nquota_cpu = 1.5\n", "tenants.a.quota_cpu"),
    ("[tenants.a.namespace]\nmax_reservations = 2.5\n", "tenants.a.namespace.max_reservations"),
    ('[[access]]\nuids = [true]\ntenants = ["a"]\n', "access[0].uids[0]"),
    ('[[access]]\nuids = ["1001"]\ntenants = ["a"]\n', "access[0].uids[0]"),
]


def _case_id(text: str, key: str) -> str:
    value = text.rstrip("\n").rsplit("\n", 1)[-1].split("=", 1)[1].strip()
    if key.startswith("access"):
        value = text.split("uids = ", 1)[1].split("\n", 1)[0]
    return f"{key}={value[:12]}"


@pytest.mark.parametrize(("text", "key"), BAD_VALUES, ids=[_case_id(*case) for case in BAD_VALUES])
def test_a_bad_value_is_refused_naming_its_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ValueError) as err:
        load_text(tmp_path, text)
    message = str(err.value)
    assert key in message, message
    assert "(got " in message, message  # the value as it was read, to find it in the file


def test_insecure_as_a_string_false_is_refused_and_true_false_still_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"auth\.insecure: .*\(got \'false\'\)"):
        load_text(tmp_path, '[auth]\ninsecure = "false"\n')
    with pytest.raises(ValueError, match=r"auth\.insecure"):
        load_text(tmp_path, '[auth]\ninsecure = "true"\n')
    assert load_text(tmp_path, "[auth]\ninsecure = false\n").auth.insecure is False
    assert load_text(tmp_path, "[auth]\ninsecure = true\n").auth.insecure is True


def _serve_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}


def test_serve_refuses_insecure_false_string_and_never_serves(tmp_path: Path) -> None:
    """Before: it read as insecure = true and served 0.0.0.0 with neither TLS nor credentials."""
    config = tmp_path / "insecure.toml"
    config.write_text(
        '[auth]\ninsecure = "false"\n'
        '[cpu]\ncapacity = "4MiB"\nslab = "1MiB"\nprefault = false\n'
        '[gpu]\nenabled = "off"\n'
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", *("--address", "0.0.0.0:0", "--config", config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_serve_env(),
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"kvstore serve kept running (it served): {err[-2000:]}")
    assert proc.returncode != 0, err
    assert "auth.insecure" in err and "(got 'false')" in err, err
    assert "kvstore serving on" not in err + out, err
    assert "Traceback" not in err, err


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        # A size flag past a float's range: an OverflowError traceback from argparse's type.
        (["--cpu-capacity", HUGE_DIGITS], {}, "argument --cpu-capacity: size"),
        # A bad log level: a ValueError traceback before the config was read.
        (["--log-level", "bogus"], {}, "--log-level"),
        # A KVSTORE_* variable: the error names it.
        ([], {"KVSTORE_CPU_CAPACITY": "lots"}, "KVSTORE_CPU_CAPACITY"),
        ([], {"KVSTORE_CPU_CAPACITY": HUGE_DIGITS}, "KVSTORE_CPU_CAPACITY"),
    ],
)
def test_serve_reports_a_bad_flag_or_variable_in_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], words: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvstore", "serve", "--address", f"unix:{tmp_path}/k.sock", *args],
        capture_output=True,
        text=True,
        env={**_serve_env(), **env},
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert words in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "kvstore serving on" not in result.stderr, result.stderr


def test_serve_in_process_returns_2_naming_the_key(tmp_path: Path, capsys: Any) -> None:
    config = tmp_path / "c.toml"
    config.write_text("[nvme]\ncapacity = 1.5\n")  # was a TypeError traceback from parse_size
    assert cli.main(["serve", "--config", str(config)]) == 2
    assert "nvme.capacity" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda: DaemonConfig(drain_timeout_s=-1.0), "daemon.drain_timeout_s"),
        (lambda: DaemonConfig(lease_ttl_s=math.nan), "daemon.lease_ttl_s"),
        (lambda: DaemonConfig(reaper_interval_s=math.inf), "daemon.reaper_interval_s"),
        (lambda: LimitsConfig(write_wait_s=math.nan), "limits.write_wait_s"),
        (lambda: ConnectionsConfig(idle_timeout_s=math.inf), "connections.idle_timeout_s"),
        (lambda: RedisTierConfig(ttl_s=math.nan), "redis.ttl_s"),
        (lambda: Quota(keys_per_s=math.nan), "keys_per_s"),
    ],
)
def test_the_dataclasses_refuse_what_the_loader_refuses(make: Any, key: str) -> None:
    """Embedders build configs without TOML: the same bounds hold there."""
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        make()


def test_every_shipped_config_still_loads() -> None:
    """The strict converters must accept what ships: the embedded default and the examples."""
    assert load_config(env={}) == DaemonConfig()
    embedded = resources.files("kvstore.configs")
    shipped = sorted(p.name for p in embedded.iterdir() if p.name.endswith(".toml"))
    assert {"default.toml", "single-host.toml", "multi-host-redis.toml"} <= set(shipped)
    for name in shipped:
        with resources.as_file(embedded / name) as path:
            cfg = load_config(path, env={})
        assert cfg.drain_timeout_s > 0 and math.isfinite(cfg.lease_ttl_s), name
    for path in sorted(CONFIGS.glob("*.toml")):
        load_config(path, env={})
