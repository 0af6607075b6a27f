"""``RecordIO``: the record IO of one open slab file, run on the tier's pool threads."""

from __future__ import annotations

from kvstore.checksum import block_checksum
from kvstore.tiers import codecs
from kvstore.tiers.codecs import BlockFormat, lz4_compress
from kvstore.tiers.nvme import ondisk as fmt
from kvstore.tiers.nvme.diskio import ScratchBuffers, address, pread_full, pwrite_all
from kvstore.tiers.nvme.ondisk import CODEC_LZ4, CODEC_NONE, KIND_RECORD, PAGE, ZERO_PAGE, Header
from kvstore.tiers.nvme.records import Ident

LZ4_PROBE_BYTES = 64 * 1024


class RecordIO:
    """Reads and writes of records, headers and metadata pages in one open slab file.

    Holds only what is fixed while the file is open (the IO descriptor, whether it is O_DIRECT,
    the format id) and one scratch buffer per thread, and changes nothing else: every
    counter and map of the tier is touched on its event loop only. Every method blocks; the tier
    runs them on its pool threads (``check`` and open on the calling thread).
    """

    def __init__(self, fd: int, direct_io: bool, format_id: int = 0) -> None:
        self.fd = fd
        self.direct_io = direct_io
        self.format_id = format_id
        self._scratch = ScratchBuffers()

    def write_at(self, offset: int, data: bytes | bytearray) -> None:
        """Write whole pages (a header, a descriptor, metadata) at ``offset``."""
        scratch = self._scratch.get(len(data))
        scratch[: len(data)] = data
        pwrite_all(self.fd, [scratch[: len(data)]], offset)

    def write_pages(self, pages: list[tuple[int, bytearray]]) -> list[OSError | None]:
        """``write_at`` of each (offset, page), in order, in one job: per page, None or the
        error its write raised (one failing page does not stop the others)."""
        errors: list[OSError | None] = []
        for offset, page in pages:
            try:
                self.write_at(offset, page)
            except OSError as exc:
                errors.append(exc)
            else:
                errors.append(None)
        return errors

    def write_payload(
        self,
        slot: int,
        key: bytes,
        namespace: bytes,
        data: memoryview,
        checksum: int,
        codec: int,
        block_format: BlockFormat | None,
    ) -> tuple[int, int, int, int]:
        """Verify ``data`` against its checksum, encode it with ``codec`` (as ``codecs.plan``
        returned it) and write the payload after the slot's header page: (bytes stored, the
        codec that wrote them, the checksum of the block a read will yield, the payload's
        checksum). A lossless codec yields ``data`` itself (``checksum``); a lossy one its
        decoded form, decoded here once to take that checksum. lz4 results that save no page
        are stored raw."""
        n = data.nbytes
        # Verified here, while moving down a tier: the checksum on disk must describe these bytes
        # as this key's block of this namespace.
        if block_checksum(data, namespace, key) != checksum:
            raise ValueError(f"data for slot {slot} does not match its checksum")
        span = fmt.round_up(n)
        if codec == CODEC_LZ4 and (span <= PAGE or not self._worth_compressing(data)):
            codec = CODEC_NONE
        if codec != CODEC_NONE:
            room = fmt.round_up(codecs.scratch_bytes(n))
            scratch = self._scratch.get(room + (n if codec in codecs.LOSSY else 0))
            used, payload = codecs.encode(codec, data, block_format, scratch[:room])
            stored = payload.nbytes
            if used == CODEC_LZ4 and fmt.round_up(stored) >= span:
                used = CODEC_NONE  # saves no page: raw
            if used != CODEC_NONE:
                decoded = checksum
                if used in codecs.LOSSY:
                    assert block_format is not None
                    frame = scratch[: codecs.fp8_payload_bytes(block_format)]
                    out = scratch[room : room + n]
                    if not codecs.fp8_decode(frame, out):
                        raise AssertionError("a fresh fp8 payload failed to decode")
                    decoded = block_checksum(out, namespace, key)
                if address(payload) != address(scratch):  # fp8+lz4: after the frame
                    scratch[:stored] = payload
                pad = fmt.round_up(stored)
                scratch[stored:pad] = ZERO_PAGE[: pad - stored]
                stored_sum = block_checksum(scratch[:stored], namespace, key)
                pwrite_all(self.fd, [scratch[:pad]], slot + PAGE)
                return stored, used, decoded, stored_sum
        if not self.direct_io or (n % PAGE == 0 and address(data) % PAGE == 0):
            pwrite_all(self.fd, [data], slot + PAGE)  # zero copy: a CPU-tier slot is aligned
        else:
            scratch = self._scratch.get(span)
            scratch[:n] = data
            scratch[n:span] = ZERO_PAGE[: span - n]
            pwrite_all(self.fd, [scratch[:span]], slot + PAGE)
        return n, CODEC_NONE, checksum, checksum

    def write_record(
        self,
        slot: int,
        block: tuple[bytes, bytes, memoryview, int],
        coding: tuple[int, BlockFormat | None],
        length: int,
        pages: int,
        seq: int,
    ) -> tuple[int, int, int, int]:
        """A whole record in one job, for a write without barriers: ``write_payload`` (or
        ``write_encoded`` when ``length``, the block's, exceeds the payload's: an fp8 payload
        stored as it is), then its header page (``pages`` long slot, sequence number ``seq``).
        Two writes in that order, as a write with barriers makes them, so a crash between them
        leaves no header of this record; the tier only saves the hops between threads. Same
        result tuple. ValueError (and nothing written) when the block does not match its
        checksum; any other error may come after the header was written."""
        key, namespace, data, checksum = block
        if length != data.nbytes:
            done = self.write_encoded(slot, key, namespace, data, checksum, coding[0], length)
        else:
            done = self.write_payload(slot, key, namespace, data, checksum, *coding)
        stored, codec, decoded, stored_sum = done
        fields = (pages, slot, seq, self.format_id, key, namespace, length, stored)
        self.write_at(
            slot, fmt.pack_header(Header(KIND_RECORD, codec, *fields, decoded, stored_sum))
        )
        return done

    def write_encoded(
        self,
        slot: int,
        key: bytes,
        namespace: bytes,
        payload: memoryview,
        checksum: int,
        codec: int,
        length: int,
    ) -> tuple[int, int, int, int]:
        """``write_payload`` for a block that is already an fp8 payload (of a ``length``-byte
        block, whose decoded form's checksum is ``checksum``): verified by decoding it once,
        then stored as it is (``fp8``), or as lz4 over it (``fp8+lz4``) when that saves a
        page. Same result tuple; ValueError if it does not decode to ``checksum``."""
        size = payload.nbytes
        room = fmt.round_up(codecs.scratch_bytes(length))
        scratch = self._scratch.get(room + length)
        out = scratch[room : room + length]
        if not codecs.fp8_decode(payload, out) or block_checksum(out, namespace, key) != checksum:
            raise ValueError(f"payload for slot {slot} does not decode to its checksum")
        used, stored = codecs.CODEC_FP8, size
        if codec == codecs.CODEC_FP8_LZ4:
            n = lz4_compress(payload, scratch[: size - 1])
            if n and fmt.round_up(n) < fmt.round_up(size):
                used, stored = codecs.CODEC_FP8_LZ4, n
        if used == codecs.CODEC_FP8:
            scratch[:size] = payload
        pad = fmt.round_up(stored)
        scratch[stored:pad] = ZERO_PAGE[: pad - stored]
        stored_sum = block_checksum(scratch[:stored], namespace, key)
        pwrite_all(self.fd, [scratch[:pad]], slot + PAGE)
        return stored, used, checksum, stored_sum

    def read_payload(self, slot: int, want: Ident, out: memoryview) -> int | str:
        """Read a lossy record's fp8 payload into ``out`` (its exact length), lz4 undone: the
        payload's checksum, or why it is a miss. The stored bytes are checked against their
        own checksum; a record without one is decoded once and checked against its block
        checksum."""
        if want.codec not in codecs.LOSSY:
            return "mismatch"
        stored, span = want.stored_length, fmt.round_up(want.stored_length)
        room = codecs.scratch_bytes(want.length)
        scratch = self._scratch.get(PAGE + span + room)
        if pread_full(self.fd, [scratch[: PAGE + span]], slot) < PAGE + stored:
            return "short"
        h = fmt.parse_header(scratch)
        why = self._header_mismatch(h, slot, want)
        if why is not None:
            return why
        assert h is not None
        body = scratch[PAGE : PAGE + stored]
        if h.stored_checksum != fmt.NO_STORED_CHECKSUM and (
            block_checksum(body, want.namespace, want.key) != h.stored_checksum
        ):
            return "corrupt"
        if want.codec == codecs.CODEC_FP8:
            if stored != out.nbytes:
                return "corrupt"
            out[:] = body
        elif codecs.lz4_decompress_into(body, out) != out.nbytes:
            return "corrupt"
        if h.stored_checksum == fmt.NO_STORED_CHECKSUM:
            block = scratch[PAGE + span : PAGE + span + want.length]
            if not codecs.fp8_decode(out, block) or (
                block_checksum(block, want.namespace, want.key) != want.checksum
            ):
                return "corrupt"
        return block_checksum(out, want.namespace, want.key)

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
        """Read, verify and decode one record into ``out``: None, or why it is a miss ("short",
        "torn", "mismatch", "corrupt"). The payload is checked against its own checksum before
        it is decoded, and the decoded block against the record's block checksum."""
        length, stored, span = want.length, want.stored_length, fmt.round_up(want.stored_length)
        direct = want.codec == CODEC_NONE and (
            not self.direct_io or (length % PAGE == 0 and address(out) % PAGE == 0)
        )
        if direct:  # header into scratch, payload straight into the caller's buffer
            scratch = self._scratch.get(PAGE)
            if pread_full(self.fd, [scratch[:PAGE], out[:length]], slot) < PAGE + length:
                return "short"
        else:
            extra = codecs.scratch_bytes(length) if want.codec == codecs.CODEC_FP8_LZ4 else 0
            scratch = self._scratch.get(PAGE + span + extra)
            if pread_full(self.fd, [scratch[: PAGE + span]], slot) < PAGE + stored:
                return "short"
        h = fmt.parse_header(scratch)
        why = self._header_mismatch(h, slot, want)
        if why is not None:
            return why
        assert h is not None
        if want.codec != CODEC_NONE:
            payload = scratch[PAGE : PAGE + stored]
            if h.stored_checksum != fmt.NO_STORED_CHECKSUM and (
                block_checksum(payload, want.namespace, want.key) != h.stored_checksum
            ):
                return "corrupt"
            rest = scratch[PAGE + span :]
            if not codecs.decode(want.codec, payload, out[:length], rest):
                return "corrupt"
        elif not direct:
            out[:length] = scratch[PAGE : PAGE + length]
        # Bound to the key and namespace the bytes are served for: a header that names another
        # key (stale, or damaged and re-checksummed) never vouches for these bytes.
        if block_checksum(out[:length], want.namespace, want.key) != want.checksum:
            return "corrupt"
        return None

    def _header_mismatch(self, h: Header | None, slot: int, want: Ident) -> str | None:
        """Why a record's header does not vouch for ``want`` in ``slot`` ("torn", "mismatch"),
        or None."""
        if h is None:
            return "torn"
        got = Ident(h.key, h.namespace, h.length, h.stored_length, h.codec, h.checksum, h.seq)
        if (h.kind, h.slot, h.format_id) != (KIND_RECORD, slot, self.format_id) or got != want:
            return "mismatch"
        return None

    def read_header(self, slot: int) -> Header | None:
        scratch = self._scratch.get(PAGE)
        if pread_full(self.fd, [scratch[:PAGE]], slot) < PAGE:
            return None
        return fmt.parse_header(scratch)
