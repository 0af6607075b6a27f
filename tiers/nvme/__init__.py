"""The NVMe tier's mechanism: one preallocated slab file of checksummed, crash-safe records.

``tier`` holds ``NvmeTier`` (the daemon's interface and its contract), ``ondisk`` the on-disk
format, ``slabfile`` opening (and formatting) the file, ``recovery`` what open reads of it,
``scan`` open's scan of the record headers, ``recordio`` the record IO on the open file,
``reads`` the read path, ``meta`` the metadata and slab descriptors the open tier writes,
``tombstones`` the invalidation of freed records, ``check`` the scrub, ``alloc`` the slot
allocator, ``records`` the values handed out and the per-slot tables, ``occupancy`` the totals of
the live records, ``diskio`` the thread-side IO helpers. ``tier`` imports the others; none of
them imports ``tier`` or this package's ``__init__``. Imports only the core types
(``kvstore.errors``, ``kvstore.keys``).
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
