"""``Occupancy``: what the NVMe tier's live records hold, in totals, by namespace and by codec."""

from __future__ import annotations

from kvstore.tiers import codecs
from kvstore.tiers.nvme.ondisk import PAGE, round_up
from kvstore.tiers.nvme.records import RecordTable


class Occupancy:
    """Totals over the live (committed, not freed) records of the tier. Owns only these
    numbers: the tier calls ``add`` as a record commits (+1) or goes (-1). Loop-only."""

    def __init__(self) -> None:
        self.blocks = self.used_bytes = self.raw_bytes = self.stored_bytes = 0
        # Per namespace id (NamespaceIds): [blocks, raw bytes, slot bytes] of live records.
        self._by_ns: dict[int, list[int]] = {}
        self._by_codec = [0] * len(codecs.NAME_OF)  # live records by the codec that wrote them

    def add(self, slot_bytes: int, table: RecordTable, i: int, sign: int) -> None:
        """Count (``sign`` +1) or uncount (-1) record ``i`` of ``table``, in a slot of
        ``slot_bytes``."""
        self.blocks += sign
        self.used_bytes += sign * slot_bytes
        self.raw_bytes += sign * table.length[i]
        self.stored_bytes += sign * round_up(table.stored_length[i])
        self._by_codec[table.codec[i]] += sign
        per = self._by_ns.setdefault(table.ns[i], [0, 0, 0])
        per[0] += sign
        per[1] += sign * table.length[i]
        per[2] += sign * slot_bytes
        if not per[0]:
            del self._by_ns[table.ns[i]]

    def holds_lossy(self) -> bool:
        """Whether any live record was written by a lossy codec."""
        return any(self._by_codec[c] for c in codecs.LOSSY)

    def by_namespace(self, names: list[bytes]) -> dict[bytes, tuple[int, int, int]]:
        """(blocks, logical bytes, slot bytes) by namespace fingerprint (``names``: by id)."""
        return {names[ns]: (b, raw, used) for ns, (b, raw, used) in self._by_ns.items()}

    def by_codec(self) -> dict[str, int]:
        """``records_<codec>``: live records by the codec that wrote them."""
        return {
            f"records_{codecs.NAME_OF[c].replace('+', '_')}": n
            for c, n in enumerate(self._by_codec)
        }

    @property
    def stored_with_headers(self) -> int:
        """The pages the live records fill, header pages included."""
        return self.stored_bytes + PAGE * self.blocks

    @property
    def compression_ratio(self) -> float:
        """Raw bytes / stored payload pages over the live records (1.0 when none)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0
