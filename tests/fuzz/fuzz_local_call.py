"""Fuzz target: local-call frames (``kvstore.local_calls``) as the daemon's end serves them
(``kvstore.daemon.local_calls.LocalCalls.serve``), against a real in-process store.

Contract of the wire functions, on the raw input: ``decode_request`` and ``decode_reply`` either
raise ValueError or return fields that encode back to the very frame (a method index in
``METHODS``, a deadline above zero); ``decode_error`` never raises. Contract of ``serve``
(``_daemon``), on the input cut into frames with fix-ups: every frame gets a reply frame (of at
most ``MAX_REPLY_BYTES``) for its call id, OK with a reply message that decodes, or a status
other than INTERNAL and UNKNOWN with a message; a refused call changes nothing stored; the
store's invariants hold after each input."""

from __future__ import annotations

import logging
import math

import _harness
import atheris

with atheris.instrument_imports(include=["kvstore"]):
    from kvstore import local_calls as wire

from _daemon import Daemon, cut_frames

logging.disable(logging.CRITICAL)
_daemon: Daemon | None = None


def check_wire(frame: bytes) -> None:
    try:
        method, call_id, timeout_s, body = wire.decode_request(frame)
    except ValueError:
        pass
    else:
        assert 0 <= method < len(wire.METHODS)
        assert timeout_s > 0 and not math.isnan(timeout_s)
        assert wire.encode_request(method, call_id, timeout_s, bytes(body)) == frame
    try:
        status, call_id, body = wire.decode_reply(memoryview(frame))
    except ValueError:
        pass
    else:
        assert wire.REPLY.pack(wire.MAGIC, status, call_id) + bytes(body) == frame
        name, message = wire.decode_error(body)
        assert isinstance(name, str) and isinstance(message, str)


def TestOneInput(data: bytes) -> None:
    global _daemon
    check_wire(data)
    if _daemon is None:
        _daemon = Daemon()
    _daemon.run_frames(cut_frames(data))


if __name__ == "__main__":
    _harness.main(TestOneInput)
