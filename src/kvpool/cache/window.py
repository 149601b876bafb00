"""The attention group: paged K/V of full-attention or sliding-window layers on a BlockPool,
a `CacheGroup` (cache/group.py) of the coordinator (cache/coordinator.py). No torch.

Window rule. A layer of window W lets the query at position t read the keys of positions
[t - W + 1, t] (W keys, itself included; Gemma-2 / Mistral convention); full attention is
W = infinity. A request whose first `num_computed` tokens are computed and that computes
[num_computed, end) next reads the keys from lo = max(0, num_computed - W + 1) on, so its
table covers logical blocks [first, ceil(end / bs)), first = lo // bs (full: 0):

  [0, first * bs)            left the window: released tail-first at the commit that
                             moves lo past them (findable by hash while they stay cached)
  [first * bs, num_computed) committed keys the next step reads (a hit's blocks: shared)
  [num_computed, end)        the reserved step's slots: exclusive, unpublished

A step that starts inside a computed block the request may not write (shared after a fork:
copied; still published after a rollback: unregistered) makes it writable first.

Hits. Full attention: the leading run of the prompt's cached full blocks (`BlockPool.match`),
then, at an admission, the blocks after it that a lower tier holds (loaded into fresh
blocks: `loads`, `complete_loads`). A window: each block looked up on its own
(`BlockPool.lookup`), so a window's blocks are found after the blocks before them were
evicted (vLLM's sliding-window rule). A point P is served when the blocks covering
[max(0, P - W + 1), P) are cached. A P inside a block copies that cached block on write:
the request gets a fresh block and holds the source until its first commit, so nothing
reuses it before the runner's copy; the source may be the partial block a request left at
its turn end (full attention, `keep_turn_end`; `TurnEnds` in cache/chains.py).

Tier hooks: with a lower tier, every cached block the allocator evicts is recorded
(`take_evicted`); with `record_published`, every block published (`take_published`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.cache import chains
from kvpool.cache.chains import TurnEnds, UnitHits
from kvpool.cache.group import CacheGroup, GroupUsage, LowerTier, StepRequest, check_int_fields, check_pool_size
from kvpool.cache.types import NO_RESERVATION, BlockCopy, GroupReservation, LookupPrompt, MMItem
from kvpool.pool import BlockPool, PrefixBlock
from kvpool.pool.hashing import TOKEN_BYTES, token_bytes

_tuple_new = tuple.__new__  # a NamedTuple without its Python-level __new__: the decode path's


@dataclass(frozen=True)
class AttentionGroupSpec:
    """Layers that share one block table. window None: full attention; otherwise the query
    at t reads keys [t - window + 1, t]."""

    name: str
    block_size: int
    window: int | None = None

    def __post_init__(self) -> None:
        check_int_fields(self, "block_size", *(() if self.window is None else ("window",)))
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
        """The group: `size` blocks of its own, or None to draw from `shared_pool` (each
        group's blocks are then its own by their distinct chain roots; no tier hooks)."""
        if size is None and shared_pool is not None:
            return AttentionGroup(self, shared_pool)
        pool = BlockPool(check_pool_size(self.name, size), enable_caching=enable_caching, hash_algo=hash_algo)
        return AttentionGroup(self, pool, lower_tier=lower_tier, record_published=record_published)

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
class AttentionAdmit:
    first: int
    hit_ids: list[int]  # held blocks of [first, ceil(P / bs)) on the device, a copied tail's source included
    num_new: int
    copy_tail: bool  # P lies inside a block: hit_ids[-1] is the source of a copy
    chain: list[PrefixBlock]
    lower: list[PrefixBlock]  # blocks of the hit a lower tier holds: loaded into the first fresh ones


class AttentionGroup(CacheGroup):
    """Block tables of full-attention or window layers."""

    kind = "attention"
    has_table = True
    whole_steps = False
    has_state = False

    def __init__(
        self,
        spec: AttentionGroupSpec,
        pool: BlockPool,
        *,
        lower_tier: LowerTier | None = None,
        record_published: bool = False,
    ) -> None:
        if lower_tier is not None and spec.window is not None:
            raise ValueError(f"group {spec.name!r}: a lower tier serves full attention only")
        self.spec = spec
        self.pool = pool
        self.name = spec.name  # an attribute, not a property: read per request per step
        self.block_size = self.granularity = spec.block_size
        self.reads_whole_prefix = spec.window is None
        # A commit that ends inside a block changes nothing in a full group (a window may
        # let a block go at any position)
        self.commit_period = spec.block_size if spec.window is None else 1
        self.lower_tier = lower_tier if pool.enable_caching else None
        # The tier records (cache/group.py; None: not recorded)
        self._evicted = [] if self.lower_tier is not None else None
        self._published = [] if record_published and pool.enable_caching else None
        # Copy-on-write copies not yet taken, in the order they were made (a later copy may
        # read an earlier one's destination). One leaves only when nobody reads it.
        self._pending_copies: list[BlockCopy] = []
        self._turn_ends = TurnEnds(pool, spec.block_size)  # partial blocks kept at turn ends

    # ---- prefix hits -------------------------------------------------------------------

    def hits(self, root: PrefixBlock, prompt: LookupPrompt, limit: int | None, *, admission: bool = False) -> UnitHits:
        bs = self.block_size  # (the module docstring's "Hits")
        if not self.pool.enable_caching:
            return UnitHits([], [])
        token_ids, mm_items, packed, memo = prompt
        num = len(token_ids) // bs if limit is None else min(len(token_ids) // bs, -(-limit // bs))
        if self.spec.window is not None:
            return chains.find_units(self.pool, root, token_ids, mm_items, bs, num, packed)
        width = bs * TOKEN_BYTES
        data = packed[: num * width]  # sliced per block
        extras = [chains.unit_extra(mm_items, bs, k) for k in range(num)] if mm_items else None
        # The run that leaves a token to compute, then the prompt's last full block (a
        # point inside it copies it) without counting a collision there
        top = min(num, (len(token_ids) - 1) // bs)
        chain: list[PrefixBlock] = []  # (a prompt of a block or less: no run to walk, its last block below)
        if top:
            chain = self.pool.match(root, data, width, top, extras, count_collisions=admission, memo=memo).chain
        if len(chain) == top < num:
            parent = chain[-1] if chain else root
            more = self.pool.match(
                parent, data[top * width :], width, 1, extras and extras[top:], count_collisions=False
            )
            chain += more.chain
        hits = UnitHits(chain, list(chain))
        parent = chain[-1] if chain else root
        if admission and self.lower_tier is not None and len(chain) < top:
            lower = chains.chain_units(self.pool, parent, token_ids, mm_items, bs, len(chain), top)
            hits.lower = lower[: self.lower_tier.find(lower)]
        if self._turn_ends:
            hits.turn_ends = self._turn_ends.find(parent, len(chain) * bs, token_ids, mm_items, len(token_ids), packed)
        return hits

    def may_reach(self, root: PrefixBlock, prompt: LookupPrompt, point: int) -> bool:
        """Full attention: a probe of the block before `point` (`chains.may_reach`; its hits
        are the run of cached blocks from the root and the turn ends kept after it). A
        window finds each block on its own: no probe (True)."""
        if point <= 0 or self.spec.window is not None:
            return True
        return self.pool.enable_caching and chains.may_reach(
            self.pool, self._turn_ends, root, prompt, point, self.block_size
        )

    def upper_bound(self, hits: UnitHits) -> int:
        return hits.upper_bound(self.block_size)

    def extra_points(self, hits: UnitHits) -> list[int]:
        # (it also serves a point inside a cached block, by copying it, when another group offers one)
        return sorted(hits.turn_ends)

    def serves(self, hits: UnitHits, point: int) -> bool:
        bs = self.block_size
        last = -(-point // bs)  # blocks [.., last) hold positions below point
        if last > len(hits.found):
            if point % bs:  # inside the block after the run: a partial block kept at a turn end at or after it
                return last == len(hits.found) + 1 and any(end >= point for end in hits.turn_ends)
            return last <= len(hits.found) + len(hits.lower)  # (full attention's lower tier) at block boundaries
        if self.spec.window is None:
            return True  # every block before `last` is in the run
        first = self.spec.first_needed(point) // bs
        return all(hits.found[k] is not None for k in range(first, last))

    def plan_admit(self, hits: UnitHits | None, point: int, end: int) -> tuple[AttentionAdmit, dict[BlockPool, int]]:
        if hits is None:
            hits = UnitHits([], [])
        bs = self.block_size
        first = 0 if self.spec.window is None else self.spec.first_needed(point) // bs
        last = -(-point // bs)
        on_device = min(last, len(hits.found))
        hit_ids = []
        for k in range(first, on_device):
            block = hits.found[k]
            assert block is not None, "serves() was checked"
            hit_ids.append(chains.held_copy(self.pool, block))
        copy_tail = point % bs != 0
        lower = hits.lower[: last - on_device]
        if copy_tail and last > on_device:  # the source: a partial block kept at a turn end
            hit_ids.append(chains.held_copy(self.pool, hits.turn_ends[min(e for e in hits.turn_ends if e >= point)]))
            lower = []
        num_new = -(-end // bs) - first - len(hit_ids) + copy_tail
        revived = sum(1 for b in set(hit_ids) if self.pool.refcount(b) == 0) if hit_ids else 0
        plan = AttentionAdmit(first, hit_ids, num_new, copy_tail, hits.chain[: min(point // bs, on_device)], lower)
        return plan, {self.pool: num_new + revived}

    def claim(self, plan: AttentionAdmit) -> None:
        self.pool.incref(plan.hit_ids)

    def apply_admit(self, plan: AttentionAdmit, root: PrefixBlock) -> tuple[AttentionState, tuple[BlockCopy, ...]]:
        new = self.pool.allocate(plan.num_new, self._evicted)
        assert new is not None, "the coordinator checked the free count"
        state = AttentionState(root, plan.first, list(plan.hit_ids), list(plan.chain))
        copies: tuple[BlockCopy, ...] = ()
        if plan.copy_tail:  # the block holding position P is cached and may be shared: copy it, keep the source
            state.held_src = state.block_ids[-1]
            copies = self._copy(state, len(state.block_ids) - 1, new.pop(0))
        state.loading = list(zip(new[: len(plan.lower)], plan.lower, strict=True))  # into the first fresh blocks
        state.block_ids.extend(new)
        return state, copies

    def loads(self, state: AttentionState) -> list[tuple[int, PrefixBlock]]:
        return state.loading

    def complete_loads(self, state: AttentionState, num_loaded: int) -> None:
        parent = state.chain[-1] if state.chain else state.root
        state.chain += chains.register_run(self.pool, parent, state.loading[:num_loaded])
        state.loading = []

    # ---- steps -------------------------------------------------------------------------

    def _tail(self, state: AttentionState, num_computed: int, end: int) -> int | None:
        """The block a step that starts inside it (num_computed % bs != 0) writes first,
        when it is computed and not writable (shared: to copy; published: to unregister)."""
        index = num_computed // self.block_size - state.first
        if end == num_computed or index >= len(state.block_ids):
            return None
        block = state.block_ids[index]
        return block if self.pool.refcount(block) > 1 or self.pool.block_hash(block) is not None else None

    def blocks_needed(self, reqs: Sequence[StepRequest], ends: Sequence[int]) -> int:
        """Fresh blocks and tail copies: one copy per writer of a shared tail, except that
        when every holder writes, the last finds it exclusive."""
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
        if not detail and len(reqs) > 1:
            # A decode step's rows that reach a new block (every step starts a block and takes
            # fresh blocks only): one allocation for them all, handed out in row order, the
            # blocks the loop below would give each (the queues' heads, in order)
            counts = []
            for req, end in zip(reqs, ends, strict=True):
                state = req.states[name]
                num_new = -(-end // bs) - state.first - len(state.block_ids)
                if req.num_computed % bs or num_new <= 0:
                    break
                counts.append(num_new)
            else:
                new = pool.allocate(sum(counts), evicted)
                assert new is not None, "the coordinator checked the free count"
                i = 0
                for req, k in zip(reqs, counts, strict=True):
                    req.states[name].block_ids += new[i : i + k]
                    i += k
                return None
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
                out.append(NO_RESERVATION)  # the common decode step: the table has room
                continue
            num_new = max(0, num_new)
            copy = tail is not None and pool.refcount(tail) > 1
            new = pool.allocate(num_new + copy, evicted)
            assert new is not None, "the coordinator checked the free count"
            copies: tuple[BlockCopy, ...] = ()
            if copy:
                copies = self._copy(state, nc // bs - state.first, new.pop())
                pool.decref((tail,))  # still held by the request it is shared with
            elif tail is not None:
                pool.unregister(tail)  # exclusive, about to change under its hash
            state.block_ids.extend(new)
            out.append(_tuple_new(GroupReservation, (tuple(new), copies, ())))
        return out if detail else None

    def commit(self, reqs: Sequence[StepRequest]) -> None:
        """Publish the blocks the steps complete, then release the blocks that left the
        window (tail-first) and a held copy source."""
        bs, name, pool, window = self.block_size, self.name, self.pool, self.spec.window
        caching, published, publish = pool.enable_caching, self._published, pool.publish
        for req in reqs:
            state = req.states[name]
            nc = req.num_computed
            chain = state.chain
            k0 = len(chain)
            if caching and nc >= (k0 + 1) * bs:  # (most decode steps complete no block)
                if nc < (k0 + 2) * bs and window is None and not req.mm_items:  # one block: the decode case
                    block_id = state.block_ids[k0]
                    # (an own array("I")'s block bytes are one slice's copy; a share_ids list's
                    # slice is packed id by id)
                    block = token_bytes(req.token_ids[nc - nc % bs - bs : nc - nc % bs])
                    parent = publish(block_id, chain[-1] if k0 else state.root, block)
                    chain.append(parent)
                    if published is not None:
                        published.append((block_id, parent))
                else:
                    parent = chain[-1] if k0 else state.root
                    k1 = nc // bs
                    ids = state.block_ids[k0 - state.first : k1 - state.first]
                    if window is None and not req.mm_items:  # a prefill chunk's blocks: one pool call
                        run = pool.publish_run(
                            ids, parent, token_bytes(req.token_ids[k0 * bs : k1 * bs]), bs * TOKEN_BYTES
                        )
                    else:  # (a window's parent may have left the index: orphan_ok)
                        blocks = chains.chain_units(pool, parent, req.token_ids, req.mm_items, bs, k0, k1)
                        run = chains.register_run(
                            pool, parent, zip(ids, blocks, strict=True), orphan_ok=window is not None
                        )
                    chain += run
                    if published is not None:
                        published += zip(ids, run, strict=True)
            if state.held_src is not None:
                pool.decref((state.held_src,))
                state.held_src = None
            if window is None:
                continue  # (full attention keeps every block: none leaves a window)
            first = self.spec.first_needed(nc) // bs
            if first > state.first:
                gone = state.block_ids[: first - state.first]
                del state.block_ids[: first - state.first]
                state.first = first
                pool.decref(reversed(gone))

    def _copy(self, state: AttentionState, index: int, dst: int) -> tuple[BlockCopy]:
        """Queue the copy of table entry `index` into block `dst`, which takes its place."""
        copy = BlockCopy(state.block_ids[index], dst)
        state.block_ids[index] = dst
        self._pending_copies.append(copy)
        return (copy,)

    def take_copies(self) -> list[BlockCopy]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def _live_copies(self) -> list[BlockCopy]:
        """The queued copies someone reads: into a held block, or read by a later kept copy
        (once free, a block may go to another request before the next forward)."""
        refcount = self.pool.refcount
        read: set[int] = set()  # blocks a later kept copy reads
        kept: list[BlockCopy] = []
        for copy in reversed(self._pending_copies):
            if refcount(copy.dst) > 0 or copy.dst in read:
                kept.append(copy)
                read.add(copy.src)
        kept.reverse()
        return kept

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
        return sys.getsizeof(state) + sys.getsizeof(state.block_ids) + sys.getsizeof(state.chain)

    def prefix_blocks(self, root: PrefixBlock, token_ids: list[int]) -> tuple[list[int], list[PrefixBlock]]:
        full = token_ids[: len(token_ids) // self.block_size * self.block_size]  # (a partial block matches none)
        chain = self.hits(root, LookupPrompt(full, (), token_bytes(full)), None).chain
        return [chains.held_copy(self.pool, block) for block in chain], chain

    def chain_for(self, root: PrefixBlock, token_ids: list[int]) -> list[PrefixBlock]:
        n = len(token_ids) // self.block_size
        return chains.chain_units(self.pool, root, token_ids, (), self.block_size, 0, n)

    def partial_block(
        self, state: AttentionState, token_ids: list[int], mm_items: tuple[MMItem, ...], start: int, end: int
    ) -> tuple[int, PrefixBlock]:
        """The block after the request's chain, which ends at `start`."""
        index = start // self.block_size
        parent = state.chain[-1] if state.chain else state.root
        block = self.pool.chain(
            parent, token_bytes(token_ids[start:end]), chains.unit_extra(mm_items, self.block_size, index)
        )
        return state.block_ids[index - state.first], block

    # ---- turn ends, fork, rollback, release ---------------------------------------------

    def keep_turn_end(
        self, state: AttentionState, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> bool:
        """Full attention: file the partial last block (the release then leaves it cached,
        free, in the LRU queue); a follow-up turn that repeats its tokens copies it on write."""
        if self.spec.window is not None:
            return False
        parent = state.chain[-1] if state.chain else state.root
        block = self._turn_ends.new_block(parent, token_ids, mm_items, num_computed)
        if block is None:
            return False
        block_id = state.block_ids[num_computed // self.block_size - state.first]
        # Not a block another request holds (a fork's sibling, after this one rolled back
        # into it): its content there may be longer, and its chain may name the block as a
        # full one left unregistered (a hash collision): filed, the pool would register it as
        # other content under the sibling
        return (
            self.pool.refcount(block_id) == 1
            and self.pool.block_hash(block_id) is None
            and self._turn_ends.file(block_id, block, orphan_ok=False)
        )

    def fork(self, state: AttentionState) -> AttentionState:
        self.pool.incref(state.block_ids)
        return AttentionState(state.root, state.first, list(state.block_ids), list(state.chain))

    def can_truncate(self, state: AttentionState, num_tokens: int) -> bool:
        return self.spec.first_needed(num_tokens) // self.block_size >= state.first and not state.loading

    def truncate(self, state: AttentionState, num_tokens: int) -> None:
        """Later blocks go back tail-first; a kept tail others share stays as it is (the
        next write copies it)."""
        bs = self.block_size
        keep = -(-num_tokens // bs) - state.first
        released = state.block_ids[keep:]
        del state.block_ids[keep:]
        self.pool.decref(reversed(released))
        del state.chain[num_tokens // bs :]
        self._pending_copies = self._live_copies()

    def forget_prefixes(self) -> None:
        """The turn ends kept go with the pool's index (the coordinator empties it next)."""
        self._turn_ends.clear()

    def release(self, state: AttentionState) -> None:
        self.pool.decref(reversed(state.block_ids))  # tail-first: a chain's tail is evicted first
        if state.held_src is not None:
            self.pool.decref((state.held_src,))
        state.block_ids = []
        state.held_src = None
        state.loading = []
        self._pending_copies = self._live_copies()  # a copy dies with the last holder of its destination

    # ---- invariants and figures ---------------------------------------------------------

    def usage(self, states: Iterable[tuple[AttentionState, int]]) -> GroupUsage:
        """Each physical block once, filled up to the most any holder has computed in it; a
        hit's copied tail block, held until the first commit, filled with the positions the
        copy reads from it (it was left out: num_held_blocks + num_free_blocks fell short of
        the pool while one was held)."""
        bs = self.block_size
        counts: dict[int, int] = {}
        for state, num_computed in states:
            for i, b in enumerate(state.block_ids):
                n = min(bs, max(0, num_computed - (state.first + i) * bs))
                if n > counts.get(b, -1):
                    counts[b] = n
            src = state.held_src
            if src is not None and num_computed % bs > counts.get(src, -1):
                counts[src] = num_computed % bs
        return GroupUsage(len(counts), sum(counts.values()))

    def check_states(self, states: dict[str, Any]) -> None:
        self._turn_ends.check_integrity()
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
        if state.loading:  # the loads fill the blocks right after the computed prefix (`complete_loads`)
            at = num_computed // bs - state.first
            if num_computed % bs or [b for b, _ in state.loading] != state.block_ids[at : at + len(state.loading)]:
                raise AssertionError(
                    f"{where}: blocks {[b for b, _ in state.loading]} still load, but {num_computed} tokens "
                    f"are computed in blocks {state.block_ids}"
                )
        written = state.block_ids[num_computed // bs - state.first :] if end > num_computed else ()
        chains.check_held(where, self.pool, self.held_blocks(state), written, holders)
        if self.pool.enable_caching:
            chains.check_chain(
                where,
                self.pool,
                state.chain,
                state.root,
                token_ids,
                num_computed,
                bs,
                block_ids=state.block_ids,
                first=state.first,
            )
