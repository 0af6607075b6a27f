"""A TLS endpoint in front of a plain Redis server, for the TLS tests on a server built without
TLS (the dev extra's ``valkey-server``, tests/redis_binary.py).

``TlsTerminator`` listens on a free TCP port of 127.0.0.1 and does the server's side of every
TLS handshake with Python's ``ssl`` module, as ``redis-server --tls-port N --tls-auth-clients
no`` does: the certificate chain it is given, TLS 1.2 and 1.3 only (Redis's default
``tls-protocols``), no client certificate asked for. A connection whose handshake fails is
closed, as Redis closes it; one whose handshake succeeds gets its own connection to the server's
unix socket, and bytes are relayed both ways until either side closes, when both are closed. So
the server sees one client for each TLS connection, for as long as it lasts.

It runs its own event loop on a thread of the test process (the tests block their own loop with
redis-py calls); ``start`` returns once it listens and ``stop`` closes the listener and every
relayed connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
from pathlib import Path


class TlsTerminator:
    """Owns its thread, its event loop, the listening socket and every relayed connection.
    ``start`` and ``stop`` are called from the test's thread; everything else runs on the
    terminator's loop."""

    def __init__(self, cert: Path, key: Path, backend_socket: Path) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.load_cert_chain(cert, key)
        self.backend_socket = backend_socket
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._relays: set[asyncio.Task[None]] = set()

    def start(self) -> TlsTerminator:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(
            self._relay, "127.0.0.1", 0, ssl=self.context, ssl_handshake_timeout=10
        )

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._relays):
            task.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """One TLS connection (already past its handshake) to one server connection."""
        task = asyncio.current_task()
        assert task is not None
        self._relays.add(task)
        writers = [client_w]
        try:
            server_r, server_w = await asyncio.open_unix_connection(self.backend_socket)
            writers.append(server_w)
            pumps = [
                asyncio.create_task(_pump(client_r, server_w)),
                asyncio.create_task(_pump(server_r, client_w)),
            ]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except OSError:
            pass  # the server is gone: the client sees its connection closed
        finally:
            for w in writers:
                w.close()
            for w in writers:
                with contextlib.suppress(OSError, ssl.SSLError):
                    await asyncio.wait_for(w.wait_closed(), 5)
            self._relays.discard(task)


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Bytes from ``src`` to ``dst`` until ``src`` ends or either side fails."""
    with contextlib.suppress(OSError, ssl.SSLError):
        while data := await src.read(1 << 16):
            dst.write(data)
            await dst.drain()
