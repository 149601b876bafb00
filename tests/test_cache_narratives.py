"""Short narratives on tiny pools with exact block ids and free-queue order."""

from __future__ import annotations

import pytest

from kvpool import physical_slot
from kvpool.cache import BlockCopy, CacheDescriptor, FullAttentionManager
from kvpool.pool import BlockPool, to_csr

DESC = CacheDescriptor("tiny-model", weights_version="v1", layout_id="bs4-fp32")


def make(num_blocks: int = 10, block_size: int = 4, **kw) -> FullAttentionManager:
    return FullAttentionManager(num_blocks, block_size, DESC, **kw)


def prefill(m: FullAttentionManager, request_id: str, tokens: list[int], **kw) -> int:
    admission = m.admit(request_id, tokens, **kw)
    assert admission is not None
    m.check_integrity()
    m.commit(request_id, len(tokens) - admission.num_cached_tokens)
    m.check_integrity()
    return admission.num_cached_tokens


A = list(range(100, 110))  # 10 tokens: blocks [100..103] [104..107] [108, 109]


def test_two_requests_share_a_prefix_and_a_third_evicts_the_tail_first():
    m = make()
    assert prefill(m, "a", A) == 0
    assert m.block_ids("a") == [0, 1, 2]
    assert m.pool.free_queue() == [3, 4, 5, 6, 7, 8, 9]

    # b shares a's two full blocks; its own third block comes from the free queue.
    assert prefill(m, "b", A[:8] + [7, 7, 7]) == 8
    assert m.block_ids("b") == [0, 1, 3]
    assert [m.pool.refcount(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]

    # a leaves tail-first: its partial block 2 is unhashed and joins the plain queue.
    assert m.release("a")
    m.check_integrity()
    assert m.pool.free_queue() == [4, 5, 6, 7, 8, 9, 2]
    assert m.release("b")
    m.check_integrity()
    # b's blocks 1 and 0 stay cached (lazy eviction), tail before head in LRU order.
    assert m.pool.free_queue() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert m.lookup_prefix(A) == 8

    # c needs 7 blocks: the 7 unhashed ones go first, no cached block is touched.
    assert prefill(m, "c", list(range(28))) == 0
    assert m.block_ids("c") == [4, 5, 6, 7, 8, 9, 2]
    assert m.lookup_prefix(A) == 8
    # d needs 2 more: 3 (unhashed), then block 1 (the chain's tail) is evicted before 0.
    assert prefill(m, "d", list(range(50, 55))) == 0
    assert m.block_ids("d") == [3, 1]
    assert m.pool.free_queue() == [0]
    assert m.lookup_prefix(A) == 4  # only the head block survives
    m.check_integrity()


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_middle_of_the_queue():
    m = make()
    prefill(m, "a", A)
    m.release("a")
    assert m.pool.free_queue() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    assert prefill(m, "b", A[:4] + [1, 2]) == 4
    assert m.block_ids("b") == [0, 3]
    assert m.pool.free_queue() == [4, 5, 6, 7, 8, 9, 2, 1]
    m.check_integrity()


def test_a_prompt_always_leaves_its_last_token_to_compute():
    m = make()
    prefill(m, "a", A[:8] + [1])
    # An exact 8-token repeat could hit both blocks, but one token must stay to compute.
    assert m.lookup_prefix(A[:8]) == 4
    assert prefill(m, "b", A[:8]) == 4


def test_salt_isolation_identical_tokens_other_tenant_no_hit():
    m = make()
    prefill(m, "a", A, tenant_salt="tenant-1")
    assert m.lookup_prefix(A, tenant_salt="tenant-1") == 8
    assert m.lookup_prefix(A, tenant_salt="tenant-2") == 0
    assert m.lookup_prefix(A) == 0
    assert prefill(m, "b", A, tenant_salt="tenant-2") == 0
    assert set(m.block_ids("a")).isdisjoint(m.block_ids("b"))


def test_descriptor_mismatch_other_model_version_no_hit():
    m = make()
    prefill(m, "a", A)
    v2 = CacheDescriptor("tiny-model", weights_version="v2", layout_id="bs4-fp32")
    assert m.lookup_prefix(A, descriptor=v2) == 0
    for other in (
        CacheDescriptor("tiny-model", weights_version="v1", layout_id="bs4-bf16"),
        CacheDescriptor("tiny-model", weights_version="v1", layout_id="bs4-fp32", adapter_id="lora-7"),
        CacheDescriptor("tiny-model", weights_version="v1", layout_id="bs4-fp32", template_version="t2"),
    ):
        assert m.lookup_prefix(A, descriptor=other) == 0
    assert m.lookup_prefix(A, descriptor=DESC) == 8
    # The descriptor also flows from a manager built with another one.
    assert FullAttentionManager(10, 4, v2).lookup_prefix(A) == 0


def test_multimodal_item_identity_is_part_of_the_hash():
    m = make()
    prefill(m, "a", A, mm_items=[(4, 4, "image-1")])
    # Block 0 precedes the image and still hits; block 1 overlaps another image: miss.
    assert m.lookup_prefix(A, mm_items=[(4, 4, "image-2")]) == 4
    assert m.lookup_prefix(A, mm_items=[(4, 4, "image-1")]) == 8
    with pytest.raises(ValueError, match="outside the prompt"):
        m.admit("x", A, mm_items=[(8, 5, "image-3")])
    assert "x" not in m


def test_collision_guard_rejects_a_hash_hit_with_other_tokens():
    m = make()
    m.pool.hasher.digest = lambda data: b"\x00" * 16  # every block hashes alike: forced collisions
    prefill(m, "a", A)
    # Same (colliding) hash, other tokens: the stored token ids differ, so no reuse.
    assert m.lookup_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 0
    assert m.pool.num_collisions >= 1
    assert m.lookup_prefix(A) == 4  # the first block still matches its own tokens
    m.check_integrity()


def test_sha256_is_selectable_and_gives_the_same_hits():
    m = make(hash_algo="sha256")
    prefill(m, "a", A)
    assert len(m.pool.block_hash(0)) == 32
    assert prefill(m, "b", A) == 8
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        make(hash_algo="md5")


def test_seed_physical_slot_reference():
    table = [9, 2, 17]
    assert physical_slot(table, 4, 0) == 36
    assert physical_slot(table, 4, 5) == 9
    assert physical_slot(table, 4, 11) == 71
    with pytest.raises(ValueError):
        physical_slot(table, 0, 1)
    with pytest.raises(ValueError):
        physical_slot(table, 4, -1)
    with pytest.raises(IndexError):
        physical_slot(table, 4, 12)
    with pytest.raises(ValueError):
        physical_slot([3, -1], 4, 5)


def test_seed_fork_and_writable_tail():
    # Seed 003: parent [7] with 3 committed tokens; the child forks, then writes token 3:
    # the shared tail is copied into block 9; the parent keeps block 7.
    m = make(num_blocks=10)
    for i in range(7):
        prefill(m, f"filler-{i}", [i])  # blocks 0..6
    prefill(m, "parent", [1, 2, 3])
    assert m.block_ids("parent") == [7]
    prefill(m, "filler-8", [8])  # block 8: block 9 is the only free one
    m.fork("parent", "child")
    m.check_integrity()
    assert m.block_ids("child") == [7] and m.pool.refcount(7) == 2

    m.append_token_ids("child", [4])
    reservation = m.reserve("child", 1)
    assert reservation is not None
    assert reservation.groups["full"] == ((), (BlockCopy(src=7, dst=9),), ())  # no new block, one copy
    assert m.take_copies() == {"full": [BlockCopy(7, 9)]}
    assert m.take_copies() == {}
    m.check_integrity()
    assert m.slot_mapping("child", 3, 4) == [9 * 4 + 3]
    m.commit("child", 1)
    assert m.block_ids("parent") == [7] and m.block_ids("child") == [9]
    assert (m.pool.refcount(7), m.pool.refcount(9)) == (1, 1)
    # The parent, now exclusive again, writes in place with no copy.
    m.append_token_ids("parent", [5])
    assert m.reserve("parent", 1) == (3, 1, {"full": ((), (), ())})  # start 3, one token, no block, no copy
    m.commit("parent", 1)
    m.check_integrity()


def test_oom_reservation_returns_none_and_changes_nothing():
    m = make(num_blocks=4)
    prefill(m, "a", list(range(8)))  # blocks 0, 1
    m.append_token_ids("a", list(range(8, 20)))
    before = (m.block_ids("a"), m.num_computed_tokens("a"), m.pool.free_queue(), m.num_free_blocks)
    assert m.reserve("a", 12) is None  # needs 3 blocks, 2 are free
    assert (m.block_ids("a"), m.num_computed_tokens("a"), m.pool.free_queue(), m.num_free_blocks) == before
    assert m.admit("b", list(range(50, 70))) is None  # 5 blocks
    assert "b" not in m
    assert m.pool.free_queue() == before[2]
    m.check_integrity()
    assert m.reserve("a", 8) is not None  # exactly what is left
    assert m.num_free_blocks == 0


def test_oom_does_not_take_a_hit_block_that_is_needed():
    m = make(num_blocks=3)
    prefill(m, "a", A[:5])  # blocks 0 (full, cached), 1
    m.release("a")
    prefill(m, "x", [1])  # takes block 2 (unhashed first), free: [1, 0]
    # b hits block 0 (cached, free) and needs 2 more blocks: only block 1 is left.
    before = m.pool.free_queue()
    assert m.admit("b", A[:4] + list(range(5))) is None
    assert m.pool.free_queue() == before and m.pool.refcount(0) == 0
    m.check_integrity()


def test_cancel_twice_is_a_no_op_and_preempt_frees_everything():
    m = make()
    prefill(m, "a", A)
    prefill(m, "b", A)
    assert m.release("a", "cancel") is True
    assert m.release("a", "cancel") is False
    m.check_integrity()
    assert m.release("b", "preempt") is True
    assert m.release("b") is False
    assert m.num_free_blocks == 10
    m.check_integrity()


def test_rollback_releases_blocks_past_the_end_and_keeps_a_shared_tail_intact():
    m = make()
    prefill(m, "a", A)  # [0, 1, 2], blocks 0 and 1 registered
    prefill(m, "b", A[:8] + [1, 2, 3])  # shares 0, 1
    m.rollback("a", 6)  # speculative tokens 6..9 rejected
    m.check_integrity()
    assert m.block_ids("a") == [0, 1]
    assert m.token_ids("a") == A[:6]
    assert m.pool.free_queue()[-1] == 2
    # a writes position 6 into block 1, which b shares: copy-on-write, b is untouched.
    m.append_token_ids("a", [42])
    reservation = m.reserve("a", 1)
    assert reservation is not None and reservation.groups["full"].copies == (
        BlockCopy(1, 4),
    )  # 4: the first unhashed free block
    m.commit("a", 1)
    m.check_integrity()
    assert m.block_ids("b")[:2] == [0, 1]
    assert m.lookup_prefix(A) == 8  # b's chain (and a's old block 1) still hits


def test_rollback_into_an_exclusive_registered_block_unregisters_before_writing():
    m = make()
    prefill(m, "a", A)
    m.rollback("a", 6)
    assert m.pool.block_hash(1) is not None  # still valid content until overwritten
    m.append_token_ids("a", [42])
    assert m.reserve("a", 1) == (6, 1, {"full": ((), (), ())})
    assert m.pool.block_hash(1) is None  # no longer published: its content will change
    m.check_integrity()
    m.commit("a", 1)
    assert m.lookup_prefix(A) == 4


def test_full_blocks_are_registered_as_they_complete_so_a_running_request_is_hit():
    m = make()
    prompt = list(range(12))
    assert m.admit("a", prompt, 4) is not None  # chunked prefill: first chunk of 4
    m.commit("a", 4)
    assert m.lookup_prefix(prompt) == 4
    assert m.reserve("a", 4) is not None
    assert m.lookup_prefix(prompt) == 4  # reserved is not computed: nothing new published
    m.commit("a", 4)
    assert m.lookup_prefix(prompt) == 8
    m.check_integrity()


def test_the_step_path_matches_single_request_calls():
    m1, m2 = make(num_blocks=20), make(num_blocks=20)
    for m in (m1, m2):
        prefill(m, "a", A)
        prefill(m, "b", A[:4] + [9])
        m.append_token_ids("a", [1])
        m.append_token_ids("b", [2])
    for step in range(9):
        assert m1.reserve_step(["a", "b"], [1, 1])
        m1.commit_step(["a", "b"], [1, 1], [step, step + 100])
        for rid, tok in (("a", step), ("b", step + 100)):
            assert m2.reserve(rid, 1) is not None
            m2.commit(rid, 1)
            m2.append_token_ids(rid, [tok])
        m1.check_integrity()
        for rid in ("a", "b"):
            assert m1.block_ids(rid) == m2.block_ids(rid)
            assert m1.token_ids(rid) == m2.token_ids(rid)
            assert m1.num_computed_tokens(rid) == m2.num_computed_tokens(rid)
    assert m1.pool.free_queue() == m2.pool.free_queue()


def test_a_step_is_all_or_nothing_and_copies_shared_tails():
    m = make(num_blocks=4)
    prefill(m, "a", [1, 2, 3, 4, 5])  # blocks 0, 1
    m.fork("a", "b")  # b shares 0, 1 (1 is a partial tail)
    m.append_token_ids("a", [6])
    m.append_token_ids("b", [7])
    prefill(m, "c", [9, 9, 9, 9, 9])  # blocks 2, 3: nothing free
    before = (m.block_ids("a"), m.block_ids("b"), m.pool.free_queue())
    assert m.reserve_step(["a", "b"], [1, 1]) is False  # a must copy block 1 first: no block for it
    assert (m.block_ids("a"), m.block_ids("b"), m.pool.free_queue()) == before
    m.release("c")  # frees 3 then 2
    # One copy suffices: a copies block 1, after which b holds it alone and writes in place.
    assert m.reserve_step(["a", "b"], [1, 1]) is True
    assert m.take_copies() == {"full": [BlockCopy(1, 3)]}
    assert m.block_ids("a") == [0, 3] and m.block_ids("b") == [0, 1]
    assert m.pool.free_queue() == [2]
    m.check_integrity()


def test_csr_export():
    m = make(num_blocks=10)
    prefill(m, "a", A)  # [0, 1, 2], 10 tokens
    prefill(m, "b", [5, 6, 7])  # [3], 3 tokens
    csr = m.step_tables(["a", "b"], [10, 3], [10, 3]).csr
    assert csr.indptr == [0, 3, 4]
    assert csr.indices == [0, 1, 2, 3]
    assert csr.last_block_len == [2, 3]
    assert to_csr([[0, 1, 2], [3]], [8, 4], 4) == ([0, 2, 3], [0, 1, 3], [4, 4])


def test_first_off_step_finds_the_first_request_outside_its_reservation():
    # The runner's check of a step planned from the step buffers: request i's positions
    # [starts[i], ends[i]) start at its computed count, hold a token, end within its reservation.
    m = make(num_blocks=10)
    prefill(m, "a", A)  # 10 computed: blocks [0, 1, 2]
    prefill(m, "b", [5, 6, 7])  # 3 computed: block [3]
    m.append_token_ids("a", [1])
    m.append_token_ids("b", [1])
    assert m.reserve_step(["a", "b"], [1, 1])
    # not exact steps: a request may write its last block to its end
    assert (m.num_reserved_tokens("a"), m.num_reserved_tokens("b")) == (12, 4)
    assert m.first_off_step(["a", "b"], [10, 3], [11, 4]) is None
    assert m.first_off_step(["a", "b"], [10, 3], [12, 4]) is None  # up to the reserved end
    assert m.first_off_step(["a", "b"], [10, 3], [11, 5]) == 1  # b past its reservation
    assert m.first_off_step(["a", "b"], [10, 2], [11, 4]) == 1  # b rewrites a computed position
    assert m.first_off_step(["a", "b"], [10, 3], [10, 4]) == 0  # a's empty chunk
    assert m.first_off_step(["b", "a"], [4, 11], [5, 12]) == 0  # both off: the first
    with pytest.raises(KeyError, match="unknown request 'zzz'"):
        m.first_off_step(["a", "zzz"], [10, 0], [11, 1])
    assert (m.num_computed_tokens("a"), m.num_computed_tokens("b")) == (10, 3)
    m.check_integrity()


def test_bad_input_gets_clear_errors_and_changes_nothing():
    m = make()
    prefill(m, "a", A)
    with pytest.raises(ValueError, match="empty prompt"):
        m.admit("e", [])
    with pytest.raises(ValueError, match="already admitted"):
        m.admit("a", [1])
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        m.admit("n", [1, 2], -1)
    with pytest.raises(TypeError, match="descriptor must be a CacheDescriptor"):
        m.admit("d", [1, 2], descriptor="tiny-model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token id -1"):
        m.admit("neg", [1, -1])
    with pytest.raises(ValueError, match="append_token_ids first"):
        m.reserve("a", 1)
    with pytest.raises(ValueError, match="2 reserved, 0 token ids known"):
        m.commit("a", 1)  # block 2 is writable to its end, but token 10 is unknown
    with pytest.raises(ValueError, match="commit of 3 tokens from position 10: 2 reserved"):
        m.commit("a", 3)
    with pytest.raises(ValueError, match=r"positions \[10, 9\) do not continue"):
        m.step_tables(["a"], [10], [9])
    with pytest.raises(ValueError, match=r"positions \[10, 13\) do not continue"):
        m.step_tables(["a"], [10], [13])
    with pytest.raises(ValueError, match="rollback to 11"):
        m.rollback("a", 11)
    with pytest.raises(KeyError, match="unknown request"):
        m.reserve("zzz", 1)
    with pytest.raises(ValueError, match="unknown release reason"):
        m.release("a", "oops")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockPool(0)
    assert m.block_ids("a") == [0, 1, 2] and m.num_computed_tokens("a") == 10
    assert sorted(m.request_ids) == ["a"]
    m.check_integrity()


def test_check_integrity_names_the_broken_invariant():
    m = make()
    prefill(m, "a", A)
    m.pool._refcounts[0] += 1  # a leaked reference
    with pytest.raises(AssertionError, match="invariant 1"):
        m.check_integrity()
    m.pool._refcounts[0] -= 1
    m._requests["a"].num_computed = 13  # past the reserved blocks
    with pytest.raises(AssertionError, match="invariant 5"):
        m.check_integrity()
    m._requests["a"].num_computed = 11  # within the blocks, past the known tokens
    with pytest.raises(AssertionError, match="invariant 6"):
        m.check_integrity()


def test_a_decode_step_that_opens_a_block_in_every_row_takes_them_in_row_order():
    # Three requests of two full blocks each (bs 4) decode: every row's next token opens a
    # block. reserve_step takes them in one allocation (window.apply_reserve's batch) and
    # hands them out in row order, as one reserve per request takes them; rows whose steps
    # start inside a block (a mixed step) go through the row-by-row loop
    caches = [FullAttentionManager(13, 4, DESC), FullAttentionManager(13, 4, DESC)]
    for m in caches:
        for i, rid in enumerate(("r0", "r1", "r2")):
            assert m.admit(rid, [10 * i + t for t in range(8)]) is not None
            m.commit(rid, 8)
            m.append_token_ids(rid, [7])
    batch, single = caches
    assert batch.reserve_step(["r2", "r0", "r1"], [1, 1, 1])
    for rid in ("r2", "r0", "r1"):
        assert single.reserve(rid, 1) is not None
    for m in caches:
        assert [m.block_ids(r) for r in ("r0", "r1", "r2")] == [[0, 1, 7], [2, 3, 8], [4, 5, 6]]
        assert m.pool.free_queue() == [9, 10, 11, 12] and m.num_reserved_tokens("r0") == 12
        m.check_integrity()
        m.commit_step(["r2", "r0", "r1"], [1, 1, 1], [7, 7, 7])
        # r3 inside its second block and r1 inside its third each take 4 tokens: the loop
        assert m.admit("r3", [90, 91, 92, 93, 94]) is not None
        m.commit("r3", 5)
        m.append_token_ids("r3", [7, 7, 7, 7])
        m.append_token_ids("r1", [7, 7, 7])
        assert m.reserve_step(["r1", "r3"], [4, 4])
        assert m.block_ids("r1") == [2, 3, 8, 11] and m.block_ids("r3") == [9, 10, 12]
        m.check_integrity()
