"""The Redis shared tier (``kvstore.tiers.redis``): see ``kvstore.tiers.redis_tier``.

This module's name does not shadow redis-py: the package uses absolute imports, so ``import
redis`` anywhere (here included) still finds redis-py.
"""

from kvstore.tiers.redis_tier import HEADER_BYTES, RedisTier, RedisTierUnavailable

__all__ = ["HEADER_BYTES", "RedisTier", "RedisTierUnavailable"]
