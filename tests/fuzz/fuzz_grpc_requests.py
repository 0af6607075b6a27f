"""Fuzz target: every request message the gRPC servicer decodes (``kvstore.daemon.service``),
through its own request decoders and handlers, against a real in-process store.

An input is a few calls (``_daemon.cut_calls``): any RPC of ``kvstore.v1.KVStore``, unary or
streaming, with fuzzed serialized messages and fix-ups that let them reach past the handle and
id checks. Contract (``_daemon``): answered, or refused with a clear status (never INTERNAL or
UNKNOWN), a refusal changes nothing stored, and the store's invariants hold after each input.

Handlers are called directly, with the context local calls use (``LocalContext``), rather
than through a grpc.aio server on a socket: the bytes meet the same decoder and handler, at
about a hundred times the rate."""

from __future__ import annotations

import logging

import _harness
from _daemon import Daemon, cut_calls

logging.disable(logging.CRITICAL)  # refusals are logged (rate-limited); not the point here
_daemon: Daemon | None = None


def TestOneInput(data: bytes) -> None:
    global _daemon
    if _daemon is None:
        _daemon = Daemon()
    _daemon.run(cut_calls(data))


if __name__ == "__main__":
    _harness.main(TestOneInput)
