"""Property-based lifecycle test of the full-attention manager: random admits, extends,
batched decode steps, forks, shared-tail writes, rollbacks, preemptions, double cancels and
finishes on a small pool.

The model keeps, independently of the manager:
  - every request's token sequence;
  - every request's block table, built from what the calls return (the admission's table,
    a reservation's new blocks and copies, the copies a step queued) and from the rules
    (a fork shares the parent's computed blocks, a rollback keeps ceil(n / bs) blocks);
  - what every physical slot holds: the tenant and the whole prefix whose last token's KV was
    written there (the KV of a token depends on every token before it).
After every step:
  - check_integrity() passes;
  - the manager's tables equal the model's, and every refcount equals the number of model
    tables holding the block; the free count is the pool minus the distinct blocks held;
  - every computed position of every request reads, through its block table, exactly the
    prefix the request has up to that position, under its tenant. A missing copy-on-write, a
    prefix hit on equal tokens after another prefix or under another tenant, or a block
    freed while still read shows up here as a wrong prefix.
The same machine runs again with every block hashing alike (a constant digest), where
only the collision guard stands between a hit and a wrong one.

KVPOOL_HYPOTHESIS_EXAMPLES raises the example count (300 by default, CI's setting).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvpool.cache import CacheDescriptor, FullAttentionManager

BLOCK_SIZE = 4
NUM_BLOCKS = 24
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]
tokens = st.lists(st.integers(0, 9), min_size=0, max_size=9)


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


class Lifecycle(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.m = FullAttentionManager(NUM_BLOCKS, BLOCK_SIZE, CacheDescriptor("prop"))
        self.slots: dict[int, int] = {}  # physical slot -> token written there
        self.seq: dict[str, list[int]] = {}  # request -> its token ids (model)
        self.tenant: dict[str, str] = {}  # request -> its tenant salt
        self.tables: dict[str, list[int]] = {}  # request -> its block table (model)
        self.next_id = 0
        self.released: list[str] = []

    # ---- helpers -----------------------------------------------------------------

    def _apply_copies(self) -> None:
        """The storage layer's copy-on-write, and the model's table update: dst replaces src
        in the table of the request that made the copy (the one that now holds dst)."""
        for copy in self.m.take_copies().get("full", []):
            for offset in range(BLOCK_SIZE):
                src = copy.src * BLOCK_SIZE + offset
                if src in self.slots:
                    self.slots[copy.dst * BLOCK_SIZE + offset] = self.slots[src]

    def _write(self, rid: str, start: int, end: int) -> None:
        """The 'forward': write the tokens [start, end) into the reserved slots."""
        self._apply_copies()
        for pos, slot in zip(range(start, end), self.m.slot_mapping(rid, start, end), strict=True):
            self.slots[slot] = (self.tenant[rid], tuple(self.seq[rid][: pos + 1]))

    def _held(self) -> set[int]:
        return {b for table in self.tables.values() for b in table}

    def _adopt_step_tables(self, rids: list[str], before: dict[str, list[int]], copies: list) -> None:
        """After a batched step: each table is the old one with copied tails replaced and
        fresh blocks (held by nobody before) appended, as many as its tokens need."""
        held_before = {b for t in self.tables.values() for b in t}
        by_src = {}
        for copy in copies:
            by_src.setdefault(copy.src, []).append(copy.dst)
        for rid in rids:
            table = self.m.block_ids(rid)
            old = before[rid]
            assert len(table) == max(len(old), blocks_for(self.m.num_reserved_tokens(rid)))
            for index, (was, now) in enumerate(zip(old, table, strict=False)):
                if was != now:  # only the tail being written can change, and only by a copy
                    assert index == self.m.num_computed_tokens(rid) // BLOCK_SIZE
                    assert now in by_src.get(was, []), (rid, was, now, copies)
                    assert now not in held_before
            appended = table[len(old) :]
            assert not set(appended) & held_before and len(set(appended)) == len(appended)
            self.tables[rid] = table

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    # ---- rules -------------------------------------------------------------------

    @rule(
        target=requests,
        base=st.sampled_from(BASES),
        cut=st.integers(1, 12),
        suffix=tokens,
        tenant=st.sampled_from(["", "", "t2"]),
    )
    def admit(self, base, cut, suffix, tenant):
        prompt = base[:cut] + suffix
        if not prompt:
            return None
        rid = self._new_id()
        free_before = self.m.pool.free_queue()
        admission = self.m.admit(rid, prompt, tenant_salt=tenant)
        if admission is None:
            assert self.m.pool.free_queue() == free_before and rid not in self.m
            return None
        assert admission.num_cached_tokens % BLOCK_SIZE == 0
        assert admission.num_cached_tokens <= len(prompt) - 1
        assert admission.num_scheduled_tokens == len(prompt) - admission.num_cached_tokens
        table = list(admission.groups["full"].block_ids)
        assert len(table) == blocks_for(len(prompt))
        fresh = table[admission.num_cached_tokens // BLOCK_SIZE :]
        assert not set(fresh) & self._held(), "a fresh block that another table holds"
        self.seq[rid] = list(prompt)
        self.tenant[rid] = tenant
        self.tables[rid] = table
        self._write(rid, admission.num_cached_tokens, len(prompt))
        self.m.commit(rid, len(prompt) - admission.num_cached_tokens)
        return rid

    @rule(rid=requests, extra=st.lists(st.integers(0, 9), min_size=1, max_size=6))
    def extend(self, rid, extra):
        if rid not in self.m:
            return
        self.m.append_token_ids(rid, extra)
        self.seq[rid] += extra
        start = self.m.num_computed_tokens(rid)
        reservation = self.m.reserve(rid, len(extra))
        if reservation is None:
            assert self.m.block_ids(rid) == self.tables[rid] and not self.m.take_copies()
            self.m.rollback(rid, start)  # drop the appended ids again
            del self.seq[rid][start:]
            return
        table = self.tables[rid]
        for copy in reservation.groups["full"].copies:
            index = table.index(copy.src)
            assert index == start // BLOCK_SIZE and copy.dst not in self._held()
            table[index] = copy.dst
        assert not set(reservation.groups["full"].new_block_ids) & self._held()
        table.extend(reservation.groups["full"].new_block_ids)
        self._write(rid, start, start + len(extra))
        self.m.commit(rid, len(extra))

    @rule(rids=st.lists(requests, min_size=1, max_size=4, unique=True), tok=st.integers(0, 9))
    def decode(self, rids, tok):
        live = [r for r in rids if r in self.m]
        if not live:
            return
        for rid in live:
            if self.m.num_tokens(rid) == self.m.num_computed_tokens(rid):
                self.m.append_token_ids(rid, [tok])
                self.seq[rid].append(tok)
        before = {rid: list(self.tables[rid]) for rid in live}
        free_before = self.m.pool.free_queue()
        if not self.m.reserve_step(live, [1] * len(live)):
            assert self.m.pool.free_queue() == free_before
            assert all(self.m.block_ids(r) == before[r] for r in live)
            return
        copies = self.m.take_copies().get("full", [])
        # the model's copy of the slot contents, then its tables
        for copy in copies:
            for offset in range(BLOCK_SIZE):
                src = copy.src * BLOCK_SIZE + offset
                if src in self.slots:
                    self.slots[copy.dst * BLOCK_SIZE + offset] = self.slots[src]
        self._adopt_step_tables(live, before, copies)
        for rid in live:
            pos = self.m.num_computed_tokens(rid)
            self._write(rid, pos, pos + 1)
        self.m.commit_step(live, [1] * len(live), [tok] * len(live))
        for rid in live:
            self.seq[rid].append(tok)

    @rule(target=requests, parent=requests)
    def fork(self, parent):
        if parent not in self.m:
            return None
        child = self._new_id()
        assert self.m.fork(parent, child) is True
        num_computed = self.m.num_computed_tokens(parent)
        self.seq[child] = self.seq[parent][:num_computed]
        self.tenant[child] = self.tenant[parent]
        del self.tables[parent][blocks_for(num_computed) :]  # the parent gives up its writable slots
        self.tables[child] = list(self.tables[parent])
        return child

    @rule(rid=requests, data=st.data())
    def rollback(self, rid, data):
        if rid not in self.m:
            return
        new_len = data.draw(st.integers(0, self.m.num_computed_tokens(rid)))
        self.m.rollback(rid, new_len)
        del self.seq[rid][new_len:]
        del self.tables[rid][blocks_for(new_len) :]

    @rule(rid=consumes(requests), how=st.sampled_from(["finish", "cancel", "preempt"]))
    def release(self, rid, how):
        live = rid in self.m
        assert self.m.release(rid, how) is live
        assert self.m.release(rid, "cancel") is False  # a second release is a no-op
        self.tables.pop(rid, None)
        self.released.append(rid)

    @precondition(lambda self: self.released)
    @rule()
    def cancel_released_again(self):
        assert self.m.release(self.released[-1], "cancel") is False

    # ---- invariants --------------------------------------------------------------

    @invariant()
    def integrity(self):
        self.m.check_integrity()

    @invariant()
    def tables_and_refcounts_match_the_model(self):
        assert sorted(self.m.request_ids) == sorted(self.tables)
        expected = [0] * NUM_BLOCKS
        for rid, table in self.tables.items():
            assert self.m.block_ids(rid) == table, rid
            for block_id in table:
                expected[block_id] += 1
        assert [self.m.pool.refcount(b) for b in range(NUM_BLOCKS)] == expected
        assert self.m.num_free_blocks == NUM_BLOCKS - len(self._held())
        usage = self.m.usage()
        assert usage.num_held_blocks == len(self._held())

    @invariant()
    def every_computed_slot_holds_the_right_token(self):
        for rid in self.m.request_ids:
            n = self.m.num_computed_tokens(rid)
            assert self.m.token_ids(rid)[:n] == self.seq[rid][:n]
            for pos, slot in enumerate(self.m.slot_mapping(rid, 0, n)):
                assert self.slots.get(slot) == (self.tenant[rid], tuple(self.seq[rid][: pos + 1])), (rid, pos, slot)

    def teardown(self):
        for rid in self.m.request_ids:
            self.m.release(rid)
        self.m.check_integrity()
        assert self.m.num_free_blocks == NUM_BLOCKS


Lifecycle.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "300")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLifecycle = Lifecycle.TestCase


class ConstantHashLifecycle(Lifecycle):
    def __init__(self) -> None:
        super().__init__()
        self.m.pool.hasher.digest = lambda data: b"\x00" * 16


ConstantHashLifecycle.TestCase.settings = settings(
    max_examples=max(1, int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "300")) // 3),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestConstantHashLifecycle = ConstantHashLifecycle.TestCase
