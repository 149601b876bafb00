"""DSV4CacheManager bookkeeping (pure Python): exact block ids, waits, hits, releases."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.cache import CacheDescriptor, DSV4CacheManager, FullAttentionManager, StateRestore, coordinator, dual_pool
from kvpool.cache.coordinator import HybridCacheManager, pack_prompt
from kvpool.cache.dual_pool import RestoreChoice, TokenCost, choose_restore
from kvpool.engine import tier_bridge
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
from kvpool.pool.hashing import token_bytes
from kvpool.spec.dsv4 import DSV4Spec

SPEC = DSV4Spec.from_config(SMALL_DSV4_CONFIG)  # span 16, n_win 16, 4 layers
SPAN = SPEC.span
DESC = CacheDescriptor("small-dsv4", layout_id="span16:fp32")


def make(num_classical_blocks: int, num_state_blocks: int, **kw) -> DSV4CacheManager:
    return DSV4CacheManager(SPEC, num_classical_blocks, num_state_blocks, DESC, **kw)


def _ids(n: int, offset: int = 0) -> list[int]:
    return [(offset + 7 * i) % 251 for i in range(n)]


def _compute(m: DSV4CacheManager, rid: str, n: int):
    res = m.reserve(rid, n)
    assert res is not None
    m.commit(rid, n)
    m.check_integrity()
    return res


def test_blocks_only_for_complete_spans() -> None:
    m = make(11, 2)
    assert m.admit("a", _ids(40), 0) is not None
    res = _compute(m, "a", 15)
    assert res.groups["v4"].new_block_ids == () and m.block_ids("a") == []  # 15 tokens: no complete span
    res = _compute(m, "a", 1)
    assert res.groups["v4"].new_block_ids == (0,) and m.block_ids("a") == [0]  # token 16 completes span 0
    res = _compute(m, "a", 24)  # 40 tokens: spans 1 (32) complete, 8 tail tokens in state
    assert res.groups["v4"].new_block_ids == (1,) and m.block_ids("a") == [0, 1]
    assert m.num_computed_tokens("a") == 40 and m.num_free_blocks == 9


def test_a_decode_batch_takes_a_block_only_at_a_span_boundary() -> None:
    m = make(2, 3)
    for rid, n in (("a", 14), ("b", 16)):
        m.admit(rid, _ids(n), 0)
        _compute(m, rid, n - 1)  # the last prompt token is the first decode
    before = m.pool.free_queue()
    with pytest.raises(ValueError, match="'a' already has an uncommitted reservation"):
        assert m.reserve_step(["a"], [1])
        m.reserve_step(["b", "a"], [1, 1])
    assert m.pool.free_queue() == before and m.pending_reservation("b") is None
    m.commit_step(["a"], [1], [5])
    # a decodes token 14 (inside span 0), b token 15 (the end of span 0): one block, b's
    assert m.reserve_step(["a", "b"], [1, 1])
    assert m.pending_reservation("a") == (14, 1, {"v4": ((), (), ())})
    assert m.pending_reservation("b").start == 15 and m.pending_reservation("b").groups["v4"].new_block_ids == (0,)
    m.check_integrity()
    m.commit_step(["a", "b"], [1, 1], [6, None])
    assert (m.block_ids("a"), m.block_ids("b")) == ([], [0])
    assert m.num_computed_tokens("a") == 15 and m.token_ids("a")[-2:] == [5, 6]
    with pytest.raises(ValueError, match="'b': cannot compute 1 tokens from 16"):
        m.reserve_step(["a", "b"], [1, 1])  # b knows no next token
    assert m.pending_reservation("a") is None and m.num_free_blocks == 1
    m.admit("c", _ids(15), 0)
    _compute(m, "c", 15)
    m.append_token_ids("c", [8])
    # a and c both decode token 15, each completing its span 0: two blocks, one free: neither
    assert m.reserve_step(["a", "c"], [1, 1]) is False
    assert m.pending_reservation("a") is None and m.pending_reservation("c") is None and m.num_free_blocks == 1
    m.check_integrity()


def test_admission_waits_for_a_state_block() -> None:
    m = make(11, 1)
    assert m.admit("a", _ids(5)) is not None
    assert m.admit("b", _ids(5)) is None  # waits: nothing changed
    assert "b" not in m and m.usage().num_free_state_blocks == 0
    m.check_integrity()
    assert m.release("a") and m.admit("b", _ids(5)) is not None
    m.check_integrity()


def test_reserve_that_does_not_fit_leaves_no_trace() -> None:
    m = make(2, 1)
    assert m.admit("a", _ids(60)) is None  # the whole prompt: 3 spans, 2 blocks
    assert m.usage().num_free_state_blocks == 1 and "a" not in m
    m.admit("a", _ids(60), 0)
    assert m.reserve("a", 48) is None  # 3 spans, 2 blocks
    assert m.num_free_blocks == 2 and m.num_computed_tokens("a") == 0
    m.check_integrity()
    assert _compute(m, "a", 32).groups["v4"].new_block_ids == (0, 1)


def test_prefix_hit_leaves_one_token_and_respects_tenants() -> None:
    m = make(11, 3)
    m.admit("a", _ids(48), 0)
    _compute(m, "a", 48)
    assert m.block_ids("a") == [0, 1, 2]
    same = m.admit("b", _ids(48))  # exactly 3 spans: the last must be computed again
    assert same is not None and same.num_cached_tokens == 32 and same.num_scheduled_tokens == 16
    assert same.groups["v4"].block_ids == (0, 1, 3)  # the hit, then a fresh block for span 2
    assert same.groups["v4"].restore == StateRestore(1, "recompute", replay_start=0)  # 32 < n_win * L = 64
    assert [m.pool.refcount(b) for b in (0, 1, 2)] == [2, 2, 1]
    other = m.admit("c", _ids(48), tenant_salt="tenant-2")
    assert other is not None and other.num_cached_tokens == 0 and other.groups["v4"].restore == StateRestore(2, "none")
    m.check_integrity()


def test_recompute_replays_only_the_last_window_tokens() -> None:
    m = make(20, 2)
    m.admit("a", _ids(150), 0)
    _compute(m, "a", 150)
    adm = m.admit("b", _ids(140) + [1, 2, 3])
    assert adm is not None and adm.num_cached_tokens == 128
    assert adm.groups["v4"].restore is not None and adm.groups["v4"].restore.replay_start == 128 - 16 * 4


def test_checkpoint_restore_cuts_the_hit_to_a_checkpointed_boundary() -> None:
    m = make(11, 3, restore="checkpoint", num_checkpoints=1)
    m.admit("a", _ids(50), 0)
    res = _compute(m, "a", 50)
    assert [p for p, _ in res.groups["v4"].checkpoints] == [48]  # one slot: the latest boundary only
    adm = m.admit("b", _ids(50))
    assert adm is not None and adm.num_cached_tokens == 48
    assert adm.groups["v4"].restore == StateRestore(1, "checkpoint", 3)  # checkpoint slots follow the 3 state slots
    short = m.admit("c", _ids(40))  # blocks 0, 1 hit, but no checkpoint at 16 or 32: no hit
    assert short is not None and short.num_cached_tokens == 0 and short.groups["v4"].restore == StateRestore(2, "none")
    m.check_integrity()


class _Priced:
    """A RestoreCost in made-up units: a checkpoint copy costs `copy`, a token 1."""

    def __init__(self, copy: float) -> None:
        self.copy = copy

    def checkpoint_cost(self) -> float:
        return self.copy

    def compute_cost(self, num_tokens: int, context_len: int) -> float:
        return float(num_tokens)


@pytest.mark.parametrize(
    ("hit_len", "checkpoint_len", "copy", "expected"),
    [
        (0, 0, 0.0, RestoreChoice(0, "none")),
        (96, 96, 0.0, RestoreChoice(96, "checkpoint")),  # held at the hit: copy 0 < replay 64
        (96, 96, 63.0, RestoreChoice(96, "checkpoint")),  # 63 < 64
        (96, 96, 65.0, RestoreChoice(96, "recompute")),  # a copy dearer than the replay
        (40, 40, 40.0, RestoreChoice(40, "checkpoint")),  # short hit: replay 40 tokens, a tie
        (40, 40, 41.0, RestoreChoice(40, "recompute")),
        (96, 48, 0.0, RestoreChoice(48, "checkpoint")),  # cut 48 tokens < replay 64
        (112, 48, 0.0, RestoreChoice(48, "checkpoint")),  # cut 64 == replay 64: a tie
        (128, 48, 0.0, RestoreChoice(128, "recompute")),  # cut 80 > replay 64
        (96, 48, 20.0, RestoreChoice(96, "recompute")),  # 20 + 48 > 64
        (96, 0, 0.0, RestoreChoice(96, "recompute")),  # nothing held
    ],
)
def test_choose_restore_prices_both_sides_of_the_crossover(
    hit_len: int, checkpoint_len: int, copy: float, expected: RestoreChoice
) -> None:
    # replay window 16 x 4 = 64 tokens: recompute at P costs min(P, 64) tokens; a checkpoint
    # at C <= P costs copy + (P - C) tokens
    assert choose_restore(hit_len, checkpoint_len, SPEC.window * SPEC.num_layers, _Priced(copy)) == expected


def test_choose_restore_refuses_a_checkpoint_beyond_the_hit() -> None:
    with pytest.raises(ValueError, match="checkpoint_len <= hit_len"):
        choose_restore(32, 48, 64, TokenCost())


def _install(m: DSV4CacheManager, prompt: list[int], num_blocks: int) -> None:
    """Publish `num_blocks` spans after the device hit as if a lower tier held them (no
    checkpoint comes with them)."""
    hit, candidates = tier_bridge.prefetch_candidates(m, prompt)
    ids = m.groups["v4"].install(num_blocks, hold=hit)
    assert ids is not None
    m.groups["v4"].publish_installed(ids, candidates[:num_blocks], num_blocks)


def test_auto_restore_chooses_per_admission_by_cost() -> None:
    m = make(20, 4, restore="auto", num_checkpoints=3)
    m.admit("a", _ids(50), 0)
    assert [p for p, _ in _compute(m, "a", 50).groups["v4"].checkpoints] == [16, 32, 48]  # slots 4, 5, 6
    _install(m, _ids(200), 5)  # spans 3..7 (to 128) cached, no checkpoint past 48
    m.check_integrity()
    # hit 48, checkpointed there: copied (TokenCost: a copy is free)
    assert m.admit("b", _ids(50)).groups["v4"].restore == StateRestore(1, "checkpoint", 6)
    assert m.lookup_prefix(_ids(97)) == 48 and m.lookup_prefix(_ids(129)) == 128  # as the admissions below
    # hit 96: cut to 48 computes 48 tokens, the replay 64: cut
    c = m.admit("c", _ids(97))
    assert c.num_cached_tokens == 48 and c.groups["v4"].restore == StateRestore(2, "checkpoint", 6)
    # hit 128: cut to 48 computes 80 tokens, the replay 64: recompute [64, 128)
    d = m.admit("d", _ids(129))
    assert d.num_cached_tokens == 128 and d.groups["v4"].restore == StateRestore(3, "recompute", replay_start=64)
    # c's first step took every slot for its own boundaries (64, 80, 96): 96 is recomputed now
    assert m.lookup_prefix(_ids(97)) == 96
    m.check_integrity()


class _Versioned(_Priced):
    """`_Priced` with a `version` its owner moves with the price (RestoreCost's contract)."""

    def __init__(self, copy: float) -> None:
        super().__init__(copy)
        self.version = 0


@pytest.mark.parametrize("versioned", [True, False])
def test_auto_lookups_follow_the_restore_prices_as_they_move(versioned: bool) -> None:
    # the cut's choices are kept per version (`_restore_choice`): a new version prices
    # afresh, and a cost without one is asked at every lookup
    cost = _Versioned(0.0) if versioned else _Priced(0.0)
    m = make(20, 4, restore="auto", num_checkpoints=3, restore_cost=cost)
    m.admit("a", _ids(50), 0)
    _compute(m, "a", 50)  # checkpoints at 16, 32, 48
    _install(m, _ids(200), 5)  # spans to 128 cached, none checkpointed past 48
    # hit 96, checkpointed at 48: the cut computes copy + 48 tokens, the replay 64
    assert m.lookup_prefix(_ids(97)) == 48
    for copy, expected in [(20.0, 96), (0.0, 48), (16.0, 48), (16.5, 96)]:  # copy + 48 against 64
        cost.copy = copy
        if isinstance(cost, _Versioned):
            cost.version += 1
        assert m.lookup_prefix(_ids(97)) == expected
    m.check_integrity()


def test_the_cuts_kept_restore_choices_are_choose_restores_and_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dual_pool, "MAX_RESTORE_CHOICES", 50)
    cost = _Versioned(10.0)
    g = make(20, 4, restore="auto", num_checkpoints=3, restore_cost=cost).groups["v4"]
    replay_len = SPEC.window * SPEC.num_layers
    for _ in range(2):  # made, then (some) kept
        for n in range(12):
            for k in range(n + 1):
                assert g._restore_choice(n * SPAN, k * SPAN) == choose_restore(n * SPAN, k * SPAN, replay_len, cost)
                assert len(g._choices) <= 50
        for point in range(1, 3 * SPAN):  # a spilled turn end's point (`_spill_pays`): inside a span too
            assert g._restore_choice(point, point) == choose_restore(point, point, replay_len, cost), point
            assert len(g._choices) <= 50


def test_pooled_checkpoints_live_in_the_classical_pool_and_leave_in_its_lru_order() -> None:
    m = make(12, 3, restore="auto", checkpoint_blocks=2)
    m.admit("a", _ids(40), 0)
    res = _compute(m, "a", 40)
    # spans 0, 1 -> blocks 0, 1; the snapshots at 16 and 32 take blocks 2-3 and 4-5
    assert res.groups["v4"].new_block_ids == (0, 1) and res.groups["v4"].checkpoints == ((16, 2), (32, 4))
    assert m.num_free_blocks == 10  # the snapshots are cached free blocks now
    b = m.admit("b", _ids(40) + [1])
    assert b.num_cached_tokens == 32 and b.groups["v4"].restore == StateRestore(1, "checkpoint", 4)  # 4, 5: used last
    m.release("b")
    # c takes the 6 unhashed blocks and the least recently used cached one (2), and its
    # snapshot at 112 the next two (3, 4): both snapshots of a lost a block
    c = m.admit("c", _ids(130, offset=1), 112)
    assert c.groups["v4"].block_ids == (6, 7, 8, 9, 10, 11, 2)
    assert m.pending_reservation("c").groups["v4"].checkpoints == ((112, 3),)
    assert m.num_free_blocks == 1
    m.check_integrity()
    d = m.admit("d", _ids(33))  # the hit at 32 is recomputed now
    assert d.num_cached_tokens == 32 and d.groups["v4"].restore == StateRestore(1, "recompute", replay_start=0)
    m.release("d")
    m.unreserve("c")  # blocks 2, 3, 4 go back, findable again, and the two snapshots with them
    m.check_integrity()
    assert m.admit("e", _ids(33)).groups["v4"].restore == StateRestore(1, "checkpoint", 4)
    m.release("e")
    assert m.admit("f", _ids(17)).groups["v4"].restore == StateRestore(1, "checkpoint", 2)
    m.check_integrity()


def test_release_is_tail_first_and_once() -> None:
    m = make(11, 1)
    m.admit("a", _ids(50), 0)
    _compute(m, "a", 50)
    assert m.release("a") is True
    assert m.pool.free_queue()[-3:] == [2, 1, 0]  # the chain's tail is evicted first
    assert m.release("a") is False
    assert m.usage().num_free_state_blocks == 1
    m.check_integrity()


def test_fork_shares_blocks_and_takes_a_state_block() -> None:
    m = make(11, 2)
    m.admit("a", _ids(20), 0)
    _compute(m, "a", 20)
    m.append_token_ids("a", [7])  # sampled, not computed: the child does not inherit it
    assert m.fork("a", "b") is True
    assert m.part("b").state_slot == 1 and m.block_ids("b") == [0] and m.pool.refcount(0) == 2
    assert m.token_ids("b") == _ids(20)
    assert m.fork("a", "c") is False  # no third state block
    assert "c" not in m
    m.check_integrity()


class Model:
    """What the manager should hold, kept apart from it: every request's tokens, computed
    count, committed table and pending step (from what the calls return), and what each
    classical block and checkpoint slot holds (the prefix it was computed for)."""

    def __init__(self, m: DSV4CacheManager) -> None:
        self.m = m
        self.tokens: dict[str, list[int]] = {}
        self.tenant: dict[str, str] = {}
        self.computed: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.pending: dict[str, tuple[int, tuple[int, ...], tuple[tuple[int, int], ...]]] = {}
        self.block_content: dict[int, tuple] = {}  # block -> (tenant, prefix through its span)
        self.slot_content: dict[int, tuple] = {}  # checkpoint slot -> (tenant, prefix it snapshots)
        # pooled checkpoints: every block of a snapshot holds its prefix's state, so a block
        # taken again for anything else leaves slot_content; a pending step's snapshot blocks
        self.snapshots: dict[str, list[list[int]]] = {}
        self.parts: dict[int, list[int]] = {}  # a pooled checkpoint's first block -> its blocks
        self.undo: dict[str, dict[int, tuple]] = {}  # the snapshot contents a pending step overwrites
        # turn ends: state block -> (tenant, prefix) it holds, oldest kept first; finished
        # turns (tenant, tokens)
        self.kept: dict[int, tuple] = {}
        self.turns: list[tuple[str, list[int]]] = []
        self.num_spills = 0  # kept states spilled to pooled checkpoints

    def prefix(self, rid: str, end: int) -> tuple:
        return (self.tenant[rid], tuple(self.tokens[rid][:end]))

    def admitted(self, rid: str, tokens: list[int], tenant: str, adm) -> None:
        self.tokens[rid], self.tenant[rid] = list(tokens), tenant
        num_hit = adm.num_cached_tokens // SPAN
        hits = list(adm.groups["v4"].block_ids[:num_hit])
        for j, block_id in enumerate(hits):  # a hit holds exactly this prompt's prefix
            assert self.block_content[block_id] == self.prefix(rid, (j + 1) * SPAN), (rid, j, block_id)
        restore = adm.groups["v4"].restore
        self.took_state(restore.state_slot, adopted=restore.method == "adopt")
        if restore.method == "swap":  # a swapped-out state came back: the op checked it
            pass
        elif adm.num_cached_tokens % SPAN and restore.method == "checkpoint":  # a spilled turn end
            for slot in self.parts[restore.checkpoint_slot]:
                assert self.slot_content[slot] == self.prefix(rid, adm.num_cached_tokens)
        elif adm.num_cached_tokens % SPAN:  # else only a kept turn end serves a point inside a span
            assert restore.method == "adopt" and self.kept.pop(restore.state_slot) == self.prefix(
                rid, adm.num_cached_tokens
            )
        elif num_hit and restore.method == "checkpoint":
            for slot in self.parts.get(restore.checkpoint_slot, [restore.checkpoint_slot]):
                assert self.slot_content[slot] == self.prefix(rid, adm.num_cached_tokens)
            assert all(restore.checkpoint_slot != s for _, _, c in self.pending.values() for _, s in c)
        if adm.num_cached_tokens % SPAN or restore.method == "swap":
            pass
        elif not num_hit:
            assert restore.method == "none"
        elif self.m.groups["v4"].spec.restore == "auto":
            assert restore.method in ("checkpoint", "recompute")
        else:
            assert restore.method == self.m.groups["v4"].spec.restore
        self.tables[rid] = hits
        self.computed[rid] = adm.num_cached_tokens
        if adm.num_scheduled_tokens:
            res = self.m.pending_reservation(rid)
            assert res.groups["v4"].new_block_ids == adm.groups["v4"].block_ids[num_hit:]
            self.reserved(rid, res)

    def reserved(self, rid: str, res) -> None:
        start = self.computed[rid]
        assert res.start == start
        assert len(res.groups["v4"].new_block_ids) == (start + res.num_tokens) // SPAN - start // SPAN
        assert not set(res.groups["v4"].new_block_ids) & self.held()
        assert all(p % SPAN == 0 and start < p <= start + res.num_tokens for p, _ in res.groups["v4"].checkpoints)
        self.pending[rid] = (res.num_tokens, res.groups["v4"].new_block_ids, res.groups["v4"].checkpoints)
        if self.m.groups["v4"].spec.checkpoint_blocks:
            pending = self.m._get(rid).states["v4"].pending  # None: the step took no block
            snapshots = pending.snapshot_ids if pending is not None else []
            assert [ids[0] for ids in snapshots] == [slot for _, slot in res.groups["v4"].checkpoints]
            assert all(len(ids) == self.m.groups["v4"].spec.checkpoint_blocks for ids in snapshots)
            self.snapshots[rid] = snapshots
            undo = self.undo[rid] = {}
            for block_id in [*res.groups["v4"].new_block_ids, *(b for ids in snapshots for b in ids)]:
                if block_id in self.slot_content:  # overwritten once the step runs
                    undo[block_id] = self.slot_content.pop(block_id)

    def took_state(self, slot: int, *, adopted: bool = False) -> None:
        """A state block taken by an admission or a fork: a kept turn end in it is gone, which
        an allocation does only when every free state block is a kept one, the oldest first."""
        spills = self.m.take_spills()
        if slot in self.kept and not adopted:
            assert next(iter(self.kept)) == slot and self.m.usage().num_free_state_blocks + 1 == len(self.kept)
            prefix = self.kept.pop(slot)
            if spills:  # spilled: a pooled checkpoint of the state, in blocks nobody holds
                ((spilled_slot, first),) = spills
                g = self.m.groups["v4"]
                assert spilled_slot == slot
                self.num_spills += 1
                # (the admission's first step may have taken its blocks again already: then it is gone)
                live = [c for c in g._spilled.values() if c.slot == first and all(p.block_ids for p in c.parts)]
                if live:
                    ((ckpt,),) = (live,)  # (a block holds one live spill)
                    ids = [part.block_ids[0] for part in ckpt.parts]
                    assert len(ids) == g.spec.checkpoint_blocks and ckpt.block.token_bytes == token_bytes(
                        list(prefix[1][len(prefix[1]) // SPAN * SPAN :])
                    )
                    assert not set(ids) & self.held()
                    self.parts[first] = ids
                    for block_id in ids:
                        self.slot_content[block_id] = prefix
        assert not spills or adopted is False and spills[0][0] == slot

    def finished(self, rid: str, slot: int) -> None:
        """A finish: the state block is kept exactly when turn ends are on, the turn ends
        inside a span with no step pending, and no block keeps that prefix yet (a restore
        still pending is one at a span boundary, or an adoption: the state is there)."""
        n, prefix = self.computed[rid], self.prefix(rid, self.computed[rid])
        keep = (
            self.m.turn_end_checkpoints
            and n % SPAN != 0
            and rid not in self.pending
            and prefix not in self.kept.values()
        )
        assert (self.m.groups["v4"].state_pool.block_hash(slot) is not None) == keep, (rid, n, keep)
        if keep:
            self.kept[slot] = prefix
        self.turns.append((self.tenant[rid], list(self.tokens[rid])))

    def committed(self, rid: str) -> None:
        num_tokens, new_ids, checkpoints = self.pending.pop(rid)
        first = len(self.tables[rid])
        for k, block_id in enumerate(new_ids):
            self.block_content[block_id] = self.prefix(rid, (first + k + 1) * SPAN)
        for k, (position, slot) in enumerate(checkpoints):
            ids = self.snapshots[rid][k] if self.m.groups["v4"].spec.checkpoint_blocks else [slot]
            self.parts[slot] = ids
            for block_id in ids:
                self.slot_content[block_id] = self.prefix(rid, position)
        self.snapshots.pop(rid, None)
        self.tables[rid] += list(new_ids)
        self.computed[rid] += num_tokens

    def released(self, rid: str) -> None:
        for d in (self.tokens, self.tenant, self.computed, self.tables, self.pending, self.snapshots):
            d.pop(rid, None)

    def held(self) -> set[int]:
        committed = {b for t in self.tables.values() for b in t}
        snapshots = {b for s in self.snapshots.values() for ids in s for b in ids}
        return committed | snapshots | {b for _, ids, _ in self.pending.values() for b in ids}

    def check(self) -> None:
        m = self.m
        m.check_integrity()
        assert sorted(m.request_ids) == sorted(self.tables)
        counts = [0] * m.num_blocks
        for rid, table in self.tables.items():
            reserved = table + list(self.pending[rid][1] if rid in self.pending else ())  # the reserved step's too
            assert m.block_ids(rid) == reserved and m.num_computed_tokens(rid) == self.computed[rid]
            assert m.token_ids(rid) == self.tokens[rid]
            res = m.pending_reservation(rid)
            assert (res is None) == (rid not in self.pending)
            for block_id in reserved:
                counts[block_id] += 1
            for ids in self.snapshots.get(rid, ()):
                for block_id in ids:
                    counts[block_id] += 1
        # the batched query of the step's reservations: those that took blocks or checkpoints
        ids = sorted(self.pending)
        starts = [self.computed[r] for r in ids]
        ends = [self.computed[r] + self.pending[r][0] for r in ids]
        took = {r: m.pending_reservation(r) for r in ids if self.pending[r][1] or self.pending[r][2]}
        assert m.step_reservations(ids, starts, ends) == took
        if ids:
            with pytest.raises(ValueError, match="not its reserved step"):
                m.step_reservations(ids, starts, [e + 1 for e in ends])
            with pytest.raises(ValueError, match=rf"request '{ids[-1]}': positions \[{starts[-1] + 1},"):
                m.step_reservations(ids, starts[:-1] + [starts[-1] + 1], ends)
            with pytest.raises(KeyError, match="unknown request 'nobody'"):
                m.step_reservations([*ids, "nobody"], [*starts, 0], [*ends, 1])
        assert [m.pool.refcount(b) for b in range(m.num_blocks)] == counts
        assert m.num_free_blocks == m.num_blocks - len(self.held())
        slots = [m.part(rid).state_slot for rid in self.tables]
        usage = m.usage()
        assert len(set(slots)) == len(slots) and usage.num_free_state_blocks == usage.num_state_blocks - len(slots)
        states = m.groups["v4"].state_pool
        kept = [b for b in range(states.num_blocks) if states.block_hash(b) is not None]
        assert kept == sorted(self.kept) and all(states.refcount(b) == 0 for b in kept)
        # the one-group lookup (`_hits`, `hit_point`) against its twin over any number of
        # groups: the finished turns' prompts one token on (kept turn ends: points off the
        # grid) and the running ones, at the prompt's length and at shorter ones
        running = [(self.tenant[r], self.tokens[r]) for r in sorted(self.tables)[:2]]
        for tenant, tokens in [*self.turns[-3:], *running]:
            prompt = pack_prompt([*tokens, 3])
            roots = m._request_roots(tenant, None)
            hits = m._hits(roots, prompt)
            assert hits == m._hits_of_groups(roots, prompt, True, False)
            for n in {len(prompt.token_ids), len(tokens), 2 * SPAN + 1, SPAN}:
                assert m.hit_point(hits, n) == m._hit_point_of_groups(hits, n), (tokens, n)
            # the turn ends found by comparing the kept tokens in the packing, and by hashing
            # the prompt's blocks (the twin), after every cached span of the prompt
            g = m.groups["v4"]
            num = len(tokens) // SPAN
            parents = [roots["v4"], *g.pool.match(roots["v4"], prompt.packed, SPAN * 4, num).chain]
            for limit in (len(tokens), len(tokens) - 3):
                by_bytes = g._turn_ends.find_along(parents, prompt.token_ids, (), limit, prompt.packed)
                assert by_bytes == g._turn_ends.find_along(parents, prompt.token_ids, (), limit)


OPS = st.sampled_from(
    ["admit", "step", "step", "step", "decode", "decode", "commit", "unreserve", "fork", "release", "install"]
)


@settings(max_examples=int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "150")), deadline=None)
@given(
    checkpoints=st.sampled_from(
        [("recompute", {}), ("checkpoint", {"num_checkpoints": 2}), ("auto", {"num_checkpoints": 2})]
        + [("checkpoint", {"checkpoint_blocks": 2}), ("auto", {"checkpoint_blocks": 1})]  # pooled
    ),
    ops=st.lists(st.tuples(OPS, st.integers(0, 3), st.integers(1, 40), st.booleans()), min_size=10, max_size=60),
)
def test_lifecycle_against_a_model(
    checkpoints: tuple[str, dict[str, int]], ops: list[tuple[str, int, int, bool]]
) -> None:
    restore, kw = checkpoints
    _lifecycle(make(8, 3, restore=restore, **kw), ops, 30)


# steps reserved and undone more often than in OPS: a reservation that pushes a checkpoint
# out is undone (its checkpoint back) or committed, about as often
UNDO_OPS = st.sampled_from(["admit", "admit", "step", "step", "unreserve", "unreserve", "decode", "commit", "release"])


@settings(max_examples=int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "150")) // 3, deadline=None)
@given(
    restore=st.sampled_from(["checkpoint", "auto"]),
    ops=st.lists(st.tuples(UNDO_OPS, st.integers(0, 3), st.integers(1, 40), st.booleans()), min_size=10, max_size=60),
)
def test_lifecycle_with_one_checkpoint_slot(restore: str, ops: list[tuple[str, int, int, bool]]) -> None:
    # One slot and prompts of 3-5 spans: nearly every step that reaches a boundary pushes
    # the checkpoint out of the slot, and an unreserve puts it back (out of order too)
    _lifecycle(make(8, 3, restore=restore, num_checkpoints=1), ops, 50, undo_at_once=True)


# finishes and follow-up turns (a finished conversation's tokens and two more) mixed with
# everything else: turn ends kept, adopted, evicted by admissions and forks
TURN_OPS = st.sampled_from(
    ["admit", "follow", "follow", "step", "step", "decode", "commit", "unreserve", "fork", "release", "finish"]
)


@settings(max_examples=int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "150")) // 2, deadline=None)
@given(
    checkpoints=st.sampled_from(
        [("recompute", {}), ("auto", {"num_checkpoints": 2}), ("auto", {"checkpoint_blocks": 1})]
        + [("checkpoint", {"checkpoint_blocks": 2})]  # pooled: kept states spilled there when taken
    ),
    ops=st.lists(st.tuples(TURN_OPS, st.integers(0, 3), st.integers(1, 40), st.booleans()), min_size=10, max_size=60),
)
def test_lifecycle_with_turn_ends(
    checkpoints: tuple[str, dict[str, int]], ops: list[tuple[str, int, int, bool]]
) -> None:
    restore, kw = checkpoints
    _lifecycle(make(8, 3, restore=restore, turn_end_checkpoints=True, **kw), ops, 30)


# swap preemptions and resumes mixed with everything else, turn ends on or off
SWAP_OPS = st.sampled_from(
    ["admit", "follow", "step", "step", "decode", "commit", "swapback", "swapback", "unreserve", "fork", "finish"]
)


@settings(max_examples=int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "150")) // 2, deadline=None)
@given(
    checkpoints=st.sampled_from(
        [("recompute", {}), ("auto", {"num_checkpoints": 2}), ("auto", {"checkpoint_blocks": 1})]
    ),
    turn_ends=st.booleans(),
    ops=st.lists(st.tuples(SWAP_OPS, st.integers(0, 3), st.integers(1, 40), st.booleans()), min_size=10, max_size=60),
)
def test_lifecycle_with_swapped_states(
    checkpoints: tuple[str, dict[str, int]], turn_ends: bool, ops: list[tuple[str, int, int, bool]]
) -> None:
    restore, kw = checkpoints
    _lifecycle(make(8, 3, restore=restore, turn_end_checkpoints=turn_ends, **kw), ops, 30)


def _lru(m: DSV4CacheManager) -> tuple[dict[bytes, int], list[int], list[int]]:
    """The findable checkpoints (boundary hash -> slot), the slot pool's and the classical
    pool's free queues, in LRU order."""
    g = m.groups["v4"]
    return {h: c.slot for h, c in g._checkpoints.items()}, g.checkpoint_pool.free_queue(), m.pool.free_queue()


def _lifecycle(
    m: DSV4CacheManager, ops: list[tuple[str, int, int, bool]], prompt_len: int, *, undo_at_once: bool = False
) -> None:
    """Run `ops` on `m` against the Model (check_integrity after every op): op, request
    r<who>, a count n (prompts of n + prompt_len tokens), a flag. undo_at_once: a "step"
    with the flag that reserves is undone at once, and must leave `_lru` as it was."""
    model = Model(m)
    num_forks = 0
    for op, who, n, flag in ops:
        rid = f"r{who}"
        if op in ("admit", "follow") and rid not in m:
            tenant = "t2" if flag and who == 3 else ""
            tokens = _ids(n + prompt_len, offset=who % 2)  # r0 / r2 and r1 / r3 share prefixes
            if op == "follow" and model.turns:  # the next turn of a finished conversation
                tenant, tokens = model.turns[-1 - n % len(model.turns)]
                tokens = tokens + [n, 3]
            free_before = m.pool.free_queue()
            packed = None
            if n % 2:  # the router's path: a lookup of the packed prompt, whose memo the admission reuses
                packed = pack_prompt(tokens)
                looked = m.lookup_packed(packed, tenant_salt=tenant)
            adm = m.admit(
                rid, tokens, None if flag else n, tenant_salt=tenant, prompt=packed
            )  # whole prompt, or a chunk
            if packed is not None and adm is not None:
                assert adm.num_cached_tokens == looked
            if adm is None:
                assert rid not in m and m.pool.free_queue() == free_before
            else:
                model.admitted(rid, tokens, tenant, adm)
        elif op == "step" and rid in m:
            if rid in model.pending:
                m.commit(rid, model.pending[rid][0])
                model.committed(rid)
            else:
                left = m.num_tokens(rid) - m.num_computed_tokens(rid)
                if left == 0:
                    m.append_token_ids(rid, [n])
                    model.tokens[rid].append(n)
                    left = 1
                before = _lru(m) if undo_at_once and flag else None
                res = m.reserve(rid, min(n, left))
                if res is not None and before is not None:
                    m.unreserve(rid)  # undone latest first: every pool and checkpoint as it was
                    m.check_integrity()
                    assert _lru(m) == before
                elif res is not None:
                    model.reserved(rid, res)
        elif op == "decode":
            # the engine's decode steps: every request without a pending step, one token each,
            # n rounds (across span boundaries) committed by commit_step; with flag one round,
            # left pending for a later "step" (commit) or "commit" (commit_step)
            for _ in range(1 if flag else n):
                ids = [r for r in m.request_ids if r not in model.pending]
                for r in ids:
                    if m.num_tokens(r) == m.num_computed_tokens(r):
                        m.append_token_ids(r, [n])
                        model.tokens[r].append(n)
                free_before = m.pool.free_queue()
                if not m.reserve_step(ids, [1] * len(ids)):
                    assert m.pool.free_queue() == free_before and all(m.pending_reservation(r) is None for r in ids)
                    break
                for r in ids:
                    model.reserved(r, m.pending_reservation(r))
                if not flag:
                    m.commit_step(ids, [1] * len(ids), [None] * len(ids))
                    for r in ids:
                        model.committed(r)
                model.check()
        elif op == "commit" and model.pending:  # commit_step over every pending step, next tokens known
            ids = sorted(model.pending)
            counts = [model.pending[r][0] for r in ids]
            nexts = [
                None if flag or m.num_computed_tokens(r) + c < m.num_tokens(r) else n
                for r, c in zip(ids, counts, strict=True)
            ]
            m.commit_step(ids, counts, nexts)
            for r, next_id in zip(ids, nexts, strict=True):
                model.committed(r)
                if next_id is not None:
                    model.tokens[r].append(next_id)
        elif op == "unreserve" and rid in model.pending:
            m.unreserve(rid)
            del model.pending[rid]
            model.snapshots.pop(rid, None)
            model.slot_content.update(model.undo.pop(rid, {}))  # the step never ran
        elif op == "fork" and rid in m and rid not in model.pending:
            num_forks += 1
            child = f"{rid}-fork{num_forks}"
            if m.fork(rid, child):
                model.took_state(m.part(child).state_slot)
                model.tokens[child] = model.tokens[rid][: model.computed[rid]]
                model.tenant[child] = model.tenant[rid]
                model.computed[child] = model.computed[rid]
                model.tables[child] = list(model.tables[rid])
            else:
                assert m.usage().num_free_state_blocks == 0 and child not in m
        elif op == "finish" and rid in m:  # its pending step committed (flag: undone), then a finish
            if rid in model.pending and flag:
                m.unreserve(rid)
                del model.pending[rid]
                model.snapshots.pop(rid, None)
                model.slot_content.update(model.undo.pop(rid, {}))
            elif rid in model.pending:
                m.commit(rid, model.pending[rid][0])
                model.committed(rid)
            slot = m.part(rid).state_slot
            assert m.release(rid) is True
            model.finished(rid, slot)
            model.released(rid)
        elif op == "release":  # flag: a preemption (the request may be admitted again)
            for r in [r for r in m.request_ids if r == rid or r.startswith(rid + "-")]:
                how = "preempt" if flag else "finish"
                slot = m.part(r).state_slot
                assert m.release(r, how) is True and m.release(r, how) is False
                if how == "finish":
                    model.finished(r, slot)
                model.released(r)
        elif op == "swapback" and rid in m and (model.computed[rid] or rid in model.pending):
            # a swap preemption and its resume (engine/tier_bridge.py swap_out / swap_in): its
            # pending step committed, the request is released and admitted again with its
            # tokens (one more when all are computed); where its hit is the span boundary
            # before its computed tokens, its state comes back and the tokens past the
            # boundary count as computed
            if rid in model.pending:
                m.commit(rid, model.pending[rid][0])
                model.committed(rid)
            nc, tenant = model.computed[rid], model.tenant[rid]
            tokens = model.tokens[rid] + ([n] if len(model.tokens[rid]) == nc else [])
            assert m.release(rid, "preempt") is True
            model.released(rid)
            adm = m.admit(rid, tokens, None if flag else n, tenant_salt=tenant)
            if adm is not None:
                tail, refusal = nc % SPAN, m.swapped_state_refusal(rid, nc % SPAN)
                if adm.num_cached_tokens == nc - tail and refusal is None:
                    adm = m.restore_swapped_state(rid, tail)
                    assert adm.num_cached_tokens == nc and adm.groups["v4"].restore.method == "swap"
                elif adm.num_cached_tokens == nc - tail:  # the first step keeps no reserved token
                    assert nc >= adm.num_cached_tokens + adm.num_scheduled_tokens, refusal
                    with pytest.raises(ValueError, match=f"request '{rid}'"):
                        m.restore_swapped_state(rid, tail)
                model.admitted(rid, tokens, tenant, adm)
        elif op == "install":
            # a lower tier brings back spans after the device hit of r<who>'s prompt: up to 3
            # blocks installed, all loaded (flag) or the last one missing
            tokens, tenant = _ids(n + prompt_len, offset=who % 2), "t2" if flag and who == 3 else ""
            hit, candidates = tier_bridge.prefetch_candidates(m, tokens, tenant)
            assert len(hit) + len(candidates) == (len(tokens) - 1) // SPAN
            num = min(len(candidates), 1 + n % 3)
            free_before = m.pool.free_queue()
            ids = m.groups["v4"].install(num, hold=hit) if num else None
            if ids is None:
                assert m.pool.free_queue() == free_before
            else:
                assert not set(ids) & (model.held() | set(hit))
                num_loaded = num if flag else num - 1
                for block_id in ids if m.groups["v4"].spec.checkpoint_blocks else ():
                    model.slot_content.pop(block_id, None)  # a pooled snapshot's block written over
                for j, block_id in enumerate(ids[:num_loaded]):
                    model.block_content[block_id] = (tenant, tuple(tokens[: (len(hit) + j + 1) * SPAN]))
                m.groups["v4"].publish_installed(ids, candidates[:num], num_loaded)
                if m.enable_prefix_caching and num_loaded and m.groups["v4"].spec.restore == "recompute":
                    assert m.lookup_prefix(tokens, tenant_salt=tenant) >= (len(hit) + num_loaded) * SPAN
        model.check()
    for rid in m.request_ids:
        m.release(rid)
    m.check_integrity()
    assert m.num_free_blocks == 8 and m.usage().num_free_state_blocks == 3


@pytest.mark.parametrize("kw", [{}, {"restore": "checkpoint", "num_checkpoints": 2}, {"checkpoint_blocks": 1}])
def test_the_decode_step_asks_the_group_at_span_ends_only(kw: dict) -> None:
    # A decode step's reserve_step and step_reservations hand the dual pool only the requests
    # whose step completes a span (decode_reserve_period), and commit_step only those whose
    # one token completes one (commit_period), in a mixed step (a newcomer's prefill joins
    # the decodes) too; their naive twins (the periods unset, and `_commit_each`) ask about
    # every request. Both must take the same blocks and checkpoints, report the same
    # reservations, refuse the same steps (nothing changed), and leave the same pools and
    # requests, on staggered requests in a tight pool.
    managers = [make(12, 4, **kw), make(12, 4, **kw)]
    managers[1]._decode_period, managers[1]._commit_period = None, 1
    rng = random.Random(3)
    for m in managers:
        for i, n in enumerate((SPAN - 2, 2 * SPAN - 5, 3, SPAN + 1)):
            assert m.admit(f"r{i}", _ids(n + 1, offset=i)) is not None
            m.commit_step([f"r{i}"], [n + 1], [None])
    refused = taken = mixed = 0
    for step in range(3 * SPAN):
        ids = sorted(managers[0].request_ids)
        token = rng.randrange(251)
        newcomer = f"n{step}" if step % 5 == 4 else None
        results = []
        for k, m in enumerate(managers):
            for r in ids:
                if m.num_tokens(r) == m.num_computed_tokens(r):
                    m.append_token_ids(r, [token])
            fits = m.reserve_step(ids, [1] * len(ids))
            step_ids, counts = list(ids), [1] * len(ids)
            if fits and newcomer is not None and m.admit(newcomer, _ids(SPAN + 3, offset=step)) is not None:
                step_ids.append(newcomer)
                counts.append(SPAN + 3)
            starts = [m.num_computed_tokens(r) for r in step_ids]
            ends = [s + n for s, n in zip(starts, counts, strict=True)]
            step_res = m.step_reservations(step_ids, starts, ends) if fits else None
            results.append((fits, step_ids, step_res, [m.pending_reservation(r) for r in ids], m.pool.free_queue()))
            if fits:
                nexts = [None if (step + i) % 3 == 0 else token for i in range(len(step_ids))]
                (m.commit_step if k == 0 else m._commit_each)(step_ids, counts, nexts)
            m.check_integrity()
        assert results[0] == results[1], step
        taken += bool(results[0][2])
        mixed += len(results[0][1]) > len(ids)
        if not results[0][0]:
            refused += 1
            for m in managers:  # make room: the latest request goes
                m.release(ids[-1], "preempt")
        requests = [[(r, m.num_computed_tokens(r), m.token_ids(r)) for r in m.request_ids] for m in managers]
        assert requests[0] == requests[1], step
    assert refused and taken and mixed  # the pool ran out; some steps completed spans; some were mixed


@pytest.mark.parametrize("apart", [True, False])
@pytest.mark.parametrize("paged", [True, False])
def test_a_forks_first_decode_in_a_mixed_step_reaches_the_groups(
    paged: bool, apart: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fork's first step is a decode off the commit period beside a newcomer's prefill
    # chunk: the commit's pass looks for the few fresh requests after it
    # (`_fresh_decodes`), not at every row (apart=False: more than MAX_FRESH_APART, asked
    # about at every row). The groups must see the fork's row (it is not fresh after, as
    # the naive twin `_commit_each` leaves it), in step order, and the caches must agree
    # in every count, token and block
    if not apart:
        monkeypatch.setattr(coordinator, "MAX_FRESH_APART", 0)

    def build() -> HybridCacheManager:
        return FullAttentionManager(40, 4, DESC) if paged else make(12, 6)

    managers = [build(), build()]
    views = []
    for k, m in enumerate(managers):
        assert m.admit("r0", _ids(SPAN + 5)) is not None
        m.commit_step(["r0"], [SPAN + 5], [9])
        assert m.fork("r0", "c0")
        m.append_token_ids("c0", [8])
        assert m._fresh == {"c0"}
        assert m.reserve_step(["r0", "c0"], [1, 1])
        assert m.admit("n0", _ids(SPAN + 3, offset=1)) is not None
        ids, counts = ["r0", "c0", "n0"], [1, 1, SPAN + 3]
        (m.commit_step if k == 0 else m._commit_each)(ids, counts, [4, 5, 6])
        m.check_integrity()
        assert m._fresh == set()
        views.append(([(r, m.num_computed_tokens(r), m.token_ids(r)) for r in ids], m.pool.free_queue(), m.usage()))
    assert views[0] == views[1]
    assert views[0][0][:2] == [("r0", SPAN + 6, [*_ids(SPAN + 5), 9, 4]), ("c0", SPAN + 6, [*_ids(SPAN + 5), 8, 5])]


@pytest.mark.parametrize("exact", [True, False])
def test_a_decode_step_with_a_request_at_fault_changes_nothing(exact: bool) -> None:
    # The decode paths of reserve_step and commit_step check and change each request in one
    # pass: a request at fault (unknown, listed twice, a step already reserved, no token id,
    # a commit of a step not reserved) anywhere in the batch undoes the changes before it
    # and raises what the naive twin names. V4 (exact steps) and a paged cache.
    def build() -> HybridCacheManager:
        if exact:
            m: HybridCacheManager = make(12, 6)
        else:
            m = FullAttentionManager(40, 4, DESC)
        for i in range(4):
            rid = f"r{i}"
            assert m.admit(rid, _ids(SPAN - 1 + i, offset=i)) is not None
            m.commit_step([rid], [SPAN - 1 + i], [i])  # r0's decode ends on a span: it takes a block
        return m

    def snapshot(m: HybridCacheManager) -> tuple:
        return (
            [(r, m.num_computed_tokens(r), m.num_reserved_tokens(r), m.token_ids(r)) for r in m.request_ids],
            m.pool.free_queue(),
        )

    ids = ["r0", "r1", "r2", "r3"]
    cases = [
        (["r0", "r1", "ghost", "r3"], KeyError, "unknown request 'ghost'"),
        (["r0", "r1", "r2", "r1"], ValueError, "appears twice"),
    ]
    for bad_ids, error, message in cases:
        m = build()
        before = snapshot(m)
        with pytest.raises(error, match=message):
            m.reserve_step(bad_ids, [1] * 4)
        assert snapshot(m) == before
        m.check_integrity()
    if exact:  # (not exact steps: a decode inside its reserved block is checked at its commit)
        m = build()
        assert m.reserve_step(["r2"], [1])
        before = snapshot(m)
        with pytest.raises(ValueError, match="'r2' already has an uncommitted reservation"):
            m.reserve_step(ids, [1] * 4)
        assert snapshot(m) == before
        m.commit_step(["r2"], [1], [None])  # r2 knows no next token now
        before = snapshot(m)
        with pytest.raises(ValueError, match="'r2'.* token ids are known"):
            m.reserve_step(ids, [1] * 4)
        assert snapshot(m) == before
    # commits: r2's step is not reserved (exact), or r2's token id is not known
    m = build()
    assert m.reserve_step(["r0", "r1", "r3"], [1, 1, 1])
    if not exact:
        m.commit_step(["r2"], [1], [None])  # inside its reserved block, its next token id not known
    before = snapshot(m)
    with pytest.raises(ValueError, match="request 'r2': commit of 1 token"):
        m.commit_step(["r0", "r1", "r2", "r3"], [1] * 4, [7, 8, 9, 10])
    assert snapshot(m) == before
    for bad_ids, error, message in cases:
        with pytest.raises(error, match=message):
            m.commit_step(bad_ids, [1] * 4, [7, 8, 9, 10])
        assert snapshot(m) == before
    m.check_integrity()
    # a mixed step: a newcomer's prefill among the decodes (its commit of one token too many)
    prompt = _ids(SPAN + 5, offset=5)
    assert m.admit("new", prompt) is not None and m.num_computed_tokens("new") == 0
    before = snapshot(m)
    mixed_cases = [
        (["r0", "r1", "new", "ghost"], [1, 1, SPAN + 5, 1], KeyError, "unknown request 'ghost'"),
        (["r0", "new", "r1", "r0"], [1, SPAN + 5, 1, 1], ValueError, "appears twice"),
        (["r0", "r1", "r3", "new"], [1, 1, 1, SPAN + 6], ValueError, f"request 'new': commit of {SPAN + 6} tokens"),
    ]
    for bad_ids, counts, error, message in mixed_cases:
        with pytest.raises(error, match=message):
            m.commit_step(bad_ids, counts, [7, 8, 9, 10])
        assert snapshot(m) == before
    m.commit_step(["r0", "r1", "new", "r3"], [1, 1, SPAN + 5, 1], [7, 8, 9, 10])
    assert [m.token_ids(r)[-1] for r in ("r0", "r1", "new", "r3")] == [7, 8, 9, 10]
    assert m.token_ids("new") == [*prompt, 9] and m.num_computed_tokens("new") == SPAN + 5
    m.check_integrity()


@pytest.mark.parametrize("exact", [True, False])
def test_a_mixed_steps_decodes_take_the_decode_path_and_a_fault_anywhere_changes_nothing(exact: bool) -> None:
    # A mixed step as the engine makes it: reserve_step of the running decodes, then a
    # newcomer's admission, then step_reservations and commit_step of the decodes with the
    # newcomer's chunk after them. On V4 the admission keeps the decode-step memo, so the
    # decodes' rows are answered and committed from it (unchecked), the chunk's row after
    # them checked; on a paged cache the decodes go through the decode path's checked loop.
    # A fault in a decode row or in the chunk's row undoes every change and raises what the
    # naive twin names; the good step equals the twin's (`_commit_each`, `_each_reservation`)
    def build() -> HybridCacheManager:
        m: HybridCacheManager = make(12, 6) if exact else FullAttentionManager(40, 4, DESC)
        for i in range(4):
            rid = f"r{i}"
            assert m.admit(rid, _ids(SPAN - 1 + i, offset=i)) is not None
            m.commit_step([rid], [SPAN - 1 + i], [i])  # r0's decode ends on a span: it takes a block
        if not exact:
            m.commit_step(["r2"], [1], [None])  # inside its reserved block, its next token id not known
        assert m.reserve_step(["r0", "r1", "r3"], [1, 1, 1])
        assert m.admit("new", _ids(SPAN + 5, offset=5)) is not None
        assert (m._decode_step is not None) == exact  # (V4: the memo held through the admission)
        return m

    def snapshot(m: HybridCacheManager) -> tuple:
        return (
            [(r, m.num_computed_tokens(r), m.num_reserved_tokens(r), m.token_ids(r)) for r in m.request_ids],
            m.pool.free_queue(),
        )

    n = SPAN + 5
    cases = [
        (["r0", "r1", "r3", "new"], [1, 1, 1, n + 1], [7, 8, 9, 10], ValueError, f"request 'new': commit of {n + 1}"),
        (["r0", "r1", "r3", "new"], [1, 1, 1, n], [7, -1, 9, 10], ValueError, "token id -1 is no int"),
        (["r0", "r1", "r3", "new"], [1, 1, 1, n], [7, 8, 9, 2**32], ValueError, "token id 4294967296 is no int"),
        (["r0", "r1", "r3", "ghost"], [1, 1, 1, n], [7, 8, 9, 10], KeyError, "unknown request 'ghost'"),
        (["r0", "r1", "r3", "r1"], [1, 1, 1, n], [7, 8, 9, 10], ValueError, "appears twice"),
        (["r0", "r2", "r3", "new"], [1, 1, 1, n], [7, 8, 9, 10], ValueError, "request 'r2': commit of 1 token"),
    ]
    for ids, counts, nexts, error, message in cases:
        m = build()
        before = snapshot(m)
        with pytest.raises(error, match=message):
            m.commit_step(ids, counts, nexts)
        assert snapshot(m) == before, message
        m.check_integrity()
    ids, counts, nexts = ["r0", "r1", "r3", "new"], [1, 1, 1, n], [7, 8, 9, 10]
    fast, twin = build(), build()
    twin._decode_step = None  # the twin checks every row: no memo
    starts = [fast.num_computed_tokens(r) for r in ids]
    ends = [s + c for s, c in zip(starts, counts, strict=True)]
    # exact steps: positions that are not a decode row's reserved step are refused as the
    # twin refuses them, whether the memo answers the rows or not: a start one short, an end
    # one long, both one on (the chunk's row unchanged: only the memo's check of the decode
    # rows can see it). (A paged cache reads any positions within the reservation.)
    for row, start_shift, end_shift in [(1, -1, 0), (2, 0, 1), (0, 1, 1)] if exact else []:
        bad_starts, bad_ends = list(starts), list(ends)
        bad_starts[row] += start_shift
        bad_ends[row] += end_shift
        messages = []
        for m in (fast, twin):
            with pytest.raises(ValueError, match=f"request '{ids[row]}': positions") as raised:
                m.step_reservations(ids, bad_starts, bad_ends)
            messages.append(str(raised.value))
        assert messages[0] == messages[1]
    taken = fast.step_reservations(ids, starts, ends)
    assert taken == twin._each_reservation(ids, starts, ends)
    if exact:  # r0's decode took a block (from the memo's rows), the chunk its own: in step order
        assert list(taken) == ["r0", "new"]
    fast.commit_step(ids, counts, nexts)
    twin._commit_each(ids, counts, nexts)
    for m in (fast, twin):
        m.check_integrity()
    assert snapshot(fast) == snapshot(twin)
    assert [fast.token_ids(r)[-1] for r in ids] == nexts and fast.num_computed_tokens("new") == n
    assert [len(fast.part(r).prefix_chain()) for r in ids] == [len(twin.part(r).prefix_chain()) for r in ids]


def _collide_checkpoint_parts(pool) -> None:
    """Every checkpoint part of `pool` hashes alike from now on (a forced hash collision)."""
    digest = pool.hasher.digest
    pool.hasher.digest = lambda data: digest(b"x") if b"v4-state:" in data else digest(data)


@pytest.mark.parametrize("kw", [{"num_checkpoints": 2}, {"checkpoint_blocks": 1}])
def test_a_checkpoint_hash_collision_is_counted_over_the_caches_pools(kw: dict) -> None:
    # The engine report's hash_collisions sums over `pools`: a pool of checkpoint slots of
    # its own is one of them, as are the state blocks (before: only the classical pool)
    m = make(8, 3, restore="checkpoint", **kw)
    g = m.groups["v4"]
    _collide_checkpoint_parts(g.checkpoint_pool)
    m.admit("a", _ids(40))
    m.commit("a", 40)  # checkpoints at 16 and 32: the second's part collides with the first's
    m.check_integrity()
    assert len(g._checkpoints) == 1 and g.checkpoint_pool.num_collisions == 1
    assert sum(pool.num_collisions for pool in m.pools) == 1
    own = [g.checkpoint_pool] if kw.get("num_checkpoints") else []
    assert m.pools == [g.pool, g.state_pool, *own]


@pytest.mark.parametrize("kw", [{"checkpoint_blocks": 1}, {"num_checkpoints": 2}])
def test_metadata_bytes_counts_every_pool(kw: dict) -> None:
    import sys

    m = make(8, 3, restore="checkpoint", **kw)
    g = m.groups["v4"]
    pools = [g.pool, g.state_pool] + ([g.checkpoint_pool] if kw.get("num_checkpoints") else [])
    # no request yet: the pools' own structures and an empty request table
    assert m.metadata_bytes() == sum(pool.metadata_bytes() for pool in pools) + sys.getsizeof({})


def test_a_stale_slot_checkpoint_is_replaced_when_its_prefix_is_computed_again() -> None:
    # 3 classical blocks, 3 state slots, checkpoint slots 3-7 (slot pool blocks 0-4)
    m = make(3, 3, restore="checkpoint", num_checkpoints=5)
    g = m.groups["v4"]
    slots = g.checkpoint_pool

    def checkpoints() -> dict[int, bool]:  # slot -> its boundary block still findable
        return {c.slot: g.pool.is_published(c.block) for c in g._checkpoints.values()}

    a = _ids(20, offset=1)
    m.admit("a", a, 0)
    _compute(m, "a", 20)
    m.release("a")
    assert m.lookup_prefix(a) == 16 and checkpoints() == {3: True}
    m.admit("b", _ids(49, offset=50), 0)  # three spans: every classical block, a's evicted
    _compute(m, "b", 49)
    m.release("b")
    assert m.lookup_prefix(a) == 0 and checkpoints() == {3: False, 4: True, 5: True, 6: True}
    # a's prefix computed again: its new checkpoint (slot 7, the free one) replaces the
    # stale one, whose slot goes back unhashed, first to be taken; c's block evicted b's
    # last span (released tail first), so the checkpoint at b's 48 is stale now
    m.admit("c", a, 0)
    _compute(m, "c", 20)
    m.release("c")
    m.check_integrity()
    assert m.lookup_prefix(a) == 16 and checkpoints() == {7: True, 4: True, 5: True, 6: False}
    assert slots.free_queue()[0] == 0 and slots.block_hash(0) is None
    d = m.admit("d", a + [9])
    assert d.num_cached_tokens == 16 and d.groups["v4"].restore == StateRestore(0, "checkpoint", 7)
    m.check_integrity()


def test_a_follow_up_turn_adopts_the_state_block_its_turn_left_inside_a_span() -> None:
    m = make(11, 3, turn_end_checkpoints=True)
    m.admit("x", _ids(32, 3), 0)
    _compute(m, "x", 32)  # state block 0
    m.admit("a", _ids(40), 0)
    _compute(m, "a", 40)  # state block 1; spans 0, 1 in blocks 2, 3, tokens [32, 40) in the state block
    assert m.block_ids("a") == [2, 3]
    states = m.groups["v4"].state_pool
    m.release("a")  # its turn ends at 40, inside span 2: block 1 is kept, free and findable
    m.release("x")  # x ends on a span boundary: nothing kept
    assert states.free_queue() == [2, 0, 1] and states.block_hash(1) is not None and states.block_hash(0) is None
    m.check_integrity()
    follow_up = _ids(40) + [1, 2, 3]
    assert m.group_hit_points(follow_up) == {"v4": [0, 16, 32, 40]}
    b = m.admit("b", follow_up)  # hits the turn end: 8 tokens past paging's 32, block 1 adopted
    assert b is not None and (b.num_cached_tokens, b.num_scheduled_tokens) == (40, 3)
    assert b.groups["v4"].block_ids == (2, 3) and b.groups["v4"].restore == StateRestore(1, "adopt")
    assert states.block_hash(1) is None and states.free_queue() == [2, 0]  # out of the index: b writes it
    assert m.groups["v4"]._turn_ends.num_listed() == 0  # and out of the turn-end list
    m.check_integrity()
    c = m.admit("c", follow_up)  # the second follow-up to 40: the turn end is gone, the boundary 32 it is
    assert c is not None and (c.num_cached_tokens, c.num_scheduled_tokens) == (32, 11)
    assert c.groups["v4"].restore == StateRestore(2, "recompute", replay_start=0)
    m.commit("b", 3)
    m.commit("c", 11)
    m.release("c")  # ends at 43: block 2 kept under 43 tokens
    assert states.free_queue() == [0, 2] and states.block_hash(2) is not None
    d = m.admit("d", _ids(20, 5))  # a fresh block: the unhashed one first, the kept one stays
    e = m.admit("e", _ids(20, 6))  # none unhashed left: the kept one is evicted, reset
    assert d is not None and d.groups["v4"].restore == StateRestore(0, "none")
    assert e is not None and e.groups["v4"].restore == StateRestore(2, "none") and states.block_hash(2) is None
    m.check_integrity()
    assert m.stats.num_hit_tokens == 40 + 32


def test_the_turn_end_list_stays_bounded_over_many_conversations() -> None:
    # Two turns per conversation on 4 state blocks: each finished turn keeps a state block,
    # most are then adopted or taken for another admission. Dead entries are unlisted, so the
    # list holds the live kept blocks (those the pool still indexes) plus at most as many dead
    # ones: never more than twice the pool's 4 blocks (before the fix: ~1,500 at 1,000 turns).
    m = make(40, 4, turn_end_checkpoints=True)
    g = m.groups["v4"]
    rng = random.Random(1)
    num_adopted = 0
    for i in range(500):
        conv = [rng.randrange(251) for _ in range(rng.randrange(SPAN + 1, 3 * SPAN))]
        for turn in range(2):
            a = m.admit(f"r{i}-{turn}", conv)
            assert a is not None
            num_adopted += a.groups["v4"].restore.method == "adopt"
            m.commit(f"r{i}-{turn}", len(conv) - a.num_cached_tokens)
            m.release(f"r{i}-{turn}")
            live = sum(g.state_pool.block_hash(b) is not None for b in range(4))  # kept: free and indexed
            assert live <= g._turn_ends.num_listed() <= 2 * 4
            conv = conv + [rng.randrange(251) for _ in range(rng.randrange(1, SPAN))]
        m.check_integrity()
    assert num_adopted > 100  # the adoption path was taken, not only evictions


def test_a_classical_block_shared_before_its_step_writes_it_is_named_as_v4s_write_once_rule() -> None:
    m = make(4, 2)
    m.admit("a", _ids(40), 0)
    res = m.reserve("a", 16)  # the step writes span 0's block
    (block,) = res.groups["v4"].new_block_ids
    m.pool.incref([block])  # a corruption: someone else holds the block the step writes
    named = rf"written once \(V4 never copies\): .* classical block {block} \(refcount 2"
    with pytest.raises(AssertionError, match=named):
        m.check_integrity()


def test_a_kept_turn_end_whose_state_block_is_taken_spills_to_a_pooled_checkpoint_and_is_hit() -> None:
    m = make(12, 2, restore="auto", checkpoint_blocks=1, turn_end_checkpoints=True)
    g = m.groups["v4"]
    m.admit("a", _ids(40), 0)
    _compute(m, "a", 40)  # state block 0, spans in blocks 0 and 1 (checkpoints at 16, 32: blocks 2, 3)
    m.release("a")  # its turn ends at 40: state block 0 kept
    m.admit("x", _ids(32, 5))  # the unhashed state block 1
    assert m.take_spills() == []
    y = m.admit("y", _ids(32, 6))  # no unhashed state block left: the kept one is taken, and spilled
    assert y is not None and y.groups["v4"].restore == StateRestore(0, "none")
    assert m.take_spills() == [(0, 8)] and g.num_spills == 1  # the runner copies state block 0 into block 8
    assert g.state_pool.block_hash(0) is None and m.pool.refcount(8) == 0  # a free cached block
    m.check_integrity()
    m.commit("x", 32)
    m.commit("y", 32)
    follow_up = _ids(40) + [1, 2, 3]
    assert m.group_hit_points(follow_up) == {"v4": [0, 16, 32, 40]}  # 40: the spilled turn end
    m.release("x")  # ends on a span boundary: nothing kept, state block 1 free
    b = m.admit("b", follow_up)
    assert b is not None and (b.num_cached_tokens, b.num_scheduled_tokens) == (40, 3)
    assert b.groups["v4"].block_ids == (0, 1) and b.groups["v4"].restore == StateRestore(1, "checkpoint", 8, whole=True)
    assert g.num_spill_hits == 1 and m.stats.num_hit_tokens == 40
    m.check_integrity()
    m.release("y")
    c = m.admit("c", _ids(32) + [9])  # a's checkpoint at 32 (block 3): a restore that is no spill's
    assert c is not None and c.groups["v4"].restore == StateRestore(0, "checkpoint", 3)
    assert g.num_spill_hits == 1
    m.check_integrity()
    # without turn ends spilled (recompute: no pooled checkpoints) the follow-up gets 32
    r = make(12, 2, turn_end_checkpoints=True)
    r.admit("a", _ids(40), 0)
    _compute(r, "a", 40)
    r.release("a")
    r.admit("x", _ids(32, 5))
    r.admit("y", _ids(32, 6))
    assert r.take_spills() == [] and r.group_hit_points(follow_up) == {"v4": [0, 16, 32]}


def test_a_spill_takes_only_free_blocks_and_is_skipped_without_them() -> None:
    m = make(4, 2, restore="auto", checkpoint_blocks=1, turn_end_checkpoints=True)
    g = m.groups["v4"]
    m.admit("a", _ids(20), 0)
    _compute(m, "a", 20)  # block 0; its turn ends at 20
    m.release("a")
    assert m.admit("x", _ids(64, 5), 63) is not None  # all 3 other blocks, and block 0 evicted: none free
    assert m.num_free_blocks == 0
    y = m.admit("y", [5, 6, 7], 3)  # takes the kept state block: no free block to spill it to
    assert y is not None and m.take_spills() == [] and g.num_spills == 0
    assert m.num_free_blocks == 0 and m.group_hit_points(_ids(20) + [1]) == {"v4": [0]}
    m.check_integrity()


@pytest.mark.parametrize(
    "kw",
    [
        {},  # restore by recompute: no checkpoint at all
        {"restore": "checkpoint", "num_checkpoints": 2},  # slots of their own: no spilled turn end
        {"restore": "checkpoint", "checkpoint_blocks": 1, "turn_end_checkpoints": True},  # pooled, spills on
    ],
)
def test_check_integrity_refuses_a_checkpoint_restore_the_group_cannot_make(kw) -> None:
    """A pending restore by checkpoint is checked against what can serve it: at a span
    boundary a checkpoint slot of the group's (checkpointing on), not a whole state block;
    inside a span a spilled turn end's whole state block (spills on) in the classical pool.
    Any restore by checkpoint passed."""
    m = make(12, 2, **kw)
    m.admit("a", _ids(20), 0)
    _compute(m, "a", 20)  # inside span 1
    m.admit("b", _ids(32, 100), 0)
    _compute(m, "b", 32)  # at a span boundary
    g = m.groups["v4"]
    a, b = m._requests["a"].states["v4"], m._requests["b"].states["v4"]
    checkpointing, spills = "restore" in kw, "checkpoint_blocks" in kw
    checkpoint_slot = g._slot_base  # (the first slot a checkpoint can have)
    for state, whole, ok in ((a, True, spills), (b, False, checkpointing)):
        state.restore = StateRestore(state.state_slot, "checkpoint", checkpoint_slot, whole=whole)
        if ok:
            m.check_integrity()
        else:
            with pytest.raises(AssertionError, match="a restore .* pending at"):
                m.check_integrity()
        bad_restores = [StateRestore(state.state_slot, "checkpoint", checkpoint_slot, whole=not whole)]
        bad_restores += [StateRestore(state.state_slot, "checkpoint", bad, whole=whole) for bad in (None, -1, 10**6)]
        for restore in bad_restores:  # a whole block on the grid, a slot one inside a span; no slot of the group's
            state.restore = restore
            with pytest.raises(AssertionError, match="a restore .* pending at"):
                m.check_integrity()
        state.restore = None
        m.check_integrity()


def test_dead_spilled_turn_end_records_are_swept_and_live_ones_kept() -> None:
    """One state block: each admission takes the kept turn end of the request before it and
    spills it to a free classical block, which later allocations evict (a dead record).
    Over 300 conversations the records stay bounded (swept at twice the live ones + 64: they
    grew by one a spill), and every record still whole is kept and hit at its turn end (a
    sweep that dropped a live one lost the hit)."""
    m = make(8, 1, restore="auto", checkpoint_blocks=1, turn_end_checkpoints=True)
    g = m.groups["v4"]
    seen = {}  # every record ever filed: its turn end's prompt
    most = swept_live = hits = 0
    previous: list[int] = []
    for i in range(300):
        prompt = _ids(20, 3 * i + 1)
        before = len(g._spilled)
        assert m.admit(f"r{i}", prompt, 0) is not None
        m.take_spills()
        if len(g._spilled) < before:  # a sweep ran: the live records it kept (and the new one)
            swept_live = max(swept_live, len(g._spilled) - 1)
        for block_hash, ckpt in g._spilled.items():  # (a spill is the turn end of the request before)
            seen.setdefault(block_hash, (ckpt, previous))
        _compute(m, f"r{i}", 20)
        m.release(f"r{i}")  # its turn ends at 20: the state block kept
        previous = prompt
        most = max(most, len(g._spilled))
        for block_hash, (ckpt, p) in seen.items():
            if all(map(m.pool.is_published, ckpt.parts)):
                assert g._spilled.get(block_hash) is ckpt, f"a live spilled record swept (conversation {i})"
                if p != prompt:  # (the request just released holds its own turn end in the state block)
                    assert 20 in m.group_hit_points([*p, 1])["v4"]
                    hits += 1
        m.check_integrity()
    assert g.num_spills >= 250 and len(seen) >= 250
    assert most <= 2 * m.pool.num_blocks + 64, most
    assert swept_live > 0 and hits > 250  # (the sweeps met live records and kept them; each was hit)
