"""The Redis shared tier's mechanism: blocks of many hosts in one Redis or Redis Cluster.

``tier`` holds ``RedisTier`` (the daemon's interface and its contract), ``value`` the value
format and key names, ``resp`` the tier's own minimal RESP2 client (the fast path for
``redis://`` and ``unix://``), ``drivers`` the choice between it and redis-py (TLS, Cluster).
Imports only the core types (``kvstore.errors``, ``kvstore.keys``, ``kvstore.checksum``) and
redis-py. ``kvstore.tiers.redis`` re-exports the public names.
"""

from kvstore.tiers.redis_tier.tier import RedisTier, RedisTierUnavailable
from kvstore.tiers.redis_tier.value import HEADER_BYTES

__all__ = ["HEADER_BYTES", "RedisTier", "RedisTierUnavailable"]
