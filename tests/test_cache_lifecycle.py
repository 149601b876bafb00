"""Property-based lifecycle test: random admits, extends, forks, shared-tail writes,
rollbacks, preemptions, double cancels and finishes on a small pool.

The model keeps, independently of the manager, what every physical slot holds (the token
whose KV was written there) and every request's token sequence. After every step:
  - check_integrity() passes;
  - the refcount of every block equals the number of live tables holding it;
  - every computed position of every request reads, through its block table, exactly the
    token the request has at that position. A missing copy-on-write, a wrong prefix hit or
    a block freed while still read shows up here as a wrong token.

KVPOOL_HYPOTHESIS_EXAMPLES raises the example count (300 by default, CI's setting).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvpool.cache import CacheDescriptor, KVCacheManager

BLOCK_SIZE = 4
NUM_BLOCKS = 24
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]
tokens = st.lists(st.integers(0, 9), min_size=0, max_size=9)


class Lifecycle(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, CacheDescriptor("prop"))
        self.slots: dict[int, int] = {}  # physical slot -> token written there
        self.seq: dict[str, list[int]] = {}  # request -> its token ids (model)
        self.next_id = 0
        self.released: list[str] = []

    # ---- helpers -----------------------------------------------------------------

    def _write(self, rid: str, start: int, end: int) -> None:
        """The 'forward': write the tokens [start, end) into the reserved slots."""
        for copy in self.m.take_copies():
            for offset in range(BLOCK_SIZE):
                src = copy.src * BLOCK_SIZE + offset
                if src in self.slots:
                    self.slots[copy.dst * BLOCK_SIZE + offset] = self.slots[src]
        for pos, slot in zip(range(start, end), self.m.slot_mapping(rid, start, end), strict=True):
            self.slots[slot] = self.seq[rid][pos]

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    # ---- rules -------------------------------------------------------------------

    @rule(target=requests, base=st.sampled_from(BASES), cut=st.integers(1, 12), suffix=tokens)
    def admit(self, base, cut, suffix):
        prompt = base[:cut] + suffix
        if not prompt:
            return None
        rid = self._new_id()
        free_before = self.m.pool.free_queue()
        admission = self.m.admit(rid, prompt)
        if admission is None:
            assert self.m.pool.free_queue() == free_before and rid not in self.m
            return None
        assert admission.num_cached_tokens % BLOCK_SIZE == 0
        assert admission.num_cached_tokens <= len(prompt) - 1
        self.seq[rid] = list(prompt)
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
        before = self.m.block_ids(rid)
        reservation = self.m.reserve(rid, len(extra))
        if reservation is None:
            assert self.m.block_ids(rid) == before and not self.m.take_copies()
            self.m.rollback(rid, start)  # drop the appended ids again
            del self.seq[rid][start:]
            return
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
        if self.m.reserve_decode(live) is None:
            return
        for rid in live:
            pos = self.m.num_computed_tokens(rid)
            self._write(rid, pos, pos + 1)
        self.m.commit_decode(live, [tok] * len(live))
        for rid in live:
            self.seq[rid].append(tok)

    @rule(target=requests, parent=requests)
    def fork(self, parent):
        if parent not in self.m:
            return None
        child = self._new_id()
        self.m.fork(parent, child)
        self.seq[child] = self.seq[parent][: self.m.num_computed_tokens(parent)]
        return child

    @rule(rid=requests, data=st.data())
    def rollback(self, rid, data):
        if rid not in self.m:
            return
        new_len = data.draw(st.integers(0, self.m.num_computed_tokens(rid)))
        self.m.rollback(rid, new_len)
        del self.seq[rid][new_len:]

    @rule(rid=consumes(requests), how=st.sampled_from(["finish", "cancel", "preempt"]))
    def release(self, rid, how):
        live = rid in self.m
        assert getattr(self.m, how)(rid) is live
        assert self.m.cancel(rid) is False  # a second release is a no-op
        self.released.append(rid)

    @precondition(lambda self: self.released)
    @rule()
    def cancel_released_again(self):
        assert self.m.cancel(self.released[-1]) is False

    # ---- invariants --------------------------------------------------------------

    @invariant()
    def integrity(self):
        self.m.check_integrity()

    @invariant()
    def refcounts_match_the_model(self):
        expected = [0] * NUM_BLOCKS
        for rid in self.m.request_ids:
            for block_id in self.m.block_ids(rid):
                expected[block_id] += 1
        assert [self.m.pool.refcount(b) for b in range(NUM_BLOCKS)] == expected

    @invariant()
    def every_computed_slot_holds_the_right_token(self):
        for rid in self.m.request_ids:
            n = self.m.num_computed_tokens(rid)
            assert self.m.token_ids(rid)[:n] == self.seq[rid][:n]
            for pos, slot in enumerate(self.m.slot_mapping(rid, 0, n)):
                assert self.slots.get(slot) == self.seq[rid][pos], (rid, pos, slot)

    def teardown(self):
        for rid in self.m.request_ids:
            self.m.finish(rid)
        self.m.check_integrity()
        assert self.m.num_free_blocks == NUM_BLOCKS


Lifecycle.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "300")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLifecycle = Lifecycle.TestCase
