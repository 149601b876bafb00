"""The tiers below device memory as one: host, then disk, then Redis.

Two ways in:
  - `put` is the eviction path (and swap): a block the device pool pushes out goes to the
    host tier, or, without one, to the persistent tiers (where it usually is already);
  - `persist` is the write-through path: every block that becomes a full, cached block is
    written to the persistent tiers (disk, Redis) in the background, so that another
    process, or this one after a restart, finds the prefix whether or not it was ever
    evicted here.
A lookup asks each tier in order (host -> disk -> Redis) and hits in the first that holds
the block valid; `TierIndex.find` over the stack is then the longest prefix whose every
block some tier holds: the longest hit across tiers. A get reads from the first tier that
has the block.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from kvpool.tiers.base import Tier, TierStats
from kvpool.tiers.descriptor import BlockDescriptor

DEFAULT_DISK_CACHE_BYTES = 16 << 30  # --disk-cache-gib's default


@dataclass(frozen=True)
class TierDeadlines:
    """The persistent tiers' deadlines in seconds (`kvpool run --disk-timeout ...`); None:
    the tier's own default (DiskTier's timeout_s 1, write_timeout_s 10, open_timeout_s 10;
    RedisTier's timeout_s 0.5)."""

    disk_s: float | None = None  # a disk read, stat, unlink or rename (DiskTier timeout_s)
    disk_write_s: float | None = None  # a whole disk write, a rescan (write_timeout_s)
    disk_open_s: float | None = None  # the disk tier's open, each answer (open_timeout_s)
    redis_s: float | None = None  # every Redis call (RedisTier timeout_s)

    def disk(self) -> dict[str, float]:
        """DiskTier's options for those given."""
        given = {"timeout_s": self.disk_s, "write_timeout_s": self.disk_write_s, "open_timeout_s": self.disk_open_s}
        return {name: value for name, value in given.items() if value is not None}


def open_persistent_tiers(
    disk_cache: str | os.PathLike | None = None,
    disk_cache_bytes: int = DEFAULT_DISK_CACHE_BYTES,
    redis_url: str | None = None,
    deadlines: TierDeadlines | None = None,
) -> list[Tier]:
    """The disk tier in `disk_cache` (LRU under `disk_cache_bytes`) and the Redis tier at
    `redis_url`, in lookup order, for those given; `deadlines` theirs (None: the defaults)."""
    deadlines = deadlines or TierDeadlines()
    tiers: list[Tier] = []
    if disk_cache is not None:
        from kvpool.tiers.disk import DiskTier

        tiers.append(DiskTier(disk_cache, disk_cache_bytes, **deadlines.disk()))
    if redis_url is not None:
        from kvpool.tiers.redis_tier import RedisTier  # imports the redis client only when asked for

        redis = {"timeout_s": deadlines.redis_s} if deadlines.redis_s is not None else {}
        tiers.append(RedisTier(redis_url, **redis))
    return tiers


class TierStack(Tier):
    name = "stack"

    def __init__(self, host: Tier | None, persistent: Sequence[Tier] = ()) -> None:
        if host is None and not persistent:
            raise ValueError("a tier stack needs at least one tier")
        self.host = host
        self.persistent = list(persistent)
        self.tiers: list[Tier] = ([host] if host is not None else []) + self.persistent
        self.stats = TierStats()  # the stack's own: none (each tier keeps its counters)

    @property
    def capacity_bytes(self) -> int:
        return sum(getattr(t, "capacity_bytes", 0) for t in self.tiers)

    @property
    def peak_bytes(self) -> int:
        """The host tier's peak: the memory the stack holds (disk and Redis are not memory)."""
        return getattr(self.host, "peak_bytes", 0) if self.host is not None else 0

    @property
    def num_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tiers)

    @property
    def num_entries(self) -> int:
        return sum(t.num_entries for t in self.tiers)

    def put(self, key: bytes, descriptor: BlockDescriptor, tensors: dict[str, Tensor]) -> bool:
        if self.host is not None:
            return self.host.put(key, descriptor, tensors)
        return self.persist(key, descriptor, tensors) > 0

    def persist(self, key: bytes, descriptor: BlockDescriptor, tensors: dict[str, Tensor]) -> int:
        """Write to every persistent tier that does not hold the block; how many accepted."""
        return sum(t.put(key, descriptor, tensors) for t in self.persistent if not t.holds(key, descriptor))

    def persisted(self, key: bytes, descriptor: BlockDescriptor) -> bool:
        """Whether every persistent tier holds the block (nothing to write)."""
        return all(t.holds(key, descriptor) for t in self.persistent)

    def lookup(self, key: bytes, expected: BlockDescriptor) -> bool:
        return any(t.lookup(key, expected) for t in self.tiers)

    def get(self, key: bytes, expected: BlockDescriptor) -> dict[str, Tensor] | None:
        for tier in self.tiers:
            if tier.contains(key):
                tensors = tier.get(key, expected)
                if tensors is not None:
                    return tensors
        return None

    def contains(self, key: bytes) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def holds(self, key: bytes, descriptor: BlockDescriptor) -> bool:
        if self.host is not None:
            return self.host.holds(key, descriptor)
        return self.persisted(key, descriptor)

    def evict(self, key: bytes) -> bool:
        return any([t.evict(key) for t in self.tiers])  # every tier's copy (a list: no short cut)

    def flush(self, timeout: float | None = None) -> bool:
        return all([t.flush(timeout) for t in self.tiers])

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()
