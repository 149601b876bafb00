"""DSV4CacheManager bookkeeping (pure Python): exact block ids, waits, hits, releases."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.cache import CacheDescriptor, DSV4CacheManager, Reservation, StateRestore
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
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
    assert res.new_block_ids == () and m.block_ids("a") == []  # 15 tokens: no complete span
    res = _compute(m, "a", 1)
    assert res.new_block_ids == (0,) and m.block_ids("a") == [0]  # token 16 completes span 0
    res = _compute(m, "a", 24)  # 40 tokens: spans 1 (32) complete, 8 tail tokens in state
    assert res.new_block_ids == (1,) and m.block_ids("a") == [0, 1]
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
    assert m.pending_reservation("a") == Reservation(14, 1, (), (), ())
    assert m.pending_reservation("b").start == 15 and m.pending_reservation("b").new_block_ids == (0,)
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
    assert "b" not in m and m.num_free_state_blocks == 0
    m.check_integrity()
    assert m.release("a") and m.admit("b", _ids(5)) is not None
    m.check_integrity()


def test_reserve_that_does_not_fit_leaves_no_trace() -> None:
    m = make(2, 1)
    assert m.admit("a", _ids(60)) is None  # the whole prompt: 3 spans, 2 blocks
    assert m.num_free_state_blocks == 1 and "a" not in m
    m.admit("a", _ids(60), 0)
    assert m.reserve("a", 48) is None  # 3 spans, 2 blocks
    assert m.num_free_blocks == 2 and m.num_computed_tokens("a") == 0
    m.check_integrity()
    assert _compute(m, "a", 32).new_block_ids == (0, 1)


def test_prefix_hit_leaves_one_token_and_respects_tenants() -> None:
    m = make(11, 3)
    m.admit("a", _ids(48), 0)
    _compute(m, "a", 48)
    assert m.block_ids("a") == [0, 1, 2]
    same = m.admit("b", _ids(48))  # exactly 3 spans: the last must be computed again
    assert same is not None and same.num_cached_tokens == 32 and same.num_scheduled_tokens == 16
    assert same.block_ids == (0, 1, 3)  # the hit, then a fresh block for span 2
    assert same.restore == StateRestore(1, "recompute", replay_start=0)  # 32 < n_win * L = 64
    assert [m.pool.refcount(b) for b in (0, 1, 2)] == [2, 2, 1]
    other = m.admit("c", _ids(48), tenant_salt="tenant-2")
    assert other is not None and other.num_cached_tokens == 0 and other.restore == StateRestore(2, "none")
    m.check_integrity()


def test_recompute_replays_only_the_last_window_tokens() -> None:
    m = make(20, 2)
    m.admit("a", _ids(150), 0)
    _compute(m, "a", 150)
    adm = m.admit("b", _ids(140) + [1, 2, 3])
    assert adm is not None and adm.num_cached_tokens == 128
    assert adm.restore is not None and adm.restore.replay_start == 128 - 16 * 4


def test_checkpoint_restore_cuts_the_hit_to_a_checkpointed_boundary() -> None:
    m = make(11, 3, restore="checkpoint", num_checkpoints=1)
    m.admit("a", _ids(50), 0)
    res = _compute(m, "a", 50)
    assert [p for p, _ in res.checkpoints] == [48]  # one slot: the latest boundary only
    adm = m.admit("b", _ids(50))
    assert adm is not None and adm.num_cached_tokens == 48
    assert adm.restore == StateRestore(1, "checkpoint", 3)  # checkpoint slots follow the 3 state slots
    short = m.admit("c", _ids(40))  # blocks 0, 1 hit, but no checkpoint at 16 or 32: no hit
    assert short is not None and short.num_cached_tokens == 0 and short.restore == StateRestore(2, "none")
    m.check_integrity()


def test_release_is_tail_first_and_once() -> None:
    m = make(11, 1)
    m.admit("a", _ids(50), 0)
    _compute(m, "a", 50)
    assert m.release("a") is True
    assert m.pool.free_queue()[-3:] == [2, 1, 0]  # the chain's tail is evicted first
    assert m.release("a") is False
    assert m.num_free_state_blocks == 1
    m.check_integrity()


def test_fork_shares_blocks_and_takes_a_state_block() -> None:
    m = make(11, 2)
    m.admit("a", _ids(20), 0)
    _compute(m, "a", 20)
    m.append_token_ids("a", [7])  # sampled, not computed: the child does not inherit it
    assert m.fork("a", "b") is True
    assert m.state_slot("b") == 1 and m.block_ids("b") == [0] and m.pool.refcount(0) == 2
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

    def prefix(self, rid: str, end: int) -> tuple:
        return (self.tenant[rid], tuple(self.tokens[rid][:end]))

    def admitted(self, rid: str, tokens: list[int], tenant: str, adm) -> None:
        self.tokens[rid], self.tenant[rid] = list(tokens), tenant
        num_hit = adm.num_cached_tokens // SPAN
        hits = list(adm.block_ids[:num_hit])
        for j, block_id in enumerate(hits):  # a hit holds exactly this prompt's prefix
            assert self.block_content[block_id] == self.prefix(rid, (j + 1) * SPAN), (rid, j, block_id)
        restore = adm.restore
        if num_hit and restore.method == "checkpoint":
            assert self.slot_content[restore.checkpoint_slot] == self.prefix(rid, adm.num_cached_tokens)
            assert all(restore.checkpoint_slot != s for _, _, c in self.pending.values() for _, s in c)
        assert restore.method == ("none" if not num_hit else self.m.restore)
        self.tables[rid] = hits
        self.computed[rid] = adm.num_cached_tokens
        if adm.num_scheduled_tokens:
            res = self.m.pending_reservation(rid)
            assert res.new_block_ids == adm.block_ids[num_hit:]
            self.reserved(rid, res)

    def reserved(self, rid: str, res) -> None:
        start = self.computed[rid]
        assert res.start == start
        assert len(res.new_block_ids) == (start + res.num_tokens) // SPAN - start // SPAN
        assert not set(res.new_block_ids) & self.held()
        assert all(p % SPAN == 0 and start < p <= start + res.num_tokens for p, _ in res.checkpoints)
        self.pending[rid] = (res.num_tokens, res.new_block_ids, res.checkpoints)

    def committed(self, rid: str) -> None:
        num_tokens, new_ids, checkpoints = self.pending.pop(rid)
        first = len(self.tables[rid])
        for k, block_id in enumerate(new_ids):
            self.block_content[block_id] = self.prefix(rid, (first + k + 1) * SPAN)
        for position, slot in checkpoints:
            self.slot_content[slot] = self.prefix(rid, position)
        self.tables[rid] += list(new_ids)
        self.computed[rid] += num_tokens

    def released(self, rid: str) -> None:
        for d in (self.tokens, self.tenant, self.computed, self.tables, self.pending):
            d.pop(rid, None)

    def held(self) -> set[int]:
        committed = {b for t in self.tables.values() for b in t}
        return committed | {b for _, ids, _ in self.pending.values() for b in ids}

    def check(self) -> None:
        m = self.m
        m.check_integrity()
        assert sorted(m.request_ids) == sorted(self.tables)
        counts = [0] * m.num_blocks
        for rid, table in self.tables.items():
            assert m.block_ids(rid) == table and m.num_computed_tokens(rid) == self.computed[rid]
            assert m.token_ids(rid) == self.tokens[rid]
            res = m.pending_reservation(rid)
            assert (res is None) == (rid not in self.pending)
            for block_id in table + list(self.pending[rid][1] if rid in self.pending else ()):
                counts[block_id] += 1
        assert [m.pool.refcount(b) for b in range(m.num_blocks)] == counts
        assert m.num_free_blocks == m.num_blocks - len(self.held())
        slots = [m.state_slot(rid) for rid in self.tables]
        assert len(set(slots)) == len(slots) and m.num_free_state_blocks == m.num_state_blocks - len(slots)


OPS = st.sampled_from(["admit", "step", "step", "step", "decode", "decode", "commit", "unreserve", "fork", "release"])


@settings(max_examples=int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "150")), deadline=None)
@given(
    restore=st.sampled_from(["recompute", "checkpoint"]),
    ops=st.lists(st.tuples(OPS, st.integers(0, 3), st.integers(1, 40), st.booleans()), min_size=10, max_size=60),
)
def test_lifecycle_against_a_model(restore: str, ops: list[tuple[str, int, int, bool]]) -> None:
    m = make(8, 3, restore=restore, num_checkpoints=2 if restore == "checkpoint" else 0)
    model = Model(m)
    num_forks = 0
    for op, who, n, flag in ops:
        rid = f"r{who}"
        if op == "admit" and rid not in m:
            tenant = "t2" if flag and who == 3 else ""
            tokens = _ids(n + 30, offset=who % 2)  # r0 / r2 and r1 / r3 share prefixes
            free_before = m.pool.free_queue()
            adm = m.admit(rid, tokens, None if flag else n, tenant_salt=tenant)  # whole prompt, or a chunk
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
                res = m.reserve(rid, min(n, left))
                if res is not None:
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
        elif op == "fork" and rid in m and rid not in model.pending:
            num_forks += 1
            child = f"{rid}-fork{num_forks}"
            if m.fork(rid, child):
                model.tokens[child] = model.tokens[rid][: model.computed[rid]]
                model.tenant[child] = model.tenant[rid]
                model.computed[child] = model.computed[rid]
                model.tables[child] = list(model.tables[rid])
            else:
                assert m.num_free_state_blocks == 0 and child not in m
        elif op == "release":
            for r in [r for r in m.request_ids if r == rid or r.startswith(rid + "-")]:
                assert m.release(r) is True and m.release(r) is False
                model.released(r)
        model.check()
    for rid in m.request_ids:
        m.release(rid)
    m.check_integrity()
    assert m.num_free_blocks == 8 and m.num_free_state_blocks == 3
