"""Tiers beyond device memory: the block descriptor every block that leaves the pool
carries, the tier interface, the host-memory tier, the crash-safe disk tier (and, in
disk_admin.py, what `kvpool cache` does to its directory), the shared Redis tier, and the
stack that looks them up in that order."""

from kvpool.tiers.base import Tier, TierStats
from kvpool.tiers.descriptor import BlockDescriptor, TierIndex, descriptor_from_key
from kvpool.tiers.disk import DiskTier
from kvpool.tiers.host import HostTier
from kvpool.tiers.stack import DEFAULT_DISK_CACHE_BYTES, TierDeadlines, TierStack, open_persistent_tiers

# RedisTier lives in kvpool.tiers.redis_tier (imported where a --redis URL is given).
__all__ = [
    "DEFAULT_DISK_CACHE_BYTES",
    "BlockDescriptor",
    "DiskTier",
    "HostTier",
    "Tier",
    "TierDeadlines",
    "TierIndex",
    "TierStack",
    "TierStats",
    "descriptor_from_key",
    "open_persistent_tiers",
]
