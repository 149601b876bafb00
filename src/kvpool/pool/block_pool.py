"""The block pool: block ids, reference counts, the free queue and the prefix hash index.

Block states:
  free       refcount 0, in the free queue (with or without a cached hash)
  exclusive  refcount 1, held by one block table
  shared     refcount > 1, read-only until copied (copy-on-write is the cache layer's job)

The free queue has two parts, so that eviction order is what prefix caching needs:
  - unhashed free blocks (never registered, or their hash was dropped): reused first, FIFO;
  - cached free blocks (they keep their hash until reused): an LRU queue. A hit takes a
    block out of the middle in O(1) (an OrderedDict is a C doubly-linked list + dict).
Freed blocks join the end in the order given; the cache layer frees a request tail-first, so
a chain's tail is evicted before its head. A cached block keeps its hash until the
allocator hands it out again (lazy eviction).

Pure Python integers, no torch: this code also runs inside the serving simulator.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable


class BlockPool:
    __slots__ = (
        "num_blocks",
        "enable_caching",
        "_refcounts",
        "_hashes",
        "_token_bytes",
        "_index",
        "_free_unhashed",
        "_free_cached",
        "num_collisions",
    )

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._refcounts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._token_bytes: list[bytes | None] = [None] * num_blocks  # the collision guard
        self._index: dict[bytes, int] = {}  # block hash -> block id
        self._free_unhashed: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self.num_collisions = 0  # hash hits whose stored tokens differed

    # ---- queries ---------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take now (cached free blocks included)."""
        return len(self._free_unhashed) + len(self._free_cached)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the hash index (held or free)."""
        return len(self._index)

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hashes[block_id]

    def free_queue(self) -> list[int]:
        """Free block ids in allocation order: unhashed first, then cached in LRU order."""
        return [*self._free_unhashed, *self._free_cached]

    def is_free_cached(self, block_id: int) -> bool:
        return block_id in self._free_cached

    # ---- allocation ------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` blocks with refcount 1, or return None and change nothing."""
        if num_blocks > len(self._free_unhashed) + len(self._free_cached):
            return None
        unhashed = self._free_unhashed
        if num_blocks <= len(unhashed):
            block_ids = [unhashed.popleft() for _ in range(num_blocks)]
        else:
            block_ids = list(unhashed)
            unhashed.clear()
            for _ in range(num_blocks - len(block_ids)):
                block_ids.append(self._evict_lru())
        refcounts = self._refcounts
        for block_id in block_ids:
            refcounts[block_id] = 1
        return block_ids

    def _evict_lru(self) -> int:
        block_id, _ = self._free_cached.popitem(last=False)
        # Lazy eviction: the hash leaves the index only now that the block is reused.
        del self._index[self._hashes[block_id]]  # type: ignore[index]
        self._hashes[block_id] = None
        self._token_bytes[block_id] = None
        return block_id

    def incref(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block; a cached free block leaves the queue."""
        refcounts = self._refcounts
        free_cached = self._free_cached
        for block_id in block_ids:
            if refcounts[block_id] == 0:
                # Only a cached block can be found again while free (through a hash hit).
                assert self._hashes[block_id] is not None, f"incref of free unhashed block {block_id}"
                del free_cached[block_id]
            refcounts[block_id] += 1

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order; at zero it becomes free."""
        refcounts = self._refcounts
        hashes = self._hashes
        for block_id in block_ids:
            refcount = refcounts[block_id] - 1
            assert refcount >= 0, f"block {block_id} released more often than taken"
            refcounts[block_id] = refcount
            if refcount == 0:
                if hashes[block_id] is None:
                    self._free_unhashed.append(block_id)
                else:
                    self._free_cached[block_id] = None

    # ---- prefix cache ----------------------------------------------------------------

    def register(self, block_id: int, block_hash: bytes, block_token_bytes: bytes) -> bool:
        """Publish a full, computed block under its chained hash.

        Returns False (and registers nothing) when caching is off or another block already
        holds this hash: two requests computed the same block; the first copy stays cached
        and the second is freed as an ordinary block.
        """
        if not self.enable_caching or block_hash in self._index:
            return False
        assert self._refcounts[block_id] > 0, f"register of free block {block_id}"
        assert self._hashes[block_id] is None, f"block {block_id} is already registered"
        self._index[block_hash] = block_id
        self._hashes[block_id] = block_hash
        self._token_bytes[block_id] = block_token_bytes
        return True

    def unregister(self, block_id: int) -> None:
        """Drop a held block's hash before its owner overwrites it (e.g. after a rollback)."""
        block_hash = self._hashes[block_id]
        assert block_hash is not None, f"block {block_id} is not registered"
        assert self._refcounts[block_id] == 1, f"unregister of block {block_id} that others hold"
        del self._index[block_hash]
        self._hashes[block_id] = None
        self._token_bytes[block_id] = None

    def lookup(self, block_hash: bytes, block_token_bytes: bytes) -> int | None:
        """The block cached under `block_hash`, if its stored tokens are exactly these."""
        block_id = self._index.get(block_hash)
        if block_id is None:
            return None
        if self._token_bytes[block_id] != block_token_bytes:
            self.num_collisions += 1
            return None
        return block_id

    def reset_prefix_cache(self) -> int:
        """Forget every free cached block's hash (e.g. after a weights update); returns how many."""
        num_dropped = 0
        while self._free_cached:
            self._free_unhashed.append(self._evict_lru())
            num_dropped += 1
        return num_dropped

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
            if self._hashes[block_id] is not None:
                raise AssertionError(f"pool: unhashed free block {block_id} still has a hash")
        for block_id in cached:
            if self._hashes[block_id] is None:
                raise AssertionError(f"pool: cached free block {block_id} has no hash")
        for block_hash, block_id in self._index.items():
            if self._hashes[block_id] != block_hash or self._token_bytes[block_id] is None:
                raise AssertionError(f"pool: hash index entry of block {block_id} is stale")
        num_hashed = sum(h is not None for h in self._hashes)
        if num_hashed != len(self._index):
            raise AssertionError(f"pool: {num_hashed} blocks carry a hash, the index holds {len(self._index)}")
