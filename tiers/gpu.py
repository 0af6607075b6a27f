"""The GPU tier's mechanism: one device-memory pool shared with same-GPU workers by CUDA IPC.

The daemon makes one plain ``cudaMalloc`` allocation (CUDA IPC exports whole allocations, not
pieces of a caching allocator's segments), writes a random token at offset 0 and hands workers
the allocation's IPC handle, the device's UUID and the token. A worker on the same GPU opens
the handle once per process and copies blocks straight between its paged cache and pool slots:
a device-to-device copy, no PCIe. Slots are handed out by the CPU tier's ``SlabAllocator`` (the
layout of offsets is the same: a header page, then slabs of equal-size slots).

This module knows nothing of keys, leases or eviction: it owns the memory and its handle.
``DevicePool`` also runs on a CPU ``torch.device`` (plain host memory, no IPC handle) so the
daemon's tier logic can be exercised without a GPU; the daemon itself never enables the tier
without CUDA.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvstore.tiers.cpu import HEADER_BYTES, SLOT_ALIGN, TOKEN_BYTES

# cudaIpcMemLazyEnablePeerAccess: a worker on another device of the same host may open it too.
_IPC_LAZY_PEER_ACCESS = 1


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            "the GPU tier needs CuPy for CUDA IPC: pip install 'kvstore[cuda]'"
        ) from exc
    return cupy


def cuda_usable() -> str | None:
    """None when this process can run the GPU tier, else why not (for logs and errors)."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        _cupy()
    except RuntimeError as exc:
        return str(exc)
    return None


def device_uuid(index: int) -> bytes:
    """The 16-byte UUID of CUDA device ``index`` as this process numbers it. Indices differ
    between processes (CUDA_VISIBLE_DEVICES); the UUID names the same chip in all of them.

    From torch: its ``uuid.bytes`` (16 ints) where present, else its text form. CuPy's
    ``getDeviceProperties()["uuid"]`` is not used: it is cut at the first zero byte."""
    uuid = torch.cuda.get_device_properties(index).uuid
    raw = getattr(uuid, "bytes", None)
    if raw is not None and not isinstance(raw, str):
        raw = bytes(bytearray(raw))
    else:
        # Spelled "GPU-xxxxxxxx-xxxx-..." or plain hex with dashes, depending on the version.
        text = str(uuid).removeprefix("GPU-").replace("-", "")
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raw = b""
    if len(raw) != 16:
        raise RuntimeError(f"CUDA device {index} reports no 16-byte UUID (got {uuid!r})")
    return raw


def local_device_index(uuid: bytes) -> int | None:
    """This process's index of the device with ``uuid``, or None if it cannot see it."""
    if not uuid or not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        with contextlib.suppress(RuntimeError):
            if device_uuid(index) == uuid:
                return index
    return None


def _wrap(ptr: int, size: int, device_index: int, owner: Any) -> torch.Tensor:
    """A uint8 torch tensor over ``size`` bytes of device memory at ``ptr`` (no copy)."""
    cp = _cupy()
    memory = cp.cuda.UnownedMemory(ptr, size, owner, device_index)
    array = cp.ndarray((size,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(memory, 0))
    return torch.utils.dlpack.from_dlpack(array)


@dataclass(frozen=True)
class PoolInfo:
    """What a worker needs to open the pool: sent in OpenNamespace's reply."""

    device_uuid: bytes
    ipc_handle: bytes
    size_bytes: int
    token: bytes


class DevicePool:
    """Owns the pool's memory for the daemon's lifetime. ``tensor`` is a uint8 view of all of
    it; slot ``offset`` of a block is ``tensor[offset : offset + block_bytes]``."""

    def __init__(self, size_bytes: int, device: torch.device | str) -> None:
        device = torch.device(device)
        if size_bytes <= HEADER_BYTES:
            raise ValueError(f"gpu pool size {size_bytes} too small (header is {HEADER_BYTES})")
        self.size_bytes = (size_bytes + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.ipc_handle = b""
        self.uuid = b""
        self._ptr = 0
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            cp = _cupy()
            with cp.cuda.Device(index):
                self._ptr = int(cp.cuda.runtime.malloc(self.size_bytes))
                try:
                    self.ipc_handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self._ptr))
                    self.uuid = device_uuid(index)
                    self.tensor = _wrap(self._ptr, self.size_bytes, index, self)
                except BaseException:
                    cp.cuda.runtime.free(self._ptr)
                    raise
        else:
            self.device = device
            self.tensor = torch.empty(self.size_bytes, dtype=torch.uint8, device=device)
        self.tensor[:TOKEN_BYTES].copy_(torch.frombuffer(bytearray(self.token), dtype=torch.uint8))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._closed = False

    @property
    def info(self) -> PoolInfo:
        return PoolInfo(self.uuid, self.ipc_handle, self.size_bytes, self.token)

    def retain(self) -> None:
        """Pools share ``retain``/``release`` with ``MappedDevicePool``; the owner's pool lives
        until ``close`` whatever its users do."""

    def release(self) -> None:
        """See ``retain``."""

    def slot(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset : offset + nbytes]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ptr:
            cp = _cupy()
            torch.cuda.synchronize(self.device)
            with cp.cuda.Device(self.device.index):
                cp.cuda.runtime.free(self._ptr)
            self._ptr = 0


class MappedDevicePool:
    """A worker's mapping of the daemon's pool, opened through its IPC handle.

    CUDA lets a process open one handle once, so mappings are shared per process and counted:
    ``open`` returns the existing one for a handle already open. The token at offset 0 proves the
    mapping is the pool the daemon described (not a stale allocation at a reused address).
    """

    _lock = threading.Lock()
    # By handle and token: a handle's bytes could repeat across daemon starts; the token never.
    _open: ClassVar[dict[tuple[bytes, bytes], MappedDevicePool]] = {}

    def __init__(self, info: PoolInfo, device_index: int) -> None:
        self.info = info
        self.size_bytes = info.size_bytes
        self.device = torch.device("cuda", device_index)
        cp = _cupy()
        with cp.cuda.Device(device_index):
            self._ptr = int(
                cp.cuda.runtime.ipcOpenMemHandle(info.ipc_handle, _IPC_LAZY_PEER_ACCESS)
            )
        try:
            self.tensor = _wrap(self._ptr, info.size_bytes, device_index, self)
            token = bytes(self.tensor[:TOKEN_BYTES].cpu().numpy().tobytes())
            if token != info.token:
                raise ValueError("the GPU pool's token does not match what the daemon sent")
        except BaseException:
            self._close_handle()
            raise
        self._refs = 0

    @classmethod
    def open(cls, info: PoolInfo) -> MappedDevicePool | None:
        """The mapping of ``info``'s pool, or None when this process cannot see that GPU."""
        index = local_device_index(info.device_uuid)
        if index is None or not info.ipc_handle:
            return None
        key = (info.ipc_handle, info.token)
        with cls._lock:
            pool = cls._open.get(key)
            if pool is None:
                pool = cls._open[key] = cls(info, index)
            pool._refs += 1
            return pool

    def slot(self, offset: int, nbytes: int) -> torch.Tensor:
        if not self._ptr:
            raise ValueError("the GPU pool mapping is closed (the daemon restarted?)")
        if offset < HEADER_BYTES or offset + nbytes > self.size_bytes:
            raise ValueError(f"gpu slot [{offset}, {offset + nbytes}) is outside the pool")
        return self.tensor[offset : offset + nbytes]

    def retain(self) -> None:
        """One more user (a lease or reservation in flight): the mapping stays until each has
        called ``release``, even if the client lets go of the pool meanwhile."""
        with self._lock:
            if not self._ptr:
                raise ValueError("the GPU pool mapping is closed (the daemon restarted?)")
            self._refs += 1

    def release(self) -> None:
        self.close()

    def close(self) -> None:
        """Drop one reference; the last one unmaps. Views taken from ``slot`` must not be used
        after that."""
        with self._lock:
            self._refs -= 1
            if self._refs > 0:
                return
            self._open.pop((self.info.ipc_handle, self.info.token), None)
        try:
            torch.cuda.synchronize(self.device)
        finally:
            self._close_handle()

    def _close_handle(self) -> None:
        ptr, self._ptr = self._ptr, 0
        if ptr:
            try:
                cp = _cupy()
                with cp.cuda.Device(self.device.index):
                    cp.cuda.runtime.ipcCloseMemHandle(ptr)
            except Exception as exc:  # the mapping is gone either way; keep the client usable
                warnings.warn(
                    f"closing the GPU pool mapping failed: {exc}", RuntimeWarning, stacklevel=2
                )
