"""What every fuzz target shares: starting libFuzzer (atheris) on a ``TestOneInput``, and the
small binary reader the structure-aware targets cut their input with.

A target is a script, ``python tests/fuzz/fuzz_<name>.py [libFuzzer flags] [corpus dirs]``:
libFuzzer runs ``TestOneInput`` on each input; any exception that escapes it is a crash (its
input is written where ``-artifact_prefix`` says). A target asserts the contract of the parser
it feeds (a clear error of the documented type, or a correct answer), not only that nothing
crashed. ``tests/fuzz/run.py`` runs them (``make fuzz``, ``tests/test_fuzz.py``)."""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable

import atheris


def main(test_one_input: Callable[[bytes], None]) -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


class Cut:
    """Reads an input front to back; past its end every read yields zeros (an input is never
    refused for being short, so every prefix of an input is one too)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out + bytes(n - len(out))

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int(struct.unpack("<H", self.take(2))[0])

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def chunk(self, limit: int) -> bytes:
        """A u16-length-prefixed piece of at most ``limit`` bytes (shorter at the input's end)."""
        n = min(self.u16(), limit)
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def rest(self) -> bytes:
        out = self.data[self.pos :]
        self.pos = len(self.data)
        return out

    @property
    def left(self) -> int:
        return max(0, len(self.data) - self.pos)


def chunk(data: bytes) -> bytes:
    """The encoding ``Cut.chunk`` reads (seed corpora)."""
    return struct.pack("<H", len(data)) + data
