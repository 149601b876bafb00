"""kvpool.cache: per-request block tables and the request lifecycle on top of the block pool,
pure Python. The one implementation is the coordinator (cache/coordinator.py,
`HybridCacheManager`, also named `CacheManager`) over a model's groups (cache/group.py);
`FullAttentionManager` and `DSV4CacheManager` are it over one group."""

from kvpool.cache.coordinator import HybridCacheManager
from kvpool.cache.dual_pool import DSV4CacheManager, DualPoolGroupSpec
from kvpool.cache.full import FullAttentionManager
from kvpool.cache.group import CacheGroup, GroupUsage, LowerTier
from kvpool.cache.recurrent import RecurrentGroupSpec
from kvpool.cache.types import (
    Admission,
    BlockCopy,
    CacheDescriptor,
    CacheUsage,
    GroupAdmission,
    GroupReservation,
    MMItem,
    PrefixStats,
    ReleaseReason,
    Reservation,
    StateRestore,
)
from kvpool.cache.window import AttentionGroupSpec
from kvpool.pool.block_table import BlockTableCSR

CacheManager = HybridCacheManager

__all__ = [
    "Admission",
    "AttentionGroupSpec",
    "BlockCopy",
    "BlockTableCSR",
    "CacheDescriptor",
    "CacheGroup",
    "CacheManager",
    "CacheUsage",
    "DSV4CacheManager",
    "DualPoolGroupSpec",
    "FullAttentionManager",
    "GroupAdmission",
    "GroupReservation",
    "GroupUsage",
    "HybridCacheManager",
    "LowerTier",
    "MMItem",
    "PrefixStats",
    "ReleaseReason",
    "RecurrentGroupSpec",
    "Reservation",
    "StateRestore",
]
