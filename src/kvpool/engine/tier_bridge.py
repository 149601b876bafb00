"""The tiers below a runner's device pool, set up, asked and reported in one place.

The model runner (engine/runner.py) owns one `TierBridge`: the host tier, the persistent
tiers (disk, Redis) stacked under it, their content-key index, the counters of the blocks
that moved, and the moves themselves: eviction saves, lower-tier loads, V4's prefetch
before admission, the write-through of published blocks, the swap of a preempted request
(its full blocks and its partial tail; V4: its state, as a window snapshot taken where it
stopped), and V4's window snapshots. The runner decides when (admission, reservation,
commit, preemption, the step's pieces) and hands in its cache and executor; the bridge
never touches a device tensor itself: the executor gathers and writes the blocks
(`to_host`, `to_device`; Llama: every layer of many blocks in one gather, V4: one block's
compressed pools at a time) and the window snapshots.

The functions below the class ask a one-group cache (a coordinator of cache/) what the tiers
and P/D transfer need of its group: the blocks a tier may fill before an admission
(prefetch, install, publish), the evicted and published blocks, the prompt's prefix blocks,
and a request's partial tail block for a swap. They go through the coordinator's `root` and
`part` to the group's own calls (`CacheGroup`'s contract docstrings say what each changes);
the coordinator keeps only what changes a request (`complete_loads`, `restore_tail`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvpool.cache import Admission, CacheDescriptor, CacheGroup, HybridCacheManager, Reservation
from kvpool.engine.memory import check_fits
from kvpool.pool import PrefixBlock
from kvpool.tiers import BlockDescriptor, Tier, TierIndex, TierStack
from kvpool.tiers.swa import SWAStrategy, snapshot_descriptor, snapshot_key


@dataclass
class TierMoves:
    """Blocks the runner moved between the device pool and its tiers, and the time."""

    num_offloaded: int = 0
    num_loaded: int = 0
    offload_s: float = 0.0
    load_s: float = 0.0
    num_swapped_out: int = 0  # preempted sequences written to the tier
    num_swapped_in: int = 0  # ... whose tail block (V4: state) came back (their full blocks come back as hits)
    num_tail_tokens_restored: int = 0  # tokens past the last full block those restored
    num_states_swapped_out: int = 0  # V4: state entries written by swap-outs, and their bytes
    state_bytes_swapped_out: int = 0
    state_bytes_swapped_in: int = 0  # ... and the bytes of those swap-ins took back
    num_prefetched_tokens: int = 0  # tokens of the blocks `prefetch` loaded (a lower tier's hits)
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
        self.block_size = block_size
        self.moves = TierMoves()
        # request -> (computed tokens at preemption, its tail block's tokens, the tail's
        # tier key): restored on resume
        self.swapped: dict[str, tuple[int, int, bytes]] = {}
        # V4: request -> (computed tokens at preemption, its state entry's tier key)
        self.swapped_states: dict[str, tuple[int, bytes, PrefixBlock]] = {}
        self.swa: SWAStrategy | None = None  # V4's window snapshots (set by a runner that keeps them)
        self.swa_moves = SWAMoves()

    def expect_blocks(
        self, descriptor: CacheDescriptor, blocks: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    ) -> None:
        """Tell the persistent tiers the tensors of one block of this cache (name -> dtype,
        shape): an entry that is not such a block is a corrupt miss, not a wrong load."""
        for tier in self.persistent_tiers:
            tier.expect_tensors(descriptor.model_id, descriptor.weights_version, descriptor.layout_id, blocks)

    def check_sizes(
        self,
        block_bytes: int,
        descriptor: CacheDescriptor | None = None,
        blocks: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None,
    ) -> None:
        """ValueError for a tier whose byte limit holds no block of `block_bytes` (it would
        refuse every block, silently: a disk tier did), and for a host tier larger than the
        memory this machine has available now (it fills as blocks are evicted: past that
        memory the process is killed mid-run, with every request it serves). A tier that
        stores an entry with a header (the disk tier) is weighed by that entry's real size,
        from `descriptor` and `blocks` (expect_blocks'): a limit of the tensors' bytes alone
        passed and still refused every block."""
        flags = {"host": "--host-cache-gib", "disk": "--disk-cache-gib"}
        for tier in ([self.host_tier] if self.host_tier is not None else []) + self.persistent_tiers:
            capacity = getattr(tier, "capacity_bytes", None)  # (Redis: the server's own limit)
            if capacity is None:
                continue
            needed, stored = block_bytes, ""
            if blocks and descriptor is not None and hasattr(tier, "entry_bytes"):
                needed = tier.entry_bytes(descriptor, self.block_size, blocks)
                stored = f" ({needed} bytes stored, with its entry's header)"
            if capacity < needed:
                flag = flags.get(tier.name, tier.name)
                raise ValueError(
                    f"a {tier.name} tier of {capacity} bytes ({flag}) holds no KV block of {block_bytes} bytes{stored}"
                )
        capacity = getattr(self.host_tier, "capacity_bytes", None)
        if capacity is not None:
            check_fits(capacity, "cpu", "the host tier (--host-cache-gib)", "lower --host-cache-gib")

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

    # ---- the block moves between a runner's device pool (`executor`) and the tiers ------------
    # (executor: `to_host(block_ids)` / `to_device(block_ids, blocks)`, engine/runner.py's
    # Executor; cache: the runner's coordinator, a one-group cache where a tier serves it)

    def save_evicted(self, cache: HybridCacheManager, executor: Any) -> None:
        """Write the cached blocks the allocator just evicted to the tier (a block whose
        content the tier already holds is not written again)."""
        todo = []
        for block_id, block in take_evicted(cache):
            entry = self.unheld(block)
            if entry is not None:
                todo.append((block_id, *entry))
        self.write(executor, todo)

    def write(self, executor: Any, todo: list[tuple[int, bytes, BlockDescriptor]]) -> None:
        """(device block, content key, descriptor) -> the tier."""
        assert self.tier is not None
        if not todo:
            return
        start = time.perf_counter()
        blocks = executor.to_host([block_id for block_id, _, _ in todo])
        for (_, key, descriptor), tensors in zip(todo, blocks, strict=True):
            if self.tier.put(key, descriptor, tensors):
                self.moves.num_offloaded += 1
        self.moves.offload_s += time.perf_counter() - start

    def load(self, executor: Any, loads: Sequence[tuple[int, PrefixBlock]]) -> int:
        """Copy lower-tier blocks into their device blocks (device block, prefix block), in
        order, up to the first the tier no longer holds valid; how many were loaded. A block
        becomes visible (findable, readable) only after this, through the cache's
        `complete_loads` or the group's `publish_installed`."""
        start = time.perf_counter()
        got: list[tuple[int, dict[str, torch.Tensor]]] = []
        for block_id, block in loads:
            tensors = self.get(block)
            if tensors is None:
                break
            got.append((block_id, tensors))
        if got:
            executor.to_device([block_id for block_id, _ in got], [t for _, t in got])
            self.moves.num_loaded += len(got)
        self.moves.load_s += time.perf_counter() - start
        return len(got)

    def write_through(self, cache: HybridCacheManager, executor: Any) -> None:
        """The blocks the step completed (published), copied and handed to the persistent
        tiers' background writers; a block every one of them holds is skipped."""
        published = take_published(cache)
        if not published:
            return
        start = time.perf_counter()
        todo = []
        for block_id, block in published:
            entry = self.unpersisted(block)
            if entry is not None:
                todo.append((block_id, *entry))
        moves = self.moves
        if todo:
            blocks = executor.to_host([b for b, _, _ in todo])
            for (_, key, descriptor), tensors in zip(todo, blocks, strict=True):
                num_bytes = self.persist(key, descriptor, tensors)
                moves.num_persisted += num_bytes > 0
                moves.persisted_bytes += num_bytes
        moves.persist_s += time.perf_counter() - start

    def prefetch(self, cache: HybridCacheManager, executor: Any, token_ids: Sequence[int], tenant_salt: str) -> None:
        """The blocks after the device hit that the tier holds valid, where the cache takes
        them before an admission (V4's dual pool): into fresh blocks, checked, then
        published as cached blocks for the admission to hit."""
        assert self.index is not None
        hit, candidates = prefetch_candidates(cache, token_ids, tenant_salt)
        num_found = self.index.find(candidates) if candidates else 0
        if not num_found:
            return
        group = one_group(cache, "prefetch")
        block_ids = group.install(num_found, hold=hit)
        self.save_evicted(cache, executor)  # the fresh blocks may be evicted ones: save them first
        if block_ids is None:
            return
        num_loaded = self.load(executor, list(zip(block_ids, candidates, strict=False)))
        self.moves.num_prefetched_tokens += num_loaded * self.block_size
        group.publish_installed(block_ids, candidates[:num_found], num_loaded)

    def swap_out(self, cache: HybridCacheManager, executor: Any, request_id: str, *, with_state: bool = True) -> None:
        """Write a preempted request's computed blocks to the host tier now: its full blocks
        under their content keys (skipped when the tier holds them), its partial tail block
        under the partial content's key, or (V4) its state after its computed tokens as a
        state entry (`swap_state_block`): the window, the pending compressor rows and the
        unfinished span's entries, as a window snapshot taken there; remember what `swap_in`
        restores. A block or state that does not fit is simply computed again on resume.
        with_state=False: the state block does not hold the state yet (its admission's
        replay was still deferred to the next step): the blocks only."""
        assert self.tier is not None and self.index is not None
        todo = []
        chain = cache.part(request_id).prefix_chain()  # the full computed blocks' prefix blocks
        for block_id, block in zip(cache.block_ids(request_id), chain, strict=False):
            entry = self.unheld(block)
            if entry is not None:
                todo.append((block_id, *entry))
        tail = tail_block(cache, request_id)
        if tail is not None:
            todo.append((tail[0], *self.index.describe(tail[1])))
        self.write(executor, todo)
        self.moves.num_swapped_out += 1
        if tail is not None and self.tier.holds(todo[-1][1], todo[-1][2]):
            self.swapped[request_id] = (cache.num_computed_tokens(request_id), tail[2], todo[-1][1])
        state = swap_state_block(cache, request_id) if with_state else None
        if state is not None:
            self._swap_state_out(cache, executor, request_id, state)

    def _swap_state_out(self, cache: HybridCacheManager, executor: Any, request_id: str, block: PrefixBlock) -> None:
        """V4: the request's live state as a window snapshot of the whole window at its
        computed tokens (the unfinished span's entries included), filed in the tier under
        `block`'s content key with its layout marked as a swapped state."""
        assert self.tier is not None
        start = time.perf_counter()
        num_computed = cache.num_computed_tokens(request_id)
        key, descriptor = self._swap_state_entry(block, executor.spec.window)
        slot = cache.part(request_id).state_slot
        tensors = executor.window_snapshot(slot, num_computed, executor.spec.window, unfinished_span=True)
        moves = self.moves
        if self.tier.put(key, descriptor, tensors):
            moves.num_states_swapped_out += 1
            moves.state_bytes_swapped_out += sum(t.numel() * t.element_size() for t in tensors.values())
            self.swapped_states[request_id] = (num_computed, key, block)
            cache.hold_swapped_state(block, True)  # its resume's hit is not cut below its span boundary
        moves.offload_s += time.perf_counter() - start

    def _swap_state_entry(self, block: PrefixBlock, window: int) -> tuple[bytes, BlockDescriptor]:
        """(tier key, descriptor) of a swapped-out state named by `block` (its content key:
        the whole prefix up to the state), the layout marked as a swapped state."""
        assert self.index is not None
        key, descriptor = self.index.describe(block)
        return key, replace(descriptor, layout_id=f"{descriptor.layout_id}:v4-swap-state{window}")

    def drop_swapped(self, request_id: str, cache: HybridCacheManager | None = None) -> None:
        """Forget a swapped-out request that will not resume (released while it waited):
        its tail's (V4: state's) tier entry goes, as one not restored at `swap_in` does
        (`cache`: the cache that holds the state's boundary, V4)."""
        swapped = self.swapped.pop(request_id, None)
        if swapped is not None and self.tier is not None:
            self.tier.evict(swapped[2])
        state = self.swapped_states.pop(request_id, None)
        if state is not None and self.tier is not None:
            self.tier.evict(state[1])
            assert cache is not None, "a swapped state's boundary is held in the cache"
            cache.hold_swapped_state(state[2], False)

    def swap_in(self, cache: HybridCacheManager, executor: Any, request_id: str, admission: Admission) -> Admission:
        """After the full blocks of a swapped-out request came back (device or host) at its
        admission, the tail block's KV from the tier, if it is still there and the prefix
        before it is exactly the swapped one: the admission to follow (`restore_tail`'s, or
        `admission` as it was). The tail's entry leaves the tier either way: a partial block
        serves this request only, and a tail not restored now is computed again. V4: the
        state entry, the same way (`_swap_state_in`)."""
        assert self.tier is not None and self.index is not None
        if request_id in self.swapped_states:
            return self._swap_state_in(cache, executor, request_id, admission)
        swapped = self.swapped.pop(request_id, None)
        if swapped is None:
            return admission
        num_computed, num_tail, key = swapped
        tail = None
        if admission.num_cached_tokens == num_computed - num_tail:  # else fewer full blocks came back
            tail = tail_block_for_restore(cache, request_id, num_tail)
        if tail is None:
            self.tier.evict(key)
            return admission
        block_id, block = tail
        start = time.perf_counter()
        tensors = self.get(block)
        if tensors is None:
            self.tier.evict(key)  # (a corrupt entry: gone already, or now)
            return admission
        executor.to_device([block_id], [tensors])
        self.tier.evict(key)
        moves = self.moves
        moves.load_s += time.perf_counter() - start
        moves.num_loaded += 1
        moves.num_swapped_in += 1
        moves.num_tail_tokens_restored += num_tail
        return cache.restore_tail(request_id, num_tail)

    def _swap_state_in(
        self, cache: HybridCacheManager, executor: Any, request_id: str, admission: Admission
    ) -> Admission:
        """V4: the swapped-out state back into the request's state block, when the admission
        hit the last span boundary before it (its spans came back, device or host), the
        state entry is still there and the cache can count its unfinished span's tokens as
        computed (`swapped_state_refusal`): then nothing is replayed, and the admission to
        follow is `restore_swapped_state`'s. Otherwise `admission` as it was (its replay or
        checkpoint restore, as without a swap). The entry leaves the tier either way."""
        assert self.tier is not None
        num_computed, key, swapped = self.swapped_states.pop(request_id)
        cache.hold_swapped_state(swapped, False)  # (the admission is made: the boundary served its hit)
        span = self.block_size
        num_tail = num_computed % span
        block = None
        if admission.num_cached_tokens == num_computed - num_tail and not cache.swapped_state_refusal(
            request_id, num_tail
        ):
            # the prefix is the swapped one: the name comes out the same, else it is a miss
            block = swap_state_block(cache, request_id, num_computed)
        if block is None:
            self.tier.evict(key)
            return admission
        start = time.perf_counter()
        entry = self._swap_state_entry(block, executor.spec.window)
        tensors = self.tier.get(*entry) if entry[0] == key else None
        self.tier.evict(key)
        if tensors is None:  # (gone, or corrupt)
            return admission
        executor.restore_window(cache.part(request_id).state_slot, num_computed, [(num_computed, tensors)])
        moves = self.moves
        moves.load_s += time.perf_counter() - start
        moves.num_swapped_in += 1
        moves.num_tail_tokens_restored += num_tail
        moves.state_bytes_swapped_in += sum(t.numel() * t.element_size() for t in tensors.values())
        return cache.restore_swapped_state(request_id, num_tail)

    # ---- V4's window snapshots at block boundaries (dual pool with persistent tiers) ---------

    def _snapshot_entry(self, block: PrefixBlock, window: int) -> tuple[bytes, BlockDescriptor]:
        """(tier key, descriptor) of the window snapshot at the end of prefix block `block`."""
        assert self.swa is not None and self.index is not None
        rows = self.swa.window_rows(self.block_size, window)
        key, descriptor = self.index.describe(block)
        return snapshot_key(key, rows), snapshot_descriptor(key, descriptor, rows)

    def restore_window(
        self, cache: HybridCacheManager, executor: Any, request_id: str, num_cached: int, state_slot: int
    ) -> int:
        """The state at the latest snapshot the SWA strategy can restore a hit of `num_cached`
        tokens from (an earlier one when a snapshot is missing), written into `state_slot`;
        that boundary, or 0 (none: recompute)."""
        if self.swa is None or self.tier is None:
            return 0
        spec, span = executor.spec, self.block_size
        points = self.swa.restore_points(num_cached, span, spec.window, spec.num_layers)
        if not points:
            return 0
        began = time.perf_counter()
        chain = cache.part(request_id).prefix_chain(reserved=True)
        moves = self.swa_moves
        for point, needed in points:
            snapshots = []
            for boundary in needed:
                key, descriptor = self._snapshot_entry(chain[boundary // span - 1], spec.window)
                tensors = self.tier.get(key, descriptor) if self.tier.lookup(key, descriptor) else None
                if tensors is None:
                    moves.num_misses += 1
                    break
                snapshots.append((boundary, tensors))
            else:
                executor.restore_window(state_slot, point, snapshots)
                moves.num_restores += 1
                moves.num_loaded += len(snapshots)
                moves.load_bytes += sum(t.numel() * t.element_size() for _, ts in snapshots for t in ts.values())
                moves.load_s += time.perf_counter() - began
                return point
        moves.load_s += time.perf_counter() - began
        return 0

    def snapshots_wanted(
        self, cache: HybridCacheManager, executor: Any, request_id: str, res: Reservation
    ) -> dict[int, tuple[bytes, BlockDescriptor]]:
        """Boundaries the step crosses where the SWA strategy keeps a snapshot that the
        persistent tiers lack: boundary -> (tier key, descriptor)."""
        if self.swa is None or self.swa.kind == "zero":
            return {}
        span = self.block_size
        positions = self.swa.snapshot_positions(res.start, res.start + res.num_tokens, span)
        if not positions:
            return {}
        assert isinstance(self.tier, TierStack)
        chain = cache.part(request_id).prefix_chain(reserved=True)
        wanted = {}
        for boundary in positions:
            key, descriptor = self._snapshot_entry(chain[boundary // span - 1], executor.spec.window)
            if not self.tier.persisted(key, descriptor):
                wanted[boundary] = (key, descriptor)
        return wanted

    def persist_snapshot(
        self,
        cache: HybridCacheManager,
        executor: Any,
        request_id: str,
        boundary: int,
        entry: tuple[bytes, BlockDescriptor],
    ) -> None:
        """The request's state at `boundary` handed to the persistent tiers as a window snapshot."""
        assert self.swa is not None
        began = time.perf_counter()
        rows = self.swa.window_rows(self.block_size, executor.spec.window)
        tensors = executor.window_snapshot(cache.part(request_id).state_slot, boundary, rows)
        num_bytes = self.persist(*entry, tensors)
        self.swa_moves.num_snapshots_persisted += num_bytes > 0
        self.swa_moves.snapshot_bytes_persisted += num_bytes
        self.swa_moves.persist_s += time.perf_counter() - began

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


def swap_state_block(cache: HybridCacheManager, request_id: str, num_computed: int | None = None) -> PrefixBlock | None:
    """`CacheGroup.swap_state_block` of the request's state after `num_computed` tokens (None:
    its computed tokens), on a one-group cache with caching on; None otherwise, or for a
    group whose state a swap does not save."""
    if len(cache.groups) != 1 or not cache.pool.enable_caching:
        return None
    part = cache.part(request_id)
    n = part.num_computed if num_computed is None else num_computed
    return part.group.swap_state_block(part.state, part.token_ids, part.mm_items, n)
