"""Prefix-cache semantics that vLLM's and SGLang's prefix caches have, as narratives with
exact block ids: duplicate copies, multimodal placement, the collision guard, all-or-nothing
batched calls, copies that die with their request, undo, and honest counters."""

from __future__ import annotations

import pytest

from kvpool.cache import BlockCopy, CacheDescriptor, DSV4CacheManager, FullAttentionManager
from kvpool.cache.coordinator import pack_prompt
from kvpool.cache.types import LookupPrompt
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
from kvpool.spec.dsv4 import DSV4Spec

DESC = CacheDescriptor("tiny-model", weights_version="v1", layout_id="bs4-fp32")
P8 = [11, 12, 13, 14, 15, 16, 17, 18]  # two blocks of 4
SPEC = DSV4Spec.from_config(SMALL_DSV4_CONFIG)  # span 16


def make(num_blocks: int = 10, **kw) -> FullAttentionManager:
    return FullAttentionManager(num_blocks, 4, DESC, **kw)


def prefill(m, request_id: str, tokens: list[int], **kw) -> int:
    admission = m.admit(request_id, tokens, **kw)
    assert admission is not None
    m.check_integrity()
    m.commit(request_id, len(tokens) - admission.num_cached_tokens)
    m.check_integrity()
    return admission.num_cached_tokens


def decode(m, request_id: str, tokens: list[int]) -> None:
    """The engine's path: one token a step (the token of the step is known already)."""
    for token in tokens:
        assert m.reserve_step([request_id], [1])
        m.commit_step([request_id], [1], [token])
        m.check_integrity()


def constant_hash(m) -> None:
    m.pool.hasher.digest = lambda data: b"\x00" * 16  # every chain hashes alike


def test_a_duplicate_copy_keeps_its_chain_reachable():
    m = make()
    assert prefill(m, "a", P8) == 0
    assert m.block_ids("a") == [0, 1]
    # b sends the same prompt: block 0 hits; block 1 is computed again (its last token's
    # logits are needed) into block 2, an identical copy that is findable too.
    assert prefill(m, "b", P8) == 4
    assert m.block_ids("b") == [0, 2]
    assert m.pool.prefix_block(2) is m.pool.prefix_block(1)
    m.append_token_ids("b", [20])
    decode(m, "b", [21, 22, 23, 24])  # positions 8..11: a third block, 3
    assert m.block_ids("b") == [0, 2, 3]
    # a finishes; its copy of block 1 is evicted by a request that needs every free block.
    assert m.release("a")
    assert m.pool.free_queue() == [4, 5, 6, 7, 8, 9, 1]
    assert prefill(m, "c", list(range(100, 128))) == 0  # 7 blocks
    assert m.block_ids("c") == [4, 5, 6, 7, 8, 9, 1]
    assert m.pool.prefix_block(2).block_ids == (2,)  # a's copy is gone; b's remains
    # b still holds every block of its sequence: a continuation is a full hit of b's copies.
    continuation = P8 + [20, 21, 22, 23] + [99]
    assert m.lookup_prefix(continuation) == 12
    assert m.release("c")
    assert prefill(m, "d", continuation) == 12
    assert m.block_ids("d")[:3] == [0, 2, 3]
    m.check_integrity()


def test_multimodal_placement_inside_a_block_is_part_of_its_key():
    # Identical placeholder token ids, the same two images, split at another position
    # inside block 1: [0, 6) + [6, 8) against [0, 5) + [5, 8). Block 1's KV differs.
    m = make()
    tokens = [7] * 9
    prefill(m, "a", tokens, mm_items=[(0, 6, "image-1"), (6, 2, "image-2")])
    assert m.block_ids("a") == [0, 1, 2]
    other = [(0, 5, "image-1"), (5, 3, "image-2")]
    # block 0 holds image-1 at offset 0 in both (same key); block 1 differs: the hit stops.
    assert m.lookup_prefix(tokens, mm_items=other) == 4
    assert prefill(m, "b", tokens, mm_items=other) == 4
    assert m.block_ids("b") == [0, 3, 4]
    # The same placement shares both blocks.
    assert m.lookup_prefix(tokens, mm_items=[(0, 6, "image-1"), (6, 2, "image-2")]) == 8
    m.check_integrity()


def test_the_collision_guard_compares_the_parent_the_tokens_and_the_root():
    m = make()
    constant_hash(m)
    x = [1, 2, 3, 4]
    prefill(m, "a", x + [9])  # block 0 holds X at position 0
    assert m.block_ids("a") == [0, 1]
    # X + X + [7]: its block 1 holds the same tokens as block 0 under the same (constant)
    # hash, but after another parent: its KV comes from other positions. One hit only.
    assert m.lookup_prefix(x + x + [7]) == 4
    assert prefill(m, "b", x + x + [7]) == 4
    assert m.block_ids("b") == [0, 2, 3]
    # Identical tokens under another tenant salt or another descriptor: no hit at all.
    assert m.lookup_prefix(x + [9], tenant_salt="tenant-2") == 0
    assert m.lookup_prefix(x + [9], descriptor=CacheDescriptor("tiny-model", weights_version="v2")) == 0
    assert m.lookup_prefix(x + [9]) == 4
    m.check_integrity()


def test_a_prompt_packed_once_is_looked_up_in_caches_with_other_contents_and_roots():
    # The router's path: one pack_prompt, a lookup in each replica. Three caches hold
    # 0, 1 and 2 blocks of the prompt; a tenant salt and a descriptor are other roots.
    a, b, c = make(), make(), make()
    prefill(b, "x", P8[:4] + [99])  # block 0 only
    prefill(c, "x", P8 + [99])  # blocks 0 and 1
    prompt = P8 + [20]
    packed = pack_prompt(prompt)
    assert [m.lookup_packed(packed) for m in (a, b, c)] == [0, 4, 8]
    assert [m.lookup_prefix(prompt) for m in (a, b, c)] == [0, 4, 8]
    assert c.lookup_packed(packed, tenant_salt="tenant-2") == 0
    assert c.lookup_packed(packed, descriptor=CacheDescriptor("tiny-model", weights_version="v2")) == 0
    # A V4 cache (span 16) packed by the same call: its span boundary only.
    v4 = DSV4CacheManager(SPEC, 8, 3, DESC)
    prefill(v4, "x", list(range(16)) + [9])
    assert v4.lookup_packed(pack_prompt(list(range(16)) + [5, 6])) == 16
    assert v4.lookup_packed(pack_prompt(list(range(15)) + [0, 5])) == 0  # token 15 differs
    for m in (a, b, c, v4):
        m.check_integrity()
    with pytest.raises(TypeError, match="LookupPrompt, got list"):
        c.lookup_packed(prompt)
    with pytest.raises(ValueError, match="empty prompt"):
        pack_prompt([])
    with pytest.raises(ValueError, match="token id -1"):
        pack_prompt([1, -1])


def test_the_cache_s_own_packing_checks_as_pack_prompt_does():
    # `_pack` (a lookup or an admission given no packing) is pack_prompt without its pass
    # over the ids' types: the same packing and items, the same refusals, word for word
    from kvpool.cache.coordinator import _pack

    items = [(1, 2, "image-1")]
    mine, theirs = _pack([5, 6, 7], items), pack_prompt([5, 6, 7], items)
    assert (mine.packed, mine.mm_items, list(mine.token_ids)) == (theirs.packed, theirs.mm_items, [5, 6, 7])
    for ids, bad in (([], ()), ([1, -1], ()), ([1, 2], [(1, 2, "image-1")]), ([1, 2], [(0, 0, "image-1")])):
        errors = []
        for pack in (_pack, pack_prompt):
            with pytest.raises(ValueError) as raised:
                pack(ids, bad, "r")
            errors.append(str(raised.value))
        assert errors[0] == errors[1], ids


def count_digests(m) -> list[int]:
    calls: list[int] = []
    digest = m.pool.hasher.digest
    m.pool.hasher.digest = lambda data: calls.append(1) or digest(data)
    return calls


def test_a_packed_prompt_hashes_each_block_once_over_its_lookups_and_admission():
    # The router's caches of the test above, counting the hashes each computes: the prompt's
    # memo holds block 0's hash after a's lookup and block 1's after b's; c and then c's
    # admission hash nothing, and the admission is the one an unpacked prompt gets (twin d).
    a, b, c, d = make(), make(), make(), make()
    for m in (b, c, d):
        prefill(m, "x", P8[:4] + [99])
    for m in (c, d):
        prefill(m, "y", P8 + [99])
    assert a.lookup_prefix([1]) == 0  # (its pool interns the root now: the counts below are of blocks)
    calls = [count_digests(m) for m in (a, b, c)]
    prompt = P8 + [20]
    packed = pack_prompt(prompt)
    assert [m.lookup_packed(packed) for m in (a, b, c)] == [0, 4, 8]
    assert [len(n) for n in calls] == [1, 1, 0]
    adm = c.admit("z", prompt, prompt=packed)
    assert adm == d.admit("z", prompt) and adm is not None
    # x took blocks 0 and 1 (its 99), y hit 0 and took 2 and 3: z hits 0 and 2, takes 4
    assert adm.num_cached_tokens == 8 and c.block_ids("z") == d.block_ids("z") == [0, 2, 4]
    assert len(calls[2]) == 0
    # The request's token list is its own: the packed prompt's does not grow with it
    c.commit("z", 1)
    c.append_token_ids("z", [5])
    assert packed.token_ids == tuple(prompt) and c.token_ids("z") == [*prompt, 5]
    for m in (a, b, c, d):
        m.check_integrity()
    # A packed prompt of other tokens, or not a LookupPrompt: refused, nothing admitted
    with pytest.raises(ValueError, match="packed prompt is not of these token ids"):
        a.admit("w", P8 + [21], prompt=packed)
    with pytest.raises(TypeError, match="LookupPrompt, got list"):
        a.admit("w", prompt, prompt=prompt)
    assert "w" not in a
    a.check_integrity()


def test_the_v4_collision_guard_and_a_table_that_holds_a_block_twice():
    m = DSV4CacheManager(SPEC, 8, 3, DESC)
    constant_hash(m)
    x = list(range(16))  # one span
    prefill(m, "a", x + [9])
    assert m.block_ids("a") == [0]
    assert m.lookup_prefix(x + x + [7]) == 16  # block 1 would be block 0 again: refused
    assert m.lookup_prefix(x + [9], tenant_salt="tenant-2") == 0
    adm = m.admit("b", x + x + [7])
    assert adm is not None and adm.groups["v4"].block_ids == (0, 1)  # block 1 is a fresh block for span 1
    m.check_integrity()
    # A table holding one block twice (refcounts made to agree) is rejected.
    req = m._requests["a"]
    state = req.states["v4"]
    state.block_ids.append(0)
    state.chain.append(state.chain[0])
    req.token_ids.extend(x)
    req.num_computed += 16
    req.end += 16
    m.pool.incref([0])
    with pytest.raises(AssertionError, match="holds a classical block twice"):
        m.check_integrity()


def test_a_step_with_a_bad_request_changes_nothing():
    # Validate every request first, then change anything: "a" sits at a block boundary and
    # would take a fresh block before the unknown request raised.
    m = make()
    prefill(m, "a", P8)  # blocks 0, 1 full
    prefill(m, "b", [5, 6, 7])  # block 2
    m.append_token_ids("a", [1])
    m.append_token_ids("b", [2])
    before = (m.block_ids("a"), m.block_ids("b"), m.pool.free_queue())
    with pytest.raises(KeyError, match="missing"):
        m.reserve_step(["a", "missing"], [1, 1])
    with pytest.raises(ValueError, match="token ids are known"):
        m.reserve_step(["a", "b"], [1, 2])  # b knows one more token, not two
    with pytest.raises(ValueError, match="appears twice"):
        m.reserve_step(["a", "a"], [1, 1])
    assert (m.block_ids("a"), m.block_ids("b"), m.pool.free_queue()) == before
    assert m.reserve_step(["a", "b"], [1, 1])
    assert m.block_ids("a") == [0, 1, 3]
    # commit_step: a's commit is valid, b's is not (2 tokens, 1 reserved-and-known): neither happens.
    with pytest.raises(ValueError, match="request 'b': commit of 2 tokens"):
        m.commit_step(["a", "b"], [1, 2], [10, 11])
    assert (m.num_computed_tokens("a"), m.num_computed_tokens("b")) == (8, 3)
    assert (m.token_ids("a"), m.token_ids("b")) == (P8 + [1], [5, 6, 7, 2])
    with pytest.raises(KeyError, match="ghost"):
        m.commit_step(["a", "ghost"], [1, 1], [10, 11])
    assert m.num_computed_tokens("a") == 8
    m.commit_step(["a", "b"], [1, 1], [10, 11])
    assert (m.num_computed_tokens("a"), m.num_computed_tokens("b")) == (9, 4)
    m.check_integrity()


def test_a_queued_copy_dies_with_its_request():
    m = make(num_blocks=6)
    prefill(m, "p", [1, 2, 3, 4, 5, 6])  # blocks 0, 1 (1 is a partial tail)
    m.fork("p", "c")
    m.append_token_ids("c", [7])
    assert m.reserve_step(["c"], [1])  # c copies the shared tail 1 into block 2
    assert m.block_ids("c") == [0, 2]
    assert m.release("c", "cancel")
    # Block 2 is free again and goes to another request before any copy is applied.
    prefill(m, "d", [9, 9, 9, 9, 9])
    assert m.block_ids("d") == [3, 4]
    assert prefill(m, "e", [8]) == 0 and m.block_ids("e") == [5]
    assert prefill(m, "f", [8, 8]) == 0 and m.block_ids("f") == [2]
    assert m.take_copies() == {}  # c's copy would have overwritten f's block 2
    m.check_integrity()


def test_a_queued_copy_a_fork_shares_stays_and_copies_keep_their_order():
    # p writes into its shared tail (copy 1 -> 2 queued), then forks c off, so c's table
    # holds block 2 too, and c writes into that shared block (copy 2 -> 3, which reads what
    # the first copy writes). p leaves before the copies are applied: nobody holds block 2
    # now, but the second copy reads it, so both stay, in the order they were made.
    m = make()
    prefill(m, "p", [1, 2, 3, 4, 5, 6])  # blocks 0, 1
    m.fork("p", "q")  # block 1 is shared
    m.append_token_ids("p", [7])
    assert m.reserve("p", 1).groups["full"].copies == (BlockCopy(1, 2),)
    m.fork("p", "c")
    assert m.block_ids("c") == [0, 2]
    m.append_token_ids("c", [8])
    assert m.reserve("c", 1).groups["full"].copies == (BlockCopy(2, 3),)
    assert m.release("p")
    m.check_integrity()
    assert m.take_copies() == {"full": [BlockCopy(1, 2), BlockCopy(2, 3)]}
    # once nobody reads a destination, its copy goes: q forks r and writes (copy 1 -> 4), then
    # leaves... r holds 4: the copy stays; r leaves too: it is dropped.
    m.fork("q", "r")
    m.append_token_ids("r", [9])
    assert m.reserve("r", 1).groups["full"].copies == (BlockCopy(1, 4),)
    assert m.release("r")
    assert m.take_copies() == {}
    m.check_integrity()


def test_a_rollback_drops_a_queued_copy_into_a_block_it_gives_up():
    m = make(num_blocks=8)
    prefill(m, "p", [1, 2, 3, 4, 5, 6])  # blocks 0, 1
    m.fork("p", "c")
    m.append_token_ids("c", [7, 8, 9, 10, 11, 12])
    # positions 6..11: blocks 2 and 3 are taken; the copy of the shared tail 1 goes into the last
    assert m.reserve("c", 6).groups["full"].copies == (BlockCopy(1, 3),)
    assert m.block_ids("c") == [0, 3, 2]
    m.rollback("c", 4)  # back to the first block: blocks 2 and 3 are released
    assert m.block_ids("c") == [0]
    assert m.take_copies() == {}
    m.check_integrity()


def test_an_undone_v4_reservation_restores_the_checkpoint_it_pushed_out():
    m = DSV4CacheManager(SPEC, 8, 3, DESC, restore="checkpoint", num_checkpoints=1)
    a = list(range(100, 117))  # a span and one token
    prefill(m, "a", a)
    assert m.admit("probe", a) is not None and m.lookup_prefix(a) == 16  # a's boundary is checkpointed
    m.release("probe")
    b = list(range(200, 240))
    adm = m.admit("b", b, 0)  # admitted, nothing reserved yet
    assert adm is not None
    v4 = m.groups["v4"]
    lru = ({h: c.slot for h, c in v4._checkpoints.items()}, v4.checkpoint_pool.free_queue())
    res = m.reserve("b", 16)  # its boundary at 16 takes the only checkpoint slot: a's is pushed out
    assert res is not None and res.groups["v4"].checkpoints == ((16, 3),)
    assert m.lookup_prefix(a) == 0
    m.unreserve("b")
    assert m.lookup_prefix(a) == 16  # undone: a's checkpoint is findable again
    assert ({h: c.slot for h, c in v4._checkpoints.items()}, v4.checkpoint_pool.free_queue()) == lru  # its LRU place
    adm = m.admit("c", a + [5])
    assert adm is not None and adm.groups["v4"].restore is not None
    restore = adm.groups["v4"].restore
    assert (adm.num_cached_tokens, restore.method, restore.checkpoint_slot) == (16, "checkpoint", 3)
    m.check_integrity()


def test_a_readmission_after_preemption_is_not_counted_again():
    m = make()
    prompt = list(range(30, 40))  # 10 tokens: blocks 0, 1 full
    prefill(m, "a", prompt)
    assert (m.stats.num_queried_tokens, m.stats.num_hit_tokens) == (10, 0)
    assert m.release("a", "preempt")
    assert prefill(m, "a", prompt) == 8  # its own blocks, still cached
    assert (m.stats.num_requests, m.stats.num_queried_tokens, m.stats.num_hit_tokens) == (1, 10, 0)
    assert (m.stats.num_readmissions, m.stats.num_readmitted_hit_tokens) == (1, 8)
    assert m.stats.hit_rate == 0.0
    # A preempted request cancelled while it waits leaves no mark behind.
    assert m.release("a", "preempt") and not m.release("a", "cancel")
    assert prefill(m, "a", prompt) == 8
    assert m.stats.num_requests == 2 and m.stats.num_readmissions == 1


def test_a_lookup_before_an_admission_counts_a_collision_once():
    m = make()
    constant_hash(m)
    prefill(m, "a", [1, 2, 3, 4, 9])
    assert m.pool.num_collisions == 0
    assert m.lookup_prefix([5, 6, 7, 8, 9]) == 0  # a hash hit with other tokens
    assert m.pool.num_collisions == 0  # a lookup changes nothing
    assert prefill(m, "b", [5, 6, 7, 8, 9]) == 0
    assert m.pool.num_collisions == 2  # the admission's miss, and b's block 0 that cannot be published


def test_an_undo_does_not_revive_a_checkpoint_filed_again_since():
    # Two checkpoint slots (3, 4). c and d checkpoint their spans; a's reservation pushes out
    # c's; b recomputes c's prefix (the checkpoint is gone, so nothing is hit) and files it
    # again, pushing out d's. Undoing a must not put c's old checkpoint back over b's.
    m = DSV4CacheManager(SPEC, 8, 3, DESC, restore="checkpoint", num_checkpoints=2)
    c, d = list(range(100, 117)), list(range(200, 217))
    prefill(m, "c", c)
    prefill(m, "d", d)
    assert m.release("c") and m.release("d")
    assert m.admit("a", list(range(300, 340)), 0) is not None
    assert m.reserve("a", 16).groups["v4"].checkpoints == ((16, 3),)  # c's slot, the least recently used
    assert m.lookup_prefix(c) == 0
    assert prefill(m, "b", c + [1]) == 0  # recomputes c's span; files it in d's slot
    assert m.lookup_prefix(d) == 0 and m.lookup_prefix(c) == 16
    m.unreserve("a")
    m.check_integrity()  # no slot leaked or filed twice
    adm = m.admit("e", c + [2])
    assert adm.groups["v4"].restore.checkpoint_slot == 4  # b's, not the old one
    m.check_integrity()


def test_a_stale_checkpoint_gives_way_to_a_new_one():
    # x's span is checkpointed; every classical block is then taken, so x's block is evicted
    # and its checkpoint points at a prefix no longer cached. When y computes the same span
    # again, a new checkpoint is filed (the stale one's slot is freed) and the prefix hits.
    m = DSV4CacheManager(SPEC, 2, 3, DESC, restore="checkpoint", num_checkpoints=1)
    x = list(range(100, 117))
    prefill(m, "x", x)
    assert m.release("x") and m.lookup_prefix(x) == 16
    prefill(m, "big", list(range(500, 533)))  # 2 spans: both blocks, x's is evicted
    assert m.release("big") and m.lookup_prefix(x) == 0
    prefill(m, "y", x + [3])
    assert m.release("y")
    assert m.lookup_prefix(x + [4]) == 16
    m.check_integrity()


def test_an_undo_gives_back_the_cached_blocks_its_allocation_evicted():
    m = DSV4CacheManager(SPEC, 2, 3, DESC)
    a = list(range(100, 133))  # 2 spans
    prefill(m, "a", a)
    assert m.release("a")
    assert m.pool.free_queue() == [1, 0] and m.lookup_prefix(a) == 32
    assert m.admit("b", list(range(400, 440)), 0) is not None
    assert m.reserve("b", 32).groups["v4"].new_block_ids == (1, 0)  # both evicted
    assert m.lookup_prefix(a) == 0
    m.unreserve("b")
    assert m.pool.free_queue() == [1, 0] and m.lookup_prefix(a) == 32  # as before the reservation
    m.check_integrity()


def test_a_one_group_lookup_is_the_largest_point_its_group_serves():
    # hit_point's one-group path against group_hit_points (every point the group alone
    # serves, from unbounded hits): a V4 cache with turn ends kept (points off the span
    # grid) and a full-attention cache, prompts that extend, cut and leave the cached tokens
    v4 = DSV4CacheManager(SPEC, 12, 4, DESC, turn_end_checkpoints=True)
    base = list(range(1, 41))  # 2 spans and 8 tokens
    prefill(v4, "a", base)
    assert v4.release("a")  # a finish: its turn end at 40 kept
    full = make()
    prefill(full, "a", P8 + [99])
    for m, prompts in (
        (v4, [base + [7], base[:30] + [7], base[:41], base[:16], [5] + base, base + base]),
        (full, [P8 + [1], P8[:5], P8, [11, 12, 13, 14, 1], [1]]),
    ):
        (name,) = m.groups
        for prompt in prompts:
            assert m.lookup_prefix(prompt) == max(m.group_hit_points(prompt)[name]), prompt
        m.check_integrity()
    assert v4.lookup_prefix(base + [7]) == 40  # the turn end, off the span grid


def test_a_stale_packing_is_refused_and_the_salt_memo_stays_bounded():
    # A LookupPrompt whose list changed after packing carries the old bytes: its admission
    # would compare them. Refused, nothing admitted. (pack_prompt's ids are a tuple: only a
    # LookupPrompt built otherwise, `_replace`'s here, has a list to change.)
    from kvpool.cache.coordinator import MAX_MEMO_SALTS

    m = make()
    prefill(m, "x", P8 + [99])
    stale = pack_prompt(P8 + [20])._replace(token_ids=P8 + [20])
    stale.token_ids[:8] = [50 + t for t in range(8)]
    with pytest.raises(ValueError, match="packed prompt is not of these token ids"):
        m.admit("y", list(stale.token_ids), prompt=stale)
    # a caller that checked the bytes itself (check_packing=False) still has the ids compared
    with pytest.raises(ValueError, match="packed prompt is not of these token ids"):
        m.admit("y", P8 + [20], prompt=stale, check_packing=False)
    assert "y" not in m.request_ids
    # and the packing's length: V4 (its lookup kept for the admission) given a packing of
    # the first 32 of 41 ids, looked up (hit 32), then vouched for, admitted a request of
    # those 32 tokens (its hit point taken again at that length: 16), not of the 41 ids
    v4 = DSV4CacheManager(SPEC, 8, 3, DESC)
    base = list(range(1, 41))
    prefill(v4, "a", base)
    v4.release("a")
    short = LookupPrompt(base + [7], (), pack_prompt(base[:32]).packed, {})
    assert v4.lookup_packed(short) == 32
    with pytest.raises(ValueError, match="packed prompt is not of these token ids"):
        v4.admit("y", base + [7], prompt=short, check_packing=False)
    assert "y" not in v4.request_ids
    v4.check_integrity()
    m.check_integrity()
    # Lookups under ever new tenant salts keep at most MAX_MEMO_SALTS of them at hand;
    # a cached prefix still hits under its own salt afterwards
    prefill(m, "t", P8 + [7], tenant_salt="tenant-0")
    for k in range(MAX_MEMO_SALTS + 5):
        m.lookup_prefix(P8 + [9], tenant_salt=f"user-{k}")
    assert len(m._default_roots) <= MAX_MEMO_SALTS
    assert m.lookup_prefix(P8 + [9], tenant_salt="tenant-0") == 8
    m.check_integrity()
