"""``RecordIO``: the record IO of one open slab file, run on the tier's pool threads."""

from __future__ import annotations

from kvstore.checksum import block_checksum
from kvstore.tiers.nvme import ondisk as fmt
from kvstore.tiers.nvme.diskio import (
    ScratchBuffers,
    address,
    lz4_compress,
    lz4_decompress,
    pread_full,
    pwrite_all,
)
from kvstore.tiers.nvme.ondisk import CODEC_LZ4, CODEC_NONE, KIND_RECORD, PAGE, ZERO_PAGE, Header
from kvstore.tiers.nvme.records import Ident

LZ4_PROBE_BYTES = 64 * 1024


class RecordIO:
    """Reads and writes of records, headers and metadata pages in one open slab file.

    Holds only what is fixed while the file is open (the IO descriptor, whether it is O_DIRECT,
    the codec, the format id) and one scratch buffer per thread, and changes nothing else: every
    counter and map of the tier is touched on its event loop only. Every method blocks; the tier
    runs them on its pool threads (``check`` and open on the calling thread).
    """

    def __init__(self, fd: int, direct_io: bool, codec: int, format_id: int = 0) -> None:
        self.fd = fd
        self.direct_io = direct_io
        self.codec = codec
        self.format_id = format_id
        self._scratch = ScratchBuffers()

    def write_at(self, offset: int, data: bytes | bytearray) -> None:
        """Write whole pages (a header, a descriptor, metadata) at ``offset``."""
        scratch = self._scratch.get(len(data))
        scratch[: len(data)] = data
        pwrite_all(self.fd, [scratch[: len(data)]], offset)

    def write_payload(
        self, slot: int, key: bytes, namespace: bytes, data: memoryview, checksum: int
    ) -> tuple[int, int]:
        """Verify ``data`` against its checksum and write it after the slot's header page,
        compressed if the codec is lz4 and that saves a page: (bytes stored, codec)."""
        n = data.nbytes
        # Verified here, while moving down a tier: the checksum on disk must describe these bytes
        # as this key's block of this namespace.
        if block_checksum(data, namespace, key) != checksum:
            raise ValueError(f"data for slot {slot} does not match its checksum")
        span = fmt.round_up(n)
        if self.codec == CODEC_LZ4 and span > PAGE and self._worth_compressing(data):
            scratch = self._scratch.get(span)
            # Room for one page less than raw: a result that saves no page is stored raw.
            stored = lz4_compress(data, scratch[: span - PAGE])
            if stored:
                pad = fmt.round_up(stored)
                scratch[stored:pad] = ZERO_PAGE[: pad - stored]
                pwrite_all(self.fd, [scratch[:pad]], slot + PAGE)
                return stored, CODEC_LZ4
        if not self.direct_io or (n % PAGE == 0 and address(data) % PAGE == 0):
            pwrite_all(self.fd, [data], slot + PAGE)  # zero copy: a CPU-tier slot is aligned
        else:
            scratch = self._scratch.get(span)
            scratch[:n] = data
            scratch[n:span] = ZERO_PAGE[: span - n]
            pwrite_all(self.fd, [scratch[:span]], slot + PAGE)
        return n, CODEC_NONE

    def _worth_compressing(self, data: memoryview) -> bool:
        """Whether the block's first 64 KiB compress by 1/16 or more. bf16 KV data compresses
        by under 1% (benchmarks/bench_nvme.py), and compressing a 2 MiB block only to store it
        raw costs ~1 ms of CPU; the probe costs 1/32 of that."""
        if data.nbytes < 2 * LZ4_PROBE_BYTES:
            return True
        scratch = self._scratch.get(LZ4_PROBE_BYTES)
        probe = data[:LZ4_PROBE_BYTES]
        return lz4_compress(probe, scratch[: LZ4_PROBE_BYTES - LZ4_PROBE_BYTES // 16]) > 0

    def read_record(self, slot: int, want: Ident, out: memoryview) -> str | None:
        """Read and verify one record into ``out``: None, or why it is a miss ("short",
        "torn", "mismatch", "corrupt")."""
        length, stored, span = want.length, want.stored_length, fmt.round_up(want.stored_length)
        direct = want.codec == CODEC_NONE and (
            not self.direct_io or (length % PAGE == 0 and address(out) % PAGE == 0)
        )
        if direct:  # header into scratch, payload straight into the caller's buffer
            scratch = self._scratch.get(PAGE)
            if pread_full(self.fd, [scratch[:PAGE], out[:length]], slot) < PAGE + length:
                return "short"
        else:
            scratch = self._scratch.get(PAGE + span)
            if pread_full(self.fd, [scratch[: PAGE + span]], slot) < PAGE + stored:
                return "short"
        h = fmt.parse_header(scratch)
        if h is None:
            return "torn"
        got = Ident(h.key, h.namespace, h.length, h.stored_length, h.codec, h.checksum, h.seq)
        if (h.kind, h.slot, h.format_id) != (KIND_RECORD, slot, self.format_id) or got != want:
            return "mismatch"
        if want.codec == CODEC_LZ4:
            if not lz4_decompress(scratch[PAGE : PAGE + stored], out[:length]):
                return "corrupt"
        elif not direct:
            out[:length] = scratch[PAGE : PAGE + length]
        # Bound to the key and namespace the bytes are served for: a header that names another
        # key (stale, or damaged and re-checksummed) never vouches for these bytes.
        if block_checksum(out[:length], want.namespace, want.key) != want.checksum:
            return "corrupt"
        return None

    def read_header(self, slot: int) -> Header | None:
        scratch = self._scratch.get(PAGE)
        if pread_full(self.fd, [scratch[:PAGE]], slot) < PAGE:
            return None
        return fmt.parse_header(scratch)
