"""kvpool.cache: per-request block tables and the request lifecycle on top of the block pool.
Pure Python, no torch.

One implementation keeps the cache contract for every model: `HybridCacheManager`
(cache/coordinator.py; `CacheManager` is its other name), over a model's layer groups, each
reached through the `CacheGroup` protocol (cache/group.py): attention groups, full or sliding-window
(cache/window.py), recurrent-state checkpoint groups (cache/recurrent.py) and V4 dual-pool
groups (cache/dual_pool.py). `FullAttentionManager` (cache/full.py) is the coordinator over
one full-attention group (the engine's paged Llama path); `DSV4CacheManager`
(cache/dual_pool.py) the coordinator over one V4 dual-pool group."""

from kvpool.cache.base import LowerTier
from kvpool.cache.coordinator import HybridCacheManager
from kvpool.cache.dual_pool import DSV4CacheManager, DualPoolGroupSpec
from kvpool.cache.full import FullAttentionManager
from kvpool.cache.group import CacheGroup, GroupUsage
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

CacheManager = HybridCacheManager  # the one implementation of the cache contract (cache/coordinator.py)

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
