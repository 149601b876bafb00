"""kvpool.cache: per-request cache managers on top of the block pool. Pure Python, no torch.

Every manager implements the contract of `CacheManager` (cache/base.py)."""

from kvpool.cache.base import CacheManager, LowerTier
from kvpool.cache.dsv4 import DSV4CacheManager
from kvpool.cache.full import FullAttentionManager
from kvpool.cache.types import (
    Admission,
    BlockCopy,
    CacheDescriptor,
    CacheUsage,
    MMItem,
    PrefixStats,
    ReleaseReason,
    Reservation,
    StateRestore,
)
from kvpool.pool.block_table import BlockTableCSR

__all__ = [
    "Admission",
    "BlockCopy",
    "BlockTableCSR",
    "CacheDescriptor",
    "CacheManager",
    "CacheUsage",
    "DSV4CacheManager",
    "FullAttentionManager",
    "LowerTier",
    "MMItem",
    "PrefixStats",
    "ReleaseReason",
    "Reservation",
    "StateRestore",
]
