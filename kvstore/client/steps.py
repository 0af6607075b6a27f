"""The steps a client core operation (``kvstore.client.core``) yields for its face to perform,
each answered with its result:

- ``Call(method, build)``: call the daemon (``build()`` makes the request, again on a retry
  after the face reopened the namespace); the result is the reply;
- ``Fetch(build, consume)``: a ``GetBlocks`` stream whose messages go to ``consume`` until it
  returns False;
- ``Post(method, build)``: send a call without waiting for its reply; the result is a token
  for ``Settle(token)``, whose result is that reply (``kvstore.client.posted_puts``);
- ``Blocking(fn, nbytes, thread)``: work that may block (a copy, a kernel launch and its wait):
  the blocking face runs it in place; the asyncio face runs it on its loop when it is a small
  copy, else in a worker thread with the caller's CUDA stream current.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore.v1 import kvstore_pb2 as pb

R = TypeVar("R")


@dataclass(frozen=True)
class Call:
    method: str  # a kvstore.v1.KVStore method name
    build: Callable[[], Any]


@dataclass(frozen=True)
class Fetch:
    build: Callable[[], pb.GetBlocksRequest]
    consume: Callable[[pb.BlockData], bool]


@dataclass(frozen=True)
class Blocking:
    fn: Callable[[], Any]
    nbytes: int = 0  # bytes the work copies (the asyncio face copies small batches inline)
    thread: bool = False  # the asyncio face runs it in a worker thread, whatever its size
    stream: Any = None  # the caller's CUDA stream, current wherever ``fn`` runs


@dataclass(frozen=True)
class Post:
    method: str  # a local call's method name
    build: Callable[[], Any]


@dataclass(frozen=True)
class Settle:
    token: Any  # what the face's ``Post`` returned


Step = Call | Fetch | Blocking | Post | Settle
Op = Generator[Step, Any, R]
