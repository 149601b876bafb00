"""Prefix chains of hash units, and the turn-end index: the code the cache groups share
(cache/window.py, cache/recurrent.py, cache/dual_pool.py). No torch.

A group hashes a prompt in units of `unit` tokens (its `granularity`: block size,
checkpoint interval, span); unit k covers positions [k * unit, (k + 1) * unit) and carries
the extra key of the multimodal items it overlaps. A request's chain is the prefix blocks
of its computed units, each chained from the one before it or from an equal copy of it
(the root first).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvpool.cache.types import LookupPrompt, MMItem
from kvpool.pool import BlockPool, PrefixBlock
from kvpool.pool.hashing import TOKEN_BYTES, token_bytes


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


def unit_extra(mm_items: tuple[MMItem, ...], unit: int, k: int) -> bytes:
    """Unit k's extra hash key (b"" without multimodal items)."""
    return mm_extra_key(mm_items, unit, k) if mm_items else b""


def chain_units(
    pool: BlockPool,
    parent: PrefixBlock,
    token_ids: list[int],
    mm_items: tuple[MMItem, ...],
    unit: int,
    k0: int,
    k1: int,
) -> list[PrefixBlock]:
    """The prefix blocks of units [k0, k1) after `parent` (unit k0 - 1's, or the root),
    unregistered. Changes nothing."""
    data, width = token_bytes(token_ids[k0 * unit : k1 * unit]), unit * TOKEN_BYTES  # packed once
    chain = []
    for k in range(k0, k1):
        parent = pool.chain(parent, data[(k - k0) * width : (k - k0 + 1) * width], unit_extra(mm_items, unit, k))
        chain.append(parent)
    return chain


def find_units(
    pool: BlockPool,
    root: PrefixBlock,
    token_ids: list[int],
    mm_items: tuple[MMItem, ...],
    unit: int,
    num: int,
    packed: bytes,
) -> UnitHits:
    """Each of the first `num` units of a prompt looked up on its own (`BlockPool.lookup`),
    so a unit is found after the units before it were evicted; the chain goes on through the
    copies found, where the next lookup's content walk stops. `packed`: token_bytes(token_ids)
    (or of its first `num` units at least). Changes nothing."""
    width = unit * TOKEN_BYTES
    data = packed[: num * width]
    found: list[PrefixBlock | None] = []
    chain = []
    parent = root
    for k in range(num):
        block = pool.chain(parent, data[k * width : (k + 1) * width], unit_extra(mm_items, unit, k))
        hit = pool.lookup(block)
        found.append(hit)
        parent = hit if hit is not None else block
        chain.append(parent)
    return UnitHits(found, chain)


def may_reach(
    pool: BlockPool, turn_ends: TurnEnds, root: PrefixBlock, prompt: LookupPrompt, point: int, unit: int
) -> bool:
    """`CacheGroup.may_reach` of a group whose hits are a run of units from the root (full
    attention, the dual pool: `BlockPool.match`) and the turn ends kept after them. False
    only when it serves no point >= `point` (> 0) of `prompt`: with q = ceil(point / unit),

      a point p >= point on the unit grid, or inside a found unit: units [0, ceil(p / unit))
          found, so a run of q units, unit q - 1 a whole unit of the prompt;
      a turn end p inside unit k (after a run of k units): k >= q - 1, and k > q - 1 is the
          case above; k == q - 1 (p off the grid, point too) needs a turn end listed after
          unit q - 2 (the root when q == 1).

    A run of m units needs each in the index: the deepest of them whose hash the prompt's
    memo holds (an earlier lookup of the same root left it there) is probed; with none known
    (no memo, multimodal keys, nothing hashed yet) the run may be found. Changes nothing."""
    memo = prompt.hashes
    if memo is None or prompt.mm_items:
        return True
    q = -(-point // unit)
    hashes = memo.get(pool.memo_key(root, unit * TOKEN_BYTES)) or ()
    num_known = len(hashes)
    # A run of m units may be found unless the deepest hash the memo knows below m is not
    # in the index. Unit q - 1 whole in the prompt (a partial unit is never found):
    if q * unit <= len(prompt.token_ids) and (not num_known or pool.is_indexed(hashes[min(q, num_known) - 1])):
        return True
    if not point % unit or not turn_ends:
        return False
    if q == 1:
        return turn_ends.lists_after(root.block_hash)
    if num_known and not pool.is_indexed(hashes[min(q - 1, num_known) - 1]):
        return False
    return num_known < q - 1 or turn_ends.lists_after(hashes[q - 2])


def register_run(
    pool: BlockPool, parent: PrefixBlock, blocks: Iterable[tuple[int, PrefixBlock]], *, orphan_ok: bool = False
) -> list[PrefixBlock]:
    """Register (block id, content) pairs in order after `parent`: each block becomes findable
    as its own content, or joins the equal copy another request published first (the run goes
    on from that copy: a content chained after another object is chained again), or, a
    collision, stays unregistered. Returns the run's prefix blocks, one per block."""
    run = []
    for block_id, block in blocks:
        if block.parent is not parent:
            block = pool.chain(parent, block.token_bytes, block.extra)
        parent = pool.register(block_id, block, orphan_ok=orphan_ok) or block
        run.append(parent)
    return run


def check_chain(
    where: str,
    pool: BlockPool,
    chain: list[PrefixBlock],
    root: PrefixBlock,
    token_ids: list[int],
    num_computed: int,
    unit: int,
    *,
    block_ids: Sequence[int] = (),
    first: int = 0,
) -> None:
    """Assert invariant 6 of one request's chain (caching on): one element per computed unit,
    each its own prefix (its tokens, chained from the prefix of the element before it: a
    cached copy found or joined may hang from an equal copy of it), and each unit's block of
    `block_ids` (units [first, ...)) registered, if at all, as it."""
    if len(chain) != num_computed // unit:
        raise AssertionError(
            f"invariant 6 (only computed units are published): {where} has {len(chain)} chained units for "
            f"{num_computed} computed tokens"
        )
    for k, block in enumerate(chain):
        parent = chain[k - 1] if k else root
        if block.token_bytes != token_bytes(token_ids[k * unit : (k + 1) * unit]) or (
            block.parent is not parent and block.parent.block_hash != parent.block_hash
        ):
            raise AssertionError(f"invariant 6: {where} chain element {k} is not its own prefix")
        if first <= k < first + len(block_ids):
            registered = pool.prefix_block(block_ids[k - first])
            if registered is not None and registered is not block:
                raise AssertionError(f"invariant 6: {where} block {k} is registered as other content")


def check_held(
    where: str,
    pool: BlockPool,
    held: list[int],
    written: Iterable[int],
    holders: list[int],
    what: str = "block",
    rule: str = "invariant 2 (copy-on-write before a write)",
) -> None:
    """Assert invariants 1 and 2 of one request: it holds no block twice (each held block
    adds 1 to `holders[b]`), and the blocks its reserved step writes are its own (refcount 1)
    and unpublished. `what`: the kind of block, `rule`: the rule a write breaks, for the
    messages."""
    if len(set(held)) != len(held):
        raise AssertionError(f"invariant 1: {where} holds a {what} twice: {held}")
    for b in held:
        holders[b] += 1
    for b in written:
        if pool.refcount(b) != 1 or pool.block_hash(b) is not None:
            raise AssertionError(
                f"{rule}: {where} will write into {what} {b} "
                f"(refcount {pool.refcount(b)}, registered {pool.block_hash(b) is not None})"
            )


@dataclass(slots=True)
class UnitHits:
    """What a group's cache holds of a prompt (`CacheGroup.hits`): per hash unit its cached
    copy or None (`found`), the prompt's prefix blocks, the units after the found run a lower
    tier holds, and the turn ends T -> what is kept there."""

    found: list[PrefixBlock | None]
    chain: list[PrefixBlock]
    lower: list[PrefixBlock] = field(default_factory=list)
    turn_ends: dict[int, PrefixBlock] = field(default_factory=dict)

    def upper_bound(self, unit: int) -> int:
        """No point is served above the last found unit, the lower tier's units after the
        found ones (full attention's: its found units are a run) and the last turn end."""
        found = self.found
        if found and found[-1] is not None:  # (a run, full attention's hits: no walk back)
            num = len(found)
        else:
            num = next((k + 1 for k in range(len(found) - 1, -1, -1) if found[k] is not None), 0)
        top = (num + len(self.lower)) * unit
        return max(top, *self.turn_ends) if self.turn_ends else top


def held_copy(pool: BlockPool, block: PrefixBlock) -> int:
    """One physical copy of a cached block: a held one rather than a free one (which would
    cost a block to revive)."""
    return next((b for b in block.block_ids if pool.refcount(b)), block.block_ids[0])


class TurnEnds:
    """Turn ends (Figure 12): where a request finished (or marked a turn end) inside a unit,
    the group files what it holds there (an attention group its partial block, a recurrent
    group a checkpoint) under the partial unit's tokens with a "turn" key, and lists it by
    its parent's hash, so a prompt probes only the turn ends kept after its own units.

    A kept block dies (leaves the pool's index) when an admission adopts it (`drop`) or when
    the pool takes it for an allocation, which tells nobody. Dead entries are dropped when a
    probe or a filing meets them under their parent, and all of them at once when a filing
    finds more listed than twice the live ones of the last sweep (+ 64), or than twice the
    pool's blocks: the live ones (each holds a block of its own) are at most the pool's
    blocks, so the list never exceeds twice that, and a sweep that leaves L live entries
    comes at least L + 64 filings before the next (amortized O(1) per filing). So a list of
    few live entries in a large pool (spilled V4 states, 31 blocks each) stays small: a
    dead entry keeps its chain of prefix blocks alive."""

    def __init__(self, pool: BlockPool, unit: int) -> None:
        self.pool = pool
        self.unit = unit
        self._by_parent: dict[bytes, list[PrefixBlock]] = {}  # dead (evicted, adopted) entries dropped as met
        self._num_listed = 0  # entries over all parents, live or dead
        self._sweep_at = min(64, 2 * pool.num_blocks)  # a filing past this many listed sweeps

    def __bool__(self) -> bool:
        return bool(self._by_parent)

    def block(
        self, parent: PrefixBlock, token_ids: list[int], mm_items: tuple[MMItem, ...], start: int, end: int
    ) -> PrefixBlock:
        """The prefix block of the partial unit [start, end) after `parent` (unregistered)."""
        extra = b"turn" + unit_extra(mm_items, self.unit, start // self.unit)
        return self.pool.chain(parent, token_bytes(token_ids[start:end]), extra)

    def new_block(
        self, parent: PrefixBlock, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> PrefixBlock | None:
        """The block a turn end after `num_computed` tokens (chained after `parent`) is filed
        as; None when there is none to file: caching off, on the unit grid, or findable already."""
        start = num_computed - num_computed % self.unit
        if not self.pool.enable_caching or start == num_computed:
            return None
        block = self.block(parent, token_ids, mm_items, start, num_computed)
        return None if self.pool.lookup(block) is not None else block

    def file(self, block_id: int, block: PrefixBlock, *, orphan_ok: bool) -> bool:
        """Register `block_id` as `block` and list it; False, nothing filed, when the pool
        refuses (a collision, counted by the pool)."""
        if self.pool.register(block_id, block, orphan_ok=orphan_ok) is None:
            return False
        assert block.parent is not None
        self._by_parent[block.parent.block_hash] = [*self._kept(block.parent.block_hash), block]
        self._num_listed += 1
        if self._num_listed > self._sweep_at:
            self._sweep()
        return True

    def relist(self, block: PrefixBlock) -> None:
        """List `block` again where an undo registered it again (`BlockPool.unallocate` of
        the allocation that evicted it), had a probe unlisted it as dead meanwhile."""
        assert block.block_ids and block.parent is not None, f"turn end {block!r} is not registered"
        if not self.listed(block):
            self._by_parent.setdefault(block.parent.block_hash, []).append(block)
            self._num_listed += 1

    def drop(self, block: PrefixBlock) -> None:
        """Unlist `block` (no longer in the pool's index: an admission adopted it)."""
        assert not block.block_ids, f"turn end {block!r} is still registered"
        assert block.parent is not None
        self._kept(block.parent.block_hash)

    def find(
        self,
        parent: PrefixBlock,
        start: int,
        token_ids: list[int],
        mm_items: tuple[MMItem, ...],
        limit: int,
        packed: bytes | None = None,
    ) -> dict[int, PrefixBlock]:
        """The turn ends T <= limit kept after `parent` (whose units end at `start`) whose
        tokens the prompt repeats: T -> the cached block (verified by the pool's content
        guard). Changes nothing but the list of dead entries under `parent`.

        packed: `token_bytes(token_ids)` (a lookup's `LookupPrompt.packed`). Then a kept
        entry's tokens and extra keys are compared with the prompt's in place, and only one
        the prompt repeats is probed, under the entry's own hash: the hash the prompt's
        block would have (the same parent hash, tokens and extra keys), so the pool's guard
        walks the same chains. An entry the prompt does not repeat has another hash; a
        cached block of that other hash under this parent is a turn end listed here too,
        found on its own turn. None: each entry's block is built and hashed from the
        prompt's tokens (the twin, and the path for a caller without the packing)."""
        out = {}
        extra = b"turn" + unit_extra(mm_items, self.unit, start // self.unit)
        offset = start * TOKEN_BYTES
        for kept in self._kept(parent.block_hash):
            stored = kept.token_bytes
            end = start + len(stored) // TOKEN_BYTES
            if end > limit:
                continue
            if packed is None:
                probe = self.block(parent, token_ids, mm_items, start, end)
            elif kept.extra == extra and packed.startswith(stored, offset):
                probe = PrefixBlock(kept.block_hash, parent, stored, extra)
            else:
                continue
            found = self.pool.lookup(probe)
            if found is not None:
                out[end] = found
        return out

    def find_along(
        self,
        parents: Sequence[PrefixBlock],
        token_ids: list[int],
        mm_items: tuple[MMItem, ...],
        limit: int,
        packed: bytes | None = None,
    ) -> dict[int, PrefixBlock]:
        """`find` after each of `parents` (a root and its chain of units: parents[k]'s units end
        at k * unit), merged in that order; only the parents that have turn ends listed are
        probed (a prompt's chain has few or none: a lookup costs a set test a unit)."""
        out: dict[int, PrefixBlock] = {}
        listed, unit = self._by_parent, self.unit
        for k, parent in enumerate(parents):
            if parent.block_hash in listed:
                out.update(self.find(parent, k * unit, token_ids, mm_items, limit, packed))
        return out

    def lists_after(self, parent_hash: bytes) -> bool:
        """Whether any turn end (live or dead) is listed after the unit of this hash (or root):
        False: a probe there finds none."""
        return parent_hash in self._by_parent

    def listed(self, block: PrefixBlock) -> bool:
        """Whether `block` (registered) is listed under its parent, where `find` probes."""
        assert block.parent is not None
        return any(kept is block for kept in self._by_parent.get(block.parent.block_hash, ()))

    def num_listed(self) -> int:
        """Entries listed, live or dead (at most twice the pool's blocks)."""
        return self._num_listed

    def clear(self) -> None:
        """Unlist every entry (the pool's index is about to be emptied: a prefix-cache reset)."""
        self._by_parent.clear()
        self._num_listed = 0

    def check_integrity(self) -> None:
        """The count matches the lists, no list is empty, and the bound holds."""
        lists = self._by_parent.values()
        if self._num_listed != sum(map(len, lists)) or not all(lists):
            raise AssertionError(f"turn ends: {self._num_listed} counted, lists {[len(v) for v in lists]}")
        if self._num_listed > 2 * self.pool.num_blocks:
            raise AssertionError(f"turn ends: {self._num_listed} listed, over twice {self.pool.num_blocks} blocks")

    def _kept(self, parent_hash: bytes) -> list[PrefixBlock]:
        """The live entries under the parent of that hash; the dead ones are unlisted here."""
        listed = self._by_parent.get(parent_hash, [])
        kept = [b for b in listed if b.block_ids]
        if len(kept) != len(listed):
            self._num_listed -= len(listed) - len(kept)
            if kept:
                self._by_parent[parent_hash] = kept
            else:
                del self._by_parent[parent_hash]
        return kept

    def _sweep(self) -> None:
        """Unlist every dead entry."""
        for parent_hash in list(self._by_parent):
            self._kept(parent_hash)
        self._sweep_at = min(2 * self._num_listed + 64, 2 * self.pool.num_blocks)
