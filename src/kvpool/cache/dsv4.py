"""DeepSeek-V4's cache manager: the coordinator over one dual-pool group (cache/dual_pool.py)."""

from kvpool.cache.dual_pool import (
    RESTORE_METHODS,
    DSV4CacheManager,
    RestoreChoice,
    RestoreCost,
    RestoreMethod,
    TokenCost,
    choose_restore,
)

__all__ = [
    "RESTORE_METHODS",
    "DSV4CacheManager",
    "RestoreChoice",
    "RestoreCost",
    "RestoreMethod",
    "TokenCost",
    "choose_restore",
]
