"""The tiers below a runner's device pool, set up, asked and reported in one place.

Every runner with tiers (Llama, V4) owns one `TierBridge`: the host tier, the persistent
tiers (disk, Redis) stacked under it, their content-key index and the counters of the
blocks that moved. The bridge answers what each runner asks of the tiers (is this block
held already, persisted already, hand this entry over) and reports them; it never touches
a device tensor. What differs stays with the runner: how blocks are gathered (Llama: every
layer of many blocks in one gather; V4: one block's compressed pools at a time), the Llama
host tier's swapped tails, V4's window snapshots.

The functions below the class ask a one-group cache (a coordinator of cache/) what the tiers
and P/D transfer need of its group: the blocks a tier may fill before an admission
(prefetch, install, publish), the evicted and published blocks, the prompt's prefix blocks,
and a request's partial tail block for a swap. They go through the coordinator's `root` and
`part` to the group's own calls (`CacheGroup`'s contract docstrings say what each changes);
the coordinator keeps only what changes a request (`complete_loads`, `restore_tail`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.cache import CacheDescriptor, CacheGroup, HybridCacheManager
from kvpool.pool import PrefixBlock
from kvpool.tiers import BlockDescriptor, Tier, TierIndex, TierStack


@dataclass
class TierMoves:
    """Blocks the runner moved between the device pool and its tiers, and the time."""

    num_offloaded: int = 0
    num_loaded: int = 0
    offload_s: float = 0.0
    load_s: float = 0.0
    num_swapped_out: int = 0  # preempted sequences written to the tier
    num_swapped_in: int = 0  # ... whose tail block came back (their full blocks come back as prefix hits)
    num_tail_tokens_restored: int = 0
    num_persisted: int = 0  # blocks handed to the persistent tiers (disk, Redis) as they completed
    persisted_bytes: int = 0  # their bytes
    persist_s: float = 0.0  # the step's share of that: the gather and the hand-over


@dataclass
class SWAMoves:
    """V4: the window snapshots written through to the persistent tiers (the blocks are
    `TierMoves`'), and those a hit restored its state from."""

    num_snapshots_persisted: int = 0
    snapshot_bytes_persisted: int = 0
    persist_s: float = 0.0  # the steps' share: gathers and hand-overs (the writes run behind)
    num_restores: int = 0  # hits whose state came from snapshots
    num_loaded: int = 0  # snapshots read for them
    load_bytes: int = 0
    load_s: float = 0.0
    num_misses: int = 0  # hits that wanted a snapshot the tiers did not hold (recomputed instead)


class TierBridge:
    """host_tier: a tier below the device pool (kvpool.tiers.HostTier); persistent_tiers:
    the disk and Redis tiers below it, looked up in that order. Without prefix caching no
    block is findable by content, so neither is any tier: the bridge then has none."""

    def __init__(
        self,
        host_tier: Tier | None,
        persistent_tiers: Sequence[Tier],
        block_size: int,
        *,
        enable_prefix_caching: bool,
    ) -> None:
        self.host_tier = host_tier if enable_prefix_caching else None
        self.persistent_tiers = list(persistent_tiers) if enable_prefix_caching else []
        self.tier: Tier | None = self.host_tier
        if self.persistent_tiers:
            self.tier = TierStack(self.host_tier, self.persistent_tiers)
        self.index = TierIndex(self.tier, block_size) if self.tier is not None else None
        self.moves = TierMoves()

    def expect_blocks(
        self, descriptor: CacheDescriptor, blocks: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    ) -> None:
        """Tell the persistent tiers the tensors of one block of this cache (name -> dtype,
        shape): an entry that is not such a block is a corrupt miss, not a wrong load."""
        for tier in self.persistent_tiers:
            tier.expect_tensors(descriptor.model_id, descriptor.layout_id, blocks)

    def unheld(self, block: PrefixBlock) -> tuple[bytes, BlockDescriptor] | None:
        """(content key, descriptor) of `block` when the tier does not hold it yet (an
        offload writes it), else None (writing it again would only cost)."""
        assert self.tier is not None and self.index is not None
        key, descriptor = self.index.describe(block)
        return None if self.tier.holds(key, descriptor) else (key, descriptor)

    def unpersisted(self, block: PrefixBlock) -> tuple[bytes, BlockDescriptor] | None:
        """(content key, descriptor) of `block` when some persistent tier lacks it (the
        write-through hands it over), else None."""
        assert isinstance(self.tier, TierStack) and self.index is not None
        key, descriptor = self.index.describe(block)
        return None if self.tier.persisted(key, descriptor) else (key, descriptor)

    def get(self, block: PrefixBlock) -> dict[str, torch.Tensor] | None:
        """The tensors a tier holds valid for `block`, or None (gone, or not this block)."""
        assert self.tier is not None and self.index is not None
        return self.tier.get(*self.index.describe(block))

    def persist(self, key: bytes, descriptor: BlockDescriptor, tensors: dict[str, torch.Tensor]) -> int:
        """Hand an entry to the persistent tiers' background writers; its bytes if any took
        it, else 0."""
        assert isinstance(self.tier, TierStack)
        if self.tier.persist(key, descriptor, tensors) == 0:
            return 0
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the persistent tiers' background writes (before a process exits)."""
        return self.tier.flush(timeout) if self.tier is not None else True

    def close(self) -> None:
        """Finish the background writes and close the tiers."""
        if self.tier is not None:
            self.tier.close()

    def check_integrity(self) -> None:
        if self.tier is not None:
            self.tier.check_integrity()

    def host_report(self, hit_tokens: int, extra: dict[str, object]) -> dict[str, object]:
        """The host tier's report: its occupancy, `hit_tokens` (the prefix tokens it served,
        as the runner counts them), the moves, the runner's `extra` figures, its counters."""
        host = self.host_tier
        assert host is not None
        moves = self.moves
        return {
            "capacity_bytes": host.capacity_bytes,
            "bytes_used": host.num_bytes,
            "entries": host.num_entries,
            "hit_tokens": hit_tokens,
            "blocks_offloaded": moves.num_offloaded,
            "blocks_loaded": moves.num_loaded,
            "offload_ms": round(moves.offload_s * 1e3, 3),
            "load_ms": round(moves.load_s * 1e3, 3),
            **extra,
            **host.stats.as_dict(),
        }

    def persistent_reports(self, hit_tokens_per_get: int | None) -> dict[str, dict[str, object]]:
        """{"<name>_tier": its report} per persistent tier, with "hit_tokens" (its gets times
        `hit_tokens_per_get`) unless that is None."""
        reports: dict[str, dict[str, object]] = {}
        for tier in self.persistent_tiers:
            report = tier.report()
            if hit_tokens_per_get is not None:
                report = {**report, "hit_tokens": tier.stats.num_gets * hit_tokens_per_get}
            reports[f"{tier.name}_tier"] = report
        return reports

    def lookup_order(self) -> list[str]:
        assert isinstance(self.tier, TierStack)
        return [t.name for t in self.tier.tiers]


# ---- a one-group cache's tier and P/D queries, asked of its group ------------------------


def one_group(cache: HybridCacheManager, what: str) -> CacheGroup:
    """The cache's one group; ValueError naming `what` for a cache of several."""
    if len(cache.groups) != 1:
        raise ValueError(f"{what} serves a one-group cache, got {len(cache.groups)} groups")
    (group,) = cache.groups.values()
    return group


def prefetch_candidates(
    cache: HybridCacheManager, token_ids: Sequence[int], tenant_salt: str = ""
) -> tuple[list[int], list[PrefixBlock]]:
    """(the device hit's blocks, the prompt's full blocks after it as unregistered prefix
    blocks): what a lower tier may hold and the group's `install` can bring in before the
    admission (its `publish_installed` then makes them hits). ([], []) for a cache of more
    than one group, or one whose admission loads a lower tier's blocks itself
    (`GroupAdmission.loads`). Changes nothing."""
    if len(cache.groups) != 1 or len(token_ids) == 0:
        return [], []
    return one_group(cache, "prefetch").prefetch_candidates(cache.root(tenant_salt), list(token_ids))


def take_evicted(cache: HybridCacheManager) -> list[tuple[int, PrefixBlock]]:
    """Cached blocks the allocator evicted since the last call, (block id, the content it
    held), oldest first: their slots hold that content until the next forward writes them.
    Empty without a lower tier (which serves a one-group cache)."""
    return [e for g in cache.groups.values() for e in g.take_evicted()]


def take_published(cache: HybridCacheManager) -> list[tuple[int, PrefixBlock]]:
    """Blocks that became full cached blocks since the last call, (block id, its prefix
    block), in order: their content is final. Empty unless the cache records them."""
    return [p for g in cache.groups.values() for p in g.take_published()]


def prefix_blocks(
    cache: HybridCacheManager, token_ids: Sequence[int], tenant_salt: str = ""
) -> tuple[list[int], list[PrefixBlock]]:
    """`CacheGroup.prefix_blocks` under `tenant_salt`: ids valid until the pool next allocates."""
    return one_group(cache, "prefix_blocks").prefix_blocks(cache.root(tenant_salt), list(token_ids))


def chain_for(cache: HybridCacheManager, token_ids: Sequence[int], tenant_salt: str = "") -> list[PrefixBlock]:
    """`CacheGroup.chain_for` under the cache's descriptor and `tenant_salt`."""
    return one_group(cache, "chain_for").chain_for(cache.root(tenant_salt), list(token_ids))


def tail_block(cache: HybridCacheManager, request_id: str) -> tuple[int, PrefixBlock, int] | None:
    """(block id, an unregistered prefix block for its content, tokens) of the request's
    computed partial block, saved at preemption; None on a block boundary, caching off, a
    cache of several groups, or a group without such blocks."""
    nc, bs = cache.num_computed_tokens(request_id), cache.block_size
    if len(cache.groups) != 1 or not cache.pool.enable_caching or nc % bs == 0:
        return None
    part = cache.part(request_id)
    tail = part.group.partial_block(part.state, part.token_ids, part.mm_items, nc - nc % bs, nc)
    return None if tail is None else (*tail, nc % bs)


def tail_block_for_restore(
    cache: HybridCacheManager, request_id: str, num_tokens: int
) -> tuple[int, PrefixBlock] | None:
    """(block id, prefix block of its would-be content) for restoring `num_tokens` positions
    after the computed full blocks (the coordinator's `restore_tail`); None when they cannot
    be (`restore_refusal`)."""
    if cache.restore_refusal(request_id, num_tokens) is not None:
        return None
    part = cache.part(request_id)
    nc = part.num_computed
    return part.group.partial_block(part.state, part.token_ids, part.mm_items, nc, nc + num_tokens)
