"""The interface every tier below device memory implements (host memory here; disk and a
shared Redis tier later), and the counters each one keeps.

A tier stores whole blocks: one block's tensors, for every layer, under its content key
(descriptor.py), with the block's `BlockDescriptor` beside them. `lookup` and `get`
validate the stored descriptor against the one the caller expects, field by field: a
mismatch is a miss counted under each field that differs, and the entry, which can never
serve this caller, is reclaimed. Nothing is ever reinterpreted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field

from torch import Tensor

from kvpool.tiers.descriptor import BlockDescriptor


@dataclass
class TierStats:
    num_puts: int = 0  # blocks stored
    num_put_bytes: int = 0
    num_rejected_puts: int = 0  # a block larger than the whole tier
    num_lookups: int = 0  # admission probes (repeated while an admission waits for blocks)
    num_lookup_hits: int = 0  # ... that found a valid entry
    num_gets: int = 0  # blocks handed back (loaded)
    num_get_bytes: int = 0
    num_get_misses: int = 0  # gets that found no valid entry (gone or refused since the probe)
    num_evictions: int = 0  # entries pushed out by the byte limit (LRU)
    num_reclaimed: int = 0  # entries dropped because their descriptor can no longer serve
    num_dropped_puts: int = 0  # writes dropped because the background writer's queue was full
    num_write_errors: int = 0  # writes that failed (disk full, the Redis server gone)
    num_corrupt: int = 0  # entries whose bytes did not check out (quarantined on disk)
    put_s: float = 0.0  # time spent storing (the background writer's, for disk and Redis)
    get_s: float = 0.0  # time spent reading blocks back (gets)
    mismatches: Counter[str] = field(default_factory=Counter)  # descriptor field -> misses it caused
    # misses (lookups and gets) by cause: "absent", "mismatch", "corrupt", "unavailable" (Redis down)
    misses: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {k: v for k, v in self.__dict__.items() if k not in ("mismatches", "misses")}
        out["put_s"], out["get_s"] = round(self.put_s, 6), round(self.get_s, 6)
        out["mismatches"] = dict(sorted(self.mismatches.items()))
        out["misses"] = dict(sorted(self.misses.items()))
        return out


class Tier(ABC):
    """One storage tier below device memory, holding whole blocks by content key."""

    name: str
    stats: TierStats

    @abstractmethod
    def put(self, key: bytes, descriptor: BlockDescriptor, tensors: dict[str, Tensor]) -> bool:
        """Store a block (its tensors are copied). False when it can never fit; an entry
        under the same key is replaced."""

    @abstractmethod
    def lookup(self, key: bytes, expected: BlockDescriptor) -> bool:
        """Whether a valid entry is stored under `key` (no data moves; the entry's LRU place
        is refreshed). A descriptor mismatch is a counted miss and reclaims the entry."""

    @abstractmethod
    def get(self, key: bytes, expected: BlockDescriptor) -> dict[str, Tensor] | None:
        """The block's tensors, validated like `lookup`; None on a miss."""

    def expect_tensors(  # noqa: B027 - optional: a tier with nothing to check keeps this
        self, model_id: str, weights_version: str, layout_id: str, tensors: dict[str, tuple[object, tuple[int, ...]]]
    ) -> None:
        """Declare the tensors every block of (model_id, weights_version, layout_id), a
        namespace (entry.namespace), has: {name: (torch dtype,
        shape)}. A tier that reads entries others may have written (disk, Redis) refuses one
        whose tensors differ as a corrupt miss; a tier of this process's own copies has
        nothing to check."""

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether any entry is stored under `key` (no validation, no counter, no LRU move)."""

    @abstractmethod
    def holds(self, key: bytes, descriptor: BlockDescriptor) -> bool:
        """Whether the entry under `key` is exactly this block (its descriptor equal): a
        writer need not store it again. No counter, no LRU move."""

    @abstractmethod
    def evict(self, key: bytes) -> bool:
        """Drop the entry under `key`; False when there is none."""

    @property
    @abstractmethod
    def num_bytes(self) -> int:
        """Bytes the stored tensors take now."""

    @property
    @abstractmethod
    def num_entries(self) -> int: ...

    @abstractmethod
    def check_integrity(self) -> None:
        """AssertionError when the tier's bookkeeping disagrees with what it stores."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted `put` is stored (tiers that write in the background);
        False on timeout."""
        return True

    def close(self) -> None:
        """Store what is queued and release what the tier holds open."""
        self.flush()
