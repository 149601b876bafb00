"""Hostile call sequences against the cache core's documented API (docs/core_api.md): calls
out of order, at and past every limit, and of the wrong type. The promises held here: a bad
call is a ValueError / TypeError naming what is wrong, and a refused call leaves every
observable as it was (free queues, refcounts, tables, counts, the prefix index)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpool.cache import CacheDescriptor, FullAttentionManager, HybridCacheManager, MMItem
from kvpool.cache.dual_pool import DualPoolGroupSpec
from kvpool.cache.recurrent import RecurrentGroupSpec
from kvpool.cache.window import AttentionGroupSpec
from kvpool.engine import tier_bridge
from kvpool.pool import BlockPool
from kvpool.tiers import HostTier, TierIndex

BS = 4
DESC = CacheDescriptor("robust")
PROMPT = list(range(1, 18))  # 17 tokens: four full blocks and one token


def snapshot(m: HybridCacheManager) -> dict:
    """Every observable a refused call must leave as it was."""
    seen: dict = {"stats": m.stats, "ids": list(m.request_ids), "lookup": m.lookup_prefix(PROMPT)}
    for i, pool in enumerate(m.pools):
        seen[i] = (pool.free_queue(), pool.num_free_cached, [pool.refcount(b) for b in range(pool.num_blocks)])
    for rid in m.request_ids:
        part = m.part(rid, next(iter(m.groups)))
        seen[rid] = (
            m.block_ids(rid),
            m.num_computed_tokens(rid),
            m.num_reserved_tokens(rid),
            list(m.token_ids(rid)),
            part.group.loads(part.state),
        )
    return seen


def _loading(exact: bool) -> HybridCacheManager:
    """A cache of 6 blocks whose request "b" hits PROMPT's blocks 1-3 in the host tier
    (block 0 on the device): admitted with a budget of 13, its loads pending."""
    tier = HostTier(1 << 20)
    index = TierIndex(tier, BS)
    if exact:
        m = HybridCacheManager([(AttentionGroupSpec("full", BS), 6)], DESC, lower_tier=index)
    else:
        m = FullAttentionManager(6, BS, DESC, lower_tier=index)
    m.admit("a", PROMPT)
    m.commit("a", len(PROMPT))
    m.release("a")
    filler = list(range(100, 120))  # pushes PROMPT's blocks 1-3 out, to the tier
    m.admit("f", filler)
    for _, block in tier_bridge.take_evicted(m):
        key, descriptor = index.describe(block)
        tier.put(key, descriptor, {"content": torch.zeros(descriptor.num_computed_tokens)})
    m.commit("f", len(filler))
    m.release("f")
    admission = m.admit("b", PROMPT, 13)
    assert admission.num_cached_tokens == 16 and len(admission.groups["full"].loads) == 3
    assert m.num_computed_tokens("b") == 4  # the device's block; the tier's three are in flight
    return m


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_a_step_of_a_request_whose_loads_are_pending_is_refused(exact, num_tokens) -> None:
    """reserve refuses a request still loading lower-tier blocks (complete_loads first), and
    so does reserve_step, the batched reserve: the full-attention manager's returned True for
    a step inside the admission's blocks, over the very blocks being loaded."""
    m = _loading(exact)
    before = snapshot(m)
    for reserve in (lambda: m.reserve("b", num_tokens), lambda: m.reserve_step(["b"], [num_tokens])):
        with pytest.raises(ValueError, match="'b' has lower-tier blocks to load \\(complete_loads first\\)"):
            reserve()
        assert snapshot(m) == before
        m.check_integrity()
    admission = m.complete_loads("b", 3)
    assert (admission.num_cached_tokens, admission.num_scheduled_tokens) == (16, 1)
    m.commit_step(["b"], [1], [None])  # the rest of the prompt, loads done: the step goes on
    assert m.num_computed_tokens("b") == 17


@pytest.mark.parametrize("exact", [False, True])
def test_the_tables_of_a_request_whose_loads_are_pending_are_refused(exact) -> None:
    """step_tables and slot_mapping answered for "b" while its three tier blocks were in
    flight (slots 4-15, the blocks being loaded: a forward given them would read or write
    them before the load lands, and its commit is refused anyway); now a ValueError naming
    the request, as every step call, nothing changed. After complete_loads they answer."""
    m = _loading(exact)
    before = snapshot(m)
    refused = "request 'b' has lower-tier blocks to load \\(complete_loads first\\)"
    for query in (lambda: m.step_tables(["b"], [4], [16]), lambda: m.slot_mapping("b", 4, 16)):
        with pytest.raises(ValueError, match=refused):
            query()
        assert snapshot(m) == before
    m.check_integrity()
    m.complete_loads("b", 3)
    assert m.slot_mapping("b", 16, 17) == [16]
    assert m.step_tables(["b"], [16], [17]).csr.indices == m.block_ids("b")


def _hybrid() -> HybridCacheManager:
    return HybridCacheManager([(AttentionGroupSpec("full", BS), 8), (RecurrentGroupSpec("rec", 4), 4)], DESC)


def _dual() -> HybridCacheManager:
    return HybridCacheManager([(DualPoolGroupSpec("v4", BS, replay_len=2), (8, 3))], DESC)


CACHES = {"full": lambda: FullAttentionManager(8, BS, DESC), "hybrid": _hybrid, "dual": _dual}


def _computed_six(make) -> HybridCacheManager:
    """Request "a": 6 tokens computed, 11 known."""
    m = make()
    m.admit("a", [1, 2, 3, 4, 5, 6])
    m.commit_step(["a"], [6], [7])
    m.append_token_ids("a", [8, 9, 10, 11])
    return m


@pytest.mark.parametrize("field", ["model_id", "weights_version", "layout_id"])
@pytest.mark.parametrize("bad", [None, 5, b"m"])
def test_a_descriptor_field_that_is_no_str_is_refused(field, bad) -> None:
    """CacheDescriptor(5) and (None) were taken: a key apart from "5"'s and ""'s, no false
    hit, but not the descriptor meant. Every field is text; anything else names the field."""
    fields = {"model_id": "m", field: bad}
    with pytest.raises(TypeError, match=f"^CacheDescriptor's {field} must be a str, got {re.escape(repr(bad))} "):
        CacheDescriptor(**fields)


@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("bad", [None, 5, np.int64(5), b"a", ("a",), ["a"]])
def test_a_request_id_that_is_no_str_is_refused(cache, bad) -> None:
    """admit(None, ...), admit(5, ...) and fork("a", 7) were taken (a request 5 beside a
    request "5"; a list id failed as "unhashable type"): the docs' ids are str. Now one
    TypeError naming the id, and nothing changed; a str subclass is a str."""
    m = _computed_six(CACHES[cache])
    before = snapshot(m)
    for call in (lambda: m.admit(bad, PROMPT), lambda: m.fork("a", bad)):
        with pytest.raises(TypeError, match=f"a request id must be a str, got {re.escape(repr(bad))} "):
            call()
        assert snapshot(m) == before
        m.check_integrity()

    class Name(str):
        pass

    assert m.admit(Name("b"), [1, 2, 3]) is not None and "b" in m.request_ids


@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("bad", [3.0, 2.5, float("nan"), "3", None])
def test_a_commit_of_a_count_that_is_no_int_is_refused(cache, bad) -> None:
    """A commit's token count that is no int is a TypeError naming it, and changes nothing:
    3.0 or nan passed the checks of the reserved span, moved the computed count to a float
    (the full manager's groups then raised 'slice indices must be integers' mid-commit, the
    dual pool took 3.0 whole) and check_integrity itself failed after."""
    m = _computed_six(CACHES[cache])
    assert m.reserve_step(["a"], [3])
    before = snapshot(m)
    for commit in (lambda: m.commit("a", bad), lambda: m.commit_step(["a"], [bad], [None])):
        with pytest.raises(TypeError, match=f"request 'a': a commit's token count must be an int, got {bad!r}"):
            commit()
        assert snapshot(m) == before
        m.check_integrity()
    m.commit_step(["a"], [np.int64(3)], [None])  # numpy's ints are ints
    assert m.num_computed_tokens("a") == 9 and type(m.num_computed_tokens("a")) is int
    m.check_integrity()


@pytest.mark.parametrize("cache", sorted(CACHES))
@pytest.mark.parametrize("bad", [3.0, 2.5, float("nan"), "3", None])
def test_a_reservation_of_a_count_that_is_no_int_is_refused(cache, bad) -> None:
    """admit's max_new_tokens, reserve's and reserve_step's counts that are no int: a
    TypeError naming them, nothing changed. nan passed the checks (comparisons) and the
    pool handed out a block before an int-only call raised: a block lost (check_integrity:
    'refcount 0 but is not free'); the full manager's reserve_step took [nan] as a step
    inside its block (True, nothing reserved)."""
    m = _computed_six(CACHES[cache])
    m.admit("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    m.commit("b", 4)  # "b": 4 hit (block 0), 4 computed: one prompt token left
    before = snapshot(m)
    calls = {
        f"max_new_tokens must be an int, got {bad!r}": lambda: m.admit("c", [9, 8, 7, 6, 5], bad),
        f"a reservation's token count must be an int, got {bad!r}": lambda: m.reserve("a", bad),
    }
    if bad is None:  # (admit's default: the rest of the prompt)
        del calls[next(iter(calls))]
    for message, call in calls.items():
        with pytest.raises(TypeError, match=f"request '[ac]': {message}"):
            call()
        assert snapshot(m) == before and "c" not in m
        m.check_integrity()
    for ids, counts, named in ((["a"], [bad], "a"), (["a", "b"], [1, bad], "b"), (["b", "a"], [bad, 2], "b")):
        with pytest.raises(
            TypeError, match=f"request '{named}': a reservation's token count must be an int, got {bad!r}"
        ):
            m.reserve_step(ids, counts)
        assert snapshot(m) == before
        m.check_integrity()
    assert m.reserve_step(["a", "b"], [np.int64(3), 1])  # numpy's ints are ints
    assert m.num_reserved_tokens("a") >= 9 and type(m.num_reserved_tokens("a")) is int
    m.check_integrity()


@pytest.mark.parametrize("salt", [42, b"tenant", None])
def test_a_tenant_salt_that_is_no_str_is_named(salt) -> None:
    """A salt that is no str (a numeric user id, bytes) is a TypeError naming the salt, at a
    lookup and at an admission, nothing changed; it was AttributeError "'int' object has no
    attribute 'encode'" from inside the hasher."""
    m = _computed_six(CACHES["full"])
    before = snapshot(m)
    message = f"tenant salt must be a str, got {type(salt).__name__} {salt!r}"
    with pytest.raises(TypeError, match=message):
        m.lookup_prefix([1, 2, 3, 4, 5], tenant_salt=salt)
    with pytest.raises(TypeError, match=message):
        m.admit("b", [1, 2, 3, 4, 5], tenant_salt=salt)
    assert snapshot(m) == before and "b" not in m
    m.check_integrity()


@pytest.mark.parametrize("exact", [True, False])
def test_a_swapped_tail_that_reaches_the_reservation_end_is_refused(exact) -> None:
    """restore_tail of the tokens that end an exact step's reservation leaves no token of it
    to compute: refused (restore_refusal names why, tail_block_for_restore says None, so the
    tokens are computed instead), nothing changed. It was accepted, then restore_tail moved
    the computed count and the hit counters and failed a bare `assert n > 0`."""
    m = HybridCacheManager([(AttentionGroupSpec("full", BS), 8)], DESC, exact_steps=exact)
    m.admit("a", list(range(1, 11)), 2)  # nothing hit, a first step of 2 tokens
    assert m.num_reserved_tokens("a") == (2 if exact else 4)  # not exact: to the block's end
    before = snapshot(m)
    if exact:
        message = "request 'a': 2 restored tokens leave no reserved token to compute"
        assert m.restore_refusal("a", 2) == message and tier_bridge.tail_block_for_restore(m, "a", 2) is None
        with pytest.raises(ValueError, match=message):
            m.restore_tail("a", 2)
        assert snapshot(m) == before
        m.check_integrity()
        return
    admission = m.restore_tail("a", 2)  # the block's end lies past them: a token is left
    assert (admission.num_cached_tokens, admission.num_scheduled_tokens) == (2, 2)
    m.check_integrity()


def _pool_state(pool: BlockPool) -> tuple:
    return pool.free_queue(), [pool.refcount(b) for b in range(pool.num_blocks)], pool.num_free, pool.num_free_cached


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda p: p.decref([0, 1, 5]), ValueError, "block 5 released more often than taken"),  # a double free
        (lambda p: p.decref([0, 0]), ValueError, "block 0 released more often than taken"),
        (lambda p: p.decref([2, 5]), ValueError, "block 5 released more often than taken"),  # a cached one walked back
        (lambda p: p.decref([0, -1]), ValueError, r"block id -1 is outside the pool's \[0, 8\)"),
        (lambda p: p.decref(iter([1, 99])), ValueError, r"block id 99 is outside the pool's \[0, 8\)"),
        (lambda p: p.decref([0, 1.0]), TypeError, "block id 1.0 is no int"),
        (lambda p: p.incref([0, 5]), ValueError, "incref of block 5, which is free and holds no cached content"),
        (lambda p: p.incref([0, 3, -1]), ValueError, r"block id -1 is outside the pool's \[0, 8\)"),
        (lambda p: p.incref([3, 99]), ValueError, r"block id 99 is outside the pool's \[0, 8\)"),
        (lambda p: p.allocate(float("nan")), TypeError, "num_blocks must be an int, got nan"),
        (lambda p: p.allocate(2.0), TypeError, "num_blocks must be an int, got 2.0"),
    ],
)
def test_a_pool_call_with_a_bad_id_or_count_changes_nothing(call, error, message) -> None:
    """BlockPool's documented incref / decref / allocate refuse a bad id or count with an
    error naming it and change nothing. decref decremented the ids before a double free and
    then asserted (under -O the freed block went to refcount -1); -1 reached the last block
    (a list index from the end); allocate(nan) emptied the unhashed queue, then raised."""
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(1) == [3]
    root = pool.root(b"d")
    pool.register(3, pool.chain(root, b"\x01\x00\x00\x00"))
    pool.register(2, pool.chain(root, b"\x02\x00\x00\x00"))  # (held: a decref makes it a free cached block)
    pool.decref([3])  # block 3: free and cached (findable), between unhashed 4..7 and nothing
    before = _pool_state(pool)
    with pytest.raises(error, match=message):
        call(pool)
    assert _pool_state(pool) == before
    pool.check_integrity()
    pool.decref([0, 1, 2])
    pool.incref([3])  # a free cached block is taken back
    assert pool.free_queue() == [4, 5, 6, 7, 0, 1, 2] and pool.allocate(np.int64(1)) == [4]
    pool.incref(np.array([3]))  # numpy's ints are ids, as decref and allocate take them
    assert pool.refcount(3) == 2
    pool.check_integrity()


# ----- any sequence: a refused call leaves no trace --------------------------------------

BAD_COUNTS = [-1, 2.5, float("nan"), "2", None]
COUNTS = st.one_of(st.integers(0, 6), st.sampled_from(BAD_COUNTS))
IDS = st.sampled_from(["r0", "r1", "r0", "r1", "r2", "nobody"])
PROMPT_IDS = st.lists(st.integers(0, 3), min_size=0, max_size=10)


class HostileCalls(RuleBasedStateMachine):
    """Random calls of the documented API, well-formed or not (unknown and repeated ids,
    counts that are negative, past the known tokens or no int, bad salts and reasons):
    each call either succeeds, or returns its refusal (None / False) or raises ValueError,
    TypeError or KeyError with every observable as it was before; check_integrity after
    each. The lifecycle machines (test_cache_lifecycle.py, test_hybrid_lifecycle.py) hold
    what succeeded to a model of the slots; this one holds what was refused."""

    make = staticmethod(CACHES["full"])

    def __init__(self) -> None:
        super().__init__()
        self.m = self.make()

    def _refusable(self, call, refusals=(None, False)) -> None:
        before = snapshot(self.m)
        try:
            result = call()
        except (ValueError, TypeError, KeyError):
            assert snapshot(self.m) == before
            return
        if any(result is r for r in refusals):
            assert snapshot(self.m) == before

    @initialize()
    def live(self):
        """r0 and r1 live, 6 tokens computed, 9 known: the hostile calls reach them."""
        for rid, prompt in (("r0", [1, 2, 3, 1, 2, 3]), ("r1", [3, 2, 1, 3, 2, 1])):
            self.m.admit(rid, prompt)
            self.m.commit_step([rid], [6], [1])
            self.m.append_token_ids(rid, [2, 3])

    @rule(rid=IDS, ids=PROMPT_IDS, budget=st.one_of(st.none(), COUNTS), salt=st.sampled_from(["", "t", 7]))
    def admit(self, rid, ids, budget, salt):
        self._refusable(lambda: self.m.admit(rid, ids, budget, tenant_salt=salt))

    @rule(rids=st.lists(IDS, min_size=1, max_size=3), counts=st.lists(COUNTS, min_size=1, max_size=3))
    def reserve_step(self, rids, counts):
        self._refusable(lambda: self.m.reserve_step(rids, (counts * 3)[: len(rids)]))

    @rule(
        rids=st.lists(IDS, min_size=1, max_size=3),
        counts=st.lists(COUNTS, min_size=1, max_size=3),
        token=st.integers(0, 3),
    )
    def commit_step(self, rids, counts, token):
        self._refusable(lambda: self.m.commit_step(rids, (counts * 3)[: len(rids)], [token] * len(rids)), ())

    @rule(rids=st.lists(IDS, min_size=1, max_size=3, unique=True), token=st.integers(0, 3))
    def decode(self, rids, token):
        """A well-formed step of the live requests named: an exact step reserved before is
        committed; else one token each is reserved and committed."""
        live = [r for r in rids if r in self.m]
        m = self.m
        pending = [r for r in live if m.exact_steps and m.num_reserved_tokens(r) > m.num_computed_tokens(r)]
        if pending:
            counts = [m.num_reserved_tokens(r) - m.num_computed_tokens(r) for r in pending]
            m.commit_step(pending, counts, [None] * len(pending))
            return
        for rid in live:
            if m.num_tokens(rid) == m.num_computed_tokens(rid):
                m.append_token_ids(rid, [token])
        if live and m.reserve_step(live, [1] * len(live)):
            m.commit_step(live, [1] * len(live), [token] * len(live))

    @rule(rid=IDS, ids=st.lists(st.one_of(st.integers(0, 3), st.sampled_from([-1, 2**32, 1.5])), max_size=3))
    def append(self, rid, ids):
        self._refusable(lambda: self.m.append_token_ids(rid, ids), ())

    @rule(parent=IDS, child=IDS)
    def fork(self, parent, child):
        self._refusable(lambda: self.m.fork(parent, child))

    @rule(rid=IDS, n=COUNTS)
    def rollback(self, rid, n):
        self._refusable(lambda: self.m.rollback(rid, n), ())

    @rule(rid=IDS)
    def unreserve(self, rid):
        self._refusable(lambda: self.m.unreserve(rid), ())

    @rule(rid=IDS, reason=st.sampled_from(["finish", "cancel", "preempt", "bogus"]))
    def release(self, rid, reason):
        self._refusable(lambda: self.m.release(rid, reason))

    @rule(rid=IDS, n=COUNTS)
    def reserve(self, rid, n):
        self._refusable(lambda: self.m.reserve(rid, n))

    @rule(rid=IDS)
    def mark_turn_end(self, rid):
        self._refusable(lambda: self.m.mark_turn_end(rid), ())

    @rule(rid=IDS, n=COUNTS, swapped_state=st.booleans())
    def restore(self, rid, n, swapped_state):
        """A swap's restore (the tier bridge's, after an admission), called at any time: a
        state of 0 tokens at 0 computed was taken and failed check_integrity."""
        call = self.m.restore_swapped_state if swapped_state else self.m.restore_tail
        self._refusable(lambda: call(rid, n), ())

    @invariant()
    def integrity(self):
        self.m.check_integrity()


class HostileHybridCalls(HostileCalls):
    make = staticmethod(CACHES["hybrid"])


class HostileDualCalls(HostileCalls):
    make = staticmethod(CACHES["dual"])


_HOSTILE = settings(max_examples=12, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck))
for _machine in (HostileCalls, HostileHybridCalls, HostileDualCalls):
    _machine.TestCase.settings = _HOSTILE
TestHostileCalls = HostileCalls.TestCase
TestHostileHybridCalls = HostileHybridCalls.TestCase
TestHostileDualCalls = HostileDualCalls.TestCase


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [
        ({1: 2, 3: 4}, "request 'b': token_ids must be a sequence of ints, got dict"),
        ({1, 2, 3}, "request 'b': token_ids must be a sequence of ints, got set"),
        ("abc", "request 'b': token_ids must be a sequence of ints, got str"),
        (None, "request 'b': token_ids must be a sequence of ints, got NoneType"),
        ((t for t in [1, 2]), "request 'b': token_ids must be a sequence of ints, got generator"),
        ([1, 1.5], "token id 1.5 is no int"),
        ([1, "2"], "token id '2' is no int"),
    ],
)
def test_a_prompt_that_is_no_sequence_of_ints_is_named(token_ids, message) -> None:
    """admit's and lookup_prefix's token ids that are no sequence of ints: a TypeError naming
    the argument or the id, nothing changed. A dict admitted its keys ([1, 3]) and a set its
    ids in hash order; None, a str or a float raised errors naming neither ('object of type
    'NoneType' has no len()', 'cannot use a str to initialize an array')."""
    m = _computed_six(CACHES["full"])
    before = snapshot(m)
    with pytest.raises(TypeError, match=message):
        m.admit("b", token_ids)
    with pytest.raises(TypeError, match=message.replace("'b'", "'<lookup>'")):
        m.lookup_prefix(token_ids)
    assert snapshot(m) == before and "b" not in m
    assert m.lookup_prefix(np.array([1, 2, 3, 4, 5])) == 4  # numpy's ids are ints (pack_prompt's docs)


def test_a_swap_restore_after_a_step_or_of_nothing_is_refused() -> None:
    """restore_tail and restore_swapped_state follow the admission, before any step (the tier
    bridge's swap-in). Called after a committed step, at a block boundary with a step
    reserved, they were accepted: the tokens the step had reserved counted as computed and
    as prefix hits (3 hit tokens that no tier gave). A swapped state of 0 tokens at 0
    computed (no state: `swap_state_block` names none there) was accepted too and left a
    "swap" restore pending at 0 computed, which check_integrity refused. Now each is
    refused by name, nothing changed."""
    full = HybridCacheManager([(AttentionGroupSpec("full", BS), 8)], DESC)
    dual = _dual()
    for m, call, what in ((full, "restore_tail", "tail"), (dual, "restore_swapped_state", "state")):
        m.admit("a", list(range(1, 21)), BS)  # no hit; a first step of one block
        m.commit("a", BS)
        m.reserve("a", 2 * BS)  # [4, 12): a block boundary, a step reserved
        before = snapshot(m)
        message = f"request 'a': a swapped {what} is restored right after the admission, before any step"
        refusal = m.restore_refusal if what == "tail" else m.swapped_state_refusal
        assert refusal("a", 3) == message
        with pytest.raises(ValueError, match=message):
            getattr(m, call)("a", 3)
        assert snapshot(m) == before
        m.check_integrity()
    dual.admit("b", list(range(30, 40)))  # nothing computed: no state to bring back
    before = snapshot(dual)
    message = r"request 'b': cannot restore a state 0 tokens after 0 computed \(10 known, block size 4\)"
    with pytest.raises(ValueError, match=message):
        dual.restore_swapped_state("b", 0)
    assert snapshot(dual) == before
    dual.check_integrity()
    assert dual.swapped_state_refusal("b", 3) is None  # a state inside the first span comes back
    assert dual.restore_swapped_state("b", 3).num_cached_tokens == 3
    dual.check_integrity()


@pytest.mark.parametrize("bad", [2.0, 1.5, "1", None])
def test_the_other_counts_that_are_no_int_are_named(bad) -> None:
    """rollback's, complete_loads', restore_tail's and restore_swapped_state's counts that are
    no int: a TypeError naming the request and the argument, nothing changed (they said
    'slice indices must be integers' or "'<' not supported between 'int' and 'str'")."""
    m = _computed_six(CACHES["full"])
    m.admit("c", list(range(100, 110)), 2)
    before = snapshot(m)
    calls = {
        "num_computed_tokens": lambda: m.rollback("a", bad),
        "a restore's token count": lambda: m.restore_tail("c", bad),
    }
    for what, call in calls.items():
        with pytest.raises(TypeError, match=f"request '[ac]': {what} must be an int, got {bad!r}"):
            call()
        assert snapshot(m) == before
    with pytest.raises(TypeError, match=f"request 'c': a restore's token count must be an int, got {bad!r}"):
        m.restore_refusal("c", bad)
    loading = _loading(False)
    before = snapshot(loading)
    with pytest.raises(TypeError, match=f"request 'b': num_loaded must be an int, got {bad!r}"):
        loading.complete_loads("b", bad)
    assert snapshot(loading) == before
    loading.check_integrity()
    dual = _dual()
    dual.admit("d", list(range(1, 11)), 2)
    with pytest.raises(TypeError, match=f"request 'd': a restore's token count must be an int, got {bad!r}"):
        dual.restore_swapped_state("d", bad)


@pytest.mark.parametrize("cache", sorted(CACHES))
def test_a_step_whose_counts_are_a_numpy_array_runs(cache) -> None:
    """reserve_step's and commit_step's counts as a numpy array: taken as their ints (the
    fast paths asked the array for `count`: AttributeError)."""
    m = _computed_six(CACHES[cache])
    assert m.reserve_step(["a"], np.array([2]))
    m.commit_step(["a"], np.array([2]), [None])
    assert m.num_computed_tokens("a") == 8 and type(m.num_computed_tokens("a")) is int
    assert m.reserve_step(["a"], np.array([1]))  # a decode step
    m.commit_step(["a"], np.array([1]), np.array([5]))
    assert m.num_computed_tokens("a") == 9 and m.token_ids("a")[-1] == 5
    m.check_integrity()


@pytest.mark.parametrize(("ids", "starts", "ends"), [(["a"], [6, 7], [7]), (["a", "b"], [6], [7, 8]), (["a"], [6], [])])
def test_step_lists_of_other_lengths_are_named(ids, starts, ends) -> None:
    """step_tables' and first_off_step's lists of other lengths: a ValueError counting
    them, as step_reservations says ('1 requests, 2 starts, 1 ends'); it was zip's 'argument
    2 is longer than argument 1'."""
    m = _computed_six(CACHES["full"])
    assert m.reserve_step(["a"], [1])
    message = f"{len(ids)} requests, {len(starts)} starts, {len(ends)} ends"
    for call in (m.step_tables, m.first_off_step, m.step_reservations):
        with pytest.raises(ValueError, match=message):
            call(ids, starts, ends)
    assert m.first_off_step(["a"], [6], [7]) is None and m.step_tables(["a"], [6], [7]).slots == [6]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: AttentionGroupSpec("w", 4, window=2.5), "group 'w': window must be an int, got float 2.5"),
        (lambda: AttentionGroupSpec("w", 4, window=True), "group 'w': window must be an int, got bool True"),
        (lambda: AttentionGroupSpec("w", 4.0), "group 'w': block_size must be an int, got float 4.0"),
        (lambda: FullAttentionManager(8, "4", DESC), "group 'full': block_size must be an int, got str '4'"),
        (lambda: RecurrentGroupSpec("r", 2.5), "group 'r': checkpoint_interval must be an int, got float 2.5"),
        (lambda: DualPoolGroupSpec("v", 2.5), "group 'v': span must be an int, got float 2.5"),
        (lambda: DualPoolGroupSpec("v", 4, replay_len=1.0), "group 'v': replay_len must be an int, got float 1.0"),
        (lambda: BlockPool(2.0), "num_blocks must be an int, got float 2.0"),
        (
            lambda: HybridCacheManager([(AttentionGroupSpec("a", 4), None)], DESC, shared_blocks=2.5),
            "shared_blocks must be an int, got float 2.5",
        ),
    ],
)
def test_a_size_that_is_no_int_is_named_when_the_cache_is_built(build, message) -> None:
    """A float window or block size was taken, and the first admission failed deep inside
    ('slice indices must be integers or None'); a bool window of True passed as 1; a float
    pool size failed as "can't multiply sequence by non-int of type 'float'"."""
    with pytest.raises(TypeError, match=message.replace("(", "\\(")):
        build()


def test_numpy_sizes_are_ints_and_a_bool_pool_size_is_refused() -> None:
    spec = AttentionGroupSpec("w", np.int64(4), window=np.int32(6))
    assert (spec.block_size, spec.window) == (4, 6) and type(spec.window) is int
    shared = HybridCacheManager([(AttentionGroupSpec("a", 4), None)], DESC, shared_blocks=np.int64(8))
    assert shared.usage().num_blocks == 8  # (it was refused: 'shared_blocks must be an int, got int64 8')
    assert BlockPool(np.int64(3)).num_blocks == 3
    assert FullAttentionManager(np.int64(8), np.int64(4), DESC).num_free_blocks == 8
    with pytest.raises(ValueError, match="its pool size must be a positive int, got True"):
        FullAttentionManager(True, 4, DESC)


@pytest.mark.parametrize(
    ("token_ids", "kind"), [(b"\x01\x02", "bytes"), ({1: 2, 3: 4}, "dict"), ({3, 1, 2}, "set"), ("12", "str")]
)
def test_appended_ids_that_are_no_sequence_of_ints_are_named(token_ids, kind) -> None:
    """append_token_ids takes what admit takes: bytes joined as their byte values ([1, 2]),
    a dict as its keys, a set in hash order, silently; admit refused them."""
    m = _computed_six(CACHES["full"])
    before = snapshot(m)
    with pytest.raises(TypeError, match=f"request 'a': token_ids must be a sequence of ints, got {kind}"):
        m.append_token_ids("a", token_ids)
    assert snapshot(m) == before
    m.append_token_ids("a", (t for t in [1, 2]))  # any other iterable of ints joins
    assert m.token_ids("a")[-2:] == [1, 2]


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (MMItem(1.5, 2, "h"), ": start must be an int, got float 1.5"),
        (MMItem(1, 2.0, "h"), ": length must be an int, got float 2.0"),
        (MMItem(True, 2, "h"), ": start must be an int, got bool True"),
        (MMItem(1, 2, b"h"), "its content_hash must be a str"),
        (MMItem(1, 2, 5), "its content_hash must be a str"),
    ],
)
def test_a_multimodal_item_of_the_wrong_types_is_named(item, message) -> None:
    """A float start was taken (its blocks' extra keys offset by a fraction), an int hash
    too, and a bytes hash failed as 'Object of type bytes is not JSON serializable'."""
    m = _computed_six(CACHES["full"])
    before = snapshot(m)
    for call in (lambda: m.lookup_prefix(PROMPT, mm_items=[item]), lambda: m.admit("b", PROMPT, mm_items=[item])):
        with pytest.raises(TypeError, match=message):
            call()
        assert snapshot(m) == before
    m.check_integrity()
    ok = (np.int64(1), np.int32(2), "h")  # numpy's ints are ints
    assert m.lookup_prefix(PROMPT, mm_items=[ok]) == m.lookup_prefix(PROMPT, mm_items=[MMItem(1, 2, "h")])
    # a str subclass (numpy's str_) is a str, hashed as the plain one (it was refused)
    assert m.lookup_prefix(PROMPT, mm_items=[(1, 2, np.str_("h"))]) == m.lookup_prefix(PROMPT, mm_items=[ok])
    m.admit("c", PROMPT, mm_items=[MMItem(1, 2, np.str_("h"))])
    m.check_integrity()
