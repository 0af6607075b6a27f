"""The NVMe tier's mechanism: one preallocated slab file of checksummed, crash-safe records.

``tier`` holds ``NvmeTier`` (the daemon's interface and its contract), ``ondisk`` the on-disk
format, ``slabfile`` opening (and formatting) the file, ``recovery`` what open reads of it,
``recordio`` the record IO on the open file, ``alloc`` the slot allocator, ``records`` the
values handed out and the per-slot tables, ``diskio`` the thread-side IO helpers. Imports only the
core types (``kvstore.errors``, ``kvstore.keys``).
"""

from kvstore.tiers.nvme.ondisk import FILE_NAME, PAGE
from kvstore.tiers.nvme.records import CheckProblem, CheckReport, NvmeFormatError, NvmeRecord
from kvstore.tiers.nvme.tier import NvmeIOError, NvmeTier

__all__ = [
    "FILE_NAME",
    "PAGE",
    "CheckProblem",
    "CheckReport",
    "NvmeFormatError",
    "NvmeIOError",
    "NvmeRecord",
    "NvmeTier",
]
