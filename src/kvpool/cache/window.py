"""The attention group: paged K/V of full-attention or sliding-window layers on a BlockPool,
driven by the coordinator (cache/coordinator.py) through the `CacheGroup` protocol. No torch.

Window rule. A layer of window W lets the query at position t read the keys of positions
[t - W + 1, t] (W keys, itself included; Gemma-2 / Mistral convention); full attention is
W = infinity. A request whose first `num_computed` tokens are computed and that computes
[num_computed, end) next needs the keys from lo = max(0, num_computed - W + 1) on, so its
table covers

  logical blocks [first, ceil(end / bs)),  first = lo // bs  (full attention: first = 0)
  [0, first * bs)            left the window: released to the pool's free queue (still
                             findable by hash while they stay cached)
  [first * bs, num_computed) committed keys the next step reads (the hit's blocks are
                             shared read-only)
  [num_computed, end)        the reserved step's slots: exclusive, unpublished

Blocks are released as the request advances: at every commit the blocks wholly before the
new lo go back, tail-first. A write that starts inside a computed block the request may
not write (shared after a fork: copy it first; still published after a rollback:
unregister it first) is made writable by the step's reservation.

Prefix hits (`hits`). Full attention: the leading run of the prompt's cached full blocks
(`BlockPool.match`), then, at an admission, the blocks after it that a lower tier holds
(they go into fresh blocks, `loads`, and are findable once `complete_loads` says they are
loaded). A window: each full block looked up on its own (`BlockPool.lookup`), so the
blocks of a window are found from the right after the blocks before them have been
evicted (vLLM's sliding-window rule). A full group serves a point P when every block
before P is cached; a window group when the blocks covering [max(0, P - W + 1), P) are.
A point inside a block takes that cached block as the source of a copy (copy-on-write):
the request gets a fresh block, the runner copies the source into it before the step
writes position P, and the source stays held until the request's first commit, so nothing
can reuse it before the copy is made.

Turn ends (Figure 12 in full; full attention). A request that finishes inside a block
(`keep_turn_end`, the coordinator's `turn_end_checkpoints`) leaves its partial last block
findable: registered under its tokens [T // bs * bs, T) with a "turn" key, listed in a side
index by its parent's hash. A follow-up turn that repeats those tokens after the same
full blocks can then hit at any point up to T inside that block (where the recurrent
groups hold a checkpoint, T itself at the least): the partial block is the copy's source.

Tier hooks: with a lower tier, every cached block the allocator evicts is recorded
(`take_evicted`) for the runner to save before anything overwrites it; with
`record_published`, every block published (`take_published`) for write-through.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.cache.base import LowerTier
from kvpool.cache.group import (
    CacheGroup,
    GroupUsage,
    StepRequest,
    TurnEnds,
    chain_units,
    check_pool_size,
    held_copy,
    num_leading,
    unit_extra,
)
from kvpool.cache.types import BlockCopy, GroupReservation, MMItem
from kvpool.pool import BlockPool, PrefixBlock
from kvpool.pool.hashing import TOKEN_BYTES, block_packer, token_bytes

_NO_RESERVATION = GroupReservation()
_tuple_new = tuple.__new__  # a NamedTuple without its Python-level __new__: the decode path's


@dataclass(frozen=True)
class AttentionGroupSpec:
    """Layers that share one block table. window None: full attention; otherwise the query
    at t reads keys [t - window + 1, t]."""

    name: str
    block_size: int
    window: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"group {self.name!r}: block_size must be positive, got {self.block_size}")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"group {self.name!r}: window must be positive, got {self.window}")

    def build(
        self,
        size: int | None,
        *,
        enable_caching: bool,
        hash_algo: str,
        shared_pool: BlockPool | None,
        lower_tier: LowerTier | None = None,
        record_published: bool = False,
    ) -> AttentionGroup:
        """The group: `size` blocks of its own, or None to draw from `shared_pool`."""
        if size is None and shared_pool is not None:
            return AttentionGroup(self, shared_pool.num_blocks, pool=shared_pool)
        size = check_pool_size(self.name, size)
        return AttentionGroup(
            self,
            size,
            enable_caching=enable_caching,
            hash_algo=hash_algo,
            lower_tier=lower_tier,
            record_published=record_published,
        )

    def first_needed(self, num_computed: int) -> int:
        """The first position whose key the step after `num_computed` tokens reads."""
        return 0 if self.window is None else max(0, num_computed - self.window + 1)


@dataclass(slots=True)
class AttentionState:
    """One request's table in one attention group."""

    root: PrefixBlock
    first: int = 0  # logical index of block_ids[0]; blocks [0, first) have left the window
    block_ids: list[int] = field(default_factory=list)
    chain: list[PrefixBlock] = field(default_factory=list)  # full computed blocks [0, len) (caching on)
    held_src: int | None = None  # the hit's copied tail block, held until the first commit
    loading: list[tuple[int, PrefixBlock]] = field(default_factory=list)  # lower-tier blocks not yet loaded


@dataclass(slots=True)
class AttentionHits:
    """What a group's cache holds of a prompt: per full block, its cached copy (or None),
    and the blocks after the device's run that a lower tier holds (full attention)."""

    found: list[PrefixBlock | None]
    chain: list[PrefixBlock]  # the prompt's prefix blocks (the found ones where found)
    lower: list[PrefixBlock] = field(default_factory=list)
    # Turn end T inside the block after the run -> the partial block kept there (full attention)
    turn_ends: dict[int, PrefixBlock] = field(default_factory=dict)


@dataclass(slots=True)
class AttentionAdmit:
    """An admission's plan in one group, checked before anything changes."""

    first: int
    hit_ids: list[int]  # held blocks of [first, ceil(P / bs)) on the device, a copied tail's source included
    num_new: int
    copy_tail: bool  # P lies inside a block: hit_ids[-1] is the source of a copy
    chain: list[PrefixBlock]
    lower: list[PrefixBlock]  # blocks of the hit a lower tier holds: loaded into the first fresh ones


class AttentionGroup(CacheGroup):
    """A `CacheGroup` (cache/group.py): block tables of full-attention or window layers."""

    kind = "attention"
    has_table = True
    whole_steps = False
    has_state = False

    def __init__(
        self,
        spec: AttentionGroupSpec,
        num_blocks: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "xxh3_128",
        pool: BlockPool | None = None,
        lower_tier: LowerTier | None = None,
        record_published: bool = False,
    ) -> None:
        """pool: a pool shared with other attention groups (the coordinator's shared pool;
        each group's blocks are then its own by their distinct chain roots); default: a pool
        of `num_blocks` of its own. lower_tier, record_published: the tier hooks above."""
        if lower_tier is not None and spec.window is not None:
            raise ValueError(f"group {spec.name!r}: a lower tier serves full attention only")
        self.spec = spec
        self.block_size = spec.block_size
        if pool is None:
            pool = BlockPool(num_blocks, enable_caching=enable_caching, hash_algo=hash_algo)
        self.pool = pool
        self.name = spec.name  # an attribute, not a property: read per request per step
        self.granularity = spec.block_size
        self.reads_whole_prefix = spec.window is None
        # A commit that ends inside a block changes nothing in a full group (a window may
        # let a block go at any position)
        self.commit_period = spec.block_size if spec.window is None else 1
        self.lower_tier = lower_tier if pool.enable_caching else None
        # evicted cached blocks whose content the runner has not yet saved (None: no tier)
        self._evicted: list[tuple[int, PrefixBlock]] | None = [] if self.lower_tier is not None else None
        # blocks published since the runner last took them (None: not recorded)
        self._published: list[tuple[int, PrefixBlock]] | None = [] if record_published and pool.enable_caching else None
        # Copy-on-write copies not yet taken, in the order they were made (a later copy may
        # read an earlier one's destination). One leaves only when nobody reads it.
        self._pending_copies: list[BlockCopy] = []
        self._pack_block = block_packer(spec.block_size)
        self._turn_ends = TurnEnds(pool, spec.block_size)  # partial blocks kept at turn ends

    # ---- prefix hits -------------------------------------------------------------------

    def hits(
        self,
        root: PrefixBlock,
        token_ids: list[int],
        mm_items: tuple[MMItem, ...],
        limit: int | None = None,
        *,
        admission: bool = False,
        packed: bytes | None = None,
    ) -> AttentionHits:
        """The prompt's full blocks that are cached, as far as a hit point can reach (up to
        `limit` tokens, another group's upper bound, for a window). Full attention: the
        leading run, then at an admission the lower tier's blocks after it. Changes nothing
        but the pool's collision counter (at an admission)."""
        bs = self.block_size
        if not self.pool.enable_caching:
            return AttentionHits([], [])
        num = len(token_ids) // bs if limit is None else min(len(token_ids) // bs, -(-limit // bs))
        width = bs * TOKEN_BYTES
        data = packed[: num * width] if packed is not None else token_bytes(token_ids[: num * bs])  # sliced per block
        extras = [unit_extra(mm_items, bs, k) for k in range(num)] if mm_items else None
        if self.spec.window is None:
            # The run that leaves a token to compute, then the prompt's last full block (a
            # point inside it copies it) without counting a collision there
            top = min(num, (len(token_ids) - 1) // bs)
            chain = self.pool.match(root, data, width, top, extras, count_collisions=admission).chain
            if len(chain) == top < num:
                parent = chain[-1] if chain else root
                more = self.pool.match(
                    parent, data[top * width :], width, 1, extras and extras[top:], count_collisions=False
                )
                chain += more.chain
            hits = AttentionHits(list(chain), list(chain))
            parent = chain[-1] if chain else root
            if admission and self.lower_tier is not None and len(chain) < top:
                # The blocks after the device's run that the lower tier holds, in order
                lower = chain_units(self.pool, parent, token_ids, mm_items, bs, len(chain), top)
                hits.lower = lower[: self.lower_tier.find(lower)]
            if self._turn_ends:
                hits.turn_ends = self._turn_ends.find(parent, len(chain) * bs, token_ids, mm_items, len(token_ids))
            return hits
        found: list[PrefixBlock | None] = []
        chain = []
        parent = root
        for k in range(num):
            block = self.pool.chain(parent, data[k * width : (k + 1) * width], extras[k] if extras else b"")
            hit = self.pool.lookup(block)
            found.append(hit)
            parent = hit if hit is not None else block
            chain.append(parent)
        return AttentionHits(found, chain)

    def upper_bound(self, hits: AttentionHits) -> int:
        """No point above this one is served (full: the leading run of found blocks and the
        lower tier's after it; window: the end of the last found block)."""
        found = hits.found
        if self.spec.window is None:  # full attention's hits are a run: no None among them
            return max([(len(found) + len(hits.lower)) * self.block_size, *hits.turn_ends])
        return num_leading(found) * self.block_size

    def extra_points(self, hits: AttentionHits) -> list[int]:
        """Points off the block grid this group offers by itself: its turn ends (and it
        serves any point inside a cached block by copying it, when another group offers one)."""
        return sorted(hits.turn_ends)

    def serves(self, hits: AttentionHits, point: int) -> bool:
        """Whether this group can resume a request after `point` cached tokens (a lower
        tier's blocks: at block boundaries only)."""
        if point == 0:
            return True
        bs = self.block_size
        last = -(-point // bs)  # blocks [.., last) hold positions below point
        if last > len(hits.found):
            if point % bs:  # inside the block after the run: a partial block kept at a turn end at or after it
                return last == len(hits.found) + 1 and any(end >= point for end in hits.turn_ends)
            return last <= len(hits.found) + len(hits.lower) and (self.spec.window is None or None not in hits.found)
        if self.spec.window is None:
            return True  # every block before `last` is in the run
        first = self.spec.first_needed(point) // bs
        return all(hits.found[k] is not None for k in range(first, last))

    def plan_admit(
        self,
        hits: AttentionHits | None,
        root: PrefixBlock,
        token_ids: list[int],
        mm_items: tuple[MMItem, ...],
        point: int,
        end: int,
    ) -> tuple[AttentionAdmit, dict[BlockPool, int]]:
        """(the plan, free blocks it needs) for a hit at `point` and a first step to `end`."""
        if hits is None:
            hits = AttentionHits([], [])
        bs = self.block_size
        first = self.spec.first_needed(point) // bs
        last = -(-point // bs)
        on_device = min(last, len(hits.found))
        hit_ids = []
        for k in range(first, on_device):
            block = hits.found[k]
            assert block is not None, "serves() was checked"
            hit_ids.append(held_copy(self.pool, block))
        copy_tail = point % bs != 0
        lower = hits.lower[: last - on_device]
        if copy_tail and last > on_device:  # the source: a partial block kept at a turn end
            hit_ids.append(held_copy(self.pool, hits.turn_ends[min(e for e in hits.turn_ends if e >= point)]))
            lower = []
        num_new = -(-end // bs) - first - len(hit_ids) + copy_tail
        revived = sum(1 for b in set(hit_ids) if self.pool.refcount(b) == 0)
        plan = AttentionAdmit(first, hit_ids, num_new, copy_tail, hits.chain[: min(point // bs, on_device)], lower)
        return plan, {self.pool: num_new + revived}

    def claim(self, plan: AttentionAdmit) -> None:
        """Hold the hit's blocks. The coordinator claims every group's hits before any group
        allocates, so that an allocation on a shared pool cannot evict another group's hit."""
        self.pool.incref(plan.hit_ids)

    def apply_admit(self, plan: AttentionAdmit, root: PrefixBlock) -> tuple[AttentionState, tuple[BlockCopy, ...]]:
        """After `claim`: the fresh blocks (the lower tier's blocks load into the first)."""
        new = self.pool.allocate(plan.num_new, self._evicted)
        assert new is not None, "the coordinator checked the free count"
        state = AttentionState(root, plan.first, list(plan.hit_ids), list(plan.chain))
        copies: tuple[BlockCopy, ...] = ()
        if plan.copy_tail:
            # The block holding position P is cached and may be shared: copy it, keep the source.
            src, dst = state.block_ids[-1], new.pop(0)
            state.block_ids[-1] = dst
            state.held_src = src
            copies = (BlockCopy(src, dst),)
            self._pending_copies.append(copies[0])
        state.loading = list(zip(new[: len(plan.lower)], plan.lower, strict=True))
        state.block_ids.extend(new)
        return state, copies

    def loads(self, state: AttentionState) -> list[tuple[int, PrefixBlock]]:
        return state.loading

    def complete_loads(self, state: AttentionState, num_loaded: int) -> None:
        """The first `num_loaded` blocks of `loads` hold their content: they join the chain
        and become findable, in order; the rest are computed instead."""
        parent = state.chain[-1] if state.chain else state.root
        for block_id, block in state.loading[:num_loaded]:
            if block.parent is not parent:  # the previous block joined an equal copy another request published
                block = self.pool.chain(parent, block.token_bytes, block.extra)
            parent = self.pool.register(block_id, block) or block
            state.chain.append(parent)
        state.loading = []

    # ---- steps -------------------------------------------------------------------------

    def _tail(self, state: AttentionState, num_computed: int, end: int) -> int | None:
        """The block the step starts writing in, when it is computed and not yet writable
        (shared after a fork: to copy; published after a rollback: to unregister)."""
        bs = self.block_size
        if end == num_computed or num_computed % bs == 0:
            return None
        index = num_computed // bs - state.first
        if index >= len(state.block_ids):
            return None
        block = state.block_ids[index]
        pool = self.pool
        return block if pool.refcount(block) > 1 or pool.block_hash(block) is not None else None

    def blocks_needed(self, reqs: Sequence[StepRequest], ends: Sequence[int]) -> int:
        """Fresh blocks and tail copies the step takes: one copy per writer of a shared
        tail, except that when every holder writes, the last finds it exclusive."""
        bs, name = self.block_size, self.name
        needed = 0
        writers: dict[int, int] = {}
        for req, end in zip(reqs, ends, strict=True):
            state = req.states[name]
            num_new = -(-end // bs) - state.first - len(state.block_ids)
            if num_new > 0:
                needed += num_new
            if req.num_computed % bs:  # (a step that starts a block has no tail)
                tail = self._tail(state, req.num_computed, end)
                if tail is not None and self.pool.refcount(tail) > 1:
                    writers[tail] = writers.get(tail, 0) + 1
        for tail, n in writers.items():
            needed += n - (n == self.pool.refcount(tail))
        return needed

    def apply_reserve(
        self, reqs: Sequence[StepRequest], ends: Sequence[int], *, detail: bool = True
    ) -> list[GroupReservation] | None:
        bs, name, pool, evicted = self.block_size, self.name, self.pool, self._evicted
        out: list[GroupReservation] = []
        for req, end in zip(reqs, ends, strict=True):
            state = req.states[name]
            nc = req.num_computed
            num_new = -(-end // bs) - state.first - len(state.block_ids)
            if not nc % bs and num_new > 0:  # the step starts a block: fresh blocks only (the decode case)
                new = pool.allocate(num_new, evicted)
                assert new is not None, "the coordinator checked the free count"
                state.block_ids += new
                if detail:  # (a step's results are garbage the collector would walk)
                    out.append(_tuple_new(GroupReservation, (tuple(new), (), ())))
                continue
            # (an earlier copy of this step may have freed a tail)
            tail = self._tail(state, nc, end) if nc % bs else None
            if num_new <= 0 and tail is None:
                out.append(_NO_RESERVATION)  # the common decode step: the table has room
                continue
            num_new = max(0, num_new)
            copy = tail is not None and pool.refcount(tail) > 1
            new = pool.allocate(num_new + copy, evicted)
            assert new is not None, "the coordinator checked the free count"
            copies: tuple[BlockCopy, ...] = ()
            if copy:
                index, dst = nc // bs - state.first, new.pop()
                state.block_ids[index] = dst
                pool.decref((tail,))  # still held by the request it is shared with
                copies = (BlockCopy(tail, dst),)
                self._pending_copies.append(copies[0])
            elif tail is not None:
                pool.unregister(tail)  # exclusive, about to change under its hash
            state.block_ids.extend(new)
            out.append(_tuple_new(GroupReservation, (tuple(new), copies, ())))
        return out if detail else None

    def commit(self, reqs: Sequence[StepRequest]) -> None:
        """Tokens [.., num_computed) are computed: publish the blocks they complete, then
        release the blocks that left the window (tail-first) and a held copy source."""
        bs, name, pool, window = self.block_size, self.name, self.pool, self.spec.window
        caching, published, publish, pack = pool.enable_caching, self._published, pool.publish, self._pack_block
        for req in reqs:
            state = req.states[name]
            nc = req.num_computed
            chain = state.chain
            k0 = len(chain)
            if caching and nc >= (k0 + 1) * bs:  # (most decode steps complete no block)
                if nc < (k0 + 2) * bs and window is None and not req.mm_items:  # one block: the decode case
                    block_id = state.block_ids[k0]
                    parent = publish(
                        block_id, chain[-1] if k0 else state.root, pack(req.token_ids[nc - nc % bs - bs : nc - nc % bs])
                    )
                    chain.append(parent)
                    if published is not None:
                        published.append((block_id, parent))
                else:
                    self._publish(state, req.token_ids, req.mm_items, k0, nc // bs)
            if state.held_src is not None:
                pool.decref((state.held_src,))
                state.held_src = None
            if window is not None:
                first = self.spec.first_needed(nc) // bs
                if first > state.first:
                    gone = state.block_ids[: first - state.first]
                    del state.block_ids[: first - state.first]
                    state.first = first
                    pool.decref(reversed(gone))

    def _publish(
        self, state: AttentionState, token_ids: list[int], mm_items: tuple[MMItem, ...], k0: int, k1: int
    ) -> None:
        """Publish blocks [k0, k1): findable as the request's own, or as the copy another
        request published first; or not at all (a collision: the chain goes on with an
        unregistered element)."""
        bs, pool = self.block_size, self.pool
        parent = state.chain[-1] if state.chain else state.root
        data, width = token_bytes(token_ids[k0 * bs : k1 * bs]), bs * TOKEN_BYTES  # packed once
        window = self.spec.window is not None
        for k in range(k0, k1):
            block_id = state.block_ids[k - state.first]
            block = pool.chain(parent, data[(k - k0) * width : (k - k0 + 1) * width], unit_extra(mm_items, bs, k))
            parent = pool.register(block_id, block, orphan_ok=window) or block
            state.chain.append(parent)
            if self._published is not None:
                self._published.append((block_id, parent))

    def take_copies(self) -> list[BlockCopy]:
        """Copies to apply before the next forward, in order (a later copy may read an
        earlier one's destination)."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def _drop_dead_copies(self) -> None:
        """A queued copy into a block nobody reads any more is dropped: nobody holds the
        block, and no later queued copy reads it (once free, the block may go to another
        request before the next forward, which must not get it)."""
        if self._pending_copies:
            self._pending_copies = self._live_copies()

    def _live_copies(self) -> list[BlockCopy]:
        refcount = self.pool.refcount
        read: set[int] = set()  # blocks a later kept copy reads
        kept: list[BlockCopy] = []
        for copy in reversed(self._pending_copies):
            if refcount(copy.dst) > 0 or copy.dst in read:
                kept.append(copy)
                read.add(copy.src)
        kept.reverse()
        return kept

    def take_evicted(self) -> list[tuple[int, PrefixBlock]]:
        """Cached blocks the allocator evicted since the last call, (block id, the content it
        held), oldest first: their slots hold that content until the next forward writes
        them. Empty without a lower tier."""
        if not self._evicted:
            return []
        evicted, self._evicted = self._evicted, []
        return evicted

    def take_published(self) -> list[tuple[int, PrefixBlock]]:
        """Blocks published since the last call, (block id, its prefix block), in order:
        their content is final. Empty unless `record_published`."""
        if not self._published:
            return []
        published, self._published = self._published, []
        return published

    # ---- queries on a request's state ---------------------------------------------------

    def block_ids(self, state: AttentionState) -> list[int]:
        return state.block_ids

    def first_block(self, state: AttentionState) -> int:
        return state.first

    def held_blocks(self, state: AttentionState) -> list[int]:
        return state.block_ids if state.held_src is None else [*state.block_ids, state.held_src]

    def prefix_chain(self, state: AttentionState) -> list[PrefixBlock]:
        return state.chain

    def metadata_bytes(self, state: AttentionState) -> int:
        size = sys.getsizeof
        return size(state) + size(state.block_ids) + size(state.chain)

    def partial_block(
        self, state: AttentionState, token_ids: list[int], mm_items: tuple[MMItem, ...], start: int, end: int
    ) -> tuple[int, PrefixBlock]:
        """(block id, an unregistered prefix block of positions [start, end)) of the block
        after the request's chain, which ends at `start` (the swap of a partial block)."""
        index = start // self.block_size
        parent = state.chain[-1] if state.chain else state.root
        block = self.pool.chain(parent, token_bytes(token_ids[start:end]), unit_extra(mm_items, self.block_size, index))
        return state.block_ids[index - state.first], block

    # ---- turn ends, fork, rollback, release ---------------------------------------------

    def keep_turn_end(
        self, state: AttentionState, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> bool:
        """At a finish inside a block (full attention): keep the request's partial last block
        findable, filed under its tokens with a "turn" key, so that a follow-up turn that
        repeats them hits there (and copies it on write). The release then leaves it
        cached, free, in the LRU queue."""
        if self.spec.window is not None:
            return False
        parent = state.chain[-1] if state.chain else state.root
        block = self._turn_ends.new_block(parent, token_ids, mm_items, num_computed)
        if block is None:
            return False
        block_id = state.block_ids[num_computed // self.block_size - state.first]
        return self.pool.block_hash(block_id) is None and self._turn_ends.file(block_id, block, orphan_ok=False)

    def fork(self, state: AttentionState) -> AttentionState:
        self.pool.incref(state.block_ids)
        return AttentionState(state.root, state.first, list(state.block_ids), list(state.chain))

    def can_truncate(self, state: AttentionState, num_tokens: int) -> bool:
        """Whether the blocks of [.., num_tokens) are still held (a window may have let them go)."""
        return self.spec.first_needed(num_tokens) // self.block_size >= state.first and not state.loading

    def truncate(self, state: AttentionState, num_tokens: int) -> None:
        """Keep the blocks of [.., num_tokens): later blocks go back tail-first, the chain
        keeps the full blocks below num_tokens. A kept tail others share stays untouched:
        the next write copies it."""
        bs = self.block_size
        keep = -(-num_tokens // bs) - state.first
        released = state.block_ids[keep:]
        del state.block_ids[keep:]
        self.pool.decref(reversed(released))
        del state.chain[num_tokens // bs :]
        self._drop_dead_copies()

    def release(self, state: AttentionState) -> None:
        self.pool.decref(reversed(state.block_ids))  # tail-first: a chain's tail is evicted first
        if state.held_src is not None:
            self.pool.decref((state.held_src,))
        state.block_ids = []
        state.held_src = None
        state.loading = []
        self._drop_dead_copies()  # a queued copy dies with the last request holding its destination

    # ---- invariants and figures ---------------------------------------------------------

    def usage(self, states: Iterable[tuple[AttentionState, int]]) -> GroupUsage:
        """Each physical block once, filled up to the most any holder has computed in it."""
        bs = self.block_size
        counts: dict[int, int] = {}
        for state, num_computed in states:
            for i, b in enumerate(state.block_ids):
                n = min(bs, max(0, num_computed - (state.first + i) * bs))
                if n > counts.get(b, -1):
                    counts[b] = n
        return GroupUsage(len(counts), sum(counts.values()))

    def check_states(self, states: dict[str, Any]) -> None:
        if self._live_copies() != self._pending_copies:
            raise AssertionError(f"group {self.name!r}: a queued copy nobody reads: {self._pending_copies}")

    def check_state(
        self, rid: str, state: AttentionState, token_ids: list[int], num_computed: int, end: int, holders: list[int]
    ) -> None:
        bs = self.block_size
        where = f"group {self.name!r}, request {rid!r}"
        if state.first != self.spec.first_needed(num_computed) // bs:
            raise AssertionError(
                f"window rule: {where} keeps blocks from {state.first}, but the next step reads from "
                f"block {self.spec.first_needed(num_computed) // bs}"
            )
        if state.first + len(state.block_ids) != -(-end // bs):
            raise AssertionError(
                f"invariant 5 (table and counts commit together): {where} holds blocks "
                f"[{state.first}, {state.first + len(state.block_ids)}) for {end} reserved tokens"
            )
        if len(set(state.block_ids)) != len(state.block_ids):
            raise AssertionError(f"invariant 1: {where} holds a block twice")
        for b in state.block_ids:
            holders[b] += 1
        if state.held_src is not None:
            holders[state.held_src] += 1
        if end > num_computed:
            for k in range(num_computed // bs, -(-end // bs)):
                b = state.block_ids[k - state.first]
                if self.pool.refcount(b) != 1 or self.pool.block_hash(b) is not None:
                    raise AssertionError(
                        f"invariant 2 (copy-on-write before a write): {where} will write into block {b} "
                        f"(refcount {self.pool.refcount(b)}, registered {self.pool.block_hash(b) is not None})"
                    )
        if self.pool.enable_caching:
            if len(state.chain) != num_computed // bs:
                raise AssertionError(
                    f"invariant 6 (only computed full blocks are published): {where} has {len(state.chain)} "
                    f"chained blocks for {num_computed} computed tokens"
                )
            for k, block in enumerate(state.chain):
                if block.token_bytes != token_bytes(token_ids[k * bs : (k + 1) * bs]) or (
                    self.spec.window is None and block.parent is not (state.chain[k - 1] if k else state.root)
                ):
                    raise AssertionError(f"invariant 6: {where} chain element {k} is not its own prefix")
                if k >= state.first:
                    registered = self.pool.prefix_block(state.block_ids[k - state.first])
                    if registered is not None and registered is not block:
                        raise AssertionError(f"invariant 6: {where} block {k} is registered as other content")
