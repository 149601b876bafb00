"""A second, independent model of the cache coordinator, "correct to the last slot", over the
shapes the other lifecycle machines (test_cache_lifecycle.py: blocks of 4, whole prompts;
test_hybrid_lifecycle.py: blocks of 4, one window of 6) leave out: blocks of 1, 3 and 16
tokens, windows of 1 and 7 beside full attention, a shared pool, chunked prefills whose
reservations stay pending while other requests step, partial commits of a block-granular
reservation, share_ids admissions, and every lookup compared with what must hit.

The model keeps every request's token ids, tenant, computed count and reserved end, and
what every physical slot holds (tenant, the whole prefix whose last token's K/V was written
there), moved by the copies the coordinator queues. After every operation:
  - check_integrity() passes, and every count the coordinator reports is the model's;
  - every position a request's next step reads, in every attention group, holds exactly the
    request's own prefix to that position under its tenant;
  - step_tables' slots are slot_mapping's, and its CSR is the group's table;
  - a lookup (and the admission after it) hits no prefix that was never computed under its
    tenant, hits the same as the admission that follows it, and, with full attention only,
    at least every full block a live request holds computed.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, precondition, rule

from kvpool.cache import CacheDescriptor, FullAttentionManager, HybridCacheManager
from kvpool.cache.coordinator import pack_prompt
from kvpool.cache.dual_pool import DualPoolGroupSpec
from kvpool.cache.recurrent import RecurrentGroupSpec
from kvpool.cache.types import PrefixStats
from kvpool.cache.window import AttentionGroupSpec
from kvpool.engine import tier_bridge
from kvpool.pool.block_table import BlockTableCSR
from kvpool.tiers import HostTier, TierIndex
from test_hybrid_lifecycle import BASES, SPECS, DualPoolCheckpointLifecycle, Lifecycle, tokens

DESC = CacheDescriptor("model")
ALPHABET = st.integers(0, 2)


class CacheModel(RuleBasedStateMachine):
    requests = Bundle("requests")
    bases: list[list[int]] = [[0, 1, 2] * 12, [1] * 40, [2, 2, 0] * 13]
    max_cut = 40

    def build(self) -> HybridCacheManager:
        raise NotImplementedError

    def __init__(self) -> None:
        super().__init__()
        self.m = self.build()
        self.groups = list(self.m.attention_groups)
        by_pool: dict[int, dict[int, tuple]] = {}
        self.content = {g.name: by_pool.setdefault(id(g.pool), {}) for g in self.groups}
        self.seq: dict[str, list[int]] = {}
        self.tenant: dict[str, str] = {}
        self.nc: dict[str, int] = {}  # computed tokens
        self.shared: dict[str, bool] = {}
        self.computed: set[tuple[str, tuple[int, ...]]] = set()  # every prefix ever committed
        self.next_id = 0
        self.full_only = all(g.spec.window is None for g in self.groups)
        self.stats = PrefixStats()  # what the coordinator's counters must say

    # ---- the "runner" ---------------------------------------------------------------------

    def _apply_copies(self) -> None:
        for name, copies in self.m.take_copies().items():
            bs = self.m.groups[name].spec.block_size
            slots = self.content[name]
            for copy in copies:
                for offset in range(bs):
                    src, dst = copy.src * bs + offset, copy.dst * bs + offset
                    if src in slots:
                        slots[dst] = slots[src]
                    else:
                        slots.pop(dst, None)

    def _slot(self, rid: str, g, pos: int) -> int:
        bs = g.spec.block_size
        part = self.m.part(rid, g.name)
        return part.block_ids[pos // bs - part.first_block] * bs + pos % bs

    def _forward(self, rids: list[str], starts: list[int], ends: list[int]) -> None:
        # the engine's questions about a planned step: it continues each request's computed
        # tokens within its reservation; the tables it reads are the groups' own
        assert self.m.first_off_step(rids, starts, ends) is None
        for g in self.groups:
            assert self.m.tables(rids, g.name) == [self.m.block_ids(r, g.name) for r in rids]
        self._apply_copies()
        for g in self.groups:
            tables = self.m.step_tables(rids, starts, ends, g.name)
            expected = []
            for rid, start, end in zip(rids, starts, ends, strict=True):
                expected += [self._slot(rid, g, p) for p in range(start, end)]
            assert tables.slots == expected, (g.name, tables.slots, expected)
            for i, rid in enumerate(rids):
                table = self.m.block_ids(rid, g.name)
                lo, hi = tables.csr.indptr[i], tables.csr.indptr[i + 1]
                bs = g.spec.block_size
                first = self.m.part(rid, g.name).first_block
                assert tables.csr.indices[lo:hi] == table[: -(-ends[i] // bs) - first], (rid, g.name)
                if hi > lo:
                    assert tables.csr.last_block_len[i] == ends[i] - (first + hi - lo - 1) * bs
        for rid, start, end in zip(rids, starts, ends, strict=True):
            for g in self.groups:
                for pos in range(start, end):
                    self.content[g.name][self._slot(rid, g, pos)] = (self.tenant[rid], tuple(self.seq[rid][: pos + 1]))

    def _load(self, rid: str, admission) -> int:
        """A lower tier's part of a hit: loaded by the tier machine (TieredFullBlocksOf3)."""
        raise AssertionError("loads without a lower tier")

    def _committed(self, rid: str) -> None:
        n = self.nc[rid]
        seq, tenant = self.seq[rid], self.tenant[rid]
        for k in range(1, n + 1):
            self.computed.add((tenant, tuple(seq[:k])))

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _expected_floor(self, prompt: list[int], tenant: str) -> int:
        """With full attention only: the full blocks a live request holds computed are cached."""
        if not self.full_only:
            return 0
        bs = self.groups[0].spec.block_size
        best = 0
        for rid in self.m.request_ids:
            if self.tenant[rid] != tenant:
                continue
            n = 0
            done = self.m.num_computed_tokens(rid)
            seq = self.seq[rid]
            while n < min(done, len(prompt) - 1) and seq[n] == prompt[n]:
                n += 1
            best = max(best, n // bs * bs)
        return best

    # ---- rules ----------------------------------------------------------------------------

    @rule(
        target=requests,
        base=st.integers(0, 2),
        cut=st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 15, 16, 17, 32]), st.integers(0, 40)),
        suffix=st.lists(ALPHABET, max_size=5),
        tenant=st.sampled_from(["", "", "t"]),
        chunk=st.one_of(st.none(), st.integers(0, 9)),
        share=st.booleans(),
    )
    def admit(self, base, cut, suffix, tenant, chunk, share):
        return self._admit(self.bases[base][: min(cut, self.max_cut)] + suffix, tenant, chunk, share)

    @rule(
        target=requests,
        source=requests,
        cut=st.one_of(st.integers(0, 60), st.just(1000)),
        suffix=st.lists(ALPHABET, max_size=4),
        chunk=st.one_of(st.none(), st.integers(0, 9)),
        share=st.booleans(),
    )
    def follow_up(self, source, cut, suffix, chunk, share):
        """The next turn of a conversation (live or not): a cut of its history, new tokens."""
        return self._admit(self.seq[source][:cut] + suffix, self.tenant[source], chunk, share)

    @rule(
        target=requests,
        source=requests,
        suffix=st.lists(ALPHABET, min_size=1, max_size=4),
        chunk=st.one_of(st.none(), st.integers(1, 9)),
    )
    def next_turn(self, source, suffix, chunk):
        """A live request finishes its turn, and the conversation's next turn comes in."""
        if source in self.m and not self._pending(source):
            assert self.m.release(source, "finish")
        return self._admit(self.seq[source] + suffix, self.tenant[source], chunk, False)

    def _admit(self, prompt, tenant, chunk, share):
        rid = self._new_id()
        if not prompt:
            try:
                self.m.admit(rid, prompt)
            except ValueError:
                assert rid not in self.m
                return multiple()
            raise AssertionError("an empty prompt was admitted")
        looked = self.m.lookup_prefix(prompt, tenant_salt=tenant)
        floor = self._expected_floor(prompt, tenant)
        ids = list(prompt)
        free = [p.free_queue() for p in self.m.pools]
        admission = self.m.admit(rid, ids, chunk, tenant_salt=tenant, share_ids=share)
        if admission is None:
            assert [p.free_queue() for p in self.m.pools] == free and rid not in self.m
            return multiple()
        self.seq[rid] = ids if share else list(prompt)
        self.tenant[rid] = tenant
        self.shared[rid] = share
        hit = admission.num_cached_tokens
        loads = admission.groups[self.groups[0].name].loads
        assert hit - len(loads) * self.groups[0].spec.block_size == looked, (hit, looked, loads)
        assert hit <= len(prompt) - 1
        assert hit == 0 or (tenant, tuple(prompt[:hit])) in self.computed, "a hit on a prefix never computed"
        assert hit >= floor, (hit, floor)
        rest = len(prompt) - hit
        assert admission.num_scheduled_tokens == (rest if chunk is None else min(chunk, rest))
        event("hit" if hit else "no hit")
        if hit % self.groups[0].spec.block_size:
            event("a hit inside a block")
        if loads:
            event("lower-tier loads")
            hit = self._load(rid, admission)
        self.nc[rid] = hit
        assert self.m.num_computed_tokens(rid) == hit
        assert self.m.num_reserved_tokens(rid) >= hit + admission.num_scheduled_tokens
        self.stats.num_requests += 1
        self.stats.num_queried_tokens += len(prompt)
        self.stats.num_hit_tokens += hit
        return rid

    def _pending(self, rid: str) -> int:
        """The exact step reserved and not committed (exact steps), else 0."""
        if not self.m.exact_steps:
            return 0
        return self.m.num_reserved_tokens(rid) - self.nc[rid]

    @rule(
        rids=st.lists(requests, min_size=1, max_size=4, unique=True),
        chunk=st.integers(1, 7),
        tok=ALPHABET,
        short=st.integers(0, 3),
    )
    def step(self, rids, chunk, tok, short):
        """One step of the live requests named: a pending step is run as reserved; else a
        prefill chunk of up to `chunk` known tokens, or a decode of one sampled token. Not
        exact steps: the commit may leave the last `short` reserved tokens of a chunk."""
        live = [r for r in rids if r in self.m]
        if not live:
            return
        counts = []
        reserve_ids, reserve_counts = [], []
        for rid in live:
            pending = self._pending(rid)
            if pending:
                counts.append(pending)
                continue
            known = len(self.seq[rid]) - self.nc[rid]
            if known == 0:  # a decode: its sampled token joins first
                if self.shared[rid]:
                    self.seq[rid].append(tok)
                else:
                    self.m.append_token_ids(rid, [tok])
                    self.seq[rid].append(tok)
                known = 1
            n = min(chunk, known)
            counts.append(n)
            reserve_ids.append(rid)
            reserve_counts.append(n)
        tables = {r: [self.m.block_ids(r, g.name) for g in self.groups] for r in live}
        free = [p.free_queue() for p in self.m.pools]
        if reserve_ids and not self.m.reserve_step(reserve_ids, reserve_counts):
            assert [p.free_queue() for p in self.m.pools] == free
            assert all(tables[r] == [self.m.block_ids(r, g.name) for g in self.groups] for r in live)
            # the sampled ids appended above stay known: a later step computes them
            return
        starts = [self.nc[r] for r in live]
        ends = [s + n for s, n in zip(starts, counts, strict=True)]
        self._forward(live, starts, ends)
        commits = []
        for n in counts:
            if not self.m.exact_steps and n > 1:
                n = max(1, n - short)
            commits.append(n)
        nexts: list[int | None] = []
        for rid, n in zip(live, commits, strict=True):
            if self.nc[rid] + n == len(self.seq[rid]):  # the step's logits sample the next token
                self.seq[rid].append(tok)  # (a share_ids request's list is the cache's: it joins there too)
                nexts.append(tok)
            else:
                nexts.append(None)
        self.m.commit_step(live, commits, nexts)
        for rid, n in zip(live, commits, strict=True):
            self.nc[rid] += n
            self._committed(rid)
            assert self.m.num_computed_tokens(rid) == self.nc[rid]
            assert list(self.m.token_ids(rid)) == self.seq[rid], rid

    @rule(rid=requests, n=st.integers(1, 5))
    def reserve_then_unreserve(self, rid, n):
        """A step reserved, then undone before its forward: attention groups cannot undo
        one (ValueError, nothing changed); the step then runs."""
        if rid not in self.m or self._pending(rid):
            return
        n = min(n, len(self.seq[rid]) - self.nc[rid])
        if n == 0:
            return
        before = self._snapshot()
        if not self.m.reserve_step([rid], [n]):
            assert self._snapshot() == before
            return
        after = self._snapshot()
        try:
            self.m.unreserve(rid)
        except ValueError as e:
            assert "cannot undo" in str(e) and self._snapshot() == after
        else:
            raise AssertionError("an attention group undid a step")
        start = self.nc[rid]
        self._forward([rid], [start], [start + n])
        self.m.commit_step([rid], [n], [None])
        self.nc[rid] += n
        self._committed(rid)

    @rule(target=requests, parent=requests)
    def fork(self, parent):
        if parent not in self.m or self._pending(parent):
            return multiple()
        child = self._new_id()
        if not self.m.fork(parent, child):
            return multiple()
        n = self.nc[parent]
        self.seq[child] = self.seq[parent][:n]
        self.tenant[child] = self.tenant[parent]
        self.nc[child] = n
        self.shared[child] = False
        assert self.m.num_computed_tokens(child) == n and self.m.num_reserved_tokens(child) == n
        return child

    @rule(rid=requests, data=st.data())
    def rollback(self, rid, data):
        if rid not in self.m or self.shared[rid] or self._pending(rid):
            return
        new_len = data.draw(st.integers(0, self.nc[rid]))
        bs = self.groups[0].spec.block_size
        first = max(self.m.part(rid, g.name).first_block for g in self.groups)
        if any(g.spec.first_needed(new_len) // bs < self.m.part(rid, g.name).first_block for g in self.groups):
            before = self._snapshot()  # a window's blocks before it are gone: refused
            try:
                self.m.rollback(rid, new_len)
            except ValueError as e:
                assert "cannot go back" in str(e) and self._snapshot() == before, first
                return
            raise AssertionError("a rollback before a window's first block")
        self.m.rollback(rid, new_len)
        del self.seq[rid][new_len:]
        self.nc[rid] = new_len
        assert self.m.num_reserved_tokens(rid) == new_len

    @rule(rid=requests, how=st.sampled_from(["finish", "cancel", "preempt"]))
    def release(self, rid, how):
        live = rid in self.m
        assert self.m.release(rid, how) is live
        before = self._snapshot()
        assert self.m.release(rid, "finish") is False
        assert self._snapshot() == before

    @rule(
        base=st.integers(0, 2),
        cut=st.integers(1, 40),
        suffix=st.lists(ALPHABET, max_size=4),
        tenant=st.sampled_from(["", "t"]),
    )
    def lookup(self, base, cut, suffix, tenant):
        prompt = self.bases[base][: min(cut, self.max_cut)] + suffix
        before = self._snapshot()
        hit = self.m.lookup_prefix(prompt, tenant_salt=tenant)
        assert self._snapshot() == before
        assert 0 <= hit <= len(prompt) - 1
        assert hit == 0 or (tenant, tuple(prompt[:hit])) in self.computed
        assert hit >= self._expected_floor(prompt, tenant)
        # the router's path: packed once, looked up (its memo of hashes filled), probed
        packed = pack_prompt(prompt)
        assert self.m.lookup_packed(packed, tenant_salt=tenant) == hit
        for n in range(1, len(prompt) + 1):
            if not self.m.may_reach(packed, n, tenant_salt=tenant):
                assert hit < n, (hit, n)
        assert self._snapshot() == before

    # ---- invariants -------------------------------------------------------------------------

    def _snapshot(self) -> tuple:
        pools = [(p.free_queue(), list(map(p.refcount, range(p.num_blocks))), p.num_free_cached) for p in self.m.pools]
        reqs = [
            (
                r,
                [self.m.block_ids(r, g.name) for g in self.groups],
                self.m.num_computed_tokens(r),
                self.m.num_reserved_tokens(r),
                list(self.m.token_ids(r)),
            )
            for r in sorted(self.m.request_ids)
        ]
        return pools, reqs, self.m.stats

    @invariant()
    def integrity(self):
        self.m.check_integrity()

    @invariant()
    def every_read_position_holds_its_prefix(self):
        # the copies queued run before the next forward, and nothing writes before it: run now
        self._apply_copies()
        assert sorted(self.m.request_ids) == sorted(r for r in self.seq if r in self.m)
        for rid in self.m.request_ids:
            n = self.nc[rid]
            assert self.m.num_computed_tokens(rid) == n
            assert list(self.m.token_ids(rid)) == self.seq[rid]
            for g in self.groups:
                lo = g.spec.first_needed(n)
                for pos in range(lo, n):
                    got = self.content[g.name].get(self._slot(rid, g, pos))
                    assert got == (self.tenant[rid], tuple(self.seq[rid][: pos + 1])), (rid, g.name, pos, got)

    @invariant()
    def stats_add_up(self):
        assert self.m.stats == self.stats, (self.m.stats, self.stats)

    @invariant()
    def usage_adds_up(self):
        """Held and free blocks make up the pool (one pool: the full-attention caches)."""
        if len(self.m.pools) == 1:
            u = self.m.usage()
            assert u.num_held_blocks + u.num_free_blocks == u.num_blocks, u
            assert 0 <= u.num_filled_slots <= u.num_held_blocks * u.block_size

    def teardown(self):
        for rid in list(self.m.request_ids):
            self.m.release(rid)
        self.m.check_integrity()
        assert all(p.num_free == p.num_blocks for p in self.m.pools)


SETTINGS = settings(
    max_examples=max(1, int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "300")) // 6),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


class FullBlocksOf1(CacheModel):
    def build(self):
        return FullAttentionManager(30, 1, DESC)


class FullBlocksOf3(CacheModel):
    def build(self):
        return FullAttentionManager(14, 3, DESC)


class FullBlocksOf16(CacheModel):
    def build(self):
        return FullAttentionManager(10, 16, DESC)


class ExactFullBlocksOf5(CacheModel):
    """Exact steps, turn ends kept: a follow-up hits inside the partial block a finish kept."""

    def build(self):
        return HybridCacheManager([(AttentionGroupSpec("full", 5), 12)], DESC, turn_end_checkpoints=True)


class Windows(CacheModel):
    """Blocks of 3: full attention, a window of 1, a window of 7,
    turn ends kept (hits inside a block)."""

    def build(self):
        return HybridCacheManager(
            [
                (AttentionGroupSpec("full", 3), 14),
                (AttentionGroupSpec("w1", 3, window=1), 8),
                (AttentionGroupSpec("w7", 3, window=7), 10),
            ],
            DESC,
            turn_end_checkpoints=True,
        )


class SharedPoolWindows(CacheModel):
    """Two groups on one shared pool of blocks of 2: full attention and a window of 3."""

    def build(self):
        return HybridCacheManager(
            [(AttentionGroupSpec("full", 2), None), (AttentionGroupSpec("w3", 2, window=3), None)],
            DESC,
            shared_blocks=24,
        )


class WindowsOnTheGrid(CacheModel):
    """Windows of exactly one and two blocks (4 and 8, blocks of 4) beside full attention,
    every group on one shared pool."""

    def build(self):
        return HybridCacheManager(
            [
                (AttentionGroupSpec("full", 4), None),
                (AttentionGroupSpec("w4", 4, window=4), None),
                (AttentionGroupSpec("w8", 4, window=8), None),
            ],
            DESC,
            shared_blocks=30,
        )


class ConstantHashWindows(Windows):
    """Every block hashes alike in every pool: the content guard alone tells blocks apart
    (a window finds each block on its own, through `BlockPool.lookup`)."""

    def build(self):
        m = super().build()
        for pool in m.pools:
            pool.hasher.digest = lambda data: b"\x00" * 16
        return m


class ConstantHashExactFullBlocksOf5(ExactFullBlocksOf5):
    """Collisions everywhere, with turn ends kept (found by their own keys)."""

    def build(self):
        m = super().build()
        m.pool.hasher.digest = lambda data: b"\x00" * 16
        return m

    def _expected_floor(self, prompt, tenant):
        return 0  # (one block per hash is findable: a collision costs the others their hits)


class FullWithoutCaching(FullBlocksOf3):
    """Prefix caching off: nothing is ever hit, everything else as before."""

    def build(self):
        return FullAttentionManager(14, 3, DESC, enable_prefix_caching=False)

    def _expected_floor(self, prompt, tenant):
        return 0

    def _committed(self, rid):  # (nothing may hit: no prefix counts as computed)
        pass


MACHINES = (FullBlocksOf1, FullBlocksOf3, FullBlocksOf16, ExactFullBlocksOf5, Windows, SharedPoolWindows)
for _machine in (*MACHINES, WindowsOnTheGrid, ConstantHashWindows, ConstantHashExactFullBlocksOf5, FullWithoutCaching):
    _machine.TestCase.settings = SETTINGS
TestWindowsOnTheGrid = WindowsOnTheGrid.TestCase
TestConstantHashWindows = ConstantHashWindows.TestCase
TestConstantHashExactFullBlocksOf5 = ConstantHashExactFullBlocksOf5.TestCase
TestFullWithoutCaching = FullWithoutCaching.TestCase
TestFullBlocksOf1 = FullBlocksOf1.TestCase
TestFullBlocksOf3 = FullBlocksOf3.TestCase
TestFullBlocksOf16 = FullBlocksOf16.TestCase
TestExactFullBlocksOf5 = ExactFullBlocksOf5.TestCase
TestWindows = Windows.TestCase
TestSharedPoolWindows = SharedPoolWindows.TestCase


def test_a_window_groups_slots_and_table_begin_at_its_first_block() -> None:
    """A window of 4 (blocks of 4) at 10 computed tokens reads [7, 11): its table holds logical
    blocks 1 and 2 (block 0 left the window). slot_mapping and step_tables indexed the table
    from logical block 0: position 7 mapped to the slot of block 2 (11 where the K/V is at 7,
    a silent wrong slot) and the decode's position 10 was an IndexError."""
    m = HybridCacheManager([(AttentionGroupSpec("full", 4), 8), (AttentionGroupSpec("swa", 4, window=4), 8)], DESC)
    m.admit("r", list(range(10)))
    m.commit_step(["r"], [10], [10])
    assert m.reserve_step(["r"], [1])
    part = m.part("r", "swa")
    assert (part.first_block, part.block_ids) == (1, [1, 2])
    assert m.slot_mapping("r", 7, 11, "swa") == [7, 8, 9, 10]  # block 1's last slot, block 2's first three
    tables = m.step_tables(["r"], [10], [11], "swa")
    assert tables.slots == [10]
    assert tables.csr == BlockTableCSR([0, 2], [1, 2], [3])  # the table over [4, 11): 3 tokens in block 2
    assert m.step_tables(["r"], [10], [11]).csr == BlockTableCSR([0, 3], [0, 1, 2], [3])  # full: from 0
    with pytest.raises(ValueError, match=r"position 3 left the window of group .swa. \(its table begins at position 4"):
        m.slot_mapping("r", 3, 4, "swa")
    m.check_integrity()


class TieredFullBlocksOf3(CacheModel):
    """Full attention, blocks of 3, over a host tier: evicted blocks go to the tier (the
    model keeps what their slots held), hits load them back (all, or the first few: an
    entry gone), and a preempted request swaps out its full blocks and its partial tail and
    comes back through `restore_tail`. Exact steps or not."""

    exact = False

    def build(self):
        self.tier = HostTier(1 << 30)
        self.index = TierIndex(self.tier, 3)
        self.held: dict[bytes, list] = {}  # tier key -> what the block's slots held
        if self.exact:
            return HybridCacheManager([(AttentionGroupSpec("full", 3), 9)], DESC, lower_tier=self.index)
        return FullAttentionManager(9, 3, DESC, lower_tier=self.index)

    def _save(self, block_id: int, block) -> None:
        key, descriptor = self.index.describe(block)
        slots = self.content["full"]
        self.held[key] = [slots.get(block_id * 3 + k) for k in range(3)]
        assert self.tier.put(key, descriptor, {"kv": torch.zeros(1)})

    def _save_evicted(self) -> None:
        for block_id, block in tier_bridge.take_evicted(self.m):
            self._save(block_id, block)

    def _forward(self, rids, starts, ends) -> None:
        self._save_evicted()  # the runner's save_evicted, before the forward writes
        super()._forward(rids, starts, ends)

    def _apply_copies(self) -> None:
        self._save_evicted()  # (a copy's destination may be a block just evicted: saved first)
        super()._apply_copies()

    def _load(self, rid: str, admission) -> int:
        self._save_evicted()
        loads = admission.groups["full"].loads
        n = self.data.draw(st.integers(0, len(loads))) if self.data is not None else len(loads)
        slots = self.content["full"]
        for block_id, block in loads[:n]:
            key, _ = self.index.describe(block)
            for k, held in enumerate(self.held[key]):
                slots[block_id * 3 + k] = held
        after = self.m.complete_loads(rid, n)
        self.stats.num_lower_tier_hit_tokens += n * 3
        assert after.num_cached_tokens == admission.num_cached_tokens - (len(loads) - n) * 3
        return after.num_cached_tokens

    data = None

    @rule(data=st.data(), rid=CacheModel.requests)
    def preempt_and_swap(self, data, rid):
        """swap_out, release("preempt"), admit again, swap_in: the engine's TierBridge calls."""
        if rid not in self.m or self._pending(rid) or self.shared[rid] or not self.seq[rid]:
            return  # (a child forked at 0 tokens knows none: no prompt to admit again)
        self.data = data
        self._apply_copies()
        self._save_evicted()
        nc = self.nc[rid]
        chain = self.m.part(rid).prefix_chain()
        for block_id, block in zip(self.m.block_ids(rid), chain, strict=False):
            self._save(block_id, block)
        tail = tier_bridge.tail_block(self.m, rid)
        if tail is not None:
            self._save(tail[0], tail[1])
            tail_key = self.index.describe(tail[1])[0]
        assert self.m.release(rid, "preempt")
        seq = self.seq[rid]
        admission = self.m.admit(rid, list(seq), tenant_salt=self.tenant[rid])
        if admission is None:
            return
        self._save_evicted()  # (the runner's, before the loads and the tail overwrite fresh blocks)
        hit = admission.num_cached_tokens
        if admission.groups["full"].loads:
            hit = self._load(rid, admission)
        self.data = None
        self.shared[rid] = False
        if tail is not None and hit == nc - tail[2]:
            restore = tier_bridge.tail_block_for_restore(self.m, rid, tail[2])
            if restore is not None:
                assert self.index.describe(restore[1])[0] == tail_key, "the tail restored is the one swapped"
                slots = self.content["full"]
                for k, held in enumerate(self.held[tail_key]):
                    slots[restore[0] * 3 + k] = held
                event("a swapped tail restored")
                after = self.m.restore_tail(rid, tail[2])
                hit = after.num_cached_tokens
                assert hit == nc
        self.nc[rid] = hit
        assert self.m.num_computed_tokens(rid) == hit
        self.stats.num_readmissions += 1
        self.stats.num_readmitted_hit_tokens += hit

    @rule()
    def flush_to_the_tier(self):
        """A long prompt of other tokens takes every free block (the cached ones go to the
        tier), then leaves: the conversations' next turns hit the tier."""
        num_free = self.m.num_free_blocks
        if not num_free:
            return
        self.next_id += 1
        rid = f"filler{self.next_id}"
        filler = [7 + k % 5 for k in range(num_free * 3)]
        admission = self.m.admit(rid, filler, tenant_salt="filler")
        assert admission is not None and admission.num_cached_tokens % 3 == 0
        self._save_evicted()
        assert self.m.release(rid, "cancel")
        self.stats.num_requests += 1
        self.stats.num_queried_tokens += len(filler)
        self.stats.num_hit_tokens += admission.num_cached_tokens

    @invariant()
    def evicted_blocks_are_saved(self):
        self._save_evicted()


class ExactTieredFullBlocksOf3(TieredFullBlocksOf3):
    exact = True


for _machine in (TieredFullBlocksOf3, ExactTieredFullBlocksOf3):
    _machine.TestCase.settings = SETTINGS
TestTieredFullBlocksOf3 = TieredFullBlocksOf3.TestCase
TestExactTieredFullBlocksOf3 = ExactTieredFullBlocksOf3.TestCase


class Prices:
    """A restore cost whose prices move (the engine's measured timings): `version` moves
    with them, as the contract asks."""

    def __init__(self) -> None:
        self.per_token = 1.0
        self.version = 0

    def checkpoint_cost(self) -> float:
        return 3.0

    def compute_cost(self, num_tokens: int, context_len: int) -> float:
        return self.per_token * num_tokens


class RoutedDualPool(DualPoolCheckpointLifecycle):
    """test_hybrid_lifecycle.py's dual-pool machine (restore "auto" from 2 checkpoint slots),
    with the router's path: a prompt packed once and looked up (`lookup_packed`, whose hits
    an admission of the very prompt takes again while no group's `lookup_stamp` moved),
    then anything else happens, then it is admitted with `prompt=`: its hit must be what a
    fresh lookup finds then, and the slots it reads must hold its prefix (the parent's
    invariants). The restore prices move between them too."""

    def _build(self) -> HybridCacheManager:
        self.prices = Prices()
        v4 = DualPoolGroupSpec("v4", 8, replay_len=2, restore="auto", num_checkpoints=2, restore_cost=self.prices)
        specs = [SPECS[0], SPECS[1], (v4, (8, 4)), (RecurrentGroupSpec("rec", 4), 12)]
        return HybridCacheManager(specs, CacheDescriptor("prop"), turn_end_checkpoints=True)

    @initialize()
    def no_prompts(self):
        self.routed: list = []

    @rule(base=st.sampled_from(BASES), cut=st.integers(1, 20), suffix=tokens, tenant=st.sampled_from(["", "t2"]))
    def router_lookup(self, base, cut, suffix, tenant):
        prompt = pack_prompt(base[:cut] + suffix)
        assert self.m.lookup_packed(prompt, tenant_salt=tenant) == self.m.lookup_prefix(
            list(prompt.token_ids), tenant_salt=tenant
        )
        self.routed.append((prompt, tenant))

    @rule(per_token=st.sampled_from([0.1, 1.0, 10.0]))
    def reprice(self, per_token):
        if per_token != self.prices.per_token:
            self.prices.per_token = per_token
            self.prices.version += 1

    @precondition(lambda self: self.routed)
    @rule(target=Lifecycle.requests, data=st.data())
    def admit_routed(self, data):
        prompt, tenant = self.routed.pop(data.draw(st.integers(0, len(self.routed) - 1)))
        if id(prompt.packed) in self.m._looked_up:
            event("an admission of a kept lookup")
        admit = self.m.admit
        self.m.admit = lambda rid, ids, budget, tenant_salt: admit(
            rid, ids, budget, tenant_salt=tenant_salt, prompt=prompt
        )
        try:  # (the parent's admit compares the hit with a fresh lookup_prefix first)
            rid = Lifecycle.admit(self, list(prompt.token_ids), len(prompt.token_ids), [], tenant, None)
        finally:
            del self.m.admit
        return multiple() if rid is None else rid


RoutedDualPool.TestCase.settings = SETTINGS
TestRoutedDualPool = RoutedDualPool.TestCase


class _Twins(RuleBasedStateMachine):
    """Two caches, `a` and `b`, driven alike (`_both`: each call's answer equal in both);
    a fork of a request whose reservation is all computed, in both."""

    requests = Bundle("twin_requests")
    child_prefix = "s"  # (a fork's child: s1, s2, ...)

    def _both(self, call):
        ra, rb = call(self.a), call(self.b)
        assert ra == rb, (ra, rb)
        return ra

    @rule(target=requests, parent=requests)
    def fork(self, parent):
        if parent not in self.a or self.a.num_reserved_tokens(parent) != self.a.num_computed_tokens(parent):
            return multiple()
        self.next_id += 1
        child = f"{self.child_prefix}{self.next_id}"
        return child if self._both(lambda m: m.fork(parent, child)) else multiple()


class TwinV4(_Twins):
    """Two V4 dual-pool caches (one group: the engine's DSV4CacheManager, whose lookups an
    admission may take again) driven alike, but for the router's path: in A each admission
    takes a prompt packed and looked up (`lookup_packed`) some operations before, with
    `prompt=`; in B the same admission comes as a plain list, looked up afresh. A kept
    lookup is taken only while no `lookup_stamp` moved, so every admission, step and pool
    must stay equal in A and B; the restore prices move between them too."""

    requests = _Twins.requests  # (the base's bundle: its fork's children join it)
    child_prefix = "v"
    restore, num_checkpoints, checkpoint_blocks = "auto", 2, 0

    def __init__(self) -> None:
        super().__init__()
        self.prices = [Prices(), Prices()]
        self.a, self.b = (self._build(p) for p in self.prices)
        self.routed: list = []
        self.last: dict[str, list[int]] = {}  # a request's token ids when last seen live
        self.swapped: list[tuple[str, int]] = []  # (request, computed tokens) swapped out
        self.held: tuple[dict, dict] = ({}, {})  # per cache: request -> the boundary block held
        self.next_id = 0

    def _build(self, prices: Prices) -> HybridCacheManager:
        spec = DualPoolGroupSpec(
            "v4",
            4,
            replay_len=2,
            restore=self.restore,
            num_checkpoints=self.num_checkpoints,
            checkpoint_blocks=self.checkpoint_blocks,
            restore_cost=prices,
        )
        return HybridCacheManager([(spec, (12, 4))], DESC, turn_end_checkpoints=True)

    @rule(base=st.integers(0, 2), cut=st.integers(1, 24), suffix=st.lists(ALPHABET, max_size=3))
    def router_lookup(self, base, cut, suffix):
        prompt = pack_prompt(CacheModel.bases[base][:cut] + suffix)
        hit = self.a.lookup_packed(prompt)
        assert hit == self.b.lookup_prefix(list(prompt.token_ids)) == self.a.lookup_prefix(list(prompt.token_ids))
        self.routed.append(prompt)

    @precondition(lambda self: self.routed)
    @rule(target=requests, data=st.data(), budget=st.one_of(st.none(), st.integers(1, 9)))
    def admit_routed(self, data, budget):
        prompt = self.routed.pop(data.draw(st.integers(0, len(self.routed) - 1)))
        if id(prompt.packed) in self.a._looked_up:
            event("an admission of a kept lookup")
        self.next_id += 1
        rid = f"v{self.next_id}"
        ids = list(prompt.token_ids)
        self.last[rid] = ids
        admission = self.a.admit(rid, ids, budget, prompt=prompt)
        assert admission == self.b.admit(rid, list(ids), budget), rid
        return multiple() if admission is None else rid

    @rule(target=requests, source=requests, suffix=st.lists(ALPHABET, min_size=1, max_size=5))
    def next_turn(self, source, suffix):
        """A finished turn's follow-up, looked up by the router first."""
        if source in self.a:
            self.last[source] = list(self.a.token_ids(source))
            if self.a.num_reserved_tokens(source) == self.a.num_computed_tokens(source):
                self._both(lambda m: m.release(source, "finish"))
        prompt = pack_prompt(self.last[source] + suffix)
        self.a.lookup_packed(prompt)
        self.routed.append(prompt)
        return multiple()

    @rule(rids=st.lists(requests, min_size=1, max_size=3, unique=True), tok=ALPHABET, chunk=st.integers(1, 6))
    def step(self, rids, tok, chunk):
        live = [r for r in rids if r in self.a]
        if not live:
            return
        pending = [r for r in live if self.a.num_reserved_tokens(r) > self.a.num_computed_tokens(r)]
        if not pending:
            counts = []
            for rid in live:
                known = self.a.num_tokens(rid) - self.a.num_computed_tokens(rid)
                if not known:
                    self._both(lambda m, rid=rid: m.append_token_ids(rid, [tok]))
                    known = 1
                counts.append(min(chunk, known))
            if not self._both(lambda m: m.reserve_step(live, counts)):
                return
            pending = live
        counts = [self.a.num_reserved_tokens(r) - self.a.num_computed_tokens(r) for r in pending]
        # the runner's question about the step's reservations: A answers through its decode
        # memo where it can, B through the naive twin
        starts = [self.a.num_computed_tokens(r) for r in pending]
        ends = [s + n for s, n in zip(starts, counts, strict=True)]
        assert self.a.first_off_step(pending, starts, ends) is None
        assert self.a.step_reservations(pending, starts, ends) == self.b._each_reservation(pending, starts, ends)
        assert self.a.tables(pending) == [self.a.block_ids(r) for r in pending]
        nexts = [
            tok if self.a.num_computed_tokens(r) + n == self.a.num_tokens(r) else None
            for r, n in zip(pending, counts, strict=True)
        ]
        self._both(lambda m: m.commit_step(pending, counts, nexts))

    @rule(rid=requests)
    def unreserve(self, rid):
        if rid in self.a:
            self._both(lambda m: m.unreserve(rid))

    @rule(rid=requests, how=st.sampled_from(["finish", "cancel", "preempt"]))
    def release(self, rid, how):
        if rid in self.a:
            self.last[rid] = list(self.a.token_ids(rid))
        self._both(lambda m: m.release(rid, how))

    @rule(rid=requests)
    def swap_out(self, rid):
        """A preemption that swaps the request's state out (the tier bridge's swap_out): the
        state's span boundary is held a hit point while the entry waits in the tier."""
        if rid not in self.a or self.a.num_reserved_tokens(rid) != self.a.num_computed_tokens(rid):
            return
        blocks = [tier_bridge.swap_state_block(m, rid) for m in (self.a, self.b)]
        assert (blocks[0] is None) == (blocks[1] is None)
        self.last[rid] = list(self.a.token_ids(rid))
        nc = self.a.num_computed_tokens(rid)
        for m, block, held in zip((self.a, self.b), blocks, self.held, strict=True):
            if block is not None:
                m.hold_swapped_state(block, True)
                held[rid] = block
            m.release(rid, "preempt")
        if blocks[0] is not None:
            self.swapped.append((rid, nc))

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        """The swapped request comes back (after whatever happened since): admitted again, its
        boundary let go, and its state restored when the admission hit that boundary."""
        rid, nc = self.swapped.pop(data.draw(st.integers(0, len(self.swapped) - 1)))
        ids = self.last[rid]
        prompt = pack_prompt(ids)
        self.a.lookup_packed(prompt)
        admission = self.a.admit(rid, list(ids), prompt=prompt)
        assert admission == self.b.admit(rid, list(ids))
        tail = nc % 4
        for m, held in zip((self.a, self.b), self.held, strict=True):
            m.hold_swapped_state(held.pop(rid), False)
        if admission is None:
            return
        if (
            admission.num_cached_tokens == nc - tail
            and self._both(lambda m: m.swapped_state_refusal(rid, tail)) is None
        ):
            event("a swapped state restored")
            self._both(lambda m: m.restore_swapped_state(rid, tail))

    @rule(per_token=st.sampled_from([0.1, 1.0, 10.0]))
    def reprice(self, per_token):
        for prices in self.prices:
            if per_token != prices.per_token:
                prices.per_token = per_token
                prices.version += 1

    @invariant()
    def alike(self):
        for m in (self.a, self.b):
            m.check_integrity()
            u = m.usage()  # the classical pool's held and free blocks make it up
            assert u.num_held_blocks + u.num_free_blocks == u.num_blocks == 12, u
            assert u.num_held_blocks == m.group_held_blocks()["v4"], (u, m.group_held_blocks())
        views = []
        for m in (self.a, self.b):
            pools = [(p.free_queue(), list(map(p.refcount, range(p.num_blocks)))) for p in m.pools]
            reqs = [
                (r, m.block_ids(r), m.num_computed_tokens(r), m.num_reserved_tokens(r), list(m.token_ids(r)))
                for r in sorted(m.request_ids)
            ]
            views.append((pools, reqs, m.stats))
        assert views[0] == views[1]


class TwinV4Pooled(TwinV4):
    restore, num_checkpoints, checkpoint_blocks = "auto", 0, 1


class TwinV4Checkpoint(TwinV4):
    restore, num_checkpoints, checkpoint_blocks = "checkpoint", 2, 0


for _machine in (TwinV4, TwinV4Pooled, TwinV4Checkpoint):
    _machine.TestCase.settings = SETTINGS
TestTwinV4 = TwinV4.TestCase
TestTwinV4Pooled = TwinV4Pooled.TestCase
TestTwinV4Checkpoint = TwinV4Checkpoint.TestCase


def test_usage_counts_a_reservations_checkpoint_snapshot_in_the_classical_pool() -> None:
    """A V4 group whose checkpoints are classical blocks (checkpoint_blocks=1): an open
    reservation holds its snapshot block (held_blocks counts it), but usage() left it out:
    after admitting 4 tokens 1 held and 10 free of 12 while group_held_blocks said 2."""
    spec = DualPoolGroupSpec("v4", 4, replay_len=2, restore="checkpoint", checkpoint_blocks=1)
    m = HybridCacheManager([(spec, (12, 4))], DESC, turn_end_checkpoints=True)

    def held_free() -> tuple[int, int]:
        usage = m.usage()
        assert usage.num_held_blocks == m.group_held_blocks()["v4"]
        return usage.num_held_blocks, usage.num_free_blocks

    m.admit("a", list(range(1, 15)), 4)
    assert held_free() == (2, 10)  # block 0 and the snapshot's block
    m.commit("a", 4)
    assert held_free() == (1, 11)
    assert m.reserve("a", 4) is not None
    assert held_free() == (3, 9)
    m.commit("a", 4)
    assert held_free() == (2, 10)
    m.check_integrity()


def test_usage_counts_a_hits_copied_tail_block_while_it_is_held() -> None:
    """A follow-up hits inside the partial block a finished turn kept (7 of 7 computed tokens,
    blocks of 5): its table is [block 0, a fresh block for the copy], and it holds the copy's
    source until its first commit. usage() left the source out: 2 held and 9 free of 12."""
    m = HybridCacheManager([(AttentionGroupSpec("full", 5), 12)], DESC, turn_end_checkpoints=True)
    m.admit("a", [1, 2, 3, 4, 5, 6, 7])
    m.commit_step(["a"], [7], [9])
    m.release("a", "finish")
    admission = m.admit("b", [1, 2, 3, 4, 5, 6, 7, 9, 9])
    (copy,) = admission.groups["full"].copies
    assert admission.num_cached_tokens == 7 and m.block_ids("b") == [0, copy.dst]
    usage = m.usage()
    assert (usage.num_held_blocks, usage.num_free_blocks, usage.num_filled_slots) == (3, 9, 5 + 2 + 2)
    m.commit_step(["b"], [2], [None])  # the first commit lets the source go
    usage = m.usage()
    assert (usage.num_held_blocks, usage.num_free_blocks, usage.num_filled_slots) == (2, 10, 9)


class Replicas(RuleBasedStateMachine):
    """Two full-attention replicas of one model (the simulator's router over a fleet): prompts
    packed once and kept, their hashes memoized in the LookupPrompt and each pool's accepted
    run, looked up again and again in either replica while requests come and go; every
    kept lookup, probe and admission with `prompt=` must answer as a fresh list does."""

    requests = Bundle("replica_requests")
    block_size = 3

    def __init__(self) -> None:
        super().__init__()
        self.caches = [self._build(), self._build()]
        self.kept: list = []
        self.next_id = 0

    def _build(self) -> HybridCacheManager:
        return FullAttentionManager(10, self.block_size, DESC)

    @rule(base=st.integers(0, 2), cut=st.integers(1, 30), suffix=st.lists(ALPHABET, max_size=3))
    def pack(self, base, cut, suffix):
        self.kept.append(pack_prompt(CacheModel.bases[base][:cut] + suffix))

    @precondition(lambda self: self.kept)
    @rule(data=st.data(), which=st.integers(0, 1), tenant=st.sampled_from(["", "t"]))
    def lookup_kept(self, data, which, tenant):
        prompt = self.kept[data.draw(st.integers(0, len(self.kept) - 1))]
        m = self.caches[which]
        fresh = m.lookup_prefix(list(prompt.token_ids), tenant_salt=tenant)
        assert m.lookup_packed(prompt, tenant_salt=tenant) == fresh
        for n in range(1, len(prompt.token_ids) + 1):
            assert m.may_reach(prompt, n, tenant_salt=tenant) or fresh < n, (n, fresh)

    @precondition(lambda self: self.kept)
    @rule(target=requests, data=st.data(), which=st.integers(0, 1), budget=st.one_of(st.none(), st.integers(1, 5)))
    def admit_kept(self, data, which, budget):
        prompt = self.kept[data.draw(st.integers(0, len(self.kept) - 1))]
        m = self.caches[which]
        fresh = m.lookup_prefix(list(prompt.token_ids))
        self.next_id += 1
        rid = f"x{self.next_id}"
        admission = m.admit(rid, list(prompt.token_ids), budget, prompt=prompt)
        if admission is None:
            return multiple()
        assert admission.num_cached_tokens == fresh
        return (which, rid)

    @rule(req=requests, tok=ALPHABET)
    def step(self, req, tok):
        which, rid = req
        m = self.caches[which]
        if rid not in m:
            return
        nc = m.num_computed_tokens(rid)
        n = m.num_tokens(rid) - nc
        if not n:
            m.append_token_ids(rid, [tok])
            n = 1
        if m.reserve_step([rid], [n]):
            m.commit_step([rid], [n], [tok])

    @rule(req=requests, how=st.sampled_from(["finish", "preempt"]))
    def release(self, req, how):
        which, rid = req
        self.caches[which].release(rid, how)

    @invariant()
    def integrity(self):
        for m in self.caches:
            m.check_integrity()


class ConstantHashReplicas(Replicas):
    """Every block hashes alike: the memo's hashes lead to entries of other contents."""

    def _build(self) -> HybridCacheManager:
        m = super()._build()
        m.pool.hasher.digest = lambda data: b"\x00" * 16
        return m


class ReplicasOfBlocksOf1(Replicas):
    block_size = 1

    def _build(self) -> HybridCacheManager:
        return FullAttentionManager(24, 1, DESC)


for _machine in (Replicas, ConstantHashReplicas, ReplicasOfBlocksOf1):
    _machine.TestCase.settings = SETTINGS
TestReplicas = Replicas.TestCase
TestConstantHashReplicas = ConstantHashReplicas.TestCase
TestReplicasOfBlocksOf1 = ReplicasOfBlocksOf1.TestCase


class _Draws:
    """`st.data()` for a rule called outside hypothesis: integers(lo, hi) from a seeded rng."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def draw(self, strategy):
        inner = strategy.wrapped_strategy
        return self.rng.randint(inner.start, inner.end)


def drive(machine: CacheModel, rng: random.Random, num_ops: int) -> None:
    """A long run of the machine's rules with random arguments (hypothesis's examples stay
    short): deep states, a full pool, long conversations; every invariant after each."""
    rids: list[str] = []
    invariants = [
        machine.integrity,
        machine.every_read_position_holds_its_prefix,
        machine.stats_add_up,
        machine.usage_adds_up,
    ]
    if isinstance(machine, TieredFullBlocksOf3):
        invariants.append(machine.evicted_blocks_are_saved)
    toks = lambda n: [rng.randint(0, 2) for _ in range(rng.randint(0, n))]  # noqa: E731
    chunk = lambda: rng.choice([None, rng.randint(0, 9)])  # noqa: E731
    for _ in range(num_ops):
        op = rng.choice(["admit", "follow", "turn", "step", "step", "step", "fork", "back", "release", "look", "swap"])
        rid = rng.choice(rids) if rids else None
        live = [r for r in rids if r in machine.m]
        if live and min(p.num_free for p in machine.m.pools) < 3 and rng.random() < 0.7:
            op, rid = "release", rng.choice(live)  # (a full pool refuses most admissions)
        if op == "admit" or rid is None:
            base = CacheModel.bases[rng.randint(0, 2)]
            out = machine._admit(
                base[: rng.randint(0, 40)] + toks(5), rng.choice(["", "t"]), chunk(), rng.random() < 0.5
            )
        elif op == "follow":
            out = machine._admit(machine.seq[rid][: rng.randint(0, 60)] + toks(4), machine.tenant[rid], chunk(), False)
        elif op == "turn":
            out = machine.next_turn(rid, toks(4) or [1], chunk())
        elif op == "step":
            out = machine.step(
                rng.sample(rids, min(len(rids), rng.randint(1, 4))), rng.randint(1, 7), 1, rng.randint(0, 3)
            )
        elif op == "fork":
            out = machine.fork(rid)
        elif op == "back":
            out = machine.rollback(rid, _Draws(rng))
        elif op == "release":
            out = machine.release(rid, rng.choice(["finish", "cancel", "preempt"]))
        elif op == "look":
            out = machine.lookup(rng.randint(0, 2), rng.randint(1, 40), toks(4), rng.choice(["", "t"]))
        elif isinstance(machine, TieredFullBlocksOf3):
            out = machine.preempt_and_swap(_Draws(rng), rid) if rng.random() < 0.7 else machine.flush_to_the_tier()
        else:
            out = None
        if isinstance(out, str):
            rids.append(out)
        for check in invariants:
            check()
    machine.teardown()


@pytest.mark.parametrize(
    "machine",
    [FullBlocksOf3, ExactFullBlocksOf5, Windows, WindowsOnTheGrid, TieredFullBlocksOf3, ExactTieredFullBlocksOf3],
)
def test_long_random_runs(machine, monkeypatch) -> None:
    monkeypatch.setitem(globals(), "event", lambda text: None)  # (hypothesis records events in its tests only)
    num_runs = max(1, int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "300")) // 150)
    for seed in range(num_runs):
        drive(machine(), random.Random(seed), 300)


class TwinSteps(_Twins):
    """The step paths against their naive twins: two caches driven alike, A through
    `reserve_step` / `commit_step` (the decode memo, `_reserve_decodes`, `_commit_decodes`,
    `_commit_chunks`), B through `_reserve_each` / `_commit_each`; batches that change from
    step to step (rows leave, join, are reordered). Every answer, table, copy, pool queue
    and counter must be equal."""

    requests = _Twins.requests

    def _build(self) -> HybridCacheManager:
        return HybridCacheManager(
            [(AttentionGroupSpec("full", 3), 16), (AttentionGroupSpec("w", 3, window=4), 10)],
            DESC,
            turn_end_checkpoints=True,
        )

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = self._build(), self._build()
        self.next_id = 0

    @rule(target=requests, base=st.integers(0, 2), cut=st.integers(1, 20), suffix=st.lists(ALPHABET, max_size=3))
    def admit(self, base, cut, suffix):
        self.next_id += 1
        rid = f"s{self.next_id}"
        prompt = CacheModel.bases[base][:cut] + suffix
        admission = self._both(lambda m: m.admit(rid, list(prompt), 4))
        return multiple() if admission is None else rid

    @rule(rids=st.lists(requests, min_size=1, max_size=5, unique=True), tok=ALPHABET, data=st.data())
    def step(self, rids, tok, data):
        live = [r for r in rids if r in self.a]
        if not live:
            return
        a = self.a
        counts, ids, ns = [], [], []  # the step's counts; the reservations it makes
        for rid in live:
            pending = a.num_reserved_tokens(rid) - a.num_computed_tokens(rid)
            if a.exact_steps and pending:  # (an admission's first step, reserved already)
                counts.append(pending)
                continue
            known = a.num_tokens(rid) - a.num_computed_tokens(rid)
            if not known:
                self._both(lambda m, rid=rid: m.append_token_ids(rid, [tok]))
                known = 1
            counts.append(min(known, data.draw(st.integers(1, 4))))
            ids.append(rid)
            ns.append(counts[-1])
        if ids:
            fits = a.reserve_step(ids, ns)
            assert fits == self.b._reserve_each(ids, ns), "reserve_step and its twin disagree"
            if not fits:
                return
        assert a.take_copies() == self.b.take_copies()
        starts = [a.num_computed_tokens(r) for r in live]
        ends = [s + n for s, n in zip(starts, counts, strict=True)]
        for g in a.attention_groups:
            assert a.step_tables(live, starts, ends, g.name) == self.b.step_tables(live, starts, ends, g.name)
        nexts = [tok if e == a.num_tokens(r) else None for r, e in zip(live, ends, strict=True)]
        a.commit_step(live, counts, nexts)
        self.b._commit_each(live, counts, nexts)

    @rule(rid=requests, how=st.sampled_from(["finish", "cancel", "preempt"]))
    def release(self, rid, how):
        self._both(lambda m: m.release(rid, how))

    @invariant()
    def alike(self):
        views = []
        for m in (self.a, self.b):
            m.check_integrity()
            pools = [(p.free_queue(), list(map(p.refcount, range(p.num_blocks)))) for p in m.pools]
            reqs = [
                (
                    r,
                    [m.block_ids(r, g.name) for g in m.attention_groups],
                    m.num_computed_tokens(r),
                    m.num_reserved_tokens(r),
                    list(m.token_ids(r)),
                )
                for r in sorted(m.request_ids)
            ]
            views.append((pools, reqs, m.stats))
        assert views[0] == views[1]


class TwinStepsNotExact(TwinSteps):
    def _build(self) -> HybridCacheManager:
        return FullAttentionManager(16, 3, DESC)


for _machine in (TwinSteps, TwinStepsNotExact):
    _machine.TestCase.settings = SETTINGS
TestTwinSteps = TwinSteps.TestCase
TestTwinStepsNotExact = TwinStepsNotExact.TestCase


def test_a_turn_end_is_not_filed_in_a_block_a_fork_sibling_holds() -> None:
    """Every hash alike: p's full block 0 is left unregistered (a collision with x's block,
    which leaves later). p forks c (sharing it), rolls back to 1 token and finishes: its turn
    end was filed in
    that block, which the pool then registered as the 1-token content under c, whose chain
    names it as the full block (check_integrity: 'block 0 is registered as other content',
    found by a long seeded run of ConstantHashExactFullBlocksOf5)."""
    m = HybridCacheManager([(AttentionGroupSpec("full", 5), 12)], DESC, turn_end_checkpoints=True)
    m.pool.hasher.digest = lambda data: b"\x00" * 16
    m.admit("x", [9, 9, 9, 9, 9, 9])
    m.commit_step(["x"], [6], [None])
    m.admit("p", [0, 1, 2, 0, 1, 1, 1])
    m.commit_step(["p"], [7], [None])
    block = m.block_ids("p")[0]
    assert m.pool.block_hash(block) is None  # the collision
    assert m.fork("p", "c")
    m.release("x")  # x's blocks leave the index: the hash is free again
    m.admit("y", [3] * 5 * m.num_free_blocks)
    m.release("y", "cancel")
    m.rollback("p", 1)
    m.release("p", "finish")
    m.check_integrity()
    assert m.pool.block_hash(block) is None and m.block_ids("c")[0] == block
    assert m.lookup_prefix([0, 5, 5]) == 0
