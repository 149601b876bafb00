"""What the cache layer's groups share besides the group contract: the protocol of a tier
below device memory, and the hash keys of multimodal items."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Protocol

from kvpool.cache.types import MMItem
from kvpool.pool import PrefixBlock


class LowerTier(Protocol):
    """A tier below device memory as a cache manager sees it (kvpool.tiers.TierIndex)."""

    def find(self, chain: Sequence[PrefixBlock]) -> int:
        """How many blocks of `chain` (consecutive full blocks of a prompt), from the
        first, the tier holds with a valid descriptor."""
        ...


def mm_extra_key(mm_items: Sequence[MMItem], block_size: int, block_index: int) -> bytes:
    """Extra hash key of one block: for every multimodal item that overlaps it, the item's
    identity and its offset relative to the block's first position (negative when it started
    in an earlier block). Two prompts with the same placeholder tokens and the same images
    placed differently inside a block get different keys. b"" when no item overlaps."""
    lo = block_index * block_size
    hi = lo + block_size
    parts = [
        [item.content_hash, item.start - lo] for item in mm_items if item.start < hi and lo < item.start + item.length
    ]
    # JSON: an identity may hold any character and still not run into the next item's
    return b"mm" + json.dumps(parts, separators=(",", ":")).encode() if parts else b""


def check_mm_items(mm_items: Sequence[MMItem], num_tokens: int) -> tuple[MMItem, ...]:
    items = tuple(MMItem(*item) for item in mm_items)
    for item in items:
        if item.start < 0 or item.length <= 0 or item.start + item.length > num_tokens:
            raise ValueError(f"multimodal item {item} lies outside the prompt of {num_tokens} tokens")
    return items
