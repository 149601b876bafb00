"""DSV4CacheManager bookkeeping (pure Python): exact block ids, waits, hits, releases."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.cache.dsv4 import DSV4CacheManager
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
from kvpool.spec.dsv4 import DSV4Spec

SPEC = DSV4Spec.from_config(SMALL_DSV4_CONFIG)  # span 16, n_win 16, 4 layers


def _ids(n: int, offset: int = 0) -> list[int]:
    return [(offset + 7 * i) % 251 for i in range(n)]


def _compute(m: DSV4CacheManager, rid: str, n: int):
    res = m.reserve(rid, n)
    assert res is not None
    m.commit(rid)
    m.check_integrity()
    return res


def test_blocks_only_for_complete_spans() -> None:
    m = DSV4CacheManager(SPEC, 11, 2)
    assert m.admit("a", _ids(40)) is not None
    res = _compute(m, "a", 15)
    assert res.num_new == 0 and m.block_ids("a") == []  # 15 tokens: no complete span
    res = _compute(m, "a", 1)
    assert res.block_ids == (0,) and m.block_ids("a") == [0]  # token 16 completes span 0
    res = _compute(m, "a", 24)  # 40 tokens: spans 1 (32) complete, 8 tail tokens in state
    assert res.block_ids == (0, 1) and res.num_new == 1
    assert m.num_computed_tokens("a") == 40 and m.num_free_blocks == 9


def test_admission_waits_for_a_state_block() -> None:
    m = DSV4CacheManager(SPEC, 11, 1)
    assert m.admit("a", _ids(5)) is not None
    assert m.admit("b", _ids(5)) is None  # waits: nothing changed
    assert "b" not in m and m.num_free_state_blocks == 0
    m.check_integrity()
    assert m.release("a") and m.admit("b", _ids(5)) is not None
    m.check_integrity()


def test_reserve_that_does_not_fit_leaves_no_trace() -> None:
    m = DSV4CacheManager(SPEC, 2, 1)
    m.admit("a", _ids(60))
    assert m.reserve("a", 48) is None  # 3 spans, 2 blocks
    assert m.num_free_blocks == 2 and m.num_computed_tokens("a") == 0
    m.check_integrity()
    assert _compute(m, "a", 32).block_ids == (0, 1)


def test_prefix_hit_leaves_one_token_and_respects_tenants() -> None:
    m = DSV4CacheManager(SPEC, 11, 3)
    m.admit("a", _ids(48))
    _compute(m, "a", 48)
    assert m.block_ids("a") == [0, 1, 2]
    same = m.admit("b", _ids(48))  # exactly 3 spans: the last must be computed again
    assert same is not None and same.num_cached_tokens == 32 and same.block_ids == (0, 1)
    assert same.restore == "recompute" and same.replay_start == 0  # 32 < n_win * L = 64
    assert [m.pool.refcount(b) for b in (0, 1, 2)] == [2, 2, 1]
    other = m.admit("c", _ids(48), tenant_salt="tenant-2")
    assert other is not None and other.num_cached_tokens == 0 and other.restore == "none"
    m.check_integrity()


def test_recompute_replays_only_the_last_window_tokens() -> None:
    m = DSV4CacheManager(SPEC, 20, 2)
    m.admit("a", _ids(150))
    _compute(m, "a", 150)
    adm = m.admit("b", _ids(140) + [1, 2, 3])
    assert adm is not None and adm.num_cached_tokens == 128
    assert adm.replay_start == 128 - 16 * 4


def test_checkpoint_restore_cuts_the_hit_to_a_checkpointed_boundary() -> None:
    m = DSV4CacheManager(SPEC, 11, 3, restore="checkpoint", num_checkpoints=1)
    m.admit("a", _ids(50))
    res = _compute(m, "a", 50)
    assert [p for p, _ in res.checkpoints] == [48]  # one slot: the latest boundary only
    adm = m.admit("b", _ids(50))
    assert adm is not None and adm.num_cached_tokens == 48 and adm.restore == "checkpoint"
    assert adm.checkpoint_slot == 3  # checkpoint slots follow the 3 state slots
    short = m.admit("c", _ids(40))  # blocks 0, 1 hit, but no checkpoint at 16 or 32: no hit
    assert short is not None and short.num_cached_tokens == 0 and short.restore == "none"
    m.check_integrity()


def test_release_is_tail_first_and_once() -> None:
    m = DSV4CacheManager(SPEC, 11, 1)
    m.admit("a", _ids(50))
    _compute(m, "a", 50)
    assert m.release("a") is True
    assert m.pool.free_queue()[-3:] == [2, 1, 0]  # the chain's tail is evicted first
    assert m.release("a") is False
    assert m.num_free_state_blocks == 1
    m.check_integrity()


def test_fork_shares_blocks_and_takes_a_state_block() -> None:
    m = DSV4CacheManager(SPEC, 11, 2)
    m.admit("a", _ids(20))
    _compute(m, "a", 20)
    slot = m.fork("a", "b")
    assert slot == 1 and m.block_ids("b") == [0] and m.pool.refcount(0) == 2
    assert m.fork("a", "c") is None  # no third state block
    m.check_integrity()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["admit", "step", "release"]), st.integers(0, 3), st.integers(1, 40)), max_size=40
    )
)
def test_lifecycle_keeps_invariants(ops: list[tuple[str, int, int]]) -> None:
    m = DSV4CacheManager(SPEC, 6, 2, restore="checkpoint", num_checkpoints=2)
    for op, who, n in ops:
        rid = f"r{who}"
        if op == "admit" and rid not in m:
            m.admit(rid, _ids(n + 30, offset=who % 2))
        elif op == "step" and rid in m:
            left = m.num_tokens(rid) - m.num_computed_tokens(rid)
            if left == 0:
                m.append_token_ids(rid, [n])
                left = 1
            res = m.reserve(rid, min(n, left))
            if res is not None:
                m.commit(rid)
        elif op == "release":
            m.release(rid)
        m.check_integrity()
    for who in range(4):
        m.release(f"r{who}")
    m.check_integrity()
    assert m.num_free_blocks == 6 and m.num_free_state_blocks == 2
