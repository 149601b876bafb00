"""Narratives of the hybrid coordinator on tiny pools, with exact block and checkpoint ids:
Figure 12's hit rule, a hit inside an attention block (copy-on-write), the sliding-window
rule (blocks leave as the request advances, hits found from the right), transactional
allocation across groups, release of every group once; V4's dual pool as a group (hits at
span boundaries only, one state block per request)."""

from __future__ import annotations

import random
import signal

import pytest

from kvpool.cache import Admission, BlockCopy, CacheDescriptor, GroupAdmission, StateRestore
from kvpool.cache.coordinator import HybridCacheManager
from kvpool.cache.dual_pool import DualPoolGroupSpec
from kvpool.cache.recurrent import RecurrentGroupSpec
from kvpool.cache.window import AttentionGroupSpec
from kvpool.capacity.kv import PageGroup
from kvpool.engine import tier_bridge

DESC = CacheDescriptor("tiny-hybrid", weights_version="v1")


def prefill(m: HybridCacheManager, rid: str, tokens: list[int]) -> int:
    admission = m.admit(rid, tokens)
    assert admission is not None
    m.check_integrity()
    m.commit(rid, admission.num_scheduled_tokens)
    m.check_integrity()
    return admission.num_cached_tokens


def decode(m: HybridCacheManager, rid: str, token: int) -> None:
    m.append_token_ids(rid, [token])
    assert m.reserve(rid, 1) is not None
    m.check_integrity()
    m.commit(rid, 1)
    m.check_integrity()


def head(adm: Admission, table: str, state: str) -> tuple:
    """An admission's counts, then one table group's blocks, one stateful group's restore
    and the table group's loads."""
    part = adm.groups[table]
    return (adm.num_cached_tokens, adm.num_scheduled_tokens, part.block_ids, adm.groups[state].restore, part.loads)


def test_figure_12_hit_is_the_largest_point_every_group_has():
    # Attention blocks of 512 tokens, a recurrent checkpoint every 1024: after a 1600-token
    # prompt the attention blocks end at {512, 1024, 1536}, the checkpoints at {0, 1024}.
    m = HybridCacheManager([(AttentionGroupSpec("mla", 512), 8), (RecurrentGroupSpec("kda", 1024), 4)], DESC)
    prompt = list(range(1600))
    admission = m.admit("a", prompt)
    assert head(admission, "mla", "kda") == (0, 1600, (0, 1, 2, 3), StateRestore(0, "none"), ())
    assert m.part("a", "kda").checkpoints == [(1024, 1)]  # slot 1 snapshots the state after 1024 tokens
    m.commit("a", 1600)
    m.check_integrity()
    follow_up = prompt + [7]
    assert m.group_hit_points(follow_up) == {"mla": [0, 512, 1024, 1536], "kda": [0, 1024]}
    assert m.lookup_prefix(follow_up) == 1024
    assert m.release("a")
    assert m.groups["mla"].pool.free_queue() == [4, 5, 6, 7, 3, 2, 1, 0]
    assert m.groups["kda"].pool.free_queue() == [2, 3, 0, 1]

    admission = m.admit("b", follow_up)
    m.check_integrity()
    # 1024 cached tokens: attention blocks 0 and 1 shared, the state restored from slot 1
    # into a fresh live slot 2; blocks 4 and 5 for [1024, 1601).
    assert head(admission, "mla", "kda") == (1024, 577, (0, 1, 4, 5), StateRestore(2, "checkpoint", 1), ())
    assert m.part("b", "kda").restore.checkpoint_slot == 1 and m.groups["kda"].pool.refcount(1) == 1
    assert m.part("b", "kda").checkpoints == []  # the step reaches no new boundary (2048 > 1601)
    m.commit("b", 577)
    m.check_integrity()
    # slot 1 was held until the first commit
    assert m.part("b", "kda").restore.checkpoint_slot is None and m.groups["kda"].pool.is_free_cached(1)


def test_a_hit_inside_an_attention_block_copies_the_block_on_write():
    # Pages of 1024 tokens, checkpoints every 512 (Kimi K3's shape, scaled down in count).
    m = HybridCacheManager([(AttentionGroupSpec("mla", 1024), 4), (RecurrentGroupSpec("kda", 512), 3)], DESC)
    a = list(range(1100))
    admission = m.admit("a", a)
    assert admission.groups["mla"].block_ids == (0, 1)
    assert m.part("a", "kda").checkpoints == [(512, 1), (1024, 2)]
    m.commit("a", 1100)
    m.release("a")
    # a's checkpoints were freed tail-first: 1024 (slot 2) is older in the LRU than 512 (slot 1).
    assert m.groups["kda"].pool.free_queue() == [0, 2, 1]
    prefill(m, "c", [7] * 10)  # takes the unhashed slot 0
    prefill(m, "d", [8] * 10)  # evicts the least recently used checkpoint: 1024 (slot 2)
    assert m.part("c", "kda").state_slot == 0 and m.part("d", "kda").state_slot == 2
    m.release("c")
    b = a + [5]
    assert m.group_hit_points(b) == {"mla": [0, 512, 1024], "kda": [0, 512]}
    admission = m.admit("b", b)
    m.check_integrity()
    # Hit at 512, inside attention block 0: b gets a copy of block 0 in block 1 (free
    # queue head), block 0 stays held (the copy's source) until b's first commit.
    assert head(admission, "mla", "kda") == (512, 589, (1, 2), StateRestore(0, "checkpoint", 1), ())
    # Each group's part: the attention table and its copy, the recurrent restore; no
    # snapshot of 1024 (slots 0, 1, 2 are b's live state, its source and d's live state)
    assert admission.groups == {
        "mla": GroupAdmission((1, 2), 0, (BlockCopy(0, 1),), None, ()),
        "kda": GroupAdmission((), 0, (), StateRestore(0, "checkpoint", 1), ()),
    }
    assert m.take_copies() == {"mla": [BlockCopy(0, 1)]}
    assert m.groups["mla"].pool.refcount(0) == 1 and m.groups["mla"].pool.block_hash(0) is not None
    assert m.groups["mla"].pool.block_hash(1) is None  # b writes [512, 1024) into its own copy
    m.commit("b", 589)
    m.check_integrity()
    assert m.groups["mla"].pool.is_free_cached(0)  # the cached block is intact and findable again
    assert m.lookup_prefix(a[:1024] + [9]) == 512  # attention could serve 1024; kda has only 512


def test_sliding_window_releases_blocks_as_the_request_advances_and_hits_from_the_right():
    # Window 8 (the query at t reads keys [t - 7, t]), blocks of 4 tokens, 10 blocks.
    m = HybridCacheManager([(AttentionGroupSpec("swa", 4, window=8), 10)], DESC)
    pool = m.groups["swa"].pool
    seq = list(range(100, 124))
    assert prefill(m, "a", seq[:12]) == 0
    # After 12 tokens the next query (position 12) reads keys [5, 12]: block 0 ([0, 4)) left.
    assert (m.part("a").first_block, m.block_ids("a")) == (1, [1, 2])
    assert pool.free_queue() == [3, 4, 5, 6, 7, 8, 9, 0] and pool.block_hash(0) is not None
    m.append_token_ids("a", [seq[12]])
    assert m.reserve("a", 1).groups["swa"].new_block_ids == (3,)
    m.commit("a", 1)
    m.check_integrity()
    assert (m.part("a").first_block, m.block_ids("a")) == (1, [1, 2, 3])  # keys [6, 13] still read block 1
    for t in range(13, 20):
        decode(m, "a", seq[t])
    # 20 tokens computed: the next query reads [13, 20] -> blocks 3 and 4 ([12, 20)) and the
    # next position's block; blocks 0, 1, 2 went back to the free queue, tail-first each time.
    assert (m.part("a").first_block, m.block_ids("a")) == (3, [3, 4])
    assert pool.free_queue() == [5, 6, 7, 8, 9, 0, 1, 2]
    assert all(pool.block_hash(b) is not None for b in (0, 1, 2))  # still findable while cached
    # While a step computes position L - 1, the table is what the planner counts for a
    # context of L tokens (capacity/kv.py PageGroup.num_blocks: positions [L - W, L - 1]).
    planner = PageGroup("swa", 1, 4, 1, 1.0, 0.0, window=8)
    for t in range(20, 24):
        m.append_token_ids("a", [seq[t]])
        m.reserve("a", 1)
        assert len(m.block_ids("a")) == planner.num_blocks(t + 1)
        m.commit("a", 1)
    assert (m.part("a").first_block, m.block_ids("a")) == (4, [4, 5])
    assert pool.free_queue() == [6, 7, 8, 9, 0, 1, 2, 3]

    # A 24-token prompt takes 6 blocks during its prefill: the 4 unhashed ones, then the
    # least recently freed cached blocks 0 and 1 (a's first two: evicted). After its commit
    # it keeps logical blocks 4, 5 ([17, 24)), which are physical 0 and 1, and frees the
    # rest (published) tail-first.
    prefill(m, "c", list(range(24)))
    assert m.block_ids("c") == [0, 1]
    assert pool.free_queue() == [2, 3, 9, 8, 7, 6]
    # A prompt repeating a's first 20 tokens hits 20 all the same: its window [13, 20) lies
    # in blocks 3 (cached, free) and 4 (a holds it). Search from the right: a's first two
    # blocks are gone, so the points 4, 8 and 12 (whose windows reach them) are not served.
    b = seq[:20] + [1]
    assert m.group_hit_points(b) == {"swa": [0, 16, 20]}
    admission = m.admit("b", b)
    m.check_integrity()
    assert admission.num_cached_tokens == 20
    # Block 3 is revived from the free queue, block 4 shared with a; the step's block
    # evicts the LRU head, block 2.
    assert (m.part("b").first_block, m.block_ids("b")) == (3, [3, 4, 2])
    assert [pool.refcount(b) for b in (3, 4, 2)] == [1, 2, 1]


def test_window_hits_need_only_the_window_and_a_full_group_needs_every_block():
    spec = [(AttentionGroupSpec("swa", 4, window=8), 12), (AttentionGroupSpec("full", 4), 12)]
    m = HybridCacheManager(spec, DESC)
    seq = list(range(50, 70))
    prefill(m, "a", seq)
    swa, full = m.groups["swa"].pool, m.groups["full"].pool
    assert m.block_ids("a", "swa") == [3, 4] and m.block_ids("a", "full") == [0, 1, 2, 3, 4]
    m.release("a")
    # The window group freed blocks 2, 1, 0 when they left the window and 4, 3 at the finish;
    # the full group 4, 3, 2, 1, 0 at the finish. Evicting the three oldest cached blocks of
    # each leaves the window group a's last window and the full group a's first two blocks.
    assert swa.free_queue()[-5:] == [2, 1, 0, 4, 3] and full.free_queue()[-5:] == [4, 3, 2, 1, 0]
    for pool in (swa, full):
        taken = pool.allocate(pool.num_free - pool.num_free_cached + 3)
        pool.decref(taken)
    assert m.group_hit_points(seq + [1]) == {"swa": [0, 20], "full": [0, 4, 8]}
    assert m.lookup_prefix(seq + [1]) == 0  # no point both groups have but the start
    m.check_integrity()


def test_allocation_is_transactional_across_groups():
    # The full group is the small one: a prompt that fits the window group but not the full
    # one changes nothing in either.
    m = HybridCacheManager(
        [
            (AttentionGroupSpec("swa", 4, window=4), 16),
            (AttentionGroupSpec("full", 4), 4),
            (RecurrentGroupSpec("r", 4), 2),
        ],
        DESC,
    )
    before = {name: g.pool.free_queue() for name, g in m.groups.items()}
    assert m.admit("big", list(range(17))) is None
    assert {name: g.pool.free_queue() for name, g in m.groups.items()} == before and "big" not in m
    prefill(m, "a", list(range(12)))
    m.append_token_ids("a", list(range(12, 20)))
    before = {name: g.pool.free_queue() for name, g in m.groups.items()}
    assert m.reserve("a", 8) is None and not m.reserve_step(["a"], [8])  # full needs 2 blocks, has 1
    assert {name: g.pool.free_queue() for name, g in m.groups.items()} == before
    m.check_integrity()
    # A recurrent group without a free slot refuses an admission and a fork, again with no trace.
    prefill(m, "b", [1, 2])
    assert m.admit("c", [3]) is None and not m.fork("a", "a2")
    m.check_integrity()
    assert m.release("a", "preempt") and not m.release("a", "cancel")  # once only
    assert m.release("b")
    m.check_integrity()
    assert all(g.pool.num_free == g.pool.num_blocks for g in m.groups.values())


def test_fork_shares_blocks_and_takes_its_own_state():
    m = HybridCacheManager([(AttentionGroupSpec("full", 4), 8), (RecurrentGroupSpec("r", 4), 4)], DESC)
    prefill(m, "p", list(range(10)))
    # 3 blocks held, 10 slots filled; slot 0 is p's state, slots 1 and 2 its checkpoints at
    # 4 and 8 (cached, so free)
    assert m.usage() == (8, 5, 3, 10, 4, 4, 3)
    assert m.fork("p", "c")
    assert m.usage() == (8, 5, 3, 10, 4, 4, 2)  # shared blocks count once; c has its own state
    m.check_integrity()
    assert m.block_ids("c") == m.block_ids("p") == [0, 1, 2]
    assert m.part("c", "r").state_slot != m.part("p", "r").state_slot
    # The shared partial tail [8, 10) is copied by the first writer; the second writes in place.
    m.append_token_ids("c", [1])
    res = m.reserve("c", 1)
    assert res.groups["full"].copies == (BlockCopy(2, 3),) and m.block_ids("c") == [0, 1, 3]
    m.commit("c", 1)
    m.append_token_ids("p", [2])
    assert m.reserve("p", 1).groups["full"].copies == ()
    m.commit("p", 1)
    m.check_integrity()


def test_bad_input_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="share one block size"):
        HybridCacheManager([(AttentionGroupSpec("a", 4), 4), (AttentionGroupSpec("b", 8), 4)], DESC)
    with pytest.raises(ValueError, match="window must be positive"):
        AttentionGroupSpec("w", 4, window=0)
    with pytest.raises(ValueError, match="checkpoint_interval must be positive"):
        RecurrentGroupSpec("r", 0)
    with pytest.raises(TypeError, match="unknown group spec"):
        HybridCacheManager([("full", 4)], DESC)  # type: ignore[list-item]
    two = [(AttentionGroupSpec("full", 4), 4), (AttentionGroupSpec("w", 4, window=4), 4)]
    with pytest.raises(ValueError, match="serve a one-group cache, got 2 groups"):
        HybridCacheManager(two, DESC, record_published=True)  # two pools' blocks under one set of keys
    m = HybridCacheManager([(AttentionGroupSpec("full", 4), 4), (RecurrentGroupSpec("r", 4), 2)], DESC)
    prefill(m, "a", [1, 2, 3])
    m.append_token_ids("a", [4, 5])
    m.reserve("a", 2)
    with pytest.raises(ValueError, match="advances by whole steps"):
        m.commit("a", 1)
    with pytest.raises(ValueError, match="uncommitted step"):
        m.reserve("a", 1)
    m.check_integrity()


def test_a_shared_pool_gives_the_blocks_a_window_lets_go_to_any_group():
    # Window 4 and full attention on one pool of 8 blocks of 4 tokens (the simulator's layout).
    spec = [(AttentionGroupSpec("swa", 4, window=4), None), (AttentionGroupSpec("full", 4), None)]
    m = HybridCacheManager(spec, DESC, shared_blocks=8)
    pool = m.groups["swa"].pool
    assert pool is m.groups["full"].pool and m.is_shared("full") and m.num_blocks == 8
    a = list(range(12))
    # The prefill takes 3 blocks per group, window group first: 0, 1, 2 and 3, 4, 5. After
    # the commit the next query (position 12) reads [9, 12]: the window group keeps block 2
    # and lets 1 and 0 go, tail-first, cached.
    assert prefill(m, "a", a) == 0
    assert (m.part("a", "swa").first_block, m.block_ids("a", "swa"), m.block_ids("a", "full")) == (2, [2], [3, 4, 5])
    assert pool.free_queue() == [6, 7, 1, 0] and m.group_held_blocks() == {"swa": 1, "full": 3}
    assert m.usage() == (8, 4, 4, 4 + 12, 4, 0, 0)  # the window's block holds 4 computed tokens
    # 20 new tokens need 5 blocks in each group: 10 > 4 free, refused with no trace.
    before = pool.free_queue()
    assert m.admit("big", list(range(100, 120))) is None and pool.free_queue() == before
    # 8 new tokens need 2 + 2: the window group takes the unhashed 6, 7, the full group the
    # window's cached 1 and 0 (least recently freed first): what a window lets go serves the
    # full group's next request.
    assert prefill(m, "b", list(range(100, 108))) == 0
    assert m.block_ids("b", "full") == [1, 0] and m.block_ids("b", "swa") == [7]
    assert pool.free_queue() == [6] and m.group_held_blocks() == {"swa": 2, "full": 5}
    # a's first 12 tokens are still a hit: the full group holds 3, 4, 5 and the window group
    # needs only [9, 12), block 2, though a's blocks 0 and 1 are gone. Each group chains
    # from a root of its own, so neither finds the other's blocks.
    assert m.group_hit_points(a + [1]) == {"swa": [0, 12], "full": [0, 4, 8, 12]}
    assert m.lookup_prefix(a + [1]) == 12
    m.release("a")
    m.release("b")
    m.check_integrity()
    assert pool.num_free == 8


def test_a_shared_pool_is_named_right():
    full = AttentionGroupSpec("full", 4)
    with pytest.raises(ValueError, match="no pool size"):
        HybridCacheManager([(full, None)], DESC)
    with pytest.raises(ValueError, match="no pool size"):
        HybridCacheManager([(full, None), (RecurrentGroupSpec("r", 4), None)], DESC, shared_blocks=4)
    with pytest.raises(ValueError, match="no group draws from it"):
        HybridCacheManager([(full, 4)], DESC, shared_blocks=4)
    with pytest.raises(ValueError, match="shared_blocks must be positive"):
        HybridCacheManager([(full, None)], DESC, shared_blocks=0)


def test_a_follow_up_turn_hits_at_the_previous_turn_end_off_the_checkpoint_grid():
    # Blocks of 4, a checkpoint every 8 tokens; turn ends kept. Turn 1: a 10-token prompt
    # and 3 answer tokens; at its finish 12 tokens are computed (the last answer token is
    # not), and 12 is no multiple of 8.
    m = HybridCacheManager(
        [(AttentionGroupSpec("full", 4), 8), (RecurrentGroupSpec("r", 8), 4)], DESC, turn_end_checkpoints=True
    )
    turn1 = list(range(10))
    assert prefill(m, "t1", turn1) == 0
    assert (
        m.part("t1", "r").state_slot == 0 and m.groups["r"].pool.block_hash(1) is not None
    )  # checkpoint of 8 in slot 1
    for tok in (50, 51):
        decode(m, "t1", tok)
    m.append_token_ids("t1", [52])
    assert m.num_computed_tokens("t1") == 12
    history = turn1 + [50, 51, 52]
    # Without the turn end the follow-up could hit only at 8, the last checkpoint.
    assert m.group_hit_points(history + [7, 7]) == {"full": [0, 4, 8, 12], "r": [0, 8]}
    assert m.release("t1")
    m.check_integrity()
    # The live slot 0 (the state after 12 tokens) is kept as the turn-end checkpoint.
    assert m.groups["r"].pool.is_free_cached(0) and m.groups["r"].pool.free_queue() == [2, 3, 1, 0]
    assert m.group_hit_points(history + [7, 7]) == {"full": [0, 4, 8, 12], "r": [0, 8, 12]}
    admission = m.admit("t2", history + [7, 7])
    m.check_integrity()
    # Hit 12: blocks 0, 1, 2 shared (12 is a block end), the state restored from slot 0 into
    # slot 2, the first unhashed slot.
    assert admission.num_cached_tokens == 12 and admission.groups["r"].restore == StateRestore(2, "checkpoint", 0)
    assert admission.groups["full"].block_ids == (0, 1, 2, 3)  # block 3 ([12, 16)) fresh: t1 never filled it
    m.commit("t2", admission.num_scheduled_tokens)
    m.check_integrity()
    # An explicit turn end mid-request: 15 computed, a fresh slot filed at 15 and held until
    # the next commit; a second mark at the same point takes nothing.
    assert m.mark_turn_end("t2") == {"r": 3}
    assert m.groups["r"].pool.refcount(3) == 1 and m.mark_turn_end("t2") == {}
    m.check_integrity()
    decode(m, "t2", 9)
    assert m.groups["r"].pool.is_free_cached(3)
    # The recurrent group serves 15 and 16 (the decode step's grid checkpoint, in slot 1: the
    # checkpoint of 8, least recently used, was evicted for it). The
    # attention group serves 15 only from a cached block [12, 16) with the same 4 tokens:
    # a turn end inside a block is a hit for a prompt that shares that whole block.
    assert m.group_hit_points(history + [7, 7, 9, 1])["r"] == [0, 12, 15, 16]
    assert m.group_hit_points(history + [7, 7, 5, 1]) == {"full": [0, 4, 8, 12], "r": [0, 12, 15]}


def free_queues(m: HybridCacheManager) -> dict[str, list[int]]:
    queues = {name: g.pool.free_queue() for name, g in m.groups.items()}
    queues.update({g.name + ".state": g.state_pool.free_queue() for g in m.dual_groups})
    return queues


def test_a_dual_pool_group_hits_only_where_the_recurrent_group_agrees_on_a_span_boundary():
    # V4's dual pool with a span of 8 (8 classical blocks, 2 state blocks; a hit replays the
    # 6 tokens before it) and a recurrent group with a checkpoint every 12 tokens (6 slots).
    # Points both can serve: multiples of lcm(8, 12) = 24 (and turn ends, off here).
    v4 = DualPoolGroupSpec("v4", 8, replay_len=6)
    m = HybridCacheManager([(v4, (8, 2)), (RecurrentGroupSpec("r", 12), 6)], DESC)
    classical, states, slots = m.groups["v4"].pool, m.groups["v4"].state_pool, m.groups["r"].pool
    a = list(range(30))
    # 30 tokens: classical blocks 0, 1, 2 for the spans ending at 8, 16, 24 (the 6 tokens of
    # [24, 30) live in state block 0 only); live slot 0, checkpoints at 12 and 24 in slots 1, 2.
    admission = m.admit("a", a)
    assert head(admission, "v4", "r") == (0, 30, (0, 1, 2), StateRestore(0, "none"), ())
    assert m.part("a", "v4").state_slot == 0 and m.part("a", "v4").restore == StateRestore(0, "none")
    assert m.part("a", "r").checkpoints == [(12, 1), (24, 2)]
    assert all(classical.block_hash(b) is None for b in (0, 1, 2))  # published at the commit, not before
    m.commit("a", 30)
    m.check_integrity()
    assert all(classical.block_hash(b) is not None and classical.refcount(b) == 1 for b in (0, 1, 2))

    # b shares a's first 28 tokens: the dual pool serves 8, 16, 24, the recurrent group 12, 24.
    b = a[:28] + [100, 101, 102]
    assert m.group_hit_points(b) == {"v4": [0, 8, 16, 24], "r": [0, 12, 24]}
    admission = m.admit("b", b)
    m.check_integrity()
    # Hit 24: classical blocks 0, 1, 2 shared (refcount 2), state block 1 rebuilt by
    # replaying [18, 24); the recurrent state restored from slot 2 into live slot 3.
    assert head(admission, "v4", "r") == (24, 7, (0, 1, 2), StateRestore(3, "checkpoint", 2), ())
    assert m.part("b", "v4").restore == StateRestore(1, "recompute", replay_start=18)
    assert [classical.refcount(k) for k in (0, 1, 2)] == [2, 2, 2]
    m.commit("b", 7)  # [24, 31) completes no span: no classical block, no copy
    m.check_integrity()
    assert m.block_ids("b", "v4") == [0, 1, 2] and m.part("b", "v4").restore == StateRestore(1, "none")

    # c shares 20 tokens: the dual pool alone could serve 16, the recurrent group alone 12;
    # no point but 0 is served by both.
    c = a[:20] + [200, 201, 202, 203]
    assert m.group_hit_points(c) == {"v4": [0, 8, 16], "r": [0, 12]}
    assert m.lookup_prefix(c) == 0
    # Both state blocks are held: c waits and a fork is refused, with no trace in any pool
    # (the recurrent group has slots to spare).
    before = free_queues(m)
    assert before == {"v4": [3, 4, 5, 6, 7], "r": [4, 5, 1, 2], "v4.state": []}
    assert m.admit("c", c) is None and not m.fork("a", "a2")
    assert free_queues(m) == before and "c" not in m and "a2" not in m
    m.check_integrity()

    assert m.release("a")
    # a's classical blocks stay held by b; its state block 0 and live slot 0 go back.
    assert free_queues(m) == {"v4": [3, 4, 5, 6, 7], "r": [4, 5, 0, 1, 2], "v4.state": [0]}
    admission = m.admit("c", c)
    m.check_integrity()
    # No hit: three fresh classical blocks, state block 0, live slot 4; the recurrent group
    # checkpoints 24 in slot 5 (12 is cached already).
    assert head(admission, "v4", "r") == (0, 24, (3, 4, 5), StateRestore(4, "none"), ())
    assert m.part("c", "v4").state_slot == 0 and m.part("c", "r").checkpoints == [(24, 5)]
    m.commit("c", 24)
    m.check_integrity()
    # c's first two spans are a's: blocks 3 and 4 are published as second copies of 0 and 1.
    assert classical.prefix_block(3) is classical.prefix_block(0)
    assert classical.prefix_block(4) is classical.prefix_block(1)
    assert classical.prefix_block(5) is not classical.prefix_block(2)

    m.release("c")  # tail-first: 5, 4, 3
    assert classical.free_queue() == [6, 7, 5, 4, 3] and states.free_queue() == [0]
    # A fork shares b's complete spans and takes the free state block (the runner copies
    # b's state, the unfinished span [24, 31) included, into it).
    assert m.fork("b", "b2")
    assert m.block_ids("b2", "v4") == [0, 1, 2] and m.part("b2", "v4").state_slot == 0
    assert [classical.refcount(k) for k in (0, 1, 2)] == [2, 2, 2] and states.free_queue() == []
    m.check_integrity()
    # Position 31 completes span 3 for both: each writes a block of its own (6, then 7);
    # a complete span is never written again, so nothing is copied.
    for rid, tok in (("b2", 1), ("b", 2)):
        m.append_token_ids(rid, [tok])
    assert m.reserve_step(["b2", "b"], [1, 1])
    assert m.block_ids("b2", "v4") == [0, 1, 2, 6] and m.block_ids("b", "v4") == [0, 1, 2, 7]
    assert m.take_copies() == {}
    m.commit_step(["b2", "b"], [1, 1], [None, None])
    m.check_integrity()
    assert classical.prefix_block(6) is not classical.prefix_block(7)  # different tokens at 31
    # Held: classical 0, 1, 2 (shared, counted once), 6, 7, every slot computed; state
    # blocks: the dual pool's 2 (both held) and the recurrent group's 6 (live slots of b, b2)
    assert m.usage() == (8, 3, 5, 5 * 8, 8, 2 + 6, 0 + 4)
    assert m.release("b", "preempt") and m.release("b2") and not m.release("b", "cancel")
    m.check_integrity()
    assert states.num_free == 2 and classical.num_free == 8 and slots.num_free == 6


def test_a_turn_end_at_a_span_boundary_is_a_hit_for_the_dual_pool_and_the_recurrent_group():
    # As above, with turn ends kept: a finish at 16 computed tokens leaves a recurrent
    # checkpoint at 16, off its grid of 12 but on the dual pool's span boundary.
    v4 = DualPoolGroupSpec("v4", 8, replay_len=6)
    m = HybridCacheManager([(v4, (6, 2)), (RecurrentGroupSpec("r", 12), 4)], DESC, turn_end_checkpoints=True)
    assert prefill(m, "t1", list(range(14))) == 0
    assert m.block_ids("t1", "v4") == [0] and m.part("t1", "r").checkpoints == []  # 12's snapshot went to slot 1
    decode(m, "t1", 50)
    m.append_token_ids("t1", [51])
    assert m.reserve("t1", 1).groups["v4"].new_block_ids == (1,)  # position 15 completes span 1
    m.commit("t1", 1)
    m.append_token_ids("t1", [52])
    history = list(range(14)) + [50, 51, 52]
    follow_up = history + [7, 7]
    assert m.group_hit_points(follow_up) == {"v4": [0, 8, 16], "r": [0, 12]}
    assert m.lookup_prefix(follow_up) == 0
    assert m.release("t1")
    m.check_integrity()
    # t1's live slot 0 holds the state after 16 tokens: filed as a turn end, free and cached.
    assert m.groups["r"].pool.is_free_cached(0)
    assert m.group_hit_points(follow_up) == {"v4": [0, 8, 16], "r": [0, 12, 16]}
    admission = m.admit("t2", follow_up)
    m.check_integrity()
    # Hit 16: classical blocks 0, 1 revived from the free queue; state block 1 (0 went back
    # to the end of the queue) replays [10, 16); the recurrent state restored from slot 0
    # into slot 2.
    assert head(admission, "v4", "r") == (16, 3, (0, 1), StateRestore(2, "checkpoint", 0), ())
    assert m.part("t2", "v4").restore == StateRestore(1, "recompute", replay_start=10)
    m.commit("t2", 3)
    m.check_integrity()


def test_a_dual_pool_group_is_named_right():
    with pytest.raises(ValueError, match="span must be positive"):
        DualPoolGroupSpec("v4", 0)
    with pytest.raises(ValueError, match="replay_len must be >= 0"):
        DualPoolGroupSpec("v4", 8, replay_len=-1)
    with pytest.raises(ValueError, match="group 'v4': spill_blocks must be >= 0, got -2"):
        DualPoolGroupSpec("v4", 8, spill_blocks=-2)
    with pytest.raises(ValueError, match=r"needs \(classical blocks, state blocks\)"):
        HybridCacheManager([(DualPoolGroupSpec("v4", 8), 4)], DESC)
    with pytest.raises(ValueError, match=r"needs \(classical blocks, state blocks\)"):
        HybridCacheManager([(DualPoolGroupSpec("v4", 8), (4, 0))], DESC)
    with pytest.raises(ValueError, match="for a dual-pool group only"):
        HybridCacheManager([(AttentionGroupSpec("full", 4), (4, 2))], DESC)
    m = HybridCacheManager([(DualPoolGroupSpec("v4", 8), (4, 2))], DESC)
    prefill(m, "a", [1, 2, 3])
    with pytest.raises(KeyError, match="no group 'nope'; the groups are \\['v4'\\]"):
        m.part("a", "nope")


def test_part_of_a_cache_of_several_groups_names_its_group():
    # No default group answers both kinds of question: before, part("a") was the recurrent
    # group's (its block_ids []) while block_ids("a") was the attention group's
    m = HybridCacheManager([(AttentionGroupSpec("mla", 4), 8), (RecurrentGroupSpec("kda", 4), 4)], DESC)
    assert prefill(m, "a", list(range(10))) == 0  # blocks 0, 1, 2; state slot 0, checkpoints in 1, 2
    with pytest.raises(ValueError, match=r"^part\('a'\): the cache has several groups; name one of \['kda', 'mla'\]$"):
        m.part("a")
    assert m.part("a", "mla").block_ids == m.block_ids("a") == [0, 1, 2]
    assert m.part("a", "kda").block_ids == [] and m.part("a", "kda").state_slot == 0
    one = HybridCacheManager([(AttentionGroupSpec("mla", 4), 8)], DESC)
    prefill(one, "a", list(range(10)))
    assert one.part("a").group is one.groups["mla"] and one.part("a").block_ids == [0, 1, 2]


def test_every_group_kind_keeps_the_whole_group_protocol():
    # The coordinator reaches groups only through CacheGroup (cache/group.py): every kind
    # has every member, each method with the protocol's parameters, and the coordinator's
    # module imports no group kind (it could not branch on one).
    import ast
    import inspect

    import kvpool.cache.coordinator as coordinator
    from kvpool.cache.group import CacheGroup

    m = HybridCacheManager(
        [(AttentionGroupSpec("full", 4), 4), (RecurrentGroupSpec("r", 4), 2), (DualPoolGroupSpec("v4", 8), (4, 2))],
        DESC,
    )
    methods = {n: f for n, f in vars(CacheGroup).items() if inspect.isfunction(f) and not n.startswith("_")}
    attributes = [n for n in CacheGroup.__annotations__ if not n.startswith("_")]
    # (48: lookup_stamp joined with the admission's reuse of a router's lookup, b98ea3e)
    # (50: can_forget_prefixes and forget_prefixes, for the coordinator's reset_prefix_cache)
    assert (
        len(methods) == 50
        and "lookup_stamp" in methods
        and attributes
        == [
            "name",
            "kind",
            "pool",
            "extra_pools",
            "can_unreserve",
            "granularity",
            "reads_whole_prefix",
            "has_table",
            "has_state",
            "whole_steps",
            "commit_period",
            "decode_reserve_period",
        ]
    )
    for g in m.groups.values():
        for name in attributes:
            assert hasattr(g, name), (g.kind, name)
        for name, f in methods.items():
            got = list(inspect.signature(getattr(type(g), name)).parameters)
            assert got == list(inspect.signature(f).parameters), (g.kind, name, got)
    imported = {
        node.module
        for node in ast.walk(ast.parse(inspect.getsource(coordinator)))
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not imported & {"kvpool.cache.window", "kvpool.cache.recurrent", "kvpool.cache.dual_pool"}


def test_prefix_queries_and_the_swap_are_the_tier_bridges_answered_by_each_group():
    # The P/D prefix queries and the partial-block swap are the tier bridge's, over a
    # one-group coordinator: an attention group answers them (a one-group coordinator over it
    # is a FullAttentionManager), a group without such blocks answers empty or None, a hybrid
    # cache refuses in one line.
    tokens = list(range(10))
    m = HybridCacheManager([(AttentionGroupSpec("full", 4), 8)], DESC, exact_steps=False)
    assert prefill(m, "a", tokens) == 0  # blocks 0, 1 full (tokens 0-7), block 2 partial (8, 9)
    ids, chain = tier_bridge.prefix_blocks(m, tokens + [99])
    hashes = [b.block_hash for b in m.part("a").prefix_chain()]
    assert ids == m.block_ids("a")[:2] and [b.block_hash for b in chain] == hashes and len(hashes) == 2
    longer = tier_bridge.chain_for(m, tokens + [99, 98])  # three full blocks, the third not cached
    assert [b.block_hash for b in longer[:2]] == hashes and len(longer) == 3 and not longer[2].block_ids
    block_id, block, n = tier_bridge.tail_block(m, "a")
    assert (block_id, n) == (m.block_ids("a")[2], 2) and m.pool.block_hash(block_id) is None
    r = HybridCacheManager([(RecurrentGroupSpec("r", 4), 2)], DESC)
    prefill(r, "a", tokens)
    assert tier_bridge.prefix_blocks(r, tokens) == ([], []) and tier_bridge.chain_for(r, tokens) == []
    assert tier_bridge.tail_block(r, "a") is None
    h = HybridCacheManager([(AttentionGroupSpec("full", 4), 8), (RecurrentGroupSpec("r", 4), 2)], DESC)
    prefill(h, "a", tokens)
    with pytest.raises(ValueError, match="prefix_blocks serves a one-group cache, got 2 groups"):
        tier_bridge.prefix_blocks(h, tokens)
    with pytest.raises(ValueError, match="a cache of 2 groups restores no partial block"):
        h.restore_tail("a", 2)
    assert tier_bridge.tail_block(h, "a") is None and tier_bridge.tail_block_for_restore(h, "a", 2) is None
    h.check_integrity()


def test_a_follow_up_turn_hits_inside_the_attention_block_where_the_previous_turn_ended():
    # Figure 12 in full. Blocks of 4, a checkpoint every 8 tokens, turn ends kept. Turn 1
    # is a 10-token prompt: at its finish the recurrent group keeps the state after 10
    # (slot 0), and the attention group keeps its partial block 2 (tokens 8, 9) findable
    # as a partial block, so the follow-up resumes at 10, not at 8.
    def make(turn_ends: bool) -> HybridCacheManager:
        specs = [(AttentionGroupSpec("full", 4), 8), (RecurrentGroupSpec("r", 8), 4)]
        return HybridCacheManager(specs, DESC, turn_end_checkpoints=turn_ends)

    turn1 = list(range(10))
    follow_up = turn1 + [5, 6, 7]
    # The reference: without turn ends neither group serves 10; the hit is 8, the last
    # point both serve (block ends 4, 8; the checkpoint of 8).
    ref = make(turn_ends=False)
    prefill(ref, "t1", turn1)
    ref.release("t1")
    assert ref.group_hit_points(follow_up) == {"full": [0, 4, 8], "r": [0, 8]} and ref.lookup_prefix(follow_up) == 8

    m = make(turn_ends=True)
    assert prefill(m, "t1", turn1) == 0
    assert m.block_ids("t1") == [0, 1, 2] and m.part("t1", "r").state_slot == 0
    assert m.release("t1")
    m.check_integrity()
    pool = m.groups["full"].pool
    # Block 2 (positions [8, 10)) is cached, free, like the full blocks 0 and 1 before it
    assert [pool.is_free_cached(b) for b in (0, 1, 2)] == [True, True, True]
    assert m.group_hit_points(follow_up) == {"full": [0, 4, 8, 10], "r": [0, 8, 10]}
    # A prompt that leaves turn 1 inside block 2 (token 9 replaced) gets no partial hit:
    # the kept block holds other tokens.
    assert m.group_hit_points(turn1[:9] + [99, 5, 6]) == {"full": [0, 4, 8], "r": [0, 8]}

    admission = m.admit("t2", follow_up)
    m.check_integrity()
    # Hit 10: blocks 0 and 1 shared; block 2's 2 tokens copied into block 3 (the first
    # unhashed free block), which t2 writes from position 10 on; block 4 for [12, 13).
    # The state is restored from the turn-end checkpoint in slot 0 into slot 2.
    assert head(admission, "full", "r") == (10, 3, (0, 1, 3, 4), StateRestore(2, "checkpoint", 0), ())
    assert admission.groups["full"].copies == (BlockCopy(2, 3),)
    assert m.take_copies() == {"full": [BlockCopy(2, 3)]}
    # The source is held until t2's first commit (nothing may reuse it before the copy)
    assert pool.refcount(2) == 1 and pool.block_hash(3) is None
    m.commit("t2", 3)
    m.check_integrity()
    assert pool.is_free_cached(2) and m.block_ids("t2") == [0, 1, 3, 4]
    # t2's block 3 now holds [8, 12) = 8, 9, 5, 6, a full block: published as one; the
    # recurrent group has no checkpoint at 12, so the partial block still sets the hit.
    assert pool.block_hash(3) is not None
    assert m.group_hit_points(follow_up[:12] + [1]) == {"full": [0, 4, 8, 10, 12], "r": [0, 8, 10]}
    assert m.lookup_prefix(follow_up[:12] + [1]) == 10
    m.release("t2")
    m.check_integrity()


def test_the_turn_end_lists_stay_bounded_over_many_conversations():
    # Each finished turn off the grid keeps a checkpoint slot (recurrent) and a partial block
    # (full attention); later admissions take most of them. Dead entries are unlisted: each
    # group's list holds at most twice its pool's blocks, and at least the live kept ones.
    m = HybridCacheManager(
        [(AttentionGroupSpec("full", 4), 24), (RecurrentGroupSpec("r", 8), 4)], DESC, turn_end_checkpoints=True
    )
    rng = random.Random(2)
    for i in range(300):
        conv = [rng.randrange(251) for _ in range(rng.randrange(9, 20))]
        for turn in range(2):
            admission = m.admit(f"c{i}-{turn}", conv)
            assert admission is not None
            m.commit(f"c{i}-{turn}", admission.num_scheduled_tokens)
            assert m.release(f"c{i}-{turn}")
            for g in m.groups.values():
                pool, turn_ends = g.pool, g._turn_ends
                live = sum(
                    (b := pool.prefix_block(k)) is not None and b.extra.startswith(b"turn")
                    for k in range(pool.num_blocks)
                )
                assert live <= turn_ends.num_listed() <= 2 * pool.num_blocks
            conv = conv + [rng.randrange(251) for _ in range(rng.randrange(1, 8))]
        m.check_integrity()
    assert m.groups["r"]._turn_ends.num_listed() > 0 and m.groups["full"]._turn_ends.num_listed() > 0


def test_a_turn_end_list_of_few_live_entries_in_a_large_pool_stays_small():
    # Spilled V4 states are turn ends of the classical pool: few live (31 blocks each) in a
    # pool of many blocks. Dead entries keep their chains of prefix blocks alive, so the list
    # is swept at twice its live entries (+ 64), not only at twice the pool's blocks.
    from kvpool.cache.chains import TurnEnds
    from kvpool.pool.block_pool import BlockPool

    pool = BlockPool(100_000)
    held = pool.allocate(100_000 - 8)  # 8 blocks cycle: each filing's block is cached, then taken
    assert held is not None
    turn_ends = TurnEnds(pool, 4)
    root = pool.root(b"d")
    for i in range(2_000):  # each under a parent of its own: no filing meets a dead one
        parent = pool.chain(root, i.to_bytes(16, "little"))
        (block_id,) = pool.allocate(1, [])
        assert turn_ends.file(block_id, turn_ends.block(parent, [i, i + 1, 0, 0, 0, 0], (), 4, 6), orphan_ok=True)
        pool.decref([block_id])  # a free cached block: alive until an allocation takes it
        assert turn_ends.num_listed() <= 2 * 8 + 64 + 1, (i, turn_ends.num_listed())
        turn_ends.check_integrity()


class _Boom(Exception):
    """A fault injected into one group's release."""


def _release_managers() -> list[HybridCacheManager]:
    return [
        HybridCacheManager(
            [
                (AttentionGroupSpec("full", 4), 12),
                (AttentionGroupSpec("swa", 4, window=4), 12),
                (RecurrentGroupSpec("r", 4), 8),
            ],
            DESC,
        ),
        HybridCacheManager([(DualPoolGroupSpec("v4", 4, replay_len=2), (8, 3)), (RecurrentGroupSpec("r", 4), 8)], DESC),
    ]


def _all_free(m: HybridCacheManager) -> bool:
    return all(pool.num_free == pool.num_blocks for pool in m._all_pools)


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("reason", ["finish", "preempt", "cancel"])
def test_a_release_that_raises_in_a_group_leaves_the_request_whole_for_a_repeat(which, reason) -> None:
    """Each group's release in turn raises (before it changes anything): the request stays
    admitted, the groups before it released, check_integrity holds, and a repeat of the
    release goes on from that group; the request is then gone, its stats counted once, and
    with b's blocks released too every pool is free. The release popped the request first:
    the groups after the fault kept their blocks, held by nobody (a leak), and the repeat
    found nothing to release."""
    for k in range(len(_release_managers()[which].groups)):
        m = _release_managers()[which]
        a = list(range(13))
        prefill(m, "a", a)
        decode(m, "a", 50)
        prefill(m, "b", a[:9] + [70, 71])  # (b shares a's first blocks: a release must not free them)
        stats = m.stats
        g = m._group_list[k]

        def boom(state, g=g):
            raise _Boom(g.name)

        g.release = boom  # (an instance attribute: the group's own release hidden)
        with pytest.raises(_Boom):
            m.release("a", reason)
        assert "a" in m
        m.check_integrity()
        del g.release
        assert m.release("a", reason) is True
        assert "a" not in m and m.release("a", reason) is False
        m.check_integrity()
        assert m.stats == stats and m.stats.num_requests == 2
        assert ("a" in m._preempted) == (reason == "preempt")
        m.release("b")
        m.check_integrity()
        assert _all_free(m)


@pytest.mark.parametrize("which", [0, 1])
def test_ctrl_c_inside_a_group_release_is_held_till_the_request_is_gone(which) -> None:
    """A SIGINT (Ctrl-C) lands inside each group's release in turn: its KeyboardInterrupt
    comes once the release is done, the request wholly gone and check_integrity holding
    (it came inside the group's release: that group's blocks and those after it stayed
    held by a request no longer there)."""
    for k in range(len(_release_managers()[which].groups)):
        m = _release_managers()[which]
        prefill(m, "a", list(range(13)))
        g = m._group_list[k]
        release = g.release

        def interrupted(state, release=release):
            signal.raise_signal(signal.SIGINT)
            release(state)

        g.release = interrupted
        with pytest.raises(KeyboardInterrupt):
            m.release("a", "cancel")
        del g.release
        assert "a" not in m and m.release("a") is False
        m.check_integrity()
        assert _all_free(m)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("which", [0, 1])
def test_the_repeat_of_a_recompute_release_ctrl_c_cut_short_keeps_the_recompute_mark(which) -> None:
    """A SIGINT lands inside the release of a request marked `will_recompute`: the release
    completes, KeyboardInterrupt follows, and the engine repeats the release (its next
    step's `_release_pending`). The repeat keeps the mark, so the request's readmission
    counts nothing (num_requests 1); a later cancel of the waiting request, no repeat,
    clears it (a new request with that id counts). The repeat cleared the mark: 2."""
    m = _release_managers()[which]
    prefill(m, "a", list(range(13)))
    g = m._group_list[-1]
    release = g.release

    def interrupted(state):
        signal.raise_signal(signal.SIGINT)
        release(state)

    g.release = interrupted
    m.will_recompute("a")
    with pytest.raises(KeyboardInterrupt):
        m.release("a", "cancel")
    del g.release
    assert m.release("a", "cancel") is False  # (the engine's repeat)
    assert "a" in m._recomputing
    prefill(m, "a", list(range(13)))
    m.check_integrity()
    assert (m.stats.num_requests, m.stats.num_readmissions, m.stats.num_queried_tokens) == (1, 0, 13)
    m.will_recompute("a")
    m.release("a", "cancel")
    assert m.release("a", "cancel") is False and "a" not in m._recomputing  # (a cancel while it waits)
    prefill(m, "a", list(range(13)))
    assert (m.stats.num_requests, m.stats.num_readmissions) == (2, 0)


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("aborted", [False, True], ids=["repeated", "aborted"])
def test_a_recompute_release_that_raised_marks_the_request_when_it_completes(which, aborted) -> None:
    """A release of a request marked `will_recompute` raises in each group in turn. It was
    marked to recompute at once, while still admitted: check_integrity failed ("a request
    marked to recompute is admitted"). The mark now follows the release that completes (the
    engine's repeat): admitted again, the request counts nothing (1 request, 13 tokens). An
    abort in between is one more release after the repeat (the engine's, as for a request
    that waits released; test_engine_scheduler's test of it): it drops the mark, and a new
    request reusing the id counts (2 requests, 26 tokens)."""
    for k in range(len(_release_managers()[which].groups)):
        m = _release_managers()[which]
        prefill(m, "a", list(range(13)))
        g = m._group_list[k]

        def boom(state, g=g):
            raise _Boom(g.name)

        g.release = boom
        m.will_recompute("a")
        with pytest.raises(_Boom):
            m.release("a", "cancel")
        del g.release
        assert "a" in m and "a" not in m._recomputing
        m.check_integrity()
        assert m.release("a", "cancel") is True and "a" in m._recomputing  # (the engine's repeat)
        if aborted:
            assert m.release("a", "cancel") is False and "a" not in m._recomputing
        m.check_integrity()
        prefill(m, "a", list(range(13)))
        m.check_integrity()
        s = m.stats
        counts = (s.num_requests, s.num_queried_tokens, s.num_readmissions, s.num_readmitted_hit_tokens)
        assert counts == ((2, 26, 0, 0) if aborted else (1, 13, 0, 0)), (k, counts)
        assert s.num_hit_tokens == (12 if aborted else 0), k  # (the first's 3 full blocks, when counted)
        assert not m._recomputing


@pytest.mark.parametrize("which", [0, 1])
def test_a_preempt_release_that_raised_then_repeated_as_a_cancel_drops_the_preempt_mark(which) -> None:
    """A "preempt" release raises in each group in turn; the request is then aborted, and
    the engine repeats the release as a "cancel": the marks follow the repeat (the release
    that completes), so the id is not marked preempted and a new request reusing it counts
    as a request, not a readmission. The preempt mark stayed (1 readmission, 1 request)."""
    for k in range(len(_release_managers()[which].groups)):
        m = _release_managers()[which]
        prefill(m, "a", list(range(13)))
        g = m._group_list[k]

        def boom(state, g=g):
            raise _Boom(g.name)

        g.release = boom
        with pytest.raises(_Boom):
            m.release("a", "preempt")
        del g.release
        assert m.release("a", "cancel") is True
        assert "a" not in m._preempted
        m.check_integrity()
        prefill(m, "a", list(range(13)))
        assert (m.stats.num_requests, m.stats.num_readmissions) == (2, 0)
