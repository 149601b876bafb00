"""`reset_prefix_cache`: the coordinator forgets every cached prefix, each group its own
records first (V4's checkpoints and kept turn ends, the attention and recurrent groups'
turn ends), then every pool's index; refused, nothing changed, while a request holds blocks.
The lifecycles of tests/test_hybrid_lifecycle.py mix resets into random runs."""

from __future__ import annotations

import pytest

from kvpool.cache import CacheDescriptor, FullAttentionManager, HybridCacheManager
from kvpool.cache.dual_pool import DualPoolGroupSpec
from kvpool.cache.recurrent import RecurrentGroupSpec
from kvpool.cache.window import AttentionGroupSpec
from kvpool.pool import BlockPool

DESC = CacheDescriptor("reset")


def _v4(**restore) -> HybridCacheManager:
    """Spans of 4, a hit replays 2 tokens; 12 classical blocks, 4 state blocks; turn ends kept."""
    spec = DualPoolGroupSpec("v", 4, replay_len=2, **restore)
    return HybridCacheManager([(spec, (12, 4))], DESC, turn_end_checkpoints=True)


def _serve(m: HybridCacheManager, rid: str, prompt: list[int]) -> int:
    """Admit, compute the whole prompt, finish; the admission's hit."""
    adm = m.admit(rid, prompt)
    assert adm is not None
    m.commit(rid, adm.num_scheduled_tokens)
    m.check_integrity()
    m.release(rid, "finish")
    m.check_integrity()
    return adm.num_cached_tokens


@pytest.mark.parametrize(
    "restore",
    [
        {"restore": "checkpoint", "checkpoint_blocks": 1},  # acore L1: pooled checkpoints
        {"restore": "checkpoint", "num_checkpoints": 3},
        {"restore": "auto", "checkpoint_blocks": 1},
        {"restore": "recompute"},
    ],
)
def test_a_v4_cache_forgets_its_checkpoints_and_turn_ends_and_hits_again(restore):
    """13 tokens computed: spans at 4, 8, 12 (checkpointed where the restore keeps them) and a
    turn end at 13. A reset of the pools alone (the old `BlockPool.reset_prefix_cache`) left
    the group's checkpoints pointing at unregistered blocks: check_integrity and the next
    admission failed ("checkpoint of ... lost a part"). Now nothing hits after the reset; the
    same prompt computed again publishes its spans and turn end, and they hit again."""
    m = _v4(**restore)
    prompt = list(range(13))
    assert _serve(m, "a", prompt) == 0
    follow_up = [*prompt, 99]
    assert m.lookup_prefix(follow_up) == 13  # the turn end
    assert m.lookup_prefix([*prompt[:12], 50, 51]) == 12  # the span boundary
    assert m.reset_prefix_cache() is True
    m.check_integrity()
    assert m.lookup_prefix(follow_up) == 0 and m.lookup_prefix([*prompt[:12], 50, 51]) == 0
    assert all(pool.num_free_cached == 0 for pool in m.pools)
    assert m.groups["v"].pool.num_free == 12 and m.groups["v"].state_pool.num_free == 4
    assert _serve(m, "b", prompt) == 0  # computed again from the start
    assert m.lookup_prefix(follow_up) == 13 and m.lookup_prefix([*prompt[:12], 50, 51]) == 12
    assert _serve(m, "c", follow_up) == 13  # the kept turn end adopted again
    assert m.reset_prefix_cache() is True and m.reset_prefix_cache() is True  # (the second: nothing to forget)
    m.check_integrity()


def test_a_reset_is_refused_while_a_request_holds_blocks():
    """vLLM's rule: not while any block is in use. Refused: False, and every lookup, free queue
    and table as it was; after the release it is done."""
    m = FullAttentionManager(8, 4, DESC)
    assert _serve(m, "a", list(range(10))) == 0
    adm = m.admit("b", list(range(9)))
    assert adm is not None and adm.num_cached_tokens == 8
    queue, table = m.pool.free_queue(), m.block_ids("b")
    assert m.reset_prefix_cache() is False
    m.check_integrity()
    assert m.pool.free_queue() == queue and m.block_ids("b") == table
    assert m.lookup_prefix(list(range(10))) == 8
    m.commit("b", adm.num_scheduled_tokens)
    m.release("b")
    assert m.reset_prefix_cache() is True
    m.check_integrity()
    assert m.lookup_prefix(list(range(10))) == 0 and m.pool.num_free_cached == 0


def test_attention_and_recurrent_groups_forget_their_turn_ends():
    """A full group and a recurrent group (checkpoints every 6 tokens) with turn ends kept:
    after a finish at 10 tokens the follow-up hits at its turn end (10); after the reset at
    nothing, with the lists of turn ends empty; computed again, at 10 again. (A shared pool:
    the lifecycles.)"""
    specs = [(AttentionGroupSpec("full", 4), 8), (RecurrentGroupSpec("rec", 6), 6)]
    m = HybridCacheManager(specs, DESC, turn_end_checkpoints=True)
    prompt = list(range(1, 11))
    assert _serve(m, "a", prompt) == 0
    assert m.lookup_prefix([*prompt, 77]) == 10
    assert m.reset_prefix_cache() is True
    m.check_integrity()
    assert m.lookup_prefix([*prompt, 77]) == 0
    assert all(not g._turn_ends for g in m.groups.values())
    assert _serve(m, "b", prompt) == 0 and m.lookup_prefix([*prompt, 77]) == 10


def test_the_pool_has_no_public_reset_that_bypasses_its_groups():
    """`BlockPool.reset_prefix_cache` emptied a pool's index behind the groups' backs (acore L1):
    the coordinator's reset is the one way in."""
    assert not hasattr(BlockPool, "reset_prefix_cache")
