"""The host-memory tier: blocks evicted from the device pool, in (pinned, on a CUDA
machine) host memory, LRU under a byte limit.

Each entry owns its tensors (a copy of one block's K and V for every layer) and the
block's descriptor. `put` makes room by pushing out least recently used entries; a block
larger than the whole tier is refused and counted. `lookup` and `get` refresh an entry's
LRU place; a descriptor that does not match the caller's is a miss, counted under each
differing field, and the entry is reclaimed (it was written under another model version,
layout or tenant, and can never serve this one).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from kvpool.cache.types import CacheDescriptor
from kvpool.tiers.base import Tier, TierStats
from kvpool.tiers.descriptor import BlockDescriptor


@dataclass
class _Entry:
    descriptor: BlockDescriptor
    tensors: dict[str, Tensor]
    num_bytes: int


class HostTier(Tier):
    name = "host"

    def __init__(self, capacity_bytes: int, *, pin_memory: bool | None = None) -> None:
        """pin_memory: page-locked host memory, for asynchronous copies to a GPU (None: when
        CUDA is available)."""
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"host tier capacity must be a positive number of bytes, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU first
        self._num_bytes = 0
        self.peak_bytes = 0  # the most the tier held at once (the memory ledger's host_tier line)
        self.stats = TierStats()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def holds(self, key: bytes, descriptor: BlockDescriptor) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.descriptor == descriptor

    def touch(self, key: bytes, descriptor: BlockDescriptor) -> int:
        """Move the entry to the LRU's end (evicted last) if the tier holds it under
        `descriptor`; its bytes, 0 when not held. Counts no lookup."""
        if not self.holds(key, descriptor):
            return 0
        self._entries.move_to_end(key)
        return self._entries[key].num_bytes

    def _copy(self, tensor: Tensor) -> Tensor:
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin_memory)
        out.copy_(tensor)
        return out

    def put(self, key: bytes, descriptor: BlockDescriptor, tensors: dict[str, Tensor]) -> bool:
        start = time.perf_counter()
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if num_bytes > self.capacity_bytes:
            self.stats.num_rejected_puts += 1
            return False
        # copied before anything is dropped: a copy that fails (pinned memory refused, a
        # device error) leaves every entry in place (the copy is briefly beside them)
        copies = {name: self._copy(t) for name, t in tensors.items()}
        self.evict(key)  # replaced (a newer write of the same content key), not counted as an eviction
        while self._num_bytes + num_bytes > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self._num_bytes -= old.num_bytes
            self.stats.num_evictions += 1
        self._entries[key] = _Entry(descriptor, copies, num_bytes)
        self._num_bytes += num_bytes
        self.peak_bytes = max(self.peak_bytes, self._num_bytes)
        self.stats.num_puts += 1
        self.stats.num_put_bytes += num_bytes
        self.stats.put_s += time.perf_counter() - start
        return True

    def _valid(self, key: bytes, expected: BlockDescriptor) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses["absent"] += 1
            return None
        differ = entry.descriptor.mismatches(expected)
        if differ:
            self.stats.mismatches.update(differ)
            self.stats.misses["mismatch"] += 1
            self.evict(key)
            self.stats.num_reclaimed += 1
            return None
        self._entries.move_to_end(key)
        return entry

    def lookup(self, key: bytes, expected: BlockDescriptor) -> bool:
        self.stats.num_lookups += 1
        found = self._valid(key, expected) is not None
        self.stats.num_lookup_hits += found
        return found

    def get(self, key: bytes, expected: BlockDescriptor) -> dict[str, Tensor] | None:
        entry = self._valid(key, expected)
        if entry is None:
            self.stats.num_get_misses += 1
            return None
        self.stats.num_gets += 1
        self.stats.num_get_bytes += entry.num_bytes  # (no copy here: the caller's load is timed by the caller)
        return entry.tensors

    def evict(self, key: bytes) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._num_bytes -= entry.num_bytes
        return True

    def reclaim(self, current: CacheDescriptor) -> int:
        """Drop every entry written under another model, weights, tokenizer, template,
        adapter, RoPE or layout than `current`'s (a version switch); returns how many."""
        model_fields = [f.name for f in fields(CacheDescriptor)]
        stale = [
            key
            for key, entry in self._entries.items()
            if any(getattr(entry.descriptor, f) != getattr(current, f) for f in model_fields)
        ]
        for key in stale:
            self.evict(key)
        self.stats.num_reclaimed += len(stale)
        return len(stale)

    def check_integrity(self) -> None:
        total = sum(e.num_bytes for e in self._entries.values())
        if total != self._num_bytes or total > self.capacity_bytes:
            raise AssertionError(
                f"host tier: {total} B stored, {self._num_bytes} B counted, {self.capacity_bytes} B limit"
            )
        for key, entry in self._entries.items():
            if entry.descriptor.content_key != key.hex():
                raise AssertionError(
                    f"host tier: entry {key.hex()} holds the descriptor of {entry.descriptor.content_key}"
                )
