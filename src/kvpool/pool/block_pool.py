"""The block pool: block ids, reference counts, the free queue and the prefix index.

Block states:
  free       refcount 0, in the free queue (with or without a cached prefix block)
  exclusive  refcount 1, held by one block table
  shared     refcount > 1, read-only until copied (copy-on-write is the cache layer's job)

The free queue has two parts, so that eviction order is what prefix caching needs:
  - unhashed free blocks (never registered, or their registration was dropped): reused
    first, FIFO;
  - cached free blocks (they stay findable until reused): an LRU queue. A hit takes a
    block out of the middle in O(1) (an OrderedDict is a C doubly-linked list + dict).
Freed blocks join the end in the order given; the cache layer frees a request tail-first, so
a chain's tail is evicted before its head. A cached block stays registered until the
allocator hands it out again (lazy eviction).

The prefix index is the one place where chained block hashes are computed, looked up,
registered and guarded; every cache manager goes through `root`, `chain`, `match` and
`register`. A `PrefixBlock` is one block's worth of a prefix: its chained hash, its parent
(the previous PrefixBlock, or the chain's root: descriptor + tenant salt), its token ids and
its extra keys (multimodal placement). The index maps a hash to one PrefixBlock, which
lists every physical block holding that content: two requests that computed the same block
each keep their copy findable, so evicting one copy never cuts a chain another copy still
holds. A hit is accepted only when the stored PrefixBlock has exactly the expected parent
(the same object: the one matched for the previous block), the same token bytes and the
same extra keys, so by induction the whole prefix, root included, is what the hash covers,
whatever the hash function does.

Pure Python integers, no torch.
"""

from __future__ import annotations

import operator
import sys
import weakref
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvpool.pool.hashing import BlockHasher, as_count


class PrefixBlock:
    """One block of a prefix chain. `block_ids`: the physical blocks registered with this
    content (empty for a chain element that is not, or no longer, in the index). A root
    (parent None) stands for the descriptor and tenant salt that every chain starts from."""

    __slots__ = ("block_hash", "parent", "token_bytes", "extra", "block_ids", "__weakref__")

    def __init__(
        self,
        block_hash: bytes,
        parent: PrefixBlock | None,
        token_bytes: bytes,
        extra: bytes,
        block_ids: tuple[int, ...] = (),
    ) -> None:
        self.block_hash = block_hash
        self.parent = parent
        self.token_bytes = token_bytes
        self.extra = extra
        # A tuple: one or two copies is the common case, and a tuple of ints is no work for
        # the garbage collector (the index holds one of these per cached block).
        self.block_ids: tuple[int, ...] = block_ids

    @property
    def is_live(self) -> bool:
        """A root, or a block whose content some physical block holds in the index."""
        return self.parent is None or bool(self.block_ids)

    def __repr__(self) -> str:
        kind = "root" if self.parent is None else f"blocks={self.block_ids}"
        return f"PrefixBlock({self.block_hash.hex()[:12]}, {kind})"


def same_content(a: PrefixBlock | None, b: PrefixBlock | None) -> bool:
    """Whether two prefix blocks stand for the same prefix: equal hash, tokens and extra
    keys at every level, walked through the parents until the chains meet."""
    while a is not b:
        if a is None or b is None:
            return False
        if a.block_hash != b.block_hash or a.token_bytes != b.token_bytes or a.extra != b.extra:
            return False
        a, b = a.parent, b.parent
    return True


_BLOCK_IDS = operator.attrgetter("block_ids")
_FIRST = operator.itemgetter(0)

# A prompt's lookup memo (`match`, `LookupPrompt.hashes`): under (algorithm, root hash,
# width) its chained hashes; under that key and a pool's id, the run that pool's last walk
# of the prompt accepted
MatchMemo = dict[tuple[str, bytes, int] | tuple[str, bytes, int, int], "list[bytes] | tuple[PrefixBlock, ...]"]


class PrefixMatch(NamedTuple):
    """The longest cached run of a prompt's full blocks, in order."""

    block_ids: list[int]  # one physical block per matched prefix block
    chain: list[PrefixBlock]  # the matched prefix blocks; chain[-1] is the parent of the next


def _index(what: str, value: object) -> int:
    """`value` as an int (numpy's ints are: `operator.index`); TypeError naming it otherwise."""
    try:
        return operator.index(value)  # (raises TypeError for anything that is no int)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r}") from None


class BlockPool:
    __slots__ = (
        "num_blocks",
        "enable_caching",
        "hasher",
        "_refcounts",
        "_cached",
        "_index",
        "_roots",
        "_free_unhashed",
        "_free_cached",
        "num_collisions",
        "num_allocated",
        "index_version",
        "num_refused",
    )

    def __init__(self, num_blocks: int, *, enable_caching: bool = True, hash_algo: str = "xxh3_128") -> None:
        """`num_blocks` blocks, all free. `enable_caching=False` keeps the index empty
        (`register` publishes nothing). `hash_algo`: "xxh3_128" or "sha256" (BlockHasher)."""
        num_blocks = as_count("num_blocks", num_blocks)  # (a float failed as "can't multiply sequence by non-int")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hasher = BlockHasher(hash_algo)
        self._refcounts = [0] * num_blocks
        self._cached: list[PrefixBlock | None] = [None] * num_blocks  # the content a block is registered as
        self._index: dict[bytes, PrefixBlock] = {}  # chained hash -> prefix block
        # Roots are interned, so that "same parent" is an identity test; a root lives as long
        # as a chain or a request refers to it.
        self._roots: weakref.WeakValueDictionary[bytes, PrefixBlock] = weakref.WeakValueDictionary()
        self._free_unhashed: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self.num_collisions = 0  # hash hits whose stored content differed (admissions and registrations)
        self.num_allocated = 0  # blocks handed out by allocate, ever
        # Moves whenever what a walk of the index (`match`, `lookup`, `is_indexed`,
        # `is_published`) can see may change: an entry added or dropped, a copy joining or
        # leaving one, a cached block turning free or held (`match` picks a held copy). Equal
        # before and after: every such answer is the same (a coordinator's admission takes
        # the router's lookup of its prompt again by it: `HybridCacheManager.admit`)
        self.index_version = 0
        # hash hits the collision guard refused in any walk, counted as collisions or not
        # (a lookup does not count them, its admission does: a lookup that refused one is
        # not taken again by its admission, which must count it)
        self.num_refused = 0

    # ---- queries ---------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take now (cached free blocks included)."""
        return len(self._free_unhashed) + len(self._free_cached)

    @property
    def num_free_cached(self) -> int:
        """Free blocks that still hold a findable prefix (the next allocations evict them last)."""
        return len(self._free_cached)

    @property
    def num_cached(self) -> int:
        """Physical blocks registered in the prefix index (held or free)."""
        return sum(len(p.block_ids) for p in self._index.values())

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        """The chained hash the block is registered under, or None."""
        cached = self._cached[block_id]
        return None if cached is None else cached.block_hash

    def prefix_block(self, block_id: int) -> PrefixBlock | None:
        return self._cached[block_id]

    def free_queue(self) -> list[int]:
        """Free block ids in allocation order: unhashed first, then cached in LRU order."""
        return [*self._free_unhashed, *self._free_cached]

    def is_free_cached(self, block_id: int) -> bool:
        return block_id in self._free_cached

    # ---- allocation ------------------------------------------------------------------

    def allocate(self, num_blocks: int, evicted: list[tuple[int, PrefixBlock]] | None = None) -> list[int] | None:
        """Take `num_blocks` blocks with refcount 1, or return None and change nothing.
        evicted: receives (block id, its prefix block) for every cached block this takes,
        for `unallocate`. TypeError for a count that is no int (nan passed the tests below
        and lost the unhashed free blocks mid-grab), ValueError for a negative one."""
        if num_blocks.__class__ is not int:
            num_blocks = _index("num_blocks", num_blocks)
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free_unhashed) + len(self._free_cached):
            return None
        unhashed = self._free_unhashed
        if num_blocks <= len(unhashed):
            block_ids = [unhashed.popleft() for _ in range(num_blocks)]
        else:
            block_ids = list(unhashed)
            unhashed.clear()
            for _ in range(num_blocks - len(block_ids)):
                block_id, _ = self._free_cached.popitem(last=False)
                if evicted is not None:
                    evicted.append((block_id, self._cached[block_id]))
                self._drop(block_id)  # lazy eviction: the block leaves the index only now
                block_ids.append(block_id)
        refcounts = self._refcounts
        for block_id in block_ids:
            refcounts[block_id] = 1
        self.num_allocated += num_blocks
        return block_ids

    def unallocate(self, block_ids: Sequence[int], evicted: Sequence[tuple[int, PrefixBlock]]) -> None:
        """Undo an `allocate` whose blocks are untouched (refcount 1, unregistered): each
        block goes back where it was, unhashed ones to the head of their queue, evicted
        cached ones to the head of the LRU queue with their content findable again (unless
        another block has since taken its hash)."""
        content = dict(evicted)
        self.index_version += 1  # (evicted contents come back)
        for block_id in reversed(block_ids):  # allocate took from the queues' heads, in order
            assert self._refcounts[block_id] == 1 and self._cached[block_id] is None, f"unallocate of block {block_id}"
            self._refcounts[block_id] = 0
            block = content.get(block_id)
            found = None if block is None else self._index.get(block.block_hash)
            if block is not None and (found is None or found is block):
                if found is None:
                    self._index[block.block_hash] = block
                block.block_ids += (block_id,)
                self._cached[block_id] = block
                self._free_cached[block_id] = None
                self._free_cached.move_to_end(block_id, last=False)
            else:
                self._free_unhashed.appendleft(block_id)
        self.num_allocated -= len(block_ids)

    def is_published(self, block: PrefixBlock) -> bool:
        """Whether `block` is the content the index holds for its hash (a root always is).
        For a block that is no root, the same as `bool(block.block_ids)`: a prefix block
        lists copies only while it is the index's entry for its hash (each path that lists a
        copy makes it the entry or finds it there, and the entry it replaces lists none), so
        a caller that holds many may test that attribute instead, with no probe of the index
        (tests/test_pool_hashing.py holds the two equal through a pool's lifecycle)."""
        return block.parent is None or self._index.get(block.block_hash) is block

    def incref(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block; a cached free block leaves the queue.
        ValueError (TypeError: an id that is no int), nothing changed, for an id outside the
        pool or a free block that is not cached (only a cached block is found while free)."""
        refcounts = self._refcounts
        free_cached = self._free_cached
        if not isinstance(block_ids, (list, tuple)):
            block_ids = list(block_ids)
        self._check_increfs(block_ids)  # first: a refusal changes nothing (a free cached block's LRU place)
        for block_id in block_ids:
            if refcounts[block_id] == 0:
                del free_cached[block_id]
                self.index_version += 1  # (held now: `match` may pick this copy)
            refcounts[block_id] += 1

    def _check_increfs(self, block_ids: Sequence[int]) -> None:
        """`incref`'s refusals of `block_ids`, before anything changes: TypeError for an id
        that is no int (numpy's ints are ids), ValueError for one outside the pool or of a
        free block that holds no cached content."""
        refcounts, cached, num_blocks = self._refcounts, self._cached, self.num_blocks
        for block_id in block_ids:
            if block_id.__class__ is not int:
                block_id = _index("block id", block_id)
            if not 0 <= block_id < num_blocks:
                raise self._bad_id(block_id)
            if refcounts[block_id] == 0 and cached[block_id] is None:
                raise ValueError(f"incref of block {block_id}, which is free and holds no cached content")

    def touch(self, block_ids: Sequence[int]) -> None:
        """`incref(block_ids)` then `decref(block_ids)` in one pass: the free cached blocks
        among them go to the end of the LRU queue, in their order (the latest a block is
        named, as the decrefs would leave them), held ones stay as they are. The refusals
        are incref's (ValueError, TypeError: an id that is no int), nothing changed. (A V4
        restore's use of a checkpoint: its parts become the most recently used.)"""
        refcounts = self._refcounts
        self._check_increfs(block_ids)  # incref's checks, first: a refusal changes nothing
        free_cached = self._free_cached
        moved = False
        for block_id in block_ids:
            if not refcounts[block_id]:  # (a free block here is a cached one: checked above)
                free_cached.move_to_end(block_id)
                moved = True
        if moved:
            self.index_version += 1  # (a cached copy left the free queue and came back: as incref, decref)

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order; at zero it becomes free.
        ValueError (TypeError: an id that is no int), nothing changed, for an id outside the
        pool or a block released more often than taken (a double free): the ids before it
        are taken back."""
        refcounts = self._refcounts
        cached = self._cached
        if not isinstance(block_ids, (list, tuple)):
            block_ids = list(block_ids)  # (a refusal walks back over them)
        # (the queues and the version as locals: a finished request frees its every block here,
        # ~65 at a 1,024-token context, and a slot's load and store a block cost more than the
        # test; the version moves once by the cached copies freed, where it moved once each)
        free_unhashed, free_cached = self._free_unhashed, self._free_cached
        num_cached = i = 0
        try:
            for i, block_id in enumerate(block_ids):  # noqa: B007  (i: how far a refusal walks back)
                refcount = refcounts[block_id] - 1  # (IndexError, TypeError: below)
                if refcount < 0 or block_id < 0:  # (a negative id would index from the end)
                    if block_id < 0:
                        raise self._bad_id(block_id)
                    raise ValueError(f"block {block_id} released more often than taken")
                refcounts[block_id] = refcount
                if refcount == 0:
                    if cached[block_id] is None:
                        free_unhashed.append(block_id)
                    else:
                        free_cached[block_id] = None
                        num_cached += 1  # (a cached copy free now: `match` may pick another)
        except (IndexError, TypeError, ValueError) as error:
            self.index_version += num_cached  # (as each freed copy moved it before the walk back)
            for block_id in reversed(block_ids[:i]):  # latest first: each back off the tail of its queue
                if refcounts[block_id] == 0:
                    if cached[block_id] is None:
                        self._free_unhashed.pop()
                    else:
                        self._free_cached.popitem(last=True)
                refcounts[block_id] += 1
            if isinstance(error, ValueError):
                raise
            raise self._bad_id(block_ids[i]) from None
        if num_cached:
            self.index_version += num_cached

    def _bad_id(self, block_id: object) -> Exception:
        """The error for an id that names no block of this pool."""
        if not isinstance(block_id, int):
            return TypeError(f"block id {block_id!r} is no int")
        return ValueError(f"block id {block_id} is outside the pool's [0, {self.num_blocks})")

    # ---- the prefix chain ------------------------------------------------------------

    def root(self, descriptor_key: bytes, tenant_salt: str = "") -> PrefixBlock:
        """The start of every chain under this descriptor and tenant (interned)."""
        preimage = BlockHasher.root_preimage(descriptor_key, tenant_salt)
        root = self._roots.get(preimage)
        if root is None:
            root = PrefixBlock(self.hasher.digest(preimage), None, preimage, b"")
            self._roots[preimage] = root
        return root

    def chain(self, parent: PrefixBlock, block_token_bytes: bytes, extra: bytes = b"") -> PrefixBlock:
        """The prefix block after `parent` holding these tokens (not yet registered)."""
        return PrefixBlock(
            self.hasher.chain(parent.block_hash, block_token_bytes, extra), parent, block_token_bytes, extra
        )

    def match(
        self,
        root: PrefixBlock,
        prompt_bytes: bytes,
        block_width: int,
        max_blocks: int,
        extras: Sequence[bytes] | None = None,
        *,
        count_collisions: bool = True,
        memo: MatchMemo | None = None,
    ) -> PrefixMatch:
        """The longest run of cached blocks for `prompt_bytes`, in blocks of `block_width`
        bytes, at most `max_blocks`. extras[i]: block i's extra keys (None: none at all).
        memo: the prompt's chained hashes already computed (`LookupPrompt.hashes`), read and
        extended here, so that a prompt looked up in several pools (the router's replicas,
        then the admission) hashes each block once; without extras only, keyed by the
        algorithm, the hash `root` starts from and the width (what the hashes depend on).
        The memo only says where to look: the collision guard compares every hit's parent,
        token bytes and extra keys all the same. It also keeps, per pool, the run this
        pool's last walk of the prompt accepted (`walked_key`): a later walk in the same
        pool (the admission after the router's lookup, an admission retried every step)
        takes that run again while the index holds each of its very blocks under its hash
        (one C-level lookup and comparison a block: a block the guard accepted for these
        bytes and this root stays acceptable, its parent, bytes and keys never change),
        and walks on from its end. Changes nothing but the collision counter (and not that
        with count_collisions=False) and the memo."""
        index_get = self._index.get
        refcounts = self._refcounts
        hashes = None  # (with multimodal keys: hashed here each time)
        parent = root
        block_ids: list[int] = []
        chain: list[PrefixBlock] = []
        walked_key = None
        kept = 0  # blocks of the memo's run that still hold
        if memo is not None and extras is None:
            key = self.memo_key(root, block_width)
            hashes = memo.setdefault(key, [])  # type: ignore[assignment]  (a hashes key holds a list)
            walked_key = (*key, id(self))
            walked = memo.get(walked_key)
            if walked and max_blocks:
                n = min(len(walked), max_blocks)
                found = list(map(index_get, hashes[:n]))
                # (element by element: identity, a PrefixBlock has no __eq__; its root: the chain's first parent)
                if found == list(walked[:n]) and found[0].parent is root:
                    kept = len(walked)
                    chain = found
                    held = list(map(_BLOCK_IDS, found))
                    if max(map(len, held)) == 1:  # one copy each (the common case): its id, C-level
                        block_ids = list(map(_FIRST, held))
                    else:
                        for ids in held:  # `held_copy`, as the walk below picks it
                            block_ids.append(
                                ids[0] if len(ids) == 1 else next((b for b in ids if refcounts[b]), ids[0])
                            )
                    parent = found[-1]
                else:
                    del memo[walked_key]  # (stale: some block left the index or another took its hash)
        start = len(chain) * block_width  # prompt_bytes[start : start + block_width] is the next block's
        refused = None  # an entry of the block's hash that the collision guard refused
        # Blocks [0, len(hashes)) of this root's chain have their hashes in the memo: the walk
        # reads them without a hash or an extra key to look at (the router's lookups after the
        # first, the admission after them)
        for block_hash in hashes[len(chain) : max_blocks] if hashes else ():
            found = index_get(block_hash)
            if found is None:
                break  # (not a return: a run longer than the pool's last one is remembered below)
            stored = found.token_bytes
            # the guard: stored == prompt_bytes[start : start + block_width], without slicing a copy
            if (
                found.parent is not parent
                or found.extra
                or len(stored) != block_width
                or not prompt_bytes.startswith(stored, start)
            ):
                refused = found
                break
            ids = found.block_ids
            # several copies: share one that is held rather than revive a free one
            block_ids.append(ids[0] if len(ids) == 1 else next((b for b in ids if refcounts[b]), ids[0]))
            chain.append(found)
            parent = found
            start += block_width
        else:
            # the blocks past the memo: hashed here (and kept in the memo, in order from
            # len(hashes), which is where this loop starts), extra keys compared
            digest = self.hasher.digest
            extra = b""
            for i in range(len(chain), max_blocks):
                if extras is not None:
                    extra = extras[i]
                chunk = prompt_bytes[start : start + block_width]
                # BlockHasher.chain, inlined (a call per block costs ~40 % of a lookup: kvpool bench pool)
                block_hash = digest(parent.block_hash + chunk + extra)
                if hashes is not None and len(chunk) == block_width:
                    hashes.append(block_hash)
                found = index_get(block_hash)
                if found is None:
                    break
                stored = found.token_bytes
                if (
                    found.parent is not parent
                    or found.extra != extra
                    or len(stored) != block_width
                    or not prompt_bytes.startswith(stored, start)
                ):
                    refused = found
                    break
                ids = found.block_ids
                block_ids.append(ids[0] if len(ids) == 1 else next((b for b in ids if refcounts[b]), ids[0]))
                chain.append(found)
                parent = found
                start += block_width
        # A refused entry whose own parent has left the index is a stale orphan (its prefix
        # was evicted or rewritten first), not a collision
        if refused is not None:
            self.num_refused += 1
            if count_collisions and refused.parent.is_live:  # (an index entry has a parent)
                self.num_collisions += 1
        if walked_key is not None and len(chain) > kept:
            memo[walked_key] = tuple(chain)  # (a copy: callers extend the chain they get)
        return PrefixMatch(block_ids, chain)

    def memo_key(self, root: PrefixBlock, block_width: int) -> tuple[str, bytes, int]:
        """The key of a prompt's chained hashes in a lookup memo (`match`): what they depend
        on, the algorithm, the hash `root` starts from and the width."""
        return (self.hasher.algo, root.block_hash, block_width)

    def is_indexed(self, block_hash: bytes) -> bool:
        """Whether a content of this chained hash is in the prefix index (a run that `match`
        finds past a block needs it there: one probe rules the run out without a walk)."""
        return block_hash in self._index

    def publish(self, block_id: int, parent: PrefixBlock, block_token_bytes: bytes, extra: bytes = b"") -> PrefixBlock:
        """`chain` and `register` in one call, the decode path's: the prefix block the
        caller's chain goes on with, registered, or (when it cannot be published) not."""
        # BlockHasher.chain, inlined: digest(parent hash || tokens || extra).
        block_hash = self.hasher.digest(parent.block_hash + block_token_bytes + extra)
        if self.enable_caching and (parent.parent is None or parent.block_ids):
            assert self._refcounts[block_id] > 0 and self._cached[block_id] is None, f"publish of block {block_id}"
            # The common case, a new content after a live parent: what `register` does, in short,
            # with one probe of the index (a large dict: each probe is a cache miss at scale)
            block = PrefixBlock(block_hash, parent, block_token_bytes, extra, (block_id,))
            if self._index.setdefault(block_hash, block) is block:
                self._cached[block_id] = block
                self.index_version += 1
                return block
            block.block_ids = ()  # the hash is taken: `register` joins that copy or counts a collision
        else:
            block = PrefixBlock(block_hash, parent, block_token_bytes, extra)
        return self.register(block_id, block) or block

    def publish_run(
        self, block_ids: Sequence[int], parent: PrefixBlock, data: bytes, block_width: int
    ) -> list[PrefixBlock]:
        """`publish` for a run of full blocks without extra keys: block i holds
        data[i * block_width : (i + 1) * block_width] and is chained after the prefix block
        that block i - 1 became (`parent` for block 0). The run's prefix blocks, one per
        block, as `chain` + `register` (cache/chains.py `register_run`) make them: each its
        own new content, or the equal copy it joined, or (a collision, caching off, a parent
        out of the index) unregistered. tests/test_pool_hashing.py holds it to that twin."""
        if len(data) != len(block_ids) * block_width:
            raise ValueError(f"{len(data)} bytes for {len(block_ids)} blocks of {block_width}")
        digest, index, cached, refcounts = self.hasher.digest, self._index, self._cached, self._refcounts
        caching = self.enable_caching
        self.index_version += 1  # (once for the run: its blocks join the index)
        run = []
        start = 0
        for block_id in block_ids:
            chunk = data[start : start + block_width]
            start += block_width
            block_hash = digest(parent.block_hash + chunk)
            if caching and (parent.parent is None or parent.block_ids):
                # `publish`'s common case, inlined: a new content after a live parent (one probe)
                assert refcounts[block_id] > 0 and cached[block_id] is None, f"publish of block {block_id}"
                block = PrefixBlock(block_hash, parent, chunk, b"", (block_id,))
                if index.setdefault(block_hash, block) is block:
                    cached[block_id] = parent = block
                    run.append(block)
                    continue
                block.block_ids = ()  # the hash is taken: an equal copy to join, or a collision
            else:  # a parent gone, caching off
                block = PrefixBlock(block_hash, parent, chunk, b"")
            parent = self.register(block_id, block) or block
            run.append(parent)
        return run

    def publish_parts(
        self, block_ids: Sequence[int], parent: PrefixBlock, extras: Sequence[bytes], *, release: bool = False
    ) -> tuple[PrefixBlock, ...] | None:
        """`publish(block_ids[i], parent, b"", extras[i])` for each block in order (the parts
        of one content that spans several blocks, each chained after `parent`, such as a
        pooled V4 checkpoint), stopping at the first that ends up unregistered (a collision,
        a parent out of the index, caching off): None then, with the parts before it left
        published. The parts otherwise (one may be an equal copy's, which the block joined).
        release: the caller's reference on each block is dropped too, as `decref(block_ids)`
        after the call would (a V4 checkpoint's blocks are freed at once, as cached blocks),
        in the same pass. tests/test_pool_hashing.py holds it to the loop of `publish` calls
        (and `decref`)."""
        if len(block_ids) != len(extras):
            raise ValueError(f"{len(block_ids)} blocks but {len(extras)} extra keys")
        digest, index, cached, refcounts = self.hasher.digest, self._index, self._cached, self._refcounts
        head = parent.block_hash
        live = self.enable_caching and (parent.parent is None or bool(parent.block_ids))  # (the parts' one parent)
        # (once for the parts: they join the index, and with release their blocks turn free;
        # no walk runs within the call)
        self.index_version += 1
        free_cached = self._free_cached
        parts: list[PrefixBlock] = []
        if live:
            for block_id, extra in zip(block_ids, extras, strict=True):
                # `publish`'s common case, inlined: a new content after a live parent (one probe)
                assert refcounts[block_id] > 0 and cached[block_id] is None, f"publish of block {block_id}"
                block_hash = digest(head + extra)
                part = PrefixBlock(block_hash, parent, b"", extra, (block_id,))
                if index.setdefault(block_hash, part) is not part:
                    part.block_ids = ()  # (not the entry: it lists no copy, `is_published`)
                    break  # (the hash is taken: an equal copy to join, or a collision)
                cached[block_id] = part
                parts.append(part)
                if release:  # `decref` of a registered block (no queue has moved since the loop began)
                    refcount = refcounts[block_id] - 1
                    refcounts[block_id] = refcount
                    if not refcount:
                        free_cached[block_id] = None
            else:
                return tuple(parts)
        # The rest, this part on (an equal copy to join, a collision, caching off, a parent
        # out of the index: rare), as the calls it stands for: `publish` block by block up to
        # the first part left unregistered, then `decref` of the blocks not released above
        i = len(parts)
        out: list[PrefixBlock] | None = parts
        for block_id, extra in zip(block_ids[i:], extras[i:], strict=True):
            part = self.publish(block_id, parent, b"", extra)
            if cached[block_id] is not part:
                out = None
                break
            parts.append(part)
        if release:
            self.decref(block_ids[i:])
        return None if out is None else tuple(out)

    def lookup(self, block: PrefixBlock) -> PrefixBlock | None:
        """The index entry holding `block`'s content, or None. Unlike `match`, the chain
        before `block` need not be in the index (a sliding-window group finds the blocks of
        its window from the right, after the blocks before them have left the pool): the
        stored entry is accepted only when its content, walked through its parents until the
        two chains meet (the root at the latest), is `block`'s, so a hash collision anywhere
        in the prefix is a miss. Changes nothing."""
        found = self._index.get(block.block_hash)
        if found is None or found is block or same_content(found, block):
            return found
        return None

    def register(self, block_id: int, block: PrefixBlock, *, orphan_ok: bool = False) -> PrefixBlock | None:
        """Publish a full, computed, held block as `block`'s content.

        Returns the prefix block it is now findable as: `block` itself, or the equal one
        already in the index (the block joins its copies). None, and nothing published, when
        caching is off, when `block`'s parent is not in the index (a chain is findable only
        from its root), or when another content holds the hash (a collision, counted).
        orphan_ok: the parent may have left the index (a sliding-window or checkpoint
        group, found by `lookup`, not by `match`); an equal entry is then recognized by its
        whole content, and an entry of other content under the hash is a collision."""
        parent = block.parent
        if not self.enable_caching or parent is None:
            return None
        if not orphan_ok and not (parent.parent is None or parent.block_ids):
            return None  # a chain is findable only from its root
        assert self._refcounts[block_id] > 0, f"register of free block {block_id}"
        assert self._cached[block_id] is None, f"block {block_id} is already registered"
        found = self._index.get(block.block_hash)
        if found is not None and found is not block:
            if orphan_ok:
                same = same_content(found, block)
            else:
                same = (
                    found.parent is block.parent
                    and found.token_bytes == block.token_bytes
                    and found.extra == block.extra
                )
            if same:
                block = found
            elif not orphan_ok and not found.parent.is_live:  # an index entry always has a parent
                self._forget(found)  # a stale orphan gives way
            else:
                self.num_collisions += 1
                return None
        if not block.block_ids:
            self._index[block.block_hash] = block
        block.block_ids += (block_id,)
        self._cached[block_id] = block
        self.index_version += 1
        return block

    def unregister(self, block_id: int) -> None:
        """Drop a held block's registration before its owner overwrites it (after a rollback)."""
        assert self._cached[block_id] is not None, f"block {block_id} is not registered"
        assert self._refcounts[block_id] == 1, f"unregister of block {block_id} that others hold"
        self._drop(block_id)

    def _drop(self, block_id: int) -> None:
        cached = self._cached[block_id]
        assert cached is not None
        self._cached[block_id] = None
        self.index_version += 1
        if len(cached.block_ids) == 1:  # its one copy (an eviction's common case): no tuple to filter
            assert cached.block_ids == (block_id,)
            cached.block_ids = ()
            del self._index[cached.block_hash]
            return
        # (one of two or more copies, each id once (`register` refuses a registered block): some remain)
        cached.block_ids = tuple(b for b in cached.block_ids if b != block_id)

    def _forget(self, block: PrefixBlock) -> None:
        """Unregister every copy of `block` (its prefix is gone: nobody can reach it)."""
        for block_id in block.block_ids:
            self._drop(block_id)
            if block_id in self._free_cached:
                del self._free_cached[block_id]
                self._free_unhashed.append(block_id)

    def _forget_cached(self) -> int:
        """Drop every registration: each free cached block becomes an unhashed free block (in
        LRU order, after the unhashed ones), so no walk of the index finds anything; returns
        how many. Every block must be free. The coordinator's `reset_prefix_cache` only, which
        has every group forget its own records of what the index held first: a group keeps
        such records (V4's checkpoints, turn ends), which a reset of its pool behind its back
        left pointing at nothing (its next admission failed an assertion)."""
        assert not any(self._refcounts), "a prefix-cache reset with blocks held"
        num_dropped = len(self._free_cached)
        while self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            self._drop(block_id)
            self._free_unhashed.append(block_id)
        assert not self._index, "every registered block was a free cached one"
        return num_dropped

    def metadata_bytes(self) -> int:
        """Bytes of the pool's Python structures (sys.getsizeof): refcounts, registrations,
        free queues, the prefix index and its prefix blocks."""
        size = sys.getsizeof
        total = size(self._refcounts) + size(self._cached) + size(self._free_unhashed) + size(self._free_cached)
        total += size(self._index) + size(self._roots)
        for block in self._index.values():
            total += size(block) + size(block.block_hash) + size(block.token_bytes) + size(block.block_ids)
        return total

    # ---- invariants ------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the pool's share of the lifecycle invariants; the message names the broken one."""
        unhashed = list(self._free_unhashed)
        cached = list(self._free_cached)
        free = unhashed + cached
        if len(set(free)) != len(free):
            raise AssertionError("invariant 3 (a block is freed once, after its last reader): a block is queued twice")
        for block_id in free:
            if self._refcounts[block_id] != 0:
                raise AssertionError(
                    f"invariant 3 (a block returns to the free list only after its last reader): "
                    f"free block {block_id} has refcount {self._refcounts[block_id]}"
                )
        free_set = set(free)
        for block_id, refcount in enumerate(self._refcounts):
            if refcount < 0:
                raise AssertionError(f"invariant 1 (refcount == holders): block {block_id} has refcount {refcount}")
            if refcount == 0 and block_id not in free_set:
                raise AssertionError(
                    f"invariant 7 (no partial grab or leak): block {block_id} has refcount 0 but is not free"
                )
        for block_id in unhashed:
            if self._cached[block_id] is not None:
                raise AssertionError(f"pool: unhashed free block {block_id} is still registered")
        for block_id in cached:
            if self._cached[block_id] is None:
                raise AssertionError(f"pool: cached free block {block_id} is not registered")
        num_registered = 0
        for block_hash, block in self._index.items():
            if block.block_hash != block_hash or not block.block_ids or block.parent is None:
                raise AssertionError(f"pool: index entry {block!r} is stale")
            if len(set(block.block_ids)) != len(block.block_ids):
                raise AssertionError(f"pool: {block!r} lists a block twice")
            for block_id in block.block_ids:
                if self._cached[block_id] is not block:
                    raise AssertionError(f"pool: block {block_id} is listed by {block!r} but registered elsewhere")
            num_registered += len(block.block_ids)
        if num_registered != sum(c is not None for c in self._cached):
            raise AssertionError("pool: a block is registered as content that the index does not hold")
