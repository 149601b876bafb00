"""Block hashes: a fixed binary layout, chained, stable across processes."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.pool import BlockHasher, BlockPool, token_bytes
from kvpool.pool.hashing import token_array


def test_token_bytes_is_little_endian_uint32():
    assert token_bytes([1, 256, 2**32 - 1]) == bytes([1, 0, 0, 0, 0, 1, 0, 0, 255, 255, 255, 255])


def test_token_array_is_the_packed_ids_and_packs_back_to_them():
    # A cache's own ids (token_array of a prompt's packing): the same ids, and token_bytes of
    # the array or of any slice of it is the list's packing (the array's fast path)
    ids = [1, 256, 2**32 - 1, 0, 70_000]
    arr = token_array(token_bytes(ids))
    assert arr.typecode == "I" and arr.tolist() == ids
    for a, b in [(0, 5), (1, 3), (2, 2), (4, 5)]:
        assert token_bytes(arr[a:b]) == token_bytes(ids[a:b])
    arr.append(9)
    assert token_bytes(arr) == token_bytes([*ids, 9])
    with pytest.raises(ValueError, match="7 bytes are not whole 4-byte token ids"):
        token_array(b"\x00" * 7)


def test_chain_is_hash_of_parent_tokens_and_extra():
    hasher = BlockHasher()
    parent = hasher.root(b"desc", "salt")
    tb = token_bytes([5, 6, 7, 8])
    assert hasher.chain(parent, tb) == xxhash.xxh3_128_digest(parent + tb)
    assert hasher.chain(parent, tb, b"mm") == xxhash.xxh3_128_digest(parent + tb + b"mm")
    assert BlockHasher("sha256").chain(parent, tb) == hashlib.sha256(parent + tb).digest()
    # the salt and the descriptor both change the root
    assert len({hasher.root(b"desc", "salt"), hasher.root(b"desc", ""), hasher.root(b"desc2", "salt")}) == 3
    # (descriptor, salt) boundaries are length-prefixed, so shifting a byte changes the root
    assert hasher.root(b"ab", "c") != hasher.root(b"a", "bc")


def test_hashes_are_stable_across_processes():
    code = (
        "from kvpool.pool import BlockHasher, token_bytes;"
        "h = BlockHasher(); print(h.chain(h.root(b'd', 's'), token_bytes(range(16))).hex())"
    )
    runs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    h = BlockHasher()
    assert runs == {h.chain(h.root(b"d", "s"), token_bytes(range(16))).hex() + "\n"}


def test_pool_keeps_every_copy_of_a_block_findable():
    pool = BlockPool(4)
    root = pool.root(b"desc")
    assert pool.root(b"desc") is root and pool.root(b"desc", "tenant") is not root  # interned
    t = token_bytes([1, 2])
    a, b = pool.allocate(2)
    first = pool.register(a, pool.chain(root, t))
    assert first is not None and first.block_ids == (a,)
    assert pool.register(b, pool.chain(root, t)) is first  # same content computed twice: b joins
    assert first.block_ids == (a, b)
    pool.decref([b, a])
    assert pool.free_queue() == [2, 3, b, a]
    assert pool.match(root, t, len(t), 1).block_ids == [a]  # both free: the first listed copy
    assert pool.allocate(3) == [2, 3, b]  # b is evicted: a still holds the content
    assert pool.match(root, t, len(t), 1).block_ids == [a]
    pool.check_integrity()
    pool.decref([2, 3, b])  # (a reset finds every block free: the coordinator refuses it otherwise)
    assert pool._forget_cached() == 1  # (the coordinator's reset_prefix_cache, its groups' records first)
    assert pool.match(root, t, len(t), 1).block_ids == []
    pool.check_integrity()


def test_pool_match_guards_the_parent_and_counts_a_collision():
    pool = BlockPool(4)
    pool.hasher.digest = lambda data: b"h" * 16  # every hash alike
    root = pool.root(b"desc")
    (a,) = pool.allocate(1)
    block = pool.register(a, pool.chain(root, token_bytes([1, 2])))
    assert block is not None
    # the same tokens after block a (not after the root): the hash hits, the guard refuses
    prompt = token_bytes([1, 2, 1, 2])
    hit = pool.match(root, prompt, 8, 2)
    assert hit.block_ids == [a] and pool.num_collisions == 1
    assert pool.match(root, prompt, 8, 2, count_collisions=False).block_ids == [a] and pool.num_collisions == 1
    # a block after a colliding parent cannot be published, nor a block under another root
    (b,) = pool.allocate(1)
    assert pool.register(b, pool.chain(block, token_bytes([1, 2]))) is None and pool.num_collisions == 2
    assert pool.register(b, pool.chain(pool.root(b"other"), token_bytes([1, 2]))) is None
    pool.check_integrity()


def test_a_memo_of_hashes_serves_pools_of_the_same_root_and_never_replaces_the_guard():
    # Two pools under one descriptor: their roots hash alike, so the chained hashes of a
    # prompt are the same in both and the memo computes each once. Block size 2 tokens.
    calls = []
    pools = [BlockPool(6), BlockPool(6)]
    for pool in pools:
        digest = pool.hasher.digest
        pool.hasher.digest = lambda data, digest=digest: calls.append(1) or digest(data)
    roots = [pool.root(b"desc") for pool in pools]
    blocks = [token_bytes([1, 2]), token_bytes([3, 4]), token_bytes([5, 6])]
    held = []
    for pool, root, n in zip(pools, roots, (1, 3), strict=True):  # pool 0 holds block 0, pool 1 all three
        parent = root
        for t in blocks[:n]:
            (b,) = pool.allocate(1)
            parent = pool.register(b, pool.chain(parent, t))
            held.append(b)
    prompt = b"".join(blocks)
    memo: dict = {}
    calls.clear()
    first = pools[0].match(roots[0], prompt, 8, 3, memo=memo)
    assert first.block_ids == [0] and len(calls) == 2  # block 0 hits, block 1 misses: hashed, kept
    second = pools[1].match(roots[1], prompt, 8, 3, memo=memo)
    assert second.block_ids == [0, 1, 2] and len(calls) == 3  # only block 2 was left to hash
    key = ("xxh3_128", roots[0].block_hash, 8)
    assert {k: v for k, v in memo.items() if len(k) == 3} == {key: [c.block_hash for c in second.chain]}
    # and per pool, the run its walk accepted (`match` takes it again while it holds)
    assert memo[(*key, id(pools[0]))] == tuple(first.chain) and memo[(*key, id(pools[1]))] == tuple(second.chain)
    calls.clear()
    assert pools[1].match(roots[1], prompt, 8, 3, memo=memo) == second and calls == []
    # The naive twin: no memo, every block hashed, the same runs
    for pool, root, hit in zip(pools, roots, (first, second), strict=True):
        assert pool.match(root, prompt, 8, 3) == hit
    # A memo only says where to look: hashes of other content lead to entries the guard
    # refuses (tokens 1 2 | 3 4 looked up with a memo that points at 5 6's entry)
    forged = {("xxh3_128", roots[1].block_hash, 8): [second.chain[0].block_hash, second.chain[2].block_hash]}
    assert pools[1].match(roots[1], prompt, 8, 3, memo=forged).block_ids == [0]
    assert pools[1].num_collisions == 1  # (the entry's parent is live: counted as one)
    # Another width or root is another key; extras are never memoized
    other: dict = {}
    assert pools[1].match(roots[1], prompt, 4, 2, memo=other).block_ids == []
    assert pools[1].match(pools[1].root(b"desc", "tenant"), prompt, 8, 3, memo=other).block_ids == []
    assert pools[1].match(roots[1], prompt, 8, 3, [b"", b"", b""], memo=other).block_ids == [0, 1, 2]
    assert sorted(len(v) for v in other.values()) == [1, 1]
    for pool in pools:
        pool.check_integrity()


def _publish_loop(pool: BlockPool, block_ids: list[int], parent, extras: list[bytes]):
    """`publish_parts`' naive twin: `publish` block by block, stopping at the first part that
    is not registered as its own content."""
    parts = []
    for block_id, extra in zip(block_ids, extras, strict=True):
        part = pool.publish(block_id, parent, b"", extra)
        if pool.prefix_block(block_id) is not part:
            return None
        parts.append(part)
    return tuple(parts)


def _index_view(pool: BlockPool) -> list[tuple[int, bytes | None]]:
    return [(b, pool.block_hash(b)) for b in range(pool.num_blocks)]


def test_publish_parts_agrees_with_publish_block_by_block():
    extras = [b"part:0", b"part:1", b"part:2"]
    # (caching, part taken before, every hash alike) -> whether the parts come back
    cases = {
        (True, None, False): True,  # each part its own new content
        (True, 1, False): True,  # part 1's content is held by another block: it joins that copy
        (True, None, True): False,  # part 0 collides with the boundary's hash: the run stops there
        (False, None, False): False,  # nothing is published
    }
    for (caching, taken, collide), published in cases.items():
        out, views = [], []
        for publish in ("fast", "twin"):
            pool = BlockPool(8, enable_caching=caching)
            if collide:
                pool.hasher.digest = lambda data: b"h" * 16
            root = pool.root(b"desc")
            (b0,) = pool.allocate(1)
            boundary = pool.register(b0, pool.chain(root, token_bytes([5, 6]))) or pool.chain(root, b"")
            if taken is not None:
                (other,) = pool.allocate(1)
                pool.publish(other, boundary, b"", extras[taken])
            ids = pool.allocate(3)
            if publish == "fast":
                parts = pool.publish_parts(ids, boundary, extras)
            else:
                parts = _publish_loop(pool, ids, boundary, extras)
            out.append(
                None if parts is None else [(p.block_hash, p.parent.block_hash, p.extra, p.block_ids) for p in parts]
            )
            views.append(_index_view(pool))
            pool.check_integrity()
        assert out[0] == out[1] and views[0] == views[1]
        assert (out[0] is not None) == published
        if taken is not None:
            assert out[0][taken][3] == (1, 3)  # joined: the other block's copy and ours


def test_publish_parts_release_agrees_with_publish_then_decref():
    """release=True (a V4 checkpoint's blocks freed in the pass that publishes them) leaves
    the pool as the twin's `publish` calls and then `decref(ids)` do: the same parts, index,
    refcounts and free queue in order, whichever way the parts end (all published, one
    joining an equal copy, a collision midway, caching off, a parent out of the index)."""
    extras = [b"part:0", b"part:1", b"part:2", b"part:3"]
    # (caching, part taken before, every hash alike, parent out of the index, also held by another)
    cases = [
        (True, None, False, False, False),
        (True, 2, False, False, False),
        (True, None, True, False, False),
        (False, None, False, False, False),
        (True, None, False, True, False),
        (True, None, False, False, True),
    ]
    for caching, taken, collide, gone, shared in cases:
        out, views = [], []
        for publish in ("fast", "twin"):
            pool = BlockPool(12, enable_caching=caching)
            if collide:
                pool.hasher.digest = lambda data: b"h" * 16
            root = pool.root(b"desc")
            (b0,) = pool.allocate(1)
            boundary = pool.register(b0, pool.chain(root, token_bytes([5, 6]))) or pool.chain(root, b"")
            if taken is not None:
                (other,) = pool.allocate(1)
                pool.publish(other, boundary, b"", extras[taken])
            pool.decref(pool.allocate(2))  # (free blocks ahead in the queue: the parts join after them)
            ids = pool.allocate(4)
            if shared:
                pool.incref(ids[1:3])
            if gone:
                pool.decref([b0])
                pool.allocate(pool.num_free)  # evicts the boundary: the parts' parent leaves the index
            if publish == "fast":
                version = pool.index_version
                parts = pool.publish_parts(ids, boundary, extras, release=True)
                assert pool.index_version != version  # (the parts joined the index or turned free)
            else:
                parts = _publish_loop(pool, ids, boundary, extras)
                pool.decref(ids)
            out.append(
                None if parts is None else [(p.block_hash, p.parent.block_hash, p.extra, p.block_ids) for p in parts]
            )
            views.append((_index_view(pool), pool.free_queue(), [pool.refcount(b) for b in range(pool.num_blocks)]))
            pool.check_integrity()
        assert out[0] == out[1] and views[0] == views[1], (caching, taken, collide, gone, shared)
        assert (out[0] is not None) == (caching and not collide and not gone)
        if out[0] is not None and not shared:
            assert views[0][1][-4:] == ids  # freed in order, last in the queue


def test_publish_parts_names_a_length_mismatch():
    pool = BlockPool(4)
    root = pool.root(b"desc")
    with pytest.raises(ValueError, match="2 blocks but 1 extra keys"):
        pool.publish_parts([0, 1], root, [b"x"])


def test_publish_run_agrees_with_chain_units_and_register_run():
    from kvpool.cache.chains import chain_units, register_run

    ids4 = [[1, 2], [3, 4], [5, 6], [7, 8]]
    tokens = [t for pair in ids4 for t in pair]
    # (caching, blocks another request published first, every hash alike) -> the run's contents
    cases = [(True, 0, False), (True, 2, False), (True, 4, False), (True, 0, True), (False, 0, False)]
    for caching, num_before, collide in cases:
        results = []
        for publish in ("fast", "twin"):
            pool = BlockPool(12, enable_caching=caching)
            if collide:
                pool.hasher.digest = lambda data: b"h" * 16
            root = pool.root(b"desc")
            if num_before:  # another request computed the first blocks: ours join its copies
                other = pool.allocate(num_before)
                register_run(pool, root, zip(other, chain_units(pool, root, tokens, (), 2, 0, num_before), strict=True))
            ours = pool.allocate(4)
            if publish == "fast":
                run = pool.publish_run(ours, root, token_bytes(tokens), 2 * 4)
            else:
                run = register_run(pool, root, zip(ours, chain_units(pool, root, tokens, (), 2, 0, 4), strict=True))
            results.append(
                (
                    [(b.block_hash, b.parent.block_hash, b.token_bytes, b.extra, b.block_ids) for b in run],
                    _index_view(pool),
                    pool.num_collisions,
                )
            )
            pool.check_integrity()
        assert results[0] == results[1]
        run, _, collisions = results[0]
        if caching and not collide:  # every block findable: its own copy, or joined to the other's
            assert [ids for *_, ids in run] == [
                (k, num_before + k) if k < num_before else (num_before + k,) for k in range(4)
            ]
        assert collisions == (1 if collide else 0)  # a collision stops the run: one counted, the rest orphans


def test_publish_run_names_a_length_mismatch():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="9 bytes for 2 blocks of 8"):
        pool.publish_run([0, 1], pool.root(b"desc"), b"x" * 9, 8)


def _touch_pools(published: list[int], released: list[int]) -> tuple[BlockPool, BlockPool]:
    """Two equal 10-block pools: every block allocated, those in `published` published (a
    chain after the root each), then those in `released` freed in that order (a published
    one as a cached free block, in LRU order; the others unhashed)."""
    pools = []
    for _ in range(2):
        pool = BlockPool(10)
        root = pool.root(b"desc")
        assert pool.allocate(10) == list(range(10))
        for block_id in published:
            pool.publish(block_id, root, token_bytes([block_id]))
        pool.decref(released)
        pools.append(pool)
    return pools[0], pools[1]


def _pool_view(pool: BlockPool) -> tuple:
    return pool.free_queue(), [pool.refcount(b) for b in range(pool.num_blocks)], _index_view(pool)


@settings(max_examples=300, deadline=None)
@given(
    published=st.lists(st.integers(0, 9), unique=True),
    released=st.permutations(range(10)).flatmap(lambda order: st.integers(0, 10).map(lambda k: order[:k])),
    data=st.data(),
)
def test_touch_is_incref_then_decref(published: list[int], released: list[int], data: st.DataObject) -> None:
    """`touch` (a V4 restore's use of a checkpoint: its parts the most recently used) leaves
    the pool as `incref(ids)` then `decref(ids)` do: the free queue in the same order, the same
    refcounts and index; it refuses what incref refuses (an id outside the pool, a free
    block with no cached content), with nothing changed; the index version moves where a free
    cached block moved."""
    fast, twin = _touch_pools(published, released)
    # ids a touch takes (held blocks, cached free ones), and now and then one it refuses
    good = [b for b in range(fast.num_blocks) if fast.refcount(b) or fast.block_hash(b) is not None]
    ids = data.draw(st.lists(st.sampled_from(good), max_size=6) if good else st.just([]))
    bad = data.draw(st.sampled_from([None, None, None, -1, 10, *(b for b in range(10) if b not in good)]))
    if bad is not None:
        ids.insert(data.draw(st.integers(0, len(ids))), bad)
    before = _pool_view(fast)
    version = fast.index_version
    try:
        twin.incref(ids)
    except ValueError as error:
        with pytest.raises(ValueError) as refused:
            fast.touch(ids)
        assert str(refused.value) == str(error)
        assert _pool_view(fast) == before and fast.index_version == version
        return
    twin.decref(ids)
    fast.touch(ids)
    assert _pool_view(fast) == _pool_view(twin)
    moved = any(fast.refcount(b) == 0 for b in ids)
    assert (fast.index_version != version) == moved
    fast.check_integrity()
    twin.check_integrity()


def test_touch_moves_free_cached_blocks_to_the_end_in_order() -> None:
    """A narrative on a 6-block pool: blocks 0-3 cached and free (LRU 0, 1, 2, 3), block 4
    held; touching [2, 4, 0] moves 2 then 0 to the end and leaves 4 held."""
    pool = BlockPool(6)
    root = pool.root(b"desc")
    ids = pool.allocate(5)
    assert ids == [0, 1, 2, 3, 4]
    for b in ids:
        pool.publish(b, root, token_bytes([b]))
    pool.decref([0, 1, 2, 3])
    assert pool.free_queue() == [5, 0, 1, 2, 3]
    pool.touch([2, 4, 0])
    assert pool.free_queue() == [5, 1, 3, 2, 0]
    assert [pool.refcount(b) for b in range(6)] == [0, 0, 0, 0, 1, 0]
    with pytest.raises(ValueError, match="block 5, which is free and holds no cached content"):
        pool.touch([1, 5])
    with pytest.raises(TypeError, match="block id must be an int, got 'x'"):
        pool.touch([1, "x"])
    assert pool.free_queue() == [5, 1, 3, 2, 0]
    pool.check_integrity()


_LIFECYCLE_OPS = ["alloc", "publish", "parts", "register", "decref", "undo", "touch", "unreg", "reset"]


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_block_lists_copies_exactly_while_it_is_published(data: st.DataObject) -> None:
    """`is_published(block)` is `bool(block.block_ids)` for every prefix block that is no
    root, through any mix of the pool's calls (allocations that evict, `publish`,
    `publish_parts` with and without release, `register` of chained blocks old and new,
    `unallocate`, `unregister`, `touch`, `decref`, a reset): the dual pool's checkpoints read
    the attribute in place of the probe. A weak hash (16 values) makes collisions, taken
    hashes and stale orphans common."""
    pool = BlockPool(10)
    weak = data.draw(st.booleans())
    if weak:
        pool.hasher.digest = lambda data: bytes([xxhash.xxh3_64_intdigest(data) % 16]) * 16
    root = pool.root(b"desc")
    seen: list = []  # every prefix block made, published or not
    held: list[int] = []  # one reference each (a block may be listed more than once)
    undo: list = []  # (ids, evicted) of the last allocation, while its blocks are untouched

    def publishable() -> list[int]:
        return [b for b in set(held) if pool.refcount(b) and pool.prefix_block(b) is None]

    for _ in range(data.draw(st.integers(5, 40))):
        op = data.draw(st.sampled_from(_LIFECYCLE_OPS))
        parents = [root, *(b for b in seen if b.block_ids)]
        if op == "alloc":
            evicted: list = []
            ids = pool.allocate(data.draw(st.integers(0, 3)), evicted)
            if ids is not None:
                held += ids
                undo = [(ids, evicted)]
                continue
        elif op == "publish" and publishable():
            b = data.draw(st.sampled_from(sorted(publishable())))
            parent = data.draw(st.sampled_from(parents))
            seen.append(pool.publish(b, parent, token_bytes([data.draw(st.integers(0, 3))]), b""))
        elif op == "parts" and len(publishable()) >= 2:
            ids = data.draw(st.permutations(sorted(publishable())))[: data.draw(st.integers(1, 3))]
            parent = data.draw(st.sampled_from(parents))
            release = data.draw(st.booleans())
            parts = pool.publish_parts(ids, parent, [b"p:%d" % i for i in range(len(ids))], release=release)
            seen += parts or ()
            if release:
                for b in ids:
                    held.remove(b)
        elif op == "register" and publishable():
            b = data.draw(st.sampled_from(sorted(publishable())))
            block = pool.chain(data.draw(st.sampled_from([root, *seen])), token_bytes([data.draw(st.integers(0, 3))]))
            seen.append(block)
            pool.register(b, block, orphan_ok=data.draw(st.booleans()))
        elif op == "decref" and held:
            b = data.draw(st.sampled_from(held))
            held.remove(b)
            pool.decref([b])
            if undo and b in undo[0][0]:
                undo = []  # (an undo is of blocks untouched since their allocation)
        elif op == "undo" and undo:
            ids, evicted = undo[0]
            if all(pool.refcount(b) == 1 and pool.prefix_block(b) is None for b in ids):
                pool.unallocate(ids, evicted)
                for b in ids:
                    held.remove(b)
            undo = []
        elif op == "touch":
            cached = [b for b in range(pool.num_blocks) if pool.is_free_cached(b)]
            if cached:
                pool.touch(data.draw(st.permutations(cached)))
        elif op == "unreg":
            mine = [b for b in set(held) if pool.refcount(b) == 1 and pool.prefix_block(b) is not None]
            if mine:
                pool.unregister(data.draw(st.sampled_from(sorted(mine))))
        elif op == "reset" and not held:
            pool._forget_cached()
            undo = []
        pool.check_integrity()
        for block in seen:
            assert pool.is_published(block) == bool(block.block_ids), (op, block)


def test_an_undone_eviction_whose_hash_was_taken_since_lists_no_copy():
    """`unallocate` of an allocation that evicted content X, whose hash another block has
    taken since: X is not put back (its block goes unhashed), so it lists no copy and is
    not published, while the new content is both."""
    pool = BlockPool(2)
    root = pool.root(b"desc")
    (a,) = pool.allocate(1)
    x = pool.publish(a, root, token_bytes([1]))
    pool.decref([a])
    (b,) = pool.allocate(1)  # (the unhashed block first)
    evicted: list = []
    (c,) = pool.allocate(1, evicted)  # evicts x
    assert evicted == [(a, x)] and c == a and not x.block_ids
    y = pool.publish(b, root, token_bytes([1]))  # the same content again: its hash, another object
    assert y is not x and pool.is_published(y)
    pool.unallocate([c], evicted)
    pool.check_integrity()
    assert not x.block_ids and not pool.is_published(x)
    assert y.block_ids == (b,) and pool.is_published(y)
    assert pool.free_queue() == [a]  # back unhashed
