"""Paths of pool/ and of the dual pool's spec that no other test reaches (coverage audit):
refusals with their messages, the pool's own integrity check finding each corruption it
states, and the small queries (num_cached, repr)."""

from __future__ import annotations

import pytest

from kvpool.cache.dual_pool import DualPoolGroupSpec, TokenCost, choose_restore
from kvpool.pool import BlockHasher, BlockPool, step_tables, token_bytes
from kvpool.pool.block_pool import same_content


def _pool_with_chain() -> tuple[BlockPool, list]:
    """A pool of 6 blocks: blocks 0, 1 published as a chain and freed (cached, free), block 2 held."""
    pool = BlockPool(6)
    root = pool.root(b"desc")
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    a = pool.publish(0, root, token_bytes([1, 2]))
    b = pool.publish(1, a, token_bytes([3, 4]))
    pool.decref([1, 0])
    pool.check_integrity()
    return pool, [root, a, b]


def test_pool_queries_and_refusals() -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive, got -1"):
        BlockPool(-1)
    pool, (root, a, b) = _pool_with_chain()
    with pytest.raises(ValueError, match="num_blocks must be >= 0, got -1"):
        pool.allocate(-1)
    assert pool.num_cached == 2 and pool.num_free == 5 and pool.num_free_cached == 2
    assert repr(root).endswith(", root)") and repr(b).endswith(", blocks=(1,))")
    assert same_content(b, b) and not same_content(b, None) and not same_content(a, b)
    with pytest.raises(ValueError, match="tenant salt '\\\\ud800' is not valid Unicode text: surrogates not allowed"):
        BlockHasher().root_preimage(b"desc", "\ud800")
    with pytest.raises(TypeError, match="token id 'x' is no int"):
        token_bytes([1, "x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"positions \[3, 2\) are not a range of non-negative positions"):
        step_tables([[0]], [3], [2], 4)
    pool.check_integrity()


def _queued_twice(pool: BlockPool) -> None:
    pool._free_unhashed.append(pool._free_unhashed[0])


def _held_but_queued(pool: BlockPool) -> None:
    pool._refcounts[3] = 1


def _negative(pool: BlockPool) -> None:
    pool._refcounts[2] = -1


def _free_not_queued(pool: BlockPool) -> None:
    pool._refcounts[2] = 0


def _unhashed_registered(pool: BlockPool) -> None:
    pool._cached[3] = pool._cached[0]


def _cached_unregistered(pool: BlockPool) -> None:
    pool._cached[0] = None


def _listed_twice(pool: BlockPool) -> None:
    pool._cached[0].block_ids = (0, 0)


def _registered_elsewhere(pool: BlockPool) -> None:
    pool._cached[0], pool._cached[1] = pool._cached[1], pool._cached[0]


def _stale_entry(pool: BlockPool) -> None:
    block = pool._cached[1]
    pool._index[b"other"] = block


def _count(pool: BlockPool) -> None:
    pool._cached[2] = pool._cached[1]  # (a held block, registered as content the index does not list there)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_queued_twice, "a block is queued twice"),
        (_held_but_queued, r"invariant 3 .*free block 3 has refcount 1"),
        (_negative, "invariant 1 .*block 2 has refcount -1"),
        (_free_not_queued, r"invariant 7 .*block 2 has refcount 0 but is not free"),
        (_unhashed_registered, "unhashed free block 3 is still registered"),
        (_cached_unregistered, "cached free block 0 is not registered"),
        (_listed_twice, "lists a block twice"),
        (_registered_elsewhere, "is listed by .* but registered elsewhere"),
        (_stale_entry, "index entry .* is stale"),
        (_count, "a block is registered as content that the index does not hold"),
    ],
)
def test_pool_check_integrity_finds_each_corruption(corrupt, message: str) -> None:
    pool, _ = _pool_with_chain()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


def test_dual_pool_spec_and_restore_choice_refusals() -> None:
    with pytest.raises(ValueError, match=r"restore must be one of .*, got 'later'"):
        DualPoolGroupSpec("v4", 4, restore="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"num_checkpoints\) or pooled \(checkpoint_blocks\), not both"):
        DualPoolGroupSpec("v4", 4, num_checkpoints=2, checkpoint_blocks=1)
    spec = DualPoolGroupSpec("v4", 4, restore="checkpoint")
    with pytest.raises(ValueError, match="restore='checkpoint' needs num_checkpoints > 0 or checkpoint_blocks > 0"):
        spec.build((8, 2), enable_caching=True, hash_algo="xxh3_128", shared_pool=None)
    cost = TokenCost()
    with pytest.raises(ValueError, match="need 0 <= checkpoint_len <= hit_len, got 8 and 4"):
        choose_restore(4, 8, 16, cost)
    assert tuple(choose_restore(0, 0, 16, cost)) == (0, "none")


@pytest.mark.parametrize("held", [False, True])
def test_a_stale_orphan_gives_way_to_its_content_published_again(held: bool) -> None:
    # "b" (block 1) stays in the index after its parent "a" (block 0) is evicted: a stale
    # orphan, no walk from the root reaches it. "a" computed again (block 2) and "b" after it
    # (block 3): the new "b" takes the hash (no collision counted) and every copy of the old
    # one is unregistered: a free one becomes an unhashed free block, a held one stays held
    # and is freed unhashed at its release.
    pool = BlockPool(4)
    root = pool.root(b"desc")
    assert pool.allocate(2) == [0, 1]
    a = pool.publish(0, root, token_bytes([1, 2]))
    b = pool.publish(1, a, token_bytes([3, 4]))
    pool.decref([0])
    if not held:
        pool.decref([1])
    assert pool.allocate(3) == [2, 3, 0]  # the unhashed blocks, then block 0: "a" evicted
    assert not a.is_live and b.block_ids == (1,) and pool.lookup(b) is b
    pool.check_integrity()
    a2 = pool.publish(2, root, token_bytes([1, 2]))
    assert a2 is not a and a2.block_hash == a.block_hash
    b2 = pool.publish(3, a2, token_bytes([3, 4]))
    assert b2 is not b and b2.block_hash == b.block_hash and b2.block_ids == (3,)
    assert b.block_ids == () and pool.block_hash(1) is None and pool.lookup(b2) is b2
    assert pool.num_collisions == 0
    assert pool.refcount(1) == (1 if held else 0) and (1 in pool.free_queue()) is not held
    pool.check_integrity()
    if held:
        pool.decref([1])
        assert pool.block_hash(1) is None and 1 in pool.free_queue()
        pool.check_integrity()
    pool.decref([3, 2, 0])
    assert pool.match(root, token_bytes([1, 2, 3, 4]), 2 * 4, 2, None).block_ids == [2, 3]
    pool.check_integrity()
