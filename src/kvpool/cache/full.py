"""`FullAttentionManager`: the coordinator (cache/coordinator.py) over one full-attention
group named "full" (cache/window.py, W = infinity) of MHA / GQA / MQA / MLA layers.

One request's token positions, against its block table (bs = block_size):

  [0, num_cached)              blocks found in the prefix cache at admission (shared, read-only)
  [num_cached, num_computed)   KV written and committed by this request
  [num_computed, num_reserved) writable slots: blocks exclusive to this request, unpublished
  [num_reserved, ...)          no slots yet

Reservations are block-granular (`exact_steps=False`: the coordinator's "Steps"). Every call
is the coordinator's; the tier and P/D queries are engine/tier_bridge.py's, over it.
"""

from __future__ import annotations

from kvpool.cache.coordinator import HybridCacheManager
from kvpool.cache.group import LowerTier
from kvpool.cache.types import CacheDescriptor
from kvpool.cache.window import AttentionGroupSpec


class FullAttentionManager(HybridCacheManager):
    """lower_tier, record_published: the attention group's tier hooks (cache/window.py)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        descriptor: CacheDescriptor,
        *,
        enable_prefix_caching: bool = True,
        hash_algo: str = "xxh3_128",
        lower_tier: LowerTier | None = None,
        record_published: bool = False,
    ) -> None:
        super().__init__(
            [(AttentionGroupSpec("full", block_size), num_blocks)],
            descriptor,
            enable_prefix_caching=enable_prefix_caching,
            hash_algo=hash_algo,
            exact_steps=False,
            lower_tier=lower_tier,
            record_published=record_published,
        )
