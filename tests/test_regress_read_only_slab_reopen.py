"""A reader of a shared tenant is handed its slabs read-only: a descriptor opened O_RDONLY, so
mapping it writable fails. But a slab file is a memfd, created with mode 0777: the reader could
reopen its own descriptor through ``/proc/self/fd`` read-write, map it shared and writable, and
overwrite the shared namespace's blocks in every process's view (the blocks then failed their
checksums: every reader missed the operator's shared system prompt, and a reader able to forge
an xxh3 collision could have served others its own bytes). Slab files are now owner-only (mode
0600), so another uid can open them only as the daemon hands them over.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DaemonProcess, config_toml
from test_security import ALICE, BOB, OPS, POLICY, needs_root, run_as


@pytest.fixture
def shared_daemon() -> Iterator[DaemonProcess]:
    base = Path(tempfile.mkdtemp(prefix="kvro-", dir="/tmp"))  # other uids can traverse it
    base.chmod(0o711)
    d = DaemonProcess(base / "d", config_toml(cpu_capacity="32MiB", extra=POLICY))
    d.directory.mkdir()
    try:
        yield d.start()
    finally:
        if d.alive():
            d.stop()
        shutil.rmtree(base, ignore_errors=True)


@needs_root
def test_a_reader_cannot_reopen_its_read_only_slab_writable(
    shared_daemon: DaemonProcess,
) -> None:
    address = shared_daemon.address
    written = run_as(
        OPS,
        address,
        """
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="prompts")
        print(json.dumps({"stored": int(kv.put(kv.hash_tokens(list(range(48))), blocks(3, 7)))}))
        """,
    )
    assert written["stored"] == 3
    attack = run_as(
        ALICE,
        address,
        """
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="prompts")
        keys = kv.hash_tokens(list(range(48)))
        assert bool(torch.equal(kv.get(keys), blocks(3, 7)))  # maps the slab
        fd, size, writable = kv._session.slab(next(iter(kv._arena._slabs)))
        try:
            rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        except OSError as e:
            result = e.errno
        else:
            m = mmap.mmap(rw, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            m[:] = b"\\xff" * size  # every block of the shared prompt in this slab
            m.close()
            os.close(rw)
            result = "reopened writable"
        os.close(fd)
        print(json.dumps({"writable": writable, "reopen": result}))
        """,
    )
    assert attack["writable"] is False, attack
    assert attack["reopen"] == 13, attack  # EACCES
    reader = run_as(
        BOB,
        address,
        """
        kv = KVStoreClient(ADDRESS, layout=LAYOUT, model="m", tenant="prompts")
        got = kv.get(kv.hash_tokens(list(range(48))))
        print(json.dumps({"same": got is not None and bool(torch.equal(got, blocks(3, 7)))}))
        """,
    )
    assert reader["same"], reader
