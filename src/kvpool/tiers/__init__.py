"""Tiers beyond device memory: the block descriptor every block that leaves the pool
carries, the tier interface, and the host-memory tier."""

from kvpool.tiers.base import Tier, TierStats
from kvpool.tiers.descriptor import BlockDescriptor, TierIndex, descriptor_from_key
from kvpool.tiers.host import HostTier

__all__ = ["BlockDescriptor", "HostTier", "Tier", "TierIndex", "TierStats", "descriptor_from_key"]
