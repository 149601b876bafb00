"""Paths of the coordinator and its groups that no narrative reaches: the stats an admission
given up takes back at its release (`give_up_admission`), the constructor's refusals, the
hit rule's points off the grid, and the queries on a step (`pending_reservation`, `tables`)
by ids of other sequence types. Each refusal leaves every group as it was."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpool.cache import CacheDescriptor, FullAttentionManager
from kvpool.cache.coordinator import HybridCacheManager, pack_prompt
from kvpool.cache.recurrent import RecurrentGroupSpec
from kvpool.cache.types import NO_RESERVATION, BlockCopy, Reservation, StateRestore
from kvpool.cache.window import AttentionGroupSpec

DESC = CacheDescriptor("tiny-coverage", weights_version="v1")


def _stats(m: HybridCacheManager) -> dict:
    return dataclasses.asdict(m.stats)


def _prefill(m: HybridCacheManager, rid: str, tokens: list[int]) -> int:
    adm = m.admit(rid, tokens)
    assert adm is not None
    m.commit(rid, adm.num_scheduled_tokens)
    m.check_integrity()
    return adm.num_cached_tokens


@pytest.mark.parametrize("exact", [False, True])
def test_an_admission_given_up_counts_nothing_and_its_next_admission_counts_once(exact: bool) -> None:
    # The engine's runner gives an admission up when what follows the cache's part raises
    # (a tier's load, a state restore), releases it ("cancel") and lets the caller admit it
    # again: the stats after the second admission are those of one admission
    if exact:
        m = HybridCacheManager([(AttentionGroupSpec("a", 4), 16), (RecurrentGroupSpec("r", 4), 6)], DESC)
    else:
        m = FullAttentionManager(16, 4, DESC)
    prompt = list(range(13))
    _prefill(m, "warm", prompt)
    m.release("warm")
    before = _stats(m)
    assert m.admit("x", prompt) is not None
    counted = _stats(m)
    assert counted["num_requests"] == before["num_requests"] + 1 and counted["num_hit_tokens"] == 12
    m.give_up_admission("x")
    assert m.release("x", "cancel")
    m.check_integrity()
    assert _stats(m) == before
    assert m.admit("x", prompt) is not None
    assert _stats(m) == counted
    m.check_integrity()


def test_a_readmission_given_up_stays_marked_preempted() -> None:
    # A preempted request admitted again and given up: its readmission and its readmitted
    # hits are taken back, and its next admission is a readmission again (not a new request)
    m = FullAttentionManager(16, 4, DESC)
    prompt = list(range(9))
    _prefill(m, "p", prompt)
    m.release("p", "preempt")
    base = _stats(m)
    assert m.admit("p", prompt) is not None
    readmitted = _stats(m)
    assert readmitted["num_readmissions"] == base["num_readmissions"] + 1
    assert readmitted["num_readmitted_hit_tokens"] == 8 and readmitted["num_requests"] == base["num_requests"]
    m.give_up_admission("p")
    assert m.release("p", "cancel")
    assert _stats(m) == base
    assert m.admit("p", prompt) is not None
    assert _stats(m) == readmitted
    m.check_integrity()


def test_a_recompute_admission_given_up_still_counts_nothing() -> None:
    # A request released to be recomputed (`will_recompute`) counts nothing when admitted
    # again; given up then, its next admission counts nothing either
    m = FullAttentionManager(16, 4, DESC)
    prompt = list(range(9))
    _prefill(m, "q", prompt)
    m.will_recompute("q")
    assert m.release("q", "cancel")
    counted = _stats(m)
    assert counted["num_requests"] == 1
    for _ in range(2):
        assert m.admit("q", prompt) is not None
        assert _stats(m) == counted
        m.give_up_admission("q")
        assert m.release("q", "cancel")
        assert _stats(m) == counted
    assert m.admit("q", prompt) is not None
    assert _stats(m) == counted
    m.check_integrity()


class _StubGroup:
    """A group's hit questions answered from sets: the points it serves, its off-grid points
    (given in any order, repeats included: a group that breaks the protocol's order) and its
    bound."""

    def __init__(self, served: set[int], extras: list[int], bound: int) -> None:
        self.served, self.extras, self.bound = served, extras, bound

    def upper_bound(self, found: object) -> int:
        return self.bound

    def extra_points(self, found: object) -> list[int]:
        return list(self.extras)

    def serves(self, found: object, point: int) -> bool:
        return point in self.served


def _reference_point(groups: list[_StubGroup], unit: int, num_tokens: int) -> int:
    """The hit rule by brute force: the largest point in (0, top] on the grid or some group's
    off-grid point, that every group serves; 0 when none."""
    top = min([num_tokens - 1] + [g.bound for g in groups])
    points = {p for p in range(1, top + 1) if p % unit == 0}
    points |= {p for g in groups for p in g.extras if 0 < p <= top}
    return max((p for p in points if all(p in g.served for g in groups)), default=0)


_points = st.lists(st.integers(1, 40), max_size=8)


@settings(max_examples=300, deadline=None)
@given(
    unit=st.sampled_from([1, 3, 4, 8]),
    num_tokens=st.integers(1, 40),
    groups=st.lists(st.tuples(st.sets(st.integers(1, 40)), _points, st.integers(0, 44)), min_size=1, max_size=3),
)
@example(unit=4, num_tokens=30, groups=[({6, 4}, [6, 10, 13], 40)])  # off-grid points not served, above and below 8
@example(unit=4, num_tokens=30, groups=[({2}, [10, 2], 40)])  # out of order; served below the grid's last point
@example(unit=4, num_tokens=30, groups=[({6}, [6, 10], 40), ({6, 8}, [], 40)])
def test_hit_point_walks_are_the_largest_point_every_group_serves(unit: int, num_tokens: int, groups: list) -> None:
    # `hit_point`'s one-group walk and `_hit_point_of_groups`, on groups whose answers are
    # given (the walks read nothing else of a group), against the rule by brute force
    m = FullAttentionManager(4, 4, DESC)
    stubs = [_StubGroup(served, extras, bound) for served, extras, bound in groups]
    m.hit_granularity = unit
    if len(stubs) == 1:
        m._one_group = ("s0", stubs[0])
    else:
        m._one_group = None
        m.groups = {f"s{i}": s for i, s in enumerate(stubs)}
    hits = {f"s{i}": None for i in range(len(stubs))}
    assert m.hit_point(hits, num_tokens) == _reference_point(stubs, unit, num_tokens)


def test_the_constructor_refuses_what_no_cache_can_be() -> None:
    attn = AttentionGroupSpec("a", 4)
    with pytest.raises(ValueError, match="at least one group"):
        HybridCacheManager([], DESC)
    with pytest.raises(TypeError, match="descriptor must be a CacheDescriptor, got str"):
        HybridCacheManager([(attn, 8)], "tiny")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two groups are named 'a'"):
        HybridCacheManager([(attn, 8), (AttentionGroupSpec("a", 4), 8)], DESC)
    with pytest.raises(ValueError, match=r"exact_steps=False needs groups without whole steps, got \['a', 'r'\]"):
        HybridCacheManager([(attn, 8), (RecurrentGroupSpec("r", 4), 4)], DESC, exact_steps=False)


def test_pack_prompt_converts_numpy_ids_to_python_ints() -> None:
    np = pytest.importorskip("numpy")
    packed = pack_prompt(np.array([3, 1, 4], dtype=np.int64))
    assert packed.token_ids == (3, 1, 4) and {type(t) for t in packed.token_ids} == {int}
    assert pack_prompt([3, 1, 4]).token_ids == (3, 1, 4)
    m = FullAttentionManager(8, 4, DESC)
    _prefill(m, "a", [3, 1, 4, 1, 5, 9])
    assert m.lookup_packed(pack_prompt(np.array([3, 1, 4, 1, 5, 9, 2], dtype=np.int32))) == 4


def _frozen(m: HybridCacheManager) -> tuple:
    """What a refusal must leave as it was: every pool's free counts, each request's counts."""
    m.check_integrity()
    pools = tuple((p.num_free, p.num_free_cached) for p in m.pools)
    reqs = tuple((r, m.num_computed_tokens(r), m.num_reserved_tokens(r), m.token_ids(r)) for r in m.request_ids)
    return pools, reqs, _stats(m)


def test_step_questions_and_their_refusals_on_a_cache_of_blocks() -> None:
    m = FullAttentionManager(16, 4, DESC)
    _prefill(m, "a", list(range(6)))
    _prefill(m, "b", list(range(10, 19)))
    # block-granular reservations: the rest of a request's last block is reserved, no block new
    assert m.pending_reservation("a") == Reservation(6, 2, {"full": NO_RESERVATION})
    assert m.pending_reservation("b") == Reservation(9, 3, {"full": NO_RESERVATION})
    m.append_token_ids("a", [7])
    assert m.reserve_step(["a", "b"], [1, 0])
    assert m.pending_reservation("a") == Reservation(6, 2, {"full": NO_RESERVATION})
    # the step's tables by other sequences of ids: a part of the step (not kept as the memo),
    # a tuple, a generator-free sequence type
    full = m.tables(["a", "b"])
    assert m.tables(["b"]) == [full[1]] and m.tables(("b", "a")) == [full[1], full[0]]
    assert m.tables(range(0)) == []  # type: ignore[arg-type]
    before = _frozen(m)
    with pytest.raises(KeyError, match="unknown request 'zz'"):
        m.tables(["a", "zz"])
    with pytest.raises(KeyError, match="no block-table group 'nope'"):
        m.block_ids("a", "nope")
    with pytest.raises(ValueError, match=r"positions \[0, 9\) outside the reserved \[0, 8\)"):
        m.slot_mapping("a", 0, 9)
    with pytest.raises(ValueError, match="2 requests but 1 token counts"):
        m.reserve_step(["a", "b"], [1])
    with pytest.raises(ValueError, match="2 requests, 1 starts, 2 ends"):
        m.step_reservations(["a", "b"], [6], [7, 9])
    with pytest.raises(ValueError, match="a commit of -1 tokens"):
        m.commit_step(["a", "b"], [-1, 0], [None, None])
    with pytest.raises(ValueError):
        m.commit_step(["a", "b"], [1], [None, None])
    assert m.reserve_step([], [])  # nothing to reserve: done
    assert _frozen(m) == before
    m.commit_step(["a", "b"], [1, 0], [None, None])
    m.check_integrity()


def _hybrid(**kwargs: object) -> HybridCacheManager:
    return HybridCacheManager([(AttentionGroupSpec("a", 4), 16), (RecurrentGroupSpec("r", 4), 6)], DESC, **kwargs)


def test_a_hybrid_cache_answers_for_its_recurrent_group_too() -> None:
    # may_reach over both groups (the recurrent group knows no probe: it never rules a
    # replica out, the attention group does), a part's questions that only one kind of
    # group has an answer to, and the bytes of both groups' bookkeeping
    m = _hybrid()
    prompt = list(range(13))
    _prefill(m, "a", prompt)
    follow = pack_prompt(prompt + [99])
    assert m.lookup_packed(follow) == 12
    assert m.may_reach(follow, 12) and m.may_reach(follow, 0)
    other = pack_prompt([5] * 14)
    assert m.may_reach(other, 4)  # nothing hashed yet: it may
    assert m.lookup_packed(other) == 0
    assert not m.may_reach(other, 4)  # its first block's hash is known now, and not cached
    with pytest.raises(TypeError, match="prompt must be pack_prompt's LookupPrompt, got list"):
        m.may_reach(prompt, 4)  # type: ignore[arg-type]
    attn, rec = m.part("a", "a"), m.part("a", "r")
    assert (
        attn.state_slot is None and attn.checkpoints == [] and attn.prefix_chain(reserved=True) == attn.prefix_chain()
    )
    assert len(attn.prefix_chain()) == 3 and len(rec.prefix_chain()) == 3  # units of 4 below 13, in both
    assert rec.state_slot is not None
    bare = _hybrid()
    assert m.metadata_bytes() > bare.metadata_bytes()


def test_a_cache_without_prefix_caching_finds_nothing_in_any_group() -> None:
    m = _hybrid(enable_prefix_caching=False)
    prompt = list(range(13))
    _prefill(m, "a", prompt)
    m.release("a")
    assert m.group_hit_points(prompt + [1]) == {"a": [0], "r": [0]}
    assert m.lookup_prefix(prompt + [1]) == 0
    m.check_integrity()


def test_specs_refuse_what_no_group_can_be() -> None:
    with pytest.raises(ValueError, match="group 'a': block_size must be positive, got 0"):
        AttentionGroupSpec("a", 0)
    with pytest.raises(ValueError, match="group 'w': a lower tier serves full attention only"):
        HybridCacheManager([(AttentionGroupSpec("w", 4, window=8), 8)], DESC, lower_tier=object())  # type: ignore[arg-type]


def test_a_checked_prompt_is_made_by_pack_prompt_only() -> None:
    import copy
    import pickle

    from kvpool.cache.types import CheckedPrompt, LookupPrompt

    checked = pack_prompt([1, 2, 3])
    with pytest.raises(TypeError, match="made only by pack_prompt"):
        CheckedPrompt(*checked)
    for other in (CheckedPrompt._make(checked), copy.copy(checked), pickle.loads(pickle.dumps(checked))):
        assert type(other) is LookupPrompt and tuple(other) == tuple(checked)


def _corrupt_states(m: HybridCacheManager) -> None:
    del m._requests["a"].states["r"]  # (a KeyError from the checker's first reading of it, before the fix)


def _corrupt_states_extra(m: HybridCacheManager) -> None:
    m._requests["a"].states["zz"] = None


def _corrupt_first(m: HybridCacheManager) -> None:
    m._requests["a"].states["a"].first = 1


def _corrupt_table(m: HybridCacheManager) -> None:
    m._requests["a"].states["a"].block_ids.append(15)


def _corrupt_snapshot(m: HybridCacheManager) -> None:
    m.append_token_ids("a", [1, 2, 3])
    assert m.reserve("a", 3) is not None  # (13, 16]: a snapshot after 16 pending
    state = m._requests["a"].states["r"]
    assert [p for p, _ in state.pending] == [16]
    state.pending[0] = (12, state.pending[0][1])


def _corrupt_copies(m: HybridCacheManager) -> None:
    m.groups["a"]._pending_copies = [BlockCopy(0, 15)]


def _corrupt_turn_ends(m: HybridCacheManager) -> None:
    m.groups["a"]._turn_ends._num_listed += 1


def _corrupt_chain(m: HybridCacheManager) -> None:
    chain = m._requests["a"].states["a"].chain
    chain[0], chain[1] = chain[1], chain[0]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_corrupt_states, r"request 'a' has state in groups \['a'\]"),
        (_corrupt_states_extra, r"request 'a' has state in groups \['a', 'r', 'zz'\]"),
        (_corrupt_first, r"window rule: group 'a', request 'a' keeps blocks from 1"),
        (_corrupt_table, r"invariant 5 .*holds blocks \[0, 5\) for 13 reserved tokens"),
        (_corrupt_snapshot, r"a snapshot at 12 outside the step \(13, 16\]"),
        (_corrupt_copies, r"group 'a': a queued copy nobody reads: \[BlockCopy\(src=0, dst=15\)\]"),
        (_corrupt_turn_ends, r"turn ends: 1 counted, lists \[\]"),
        (_corrupt_chain, r"invariant 6: .* chain element 0 is not its own prefix"),
    ],
)
def test_check_integrity_finds_each_kind_of_corruption(corrupt, message: str) -> None:
    # The checker is what the other tests lean on: each invariant it states is false here
    m = _hybrid()
    _prefill(m, "a", list(range(13)))
    _prefill(m, "b", list(range(50, 57)))
    corrupt(m)
    with pytest.raises(AssertionError, match=message):
        m.check_integrity()


@pytest.mark.parametrize("caching", [False, True])
def test_check_integrity_finds_a_block_of_a_shared_pool_in_two_groups(caching: bool) -> None:
    # Two attention groups on one pool, a request forked (its blocks held twice each), the
    # child's first blocks of the two groups swapped: every block's holders still count
    # right, but one block is in both groups' tables. Caching on, the chains' registration
    # finds it first; off, the owners' check
    m = HybridCacheManager(
        [(AttentionGroupSpec("a", 4), None), (AttentionGroupSpec("w", 4, window=32), None)],
        DESC,
        shared_blocks=32,
        enable_prefix_caching=caching,
    )
    _prefill(m, "x", list(range(13)))
    assert m.fork("x", "y")
    m.check_integrity()
    ta, tw = m._requests["y"].states["a"].block_ids, m._requests["y"].states["w"].block_ids
    ta[0], tw[0] = tw[0], ta[0]
    message = "registered as other content" if caching else r"shared pool: block \d+ is held by groups 'a' and 'w'"
    with pytest.raises(AssertionError, match=message):
        m.check_integrity()


def test_a_group_whose_decode_period_is_not_its_commit_period_is_refused() -> None:
    # The decode-step memo's rows on the decode period are taken as its commit's changed
    # rows: every group with a decode period (the dual pool's span) commits on it
    from kvpool.cache.dual_pool import DualPoolGroupSpec

    class OddSpec:
        name = "v4"

        def build(self, size: object, **kwargs: object) -> object:
            group = DualPoolGroupSpec("v4", 4).build(size, **kwargs)
            group.decode_reserve_period = 8
            return group

    with pytest.raises(AssertionError, match="a decode period that is not the commit period"):
        HybridCacheManager([(OddSpec(), (8, 2))], DESC)
    assert HybridCacheManager([(DualPoolGroupSpec("v4", 4), (8, 2))], DESC)._decode_period == 4


def test_v4_step_refusals_leave_the_cache_as_it_was() -> None:
    from kvpool.cache import DSV4CacheManager
    from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
    from kvpool.spec.dsv4 import DSV4Spec

    m = DSV4CacheManager(DSV4Spec.from_config(SMALL_DSV4_CONFIG), 12, 4, CacheDescriptor("small-dsv4"))
    for rid, n in (("r0", 10), ("r1", 6)):
        assert m.admit(rid, list(range(n))) is not None
        m.commit_step([rid], [n], [1])
    assert m.pending_reservation("r0") is None  # exact steps: nothing reserved after the commit
    assert m.reserve_step(["r0", "r1"], [1, 1])
    assert m.pending_reservation("r1").start == 6
    before = _frozen(m)
    with pytest.raises(KeyError, match="unknown request 'zz'"):
        m.step_reservations(["r0", "zz"], [10, 0], [11, 1])
    with pytest.raises(ValueError, match="request 'r0' has an uncommitted step; fork after commit"):
        m.fork("r0", "c")
    assert _frozen(m) == before
    m.commit_step(["r0", "r1"], [1, 1], [2, 2])
    assert m.fork("r0", "c")
    m.check_integrity()


def _v4_checkpointed() -> HybridCacheManager:
    """A V4 cache with a checkpoint slot: "a" computed 50 tokens (a checkpoint at 48), "b" 20."""
    from kvpool.cache import DSV4CacheManager
    from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
    from kvpool.spec.dsv4 import DSV4Spec

    spec = DSV4Spec.from_config(SMALL_DSV4_CONFIG)
    m = DSV4CacheManager(spec, 11, 3, CacheDescriptor("small-dsv4"), restore="checkpoint", num_checkpoints=1)
    for rid, n in (("a", 50), ("b", 20)):
        adm = m.admit(rid, [(7 * i + len(rid)) % 251 for i in range(n)])
        assert adm is not None
        m.commit_step([rid], [adm.num_scheduled_tokens], [1])
    m.check_integrity()
    assert len(m.groups["v4"]._checkpoints) == 1
    return m


def _v4_table(m: HybridCacheManager) -> None:
    m._requests["a"].states["v4"].block_ids.append(10)


def _v4_slot_doubled(m: HybridCacheManager) -> None:
    m._requests["b"].states["v4"].state_slot = m._requests["a"].states["v4"].state_slot


def _v4_slot_refcount(m: HybridCacheManager) -> None:
    g = m.groups["v4"]
    g.state_pool._refcounts[m._requests["a"].states["v4"].state_slot] = 2


def _v4_checkpoint_key(m: HybridCacheManager) -> None:
    g = m.groups["v4"]
    g._checkpoints[b"other"] = next(iter(g._checkpoints.values()))


def _v4_checkpoint_slot(m: HybridCacheManager) -> None:
    g = m.groups["v4"]
    key, ckpt = next(iter(g._checkpoints.items()))
    g._checkpoints[key] = dataclasses.replace(ckpt, slot=ckpt.slot + 1)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_v4_table, r"group 'v4', request 'a' holds 4 classical blocks for 50 reserved tokens \(span 16\)"),
        (_v4_slot_doubled, r"state blocks leaked or doubled: held \[0, 0\], free \[2\]"),
        (_v4_slot_refcount, r"request 'a''s state block 0 has refcount 2"),
        (_v4_checkpoint_key, r"checkpoint of 6f74686572 is not 1 parts"),
        (_v4_checkpoint_slot, r"checkpoint in slot \d+ is filed under another block"),
    ],
)
def test_dual_pool_check_integrity_finds_each_kind_of_corruption(corrupt, message: str) -> None:
    m = _v4_checkpointed()
    corrupt(m)
    with pytest.raises(AssertionError, match=message):
        m.check_integrity()


def test_a_v4_cache_without_prefix_caching_finds_and_files_nothing() -> None:
    from kvpool.cache import DSV4CacheManager
    from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
    from kvpool.spec.dsv4 import DSV4Spec

    spec = DSV4Spec.from_config(SMALL_DSV4_CONFIG)  # span 16
    m = DSV4CacheManager(spec, 12, 3, CacheDescriptor("small-dsv4"), enable_prefix_caching=False)
    prompt = list(range(40))
    adm = m.admit("a", prompt)
    assert adm is not None and adm.num_cached_tokens == 0
    m.commit_step(["a"], [40], [7])
    for t in range(10):  # decodes across the span boundary at 48
        assert m.reserve_step(["a"], [1])
        m.commit_step(["a"], [1], [t])
        m.check_integrity()
    assert len(m.block_ids("a")) == 3 and m.part("a").prefix_chain() == []
    m.release("a")
    assert m.group_hit_points(prompt + [1]) == {"v4": [0]}
    assert m.lookup_prefix(prompt + [1]) == 0 and not m.may_reach(pack_prompt(prompt + [1]), 16)
    assert m.groups["v4"].prefetch_candidates(m.root(), prompt) == ([], [])
    again = m.admit("b", prompt)
    assert again is not None and again.num_cached_tokens == 0
    m.check_integrity()


def _held(m: HybridCacheManager) -> tuple:
    """`_frozen` with every group's table of every request and the dual pools' checkpoints."""
    tables = tuple((r, g.name, tuple(m.block_ids(r, g.name))) for r in m.request_ids for g in m._table_groups)
    ckpts = tuple(dict(g._checkpoints) for g in m.groups.values() if hasattr(g, "_checkpoints"))  # (in any order)
    return _frozen(m), tables, ckpts


def test_an_undone_step_relists_the_spilled_turn_end_its_allocation_evicted() -> None:
    # A kept turn end at 40 is spilled to classical block 8 (a free cached block, first in the
    # LRU queue once "h" holds spans 0 and 1); "z"'s step takes block 8, and a probe meanwhile
    # unlists the spill as dead (its spans are still cached: the walk reaches it). Undone, the
    # step gives block 8 its content back: the spill is listed and hit again. Without the
    # relisting check_integrity names it ("not findable as filed") and the probe finds 32.
    from kvpool.cache import DSV4CacheManager
    from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
    from kvpool.spec.dsv4 import DSV4Spec

    spec = DSV4Spec.from_config(SMALL_DSV4_CONFIG)  # span 16
    m = DSV4CacheManager(
        spec, 12, 2, CacheDescriptor("small-dsv4"), restore="auto", checkpoint_blocks=1, turn_end_checkpoints=True
    )
    g = m.groups["v4"]

    def ids(n: int, offset: int = 0) -> list[int]:
        return [(offset + 7 * i) % 251 for i in range(n)]

    m.admit("a", ids(40))
    m.commit_step(["a"], [40], [1])
    m.release("a")  # its turn end at 40 kept in state block 0
    for rid, offset in (("x", 5), ("y", 6)):  # "y" takes the kept state block: spilled to block 8
        assert m.admit(rid, ids(32, offset)) is not None
    assert m.take_spills() == [(0, 8)] and g.num_spills == 1
    for rid in ("x", "y"):
        m.commit(rid, 32)
        m.release(rid)  # (both end on a span boundary: nothing kept)
    follow_up = ids(40) + [1, 2, 3]
    assert m.group_hit_points(follow_up) == {"v4": [0, 16, 32, 40]}
    h = m.admit("h", ids(32) + [9])  # holds spans 0 and 1 (blocks 0, 1)
    assert h is not None and h.num_cached_tokens == 32 and h.groups["v4"].block_ids == (0, 1)
    assert m.admit("z", ids(80, 9), 0) is not None
    before = _held(m)
    res = m.reserve("z", 16)
    assert res is not None and res.groups["v4"].new_block_ids == (8,)  # the spill's block, evicted
    assert m.group_hit_points(follow_up) == {"v4": [0, 16, 32]}  # the probe unlists the dead spill
    assert g._spills.num_listed() == 0
    m.check_integrity()
    m.unreserve("z")
    assert _held(m) == before and m.pool.refcount(8) == 0
    assert g._spills.num_listed() == 1 and m.group_hit_points(follow_up) == {"v4": [0, 16, 32, 40]}
    m.check_integrity()
    m.release("h")
    b = m.admit("b", follow_up)
    assert b is not None and b.num_cached_tokens == 40
    assert b.groups["v4"].restore == StateRestore(b.groups["v4"].restore.state_slot, "checkpoint", 8, whole=True)
    assert g.num_spill_hits == 1
    m.check_integrity()


class _DearCheckpoints:
    """A restore cost whose checkpoint copy costs more than any replay here."""

    version = 0

    def checkpoint_cost(self) -> float:
        return 100.0

    def compute_cost(self, num_tokens: int, context_len: int) -> float:
        return float(num_tokens)


@pytest.mark.parametrize(
    "kw, slots, method",
    [
        ({"restore": "auto"}, 10, "checkpoint"),  # the checkpoint at 16, priced no dearer than a replay
        ({"restore": "auto", "restore_cost": _DearCheckpoints()}, 10, "recompute"),  # priced dearer
        ({"restore": "auto"}, 4, "recompute"),  # "b"'s checkpoints took the slots of 8 and 16
        ({"restore": "checkpoint"}, 10, "checkpoint"),
        ({"restore": "recompute"}, 0, "recompute"),
    ],
)
def test_a_dual_pool_admitted_below_its_own_cut_restores_there(kw: dict, slots: int, method: str) -> None:
    # A full-attention group (blocks of 4) beside V4's dual pool (spans of 8, replay 2): "b"'s
    # prefill evicts "a"'s full blocks past 16 but none of its spans, so "c" (a's prompt and
    # one more token) is admitted at 16, below the 32 the dual pool's own hit reaches (looked
    # up first, unbounded: listed first, both groups read the whole prefix). Its
    # restore there: a checkpoint held at 16 (auto: when priced no dearer than the replay),
    # else the replay of the 2 tokens before 16.
    from kvpool.cache.dual_pool import DualPoolGroupSpec

    v4 = DualPoolGroupSpec("v4", 8, replay_len=2, num_checkpoints=slots, **kw)
    m = HybridCacheManager([(v4, (12, 4)), (AttentionGroupSpec("full", 4), 16)], DESC)  # (v4 looked up first)
    g = m.groups["v4"]
    a = list(range(100, 133))
    adm = m.admit("a", a)
    assert adm is not None
    m.commit_step(["a"], [33], [1])
    m.release("a")
    checkpointed = dict(adm.groups["v4"].checkpoints)  # position -> slot
    assert sorted(checkpointed) == ([] if not slots else [8, 16, 24, 32])
    assert m.admit("b", list(range(200, 248))) is not None
    m.commit_step(["b"], [48], [1])
    m.release("b")
    hits = m.group_hit_points(a + [5])
    assert hits["full"] == [0, 4, 8, 12, 16] and hits["v4"][-1] == 32
    span_1 = adm.groups["v4"].block_ids[1]  # (a checkpoint at 16 is filed under the block of span 1)
    held_16 = any(ck.block.block_ids == (span_1,) for ck in g._checkpoints.values())
    assert held_16 == (slots == 10)
    for i in range(4):  # every state block taken (nothing reserved: no other block): "c" waits
        assert m.admit(f"hold{i}", [400 + i], 0) is not None
    before = _held(m)
    assert m.admit("c", a + [5]) is None
    assert _held(m) == before
    for i in range(4):
        m.release(f"hold{i}")
    c = m.admit("c", a + [5])
    assert c is not None and c.num_cached_tokens == 16 and c.num_scheduled_tokens == 18
    restore = c.groups["v4"].restore
    assert c.groups["v4"].block_ids[:2] == adm.groups["v4"].block_ids[:2] and restore.method == method  # a's spans
    if method == "checkpoint":
        assert restore == StateRestore(restore.state_slot, "checkpoint", checkpointed[16])
    else:
        assert restore == StateRestore(restore.state_slot, "recompute", replay_start=14)
    m.check_integrity()
    m.commit_step(["c"], [18], [2])
    m.check_integrity()
    assert m.group_hit_points(a + [5, 6])["full"][-1] == 32


def test_a_dual_pool_admitted_below_its_cut_at_a_swap_boundary_without_a_checkpoint_replays() -> None:
    # Restoring by checkpoint only, "b"'s checkpoints evict those of "a" at 8, 16 and 24 (7
    # slots): the dual pool's hit of a's prompt is cut at 32 (a's checkpoint there), and a
    # swapped-out state waiting at 16 (a boundary with no checkpoint) makes 16 a point it
    # serves. The full group's hit ends at 16, so "c" is admitted there, below the cut: with
    # no checkpoint to copy, its state must be replayed (as the cut restores at a swap
    # boundary without one). Before the fix its restore was none: 16 tokens counted as
    # computed in a state block nobody wrote.
    from kvpool.cache.dual_pool import DualPoolGroupSpec

    v4 = DualPoolGroupSpec("v4", 8, replay_len=2, restore="checkpoint", num_checkpoints=7)
    m = HybridCacheManager([(v4, (12, 4)), (AttentionGroupSpec("full", 4), 16)], DESC)
    g = m.groups["v4"]
    a = list(range(100, 133))
    adm = m.admit("a", a)
    assert adm is not None
    m.commit_step(["a"], [33], [1])
    m.release("a")
    assert m.admit("b", list(range(200, 248))) is not None
    m.commit_step(["b"], [48], [1])
    m.release("b")
    assert m.group_hit_points(a + [5]) == {"v4": [0, 32], "full": [0, 4, 8, 12, 16]}
    span_1 = g.pool.prefix_block(adm.groups["v4"].block_ids[1])  # the boundary at 16
    assert span_1 is not None and all(ck.block is not span_1 for ck in g._checkpoints.values())
    g.hold_swapped(g.pool.chain(span_1, bytes(4), b""), True)  # a state swapped out at 16 + 1
    assert m.group_hit_points(a + [5]) == {"v4": [0, 16, 32], "full": [0, 4, 8, 12, 16]}
    c = m.admit("c", a + [5])
    assert c is not None and c.num_cached_tokens == 16
    assert c.groups["v4"].restore == StateRestore(c.groups["v4"].restore.state_slot, "recompute", replay_start=14)
    m.check_integrity()


def _v4_turn_end(spill: bool) -> HybridCacheManager:
    """A V4 cache whose "a" finished at 40 (a turn end kept in state block 0, checkpoints
    pooled a block each); spill: "x" and "y" admitted after it, "y" taking the kept state
    block, so its turn end is spilled to classical block 8."""
    from kvpool.cache import DSV4CacheManager
    from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
    from kvpool.spec.dsv4 import DSV4Spec

    spec = DSV4Spec.from_config(SMALL_DSV4_CONFIG)
    desc = CacheDescriptor("small-dsv4")
    m = DSV4CacheManager(spec, 12, 2, desc, restore="auto", checkpoint_blocks=1, turn_end_checkpoints=True)
    m.admit("a", [7 * i % 251 for i in range(40)])
    m.commit_step(["a"], [40], [1])
    m.release("a")
    if spill:
        for rid, offset in (("x", 5), ("y", 6)):
            assert m.admit(rid, [(offset + 7 * i) % 251 for i in range(32)]) is not None
        assert m.take_spills() == [(0, 8)]
    m.check_integrity()
    return m


def _unlist(turn_ends, block) -> None:
    """Unlist a live entry (a corruption: `TurnEnds` unlists dead ones only)."""
    del turn_ends._by_parent[block.parent.block_hash]
    turn_ends._num_listed -= 1


def _spilled_parts(m: HybridCacheManager) -> None:
    g = m.groups["v4"]
    key, ckpt = next(iter(g._spilled.items()))
    g._spilled[key] = dataclasses.replace(ckpt, parts=())


def _spilled_key(m: HybridCacheManager) -> None:
    g = m.groups["v4"]
    g._spilled[b"other"] = next(iter(g._spilled.values()))


def _spilled_slot(m: HybridCacheManager) -> None:
    g = m.groups["v4"]
    key, ckpt = next(iter(g._spilled.items()))
    g._spilled[key] = dataclasses.replace(ckpt, slot=ckpt.slot + 1)


def _spilled_unlisted(m: HybridCacheManager) -> None:
    g = m.groups["v4"]
    _unlist(g._spills, next(iter(g._spilled.values())).block)


def _kept_unlisted(m: HybridCacheManager) -> None:
    g = m.groups["v4"]
    kept = g.state_pool.prefix_block(0)
    assert kept is not None
    _unlist(g._turn_ends, kept)


def _checkpoint_part(m: HybridCacheManager) -> None:
    g = m.groups["v4"]
    key, ckpt = next(iter(g._checkpoints.items()))
    g._checkpoints[key] = dataclasses.replace(ckpt, parts=(ckpt.block,))  # (a part whose parent is not the block)


@pytest.mark.parametrize(
    "spill, corrupt, message",
    [
        (True, _spilled_parts, r"spilled turn end [0-9a-f]{12} is not 1 parts"),
        (True, _spilled_key, r"spilled turn end 6f74686572 is not 1 parts"),
        (True, _spilled_slot, r"spilled turn end [0-9a-f]{12} is not findable as filed"),
        (True, _spilled_unlisted, r"spilled turn end [0-9a-f]{12} is not findable as filed"),
        (False, _kept_unlisted, r"group 'v4': kept state block 0 is not findable once \(copies \(0,\)\)"),
        (False, _checkpoint_part, r"checkpoint of [0-9a-f]{12} lost a part: it is not findable"),
    ],
)
def test_dual_pool_check_integrity_finds_each_kind_of_turn_end_and_checkpoint_corruption(
    spill: bool, corrupt, message: str
) -> None:
    m = _v4_turn_end(spill)
    corrupt(m)
    with pytest.raises(AssertionError, match=message):
        m.check_integrity()


def test_dual_pool_check_integrity_finds_a_checkpoint_slot_nobody_holds() -> None:
    from kvpool.cache import DSV4CacheManager
    from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
    from kvpool.spec.dsv4 import DSV4Spec

    spec = DSV4Spec.from_config(SMALL_DSV4_CONFIG)  # span 16: checkpoints at 16 and 32 in 2 of 3 slots
    m = DSV4CacheManager(spec, 11, 3, CacheDescriptor("small-dsv4"), restore="checkpoint", num_checkpoints=3)
    assert m.admit("a", list(range(40))) is not None
    m.commit_step(["a"], [40], [1])
    m.check_integrity()
    g = m.groups["v4"]
    (slot,) = g.checkpoint_pool.allocate(1)  # the unhashed one: no checkpoint evicted, the pool whole
    g.checkpoint_pool.check_integrity()
    with pytest.raises(AssertionError, match=rf"checkpoint slot {3 + slot} has refcount 1, held 0 times"):
        m.check_integrity()


def test_pending_reservation_of_a_cache_of_blocks_is_the_rest_of_its_last_block() -> None:
    # Block-granular (exact_steps False), blocks of 4: a commit inside a block leaves the rest
    # of it reserved, and pending_reservation names that rest (no block new); it is a real
    # reservation: a commit into it needs no reserve, a commit past it is refused. None once
    # a commit ends on a block's end, and after a prefill that ends there.
    m = FullAttentionManager(16, 4, DESC)
    _prefill(m, "a", list(range(6)))
    _prefill(m, "b", list(range(10, 18)))
    assert m.pending_reservation("a") == Reservation(6, 2, {"full": NO_RESERVATION})
    assert m.pending_reservation("b") is None and m.num_reserved_tokens("b") == 8
    m.append_token_ids("b", [1])
    before = _frozen(m)
    with pytest.raises(ValueError, match="request 'b': commit of 1 tokens from position 8: 0 reserved"):
        m.commit("b", 1)
    assert _frozen(m) == before
    m.append_token_ids("a", [7, 8, 9])
    assert m.slot_mapping("a", 6, 8) == [m.block_ids("a")[1] * 4 + 2, m.block_ids("a")[1] * 4 + 3]
    m.commit("a", 1)  # no reserve: position 6 was reserved
    m.check_integrity()
    assert m.pending_reservation("a") == Reservation(7, 1, {"full": NO_RESERVATION})
    with pytest.raises(ValueError, match="request 'a': commit of 2 tokens from position 7: 1 reserved"):
        m.commit("a", 2)
    m.commit("a", 1)
    assert m.pending_reservation("a") is None and m.num_reserved_tokens("a") == m.num_computed_tokens("a") == 8
    assert m.reserve_step(["a"], [1])  # a block new (in the table: an attention group keeps no part)
    assert m.pending_reservation("a") == Reservation(8, 4, {"full": NO_RESERVATION}) and len(m.block_ids("a")) == 3
    m.check_integrity()


def test_an_undone_step_takes_its_evictions_back_from_the_lower_tier_record() -> None:
    # With a lower tier, the cached blocks an allocation evicts are recorded for it
    # (take_evicted). "z"'s step evicts a's two spans; undone, they are cached again, so the
    # record drops them (the tier need not keep them) and a's prefix is hit again.
    from kvpool.cache import DSV4CacheManager
    from kvpool.engine import tier_bridge
    from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
    from kvpool.spec.dsv4 import DSV4Spec

    spec = DSV4Spec.from_config(SMALL_DSV4_CONFIG)  # span 16
    m = DSV4CacheManager(spec, 4, 2, CacheDescriptor("small-dsv4"), lower_tier=object())  # type: ignore[arg-type]
    a = list(range(33))
    assert m.admit("a", a) is not None
    m.commit_step(["a"], [33], [1])
    m.release("a")
    assert tier_bridge.take_evicted(m) == [] and m.group_hit_points(a) == {"v4": [0, 16, 32]}
    assert m.admit("z", list(range(100, 165)), 0) is not None
    before = _held(m)
    res = m.reserve("z", 64)  # 4 blocks: the 2 unhashed, then a's 2 spans evicted
    assert res is not None and len(res.groups["v4"].new_block_ids) == 4
    assert len(m.groups["v4"]._evicted) == 2 and m.group_hit_points(a) == {"v4": [0]}
    m.unreserve("z")
    assert _held(m) == before
    assert tier_bridge.take_evicted(m) == [] and m.group_hit_points(a) == {"v4": [0, 16, 32]}
    m.check_integrity()


def test_a_spilled_turn_end_missing_a_part_is_not_served() -> None:
    # Spills of 2 classical blocks: a's turn end at 40 spilled to blocks 8 (part 0) and 9
    # (part 1). "z"'s step (2 spans, 2 pooled snapshots) takes the 2 unhashed blocks, then 2
    # and 9: part 0 is still findable, part 1 gone, so 40 is no point served (the copy would
    # read a slot another request writes). Undone, part 1 is back and 40 served again.
    from kvpool.cache import DSV4CacheManager
    from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
    from kvpool.spec.dsv4 import DSV4Spec

    spec = DSV4Spec.from_config(SMALL_DSV4_CONFIG)  # span 16
    desc = CacheDescriptor("small-dsv4")
    kw = {"restore": "auto", "checkpoint_blocks": 1, "spill_blocks": 2, "turn_end_checkpoints": True}
    m = DSV4CacheManager(spec, 16, 2, desc, **kw)
    g = m.groups["v4"]

    def ids(n: int, offset: int = 0) -> list[int]:
        return [(offset + 7 * i) % 251 for i in range(n)]

    m.admit("a", ids(40))
    m.commit_step(["a"], [40], [1])
    m.release("a")
    for rid, offset in (("x", 5), ("y", 6)):
        assert m.admit(rid, ids(32, offset)) is not None
    assert m.take_spills() == [(0, 8)]
    (ckpt,) = g._spilled.values()
    assert [p.block_ids for p in ckpt.parts] == [(8,), (9,)]
    for rid in ("x", "y"):
        m.commit(rid, 32)
        m.release(rid)
    follow_up = ids(40) + [1, 2, 3]
    assert m.group_hit_points(follow_up) == {"v4": [0, 16, 32, 40]}
    h = m.admit("h", ids(32) + [9])  # holds spans 0 and 1 (blocks 0, 1)
    assert h is not None and h.groups["v4"].block_ids == (0, 1)
    assert m.admit("z", ids(80, 9), 0) is not None
    before = _held(m)
    assert m.reserve("z", 32) is not None
    assert [p.block_ids for p in ckpt.parts] == [(8,), ()]
    assert m.group_hit_points(follow_up) == {"v4": [0, 16, 32]}
    m.check_integrity()
    m.unreserve("z")
    assert _held(m) == before and [p.block_ids for p in ckpt.parts] == [(8,), (9,)]
    assert m.group_hit_points(follow_up) == {"v4": [0, 16, 32, 40]}
    m.check_integrity()
