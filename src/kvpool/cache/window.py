"""One attention layer group of a hybrid model: paged K/V of full-attention or sliding-window
layers on its own BlockPool, driven by the coordinator (cache/coordinator.py). No torch.

Window rule. A layer of window W lets the query at position t read the keys of positions
[t - W + 1, t] (W keys, itself included; Gemma-2 / Mistral convention). A request whose
first `num_computed` tokens are computed and that computes [num_computed, end) next needs
the keys from lo = max(0, num_computed - W + 1) on, so its table covers

  logical blocks [first, ceil(end / bs)),  first = lo // bs
  [0, first * bs)            left the window: released to the pool's free queue (still
                             findable by hash while they stay cached)
  [first * bs, num_computed) committed keys the next step reads (the hit's blocks are
                             shared read-only)
  [num_computed, end)        the reserved step's slots: exclusive, unpublished

Full attention is the same with W = infinity (first = 0). Blocks are released as the
request advances: at every commit the blocks wholly before the new lo go back, tail-first.

Prefix hits (`hits`): the prompt's full blocks are hashed along the chain and each is
looked up on its own (`BlockPool.lookup`), so a window group finds the blocks of its
window from the right even after the blocks before them have been evicted (vLLM's
sliding-window rule). A full group serves a hit point P when every block before P is
cached; a window group when the blocks covering [max(0, P - W + 1), P) are. A point inside
a block takes that cached block as the source of a copy (copy-on-write): the request gets
a fresh block, the runner copies the source into it before the step writes position P, and
the source stays held until the request's first commit, so nothing can reuse it before
the copy is made.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvpool.cache.base import mm_extra_key
from kvpool.cache.group import GroupUsage, check_pool_size
from kvpool.cache.types import BlockCopy, GroupReservation, MMItem, StateRestore
from kvpool.pool import BlockPool, PrefixBlock
from kvpool.pool.hashing import TOKEN_BYTES, token_bytes


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
        self, size: int | None, *, enable_caching: bool, hash_algo: str, shared_pool: BlockPool | None
    ) -> AttentionGroup:
        """The group: `size` blocks of its own, or None to draw from `shared_pool`."""
        if size is None and shared_pool is not None:
            return AttentionGroup(self, shared_pool.num_blocks, pool=shared_pool)
        size = check_pool_size(self.name, size)
        return AttentionGroup(self, size, enable_caching=enable_caching, hash_algo=hash_algo)

    def first_needed(self, num_computed: int) -> int:
        """The first position whose key the step after `num_computed` tokens reads."""
        return 0 if self.window is None else max(0, num_computed - self.window + 1)

    def num_held_blocks(self, num_computed: int, end: int) -> int:
        """Blocks a request holds while it computes [num_computed, end)."""
        if end == 0:
            return 0
        return -(-end // self.block_size) - self.first_needed(num_computed) // self.block_size


@dataclass(slots=True)
class AttentionState:
    """One request's table in one attention group."""

    root: PrefixBlock
    first: int = 0  # logical index of block_ids[0]; blocks [0, first) have left the window
    block_ids: list[int] = field(default_factory=list)
    chain: list[PrefixBlock] = field(default_factory=list)  # full computed blocks [0, len) (caching on)
    held_src: int | None = None  # the hit's copied tail block, held until the first commit


@dataclass(slots=True)
class AttentionHits:
    """What a group's cache holds of a prompt: per full block, its cached copy (or None)."""

    found: list[PrefixBlock | None]
    chain: list[PrefixBlock]  # the prompt's prefix blocks (the found ones where found)


@dataclass(slots=True)
class AttentionAdmit:
    """An admission's plan in one group, checked before anything changes."""

    first: int
    hit_ids: list[int]  # held blocks of [first, ceil(P / bs)), the copied tail's source included
    num_new: int
    copy_tail: bool  # P lies inside a block: hit_ids[-1] is the source of a copy
    chain: list[PrefixBlock]


_NO_RESERVATION = GroupReservation()


class AttentionGroup:
    """A `CacheGroup` (cache/group.py): block tables of full-attention or window layers."""

    kind = "attention"
    has_table = True
    has_state = False

    def __init__(
        self,
        spec: AttentionGroupSpec,
        num_blocks: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "xxh3_128",
        pool: BlockPool | None = None,
    ) -> None:
        """pool: a pool shared with other attention groups (the coordinator's shared pool;
        each group's blocks are then its own by their distinct chain roots); default: a pool
        of `num_blocks` of its own."""
        self.spec = spec
        self.block_size = spec.block_size
        if pool is None:
            pool = BlockPool(num_blocks, enable_caching=enable_caching, hash_algo=hash_algo)
        self.pool = pool
        self.name = spec.name  # an attribute, not a property: read per request per step
        self.granularity = spec.block_size
        self.reads_whole_prefix = spec.window is None
        self._pending_copies: list[BlockCopy] = []

    def pools(self) -> tuple[BlockPool, ...]:
        return (self.pool,)

    # ---- prefix hits -------------------------------------------------------------------

    def _extra(self, mm_items: tuple[MMItem, ...], index: int) -> bytes:
        return mm_extra_key(mm_items, self.block_size, index) if mm_items else b""

    def hits(
        self, root: PrefixBlock, token_ids: list[int], mm_items: tuple[MMItem, ...], limit: int | None = None
    ) -> AttentionHits:
        """Each full block of the prompt, looked up on its own, as far as a hit point can
        reach: up to the first miss for full attention (a point needs every block before
        it), up to `limit` tokens (another group's upper bound) for a window. Changes nothing."""
        bs = self.block_size
        found: list[PrefixBlock | None] = []
        chain: list[PrefixBlock] = []
        if not self.pool.enable_caching:
            return AttentionHits(found, chain)
        num = len(token_ids) // bs if limit is None else min(len(token_ids) // bs, -(-limit // bs))
        full = self.spec.window is None
        data, width = token_bytes(token_ids[: num * bs]), bs * TOKEN_BYTES  # packed once, sliced per block
        parent = root
        for k in range(num):
            block = self.pool.chain(parent, data[k * width : (k + 1) * width], self._extra(mm_items, k))
            hit = self.pool.lookup(block)
            if hit is None and full:
                break
            found.append(hit)
            parent = hit if hit is not None else block
            chain.append(parent)
        return AttentionHits(found, chain)

    def upper_bound(self, hits: AttentionHits) -> int:
        """No point above this one is served (full: the leading run of found blocks; window:
        the end of the last found block). Lets the coordinator skip hopeless points."""
        found = hits.found
        if self.spec.window is None:
            k = next((i for i, b in enumerate(found) if b is None), len(found))
        else:
            k = next((i + 1 for i in range(len(found) - 1, -1, -1) if found[i] is not None), 0)
        return k * self.block_size

    def extra_points(self, hits: AttentionHits) -> list[int]:
        """Points off the block grid this group offers by itself: none (it serves any point
        inside a cached block by copying it, when another group offers one)."""
        return []

    def serves(self, hits: AttentionHits, point: int) -> bool:
        """Whether this group can resume a request after `point` cached tokens."""
        if point == 0:
            return True
        bs = self.block_size
        last = -(-point // bs)  # blocks [.., last) hold positions below point
        if last > len(hits.found):
            return False
        first = self.spec.first_needed(point) // bs
        return all(hits.found[k] is not None for k in range(first, last))

    def _held_copy(self, block: PrefixBlock) -> int:
        """One physical copy of a cached block: a held one rather than a free one."""
        ids = block.block_ids
        return next((b for b in ids if self.pool.refcount(b)), ids[0])

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
        hit_ids = []
        for k in range(first, last):
            block = hits.found[k]
            assert block is not None, "serves() was checked"
            hit_ids.append(self._held_copy(block))
        copy_tail = point % bs != 0
        num_new = -(-end // bs) - last + copy_tail
        revived = sum(1 for b in set(hit_ids) if self.pool.refcount(b) == 0)
        plan = AttentionAdmit(first, hit_ids, num_new, copy_tail, hits.chain[: point // bs])
        return plan, {self.pool: num_new + revived}

    def claim(self, plan: AttentionAdmit) -> None:
        """Hold the hit's blocks. The coordinator claims every group's hits before any group
        allocates, so that an allocation on a shared pool cannot evict another group's hit."""
        self.pool.incref(plan.hit_ids)

    def apply_admit(self, plan: AttentionAdmit, root: PrefixBlock) -> tuple[AttentionState, tuple[BlockCopy, ...]]:
        """After `claim`: the fresh blocks."""
        new = self.pool.allocate(plan.num_new)
        assert new is not None, "the coordinator checked the free count"
        state = AttentionState(root, plan.first, list(plan.hit_ids), list(plan.chain))
        if plan.copy_tail:
            # The block holding position P is cached and may be shared: copy it, keep the source.
            src, dst = state.block_ids[-1], new.pop(0)
            state.block_ids[-1] = dst
            state.held_src = src
            self._pending_copies.append(BlockCopy(src, dst))
            state.block_ids.extend(new)
            return state, (self._pending_copies[-1],)
        state.block_ids.extend(new)
        return state, ()

    # ---- steps -------------------------------------------------------------------------

    def _tail_copy_needed(self, state: AttentionState, num_computed: int, end: int) -> bool:
        """Whether the step writes into a computed partial block others hold (after a fork)."""
        bs = self.block_size
        if end == num_computed or num_computed % bs == 0:
            return False
        return self.pool.refcount(state.block_ids[num_computed // bs - state.first]) > 1

    def blocks_needed(self, state: AttentionState, num_computed: int, end: int) -> int:
        """Free blocks a step [num_computed, end) takes (fresh ones and a tail copy)."""
        num_new = max(0, -(-end // self.block_size) - state.first - len(state.block_ids))
        return num_new + self._tail_copy_needed(state, num_computed, end)

    def apply_reserve(
        self, state: AttentionState, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int, end: int
    ) -> GroupReservation:
        copy = self._tail_copy_needed(state, num_computed, end)
        num_new = max(0, -(-end // self.block_size) - state.first - len(state.block_ids))
        if not num_new and not copy:
            return _NO_RESERVATION  # the common decode step: the table has room
        new = self.pool.allocate(num_new + copy)
        assert new is not None, "the coordinator checked the free count"
        copies: list[BlockCopy] = []
        if copy:
            index = num_computed // self.block_size - state.first
            src, dst = state.block_ids[index], new.pop()
            state.block_ids[index] = dst
            self.pool.decref((src,))  # still held by the request it is shared with
            copies.append(BlockCopy(src, dst))
            self._pending_copies.append(copies[-1])
        state.block_ids.extend(new)
        return GroupReservation(tuple(new), tuple(copies))

    def commit(
        self, state: AttentionState, token_ids: list[int], num_computed: int, mm_items: tuple[MMItem, ...]
    ) -> None:
        """Tokens [.., num_computed) are computed: publish the blocks they complete, then
        release the blocks that left the window (tail-first) and a held copy source."""
        bs = self.block_size
        pool = self.pool
        k0, k1 = len(state.chain), num_computed // bs
        if pool.enable_caching and k1 > k0:  # (most decode steps complete no block)
            parent = state.chain[-1] if state.chain else state.root
            data, width = token_bytes(token_ids[k0 * bs : k1 * bs]), bs * TOKEN_BYTES  # packed once
            for k in range(k0, k1):
                chunk = data[(k - k0) * width : (k - k0 + 1) * width]
                block = pool.chain(parent, chunk, self._extra(mm_items, k))
                published = pool.register(
                    state.block_ids[k - state.first], block, orphan_ok=self.spec.window is not None
                )
                parent = published or block
                state.chain.append(parent)
        if state.held_src is not None:
            pool.decref((state.held_src,))
            state.held_src = None
        first = self.spec.first_needed(num_computed) // bs
        if first > state.first:
            gone = state.block_ids[: first - state.first]
            del state.block_ids[: first - state.first]
            state.first = first
            pool.decref(reversed(gone))

    # ---- queries on a request's state ---------------------------------------------------

    def block_ids(self, state: AttentionState) -> list[int]:
        return state.block_ids

    def first_block(self, state: AttentionState) -> int:
        return state.first

    def held_blocks(self, state: AttentionState) -> list[int]:
        return state.block_ids if state.held_src is None else [*state.block_ids, state.held_src]

    def state_slot(self, state: AttentionState) -> int | None:
        return None

    def restore(self, state: AttentionState) -> StateRestore | None:
        return None

    def checkpoints(self, state: AttentionState) -> list[tuple[int, int]]:
        return []

    # ---- turn ends, fork, release -------------------------------------------------------

    def mark_turn_end(
        self, state: AttentionState, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> int | None:
        return None

    def keep_turn_end(
        self, state: AttentionState, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> bool:
        return False

    def can_fork(self) -> bool:
        return True

    def fork(self, state: AttentionState) -> AttentionState:
        self.pool.incref(state.block_ids)
        return AttentionState(state.root, state.first, list(state.block_ids), list(state.chain))

    def release(self, state: AttentionState) -> None:
        # a copy still pending into one of its blocks is for this request alone: once the block
        # is free it may go to another request before the next forward, which must not get it
        mine = set(state.block_ids)
        self._pending_copies = [c for c in self._pending_copies if c.dst not in mine]
        self.pool.decref(reversed(state.block_ids))  # tail-first: a chain's tail is evicted first
        if state.held_src is not None:
            self.pool.decref((state.held_src,))
        state.block_ids = []
        state.held_src = None

    def take_copies(self) -> list[BlockCopy]:
        """Copies to apply before the next forward, in order; a copy into a block nobody
        holds any more is dropped."""
        copies, self._pending_copies = self._pending_copies, []
        return [c for c in copies if self.pool.refcount(c.dst) > 0]

    # ---- invariants and figures ---------------------------------------------------------

    def usage(self, states: Iterable[tuple[AttentionState, int]]) -> GroupUsage:
        """Each physical block once, filled up to the most any holder has computed in it."""
        bs = self.block_size
        counts: dict[int, int] = {}
        for state, num_computed in states:
            for i, b in enumerate(state.block_ids):
                start = (state.first + i) * bs
                counts[b] = max(counts.get(b, 0), min(bs, max(0, num_computed - start)))
        return GroupUsage(len(counts), sum(counts.values()))

    def check_states(self, states: dict[str, AttentionState]) -> None:
        pass

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
        if end and state.first + len(state.block_ids) != -(-end // bs):
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
                raise AssertionError(f"invariant 6: {where} has {len(state.chain)} chained blocks for {num_computed}")
            for k, block in enumerate(state.chain):
                if block.token_bytes != token_bytes(token_ids[k * bs : (k + 1) * bs]):
                    raise AssertionError(f"invariant 6: {where} chain element {k} is not its own prefix")
                if k >= state.first:
                    registered = self.pool.prefix_block(state.block_ids[k - state.first])
                    if registered is not None and registered is not block:
                        raise AssertionError(f"invariant 6: {where} block {k} is registered as other content")

    def check_holders(self, holders: list[int]) -> None:
        self.pool.check_integrity()
        for b, count in enumerate(holders):
            if self.pool.refcount(b) != count:
                raise AssertionError(
                    f"invariant 1 (refcount == holders): group {self.name!r} block {b} has refcount "
                    f"{self.pool.refcount(b)}, held {count} times"
                )
