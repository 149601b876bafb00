"""kvpool.cache: per-request cache managers on top of the block pool. Pure Python, no torch."""

from kvpool.cache.manager import KVCacheManager
from kvpool.cache.types import (
    Admission,
    BlockCopy,
    CacheDescriptor,
    MMItem,
    PrefixStats,
    Reservation,
)
from kvpool.pool.block_table import BlockTableCSR

__all__ = [
    "Admission",
    "BlockCopy",
    "BlockTableCSR",
    "CacheDescriptor",
    "KVCacheManager",
    "MMItem",
    "PrefixStats",
    "Reservation",
]
