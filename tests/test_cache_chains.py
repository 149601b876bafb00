"""The prefix-chain code the cache groups share (cache/chains.py), on tiny pools with exact
block ids: registering a run that joins another request's equal copies, and the per-request
integrity check catching a planted violation."""

from __future__ import annotations

import pytest

from kvpool.cache import CacheDescriptor, FullAttentionManager

DESC = CacheDescriptor("tiny-model", weights_version="v1", layout_id="bs4-fp32")
A = list(range(100, 110))  # 10 tokens: blocks [100..103] [104..107] [108, 109]


def test_a_run_computed_twice_at_once_joins_the_first_copies_block_by_block():
    # a and b compute the same prompt in the same step: nothing is published when b is
    # admitted, so b gets blocks of its own. a commits first; b's block 3 then joins a's
    # block 0, and b's block 4 must be chained after that copy to join block 1 (chained
    # after b's own block 3 it would read as a collision and stay unpublished).
    m = FullAttentionManager(10, 4, DESC)
    assert m.admit("a", A).groups["full"].block_ids == (0, 1, 2)
    assert m.admit("b", A).groups["full"].block_ids == (3, 4, 5)
    m.commit("a", 10)
    m.commit("b", 10)
    m.check_integrity()
    assert m.pool.num_collisions == 0
    assert [m.pool.prefix_block(b) for b in (3, 4)] == [m.pool.prefix_block(b) for b in (0, 1)]
    assert m.part("b").prefix_chain() == m.part("a").prefix_chain()
    assert m.pool.prefix_block(0).block_ids == (0, 3) and m.pool.prefix_block(1).block_ids == (1, 4)
    # Both copies serve: with a gone, c shares b's held copies, not a's free ones.
    assert m.release("a")
    admission = m.admit("c", A)
    assert admission.num_cached_tokens == 8
    assert admission.groups["full"].block_ids == (3, 4, 6)  # (6: the first unhashed free block)
    m.check_integrity()


def test_the_integrity_check_names_a_block_the_step_writes_but_shares():
    m = FullAttentionManager(10, 4, DESC)
    m.admit("a", A, max_new_tokens=6)  # reserves [0, 6): blocks 0, 1
    m.check_integrity()
    m.pool.incref([1])  # planted: the step's block 1 held twice
    with pytest.raises(AssertionError, match="invariant 2 .* will write into block 1"):
        m.check_integrity()
