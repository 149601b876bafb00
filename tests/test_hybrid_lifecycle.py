"""Property-based lifecycle test of the hybrid coordinator: random admits (with prefix hits at
every kind of point), extends, batched decode steps, forks, preemptions, cancels and
finishes on small pools of three groups: a sliding-window group (blocks of 4, window 6), a
full-attention group (blocks of 4) and a recurrent group (a checkpoint every 6 tokens, so
hits fall inside attention blocks and are copied on write).

The model keeps, independently of the coordinator, what every physical slot of every group
holds, as (tenant, the whole prefix it stands for):
  - attention slot: the prefix up to and including the token whose K/V was written there
    (the K/V of a token depends on every token before it);
  - recurrent slot: the prefix the state is the state after (a live state, a checkpoint).
It follows what the calls say: the copies (`take_copies`), the restore source, the
checkpoint slots of each step; the "forward" writes the step's positions and advances the
live state. After every operation:
  - check_integrity() passes;
  - every request reads, in every attention group, exactly its own prefix at every
    position its next step reads ([max(0, computed - W + 1), computed) for the window
    group, [0, computed) for the full one), and its live state is the state after its
    computed tokens, under its tenant. A wrong hit point (one group's hit taken without
    the other's), a missing copy, a block freed while still read, or a checkpoint filed
    under the wrong prefix shows up here as a wrong prefix.
DualPoolLifecycle adds V4's dual pool as a group (spans of 8, a hit replays the 2 tokens
before it): each classical block holds (group, tenant, the prefix through its span), written
by the step that completes the span; each state block the state after some prefix. A hit's
state is rebuilt as a runner would: replaying [replay_start, P) on top of the cached spans,
which rebuilds the unfinished span's entries only if the replay starts at or before the
last cached span's end, and the window only if it starts at or before P - replay_len; a
state that was not rebuilt is marked and the invariant catches it.
KVPOOL_HYPOTHESIS_EXAMPLES raises the example count (300 by default, CI's setting; this test
runs a third of it).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvpool.cache import CacheDescriptor
from kvpool.cache.coordinator import HybridCacheManager
from kvpool.cache.dual_pool import DualPoolGroup, DualPoolGroupSpec
from kvpool.cache.recurrent import RecurrentGroupSpec
from kvpool.cache.window import AttentionGroupSpec

BS = 4
SPECS = [
    (AttentionGroupSpec("swa", BS, window=6), 10),
    (AttentionGroupSpec("full", BS), 16),
    (RecurrentGroupSpec("rec", 6), 12),
]
BASES = [list(range(1, 20)), [1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9, 9], [5] * 20]
tokens = st.lists(st.integers(0, 9), min_size=0, max_size=6)


class Lifecycle(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.m = self._build()
        # What each slot holds, one dict per pool (groups on a shared pool see each other's
        # writes; an attention slot names the group that wrote it)
        by_pool: dict[object, dict[int, tuple]] = {}
        self.content = {name: by_pool.setdefault(g.pool, {}) for name, g in self.m.groups.items()}
        # Dual-pool groups: what each state block holds
        self.states: dict[str, dict[int, tuple]] = {g.name: {} for g in self.m.dual_groups}
        self.seq: dict[str, list[int]] = {}
        self.tenant: dict[str, str] = {}
        self.next_id = 0
        self.prompts: set[tuple[tuple[int, ...], str]] = set()  # every prompt admitted, with its tenant

    def _build(self) -> HybridCacheManager:
        # turn ends on: a finish files the live state, `mark_turn_end` a copy of it
        return HybridCacheManager(SPECS, CacheDescriptor("prop"), turn_end_checkpoints=True)

    # ---- the "runner" ------------------------------------------------------------------

    def _queues(self) -> dict[str, list[int]]:
        """Every pool's free queue (a dual pool's state pool apart)."""
        queues = {name: g.pool.free_queue() for name, g in self.m.groups.items()}
        queues.update({g.name + ".state": g.state_pool.free_queue() for g in self.m.dual_groups})
        return queues

    def _restore_dual(self, rid: str, point: int) -> None:
        """Rebuild each dual pool's state after a hit at `point` as the restore says: copy a
        checkpoint, replay [replay_start, point) on top of the cached spans the request holds, or
        adopt a kept turn-end state."""
        tenant, seq = self.tenant[rid], tuple(self.seq[rid])
        for g in self.m.dual_groups:
            restore = self.m.part(rid, g.name).restore
            assert restore.state_slot == self.m.part(rid, g.name).state_slot
            if not point:
                assert restore.method == "none"
                self.states[g.name][restore.state_slot] = (tenant, ())
                continue
            cached = point // g.span * g.span  # the spans read from the classical pool
            table = self.m.block_ids(rid, g.name)
            for k in range(point // g.span):
                assert self.content[g.name].get(table[k]) == (g.name, tenant, seq[: (k + 1) * g.span]), (rid, k)
            if restore.method == "adopt":  # a turn end's kept state block: the state at point already
                assert point % g.span and self.states[g.name].get(restore.state_slot) == (tenant, seq[:point])
                continue
            if restore.method == "checkpoint":
                assert g.spec.restore != "recompute" and restore.checkpoint_slot is not None
                assert self.states[g.name].get(self._ckpt_key(restore.checkpoint_slot)) == (tenant, seq[:point]), (
                    "the checkpoint"
                )
                self.states[g.name][restore.state_slot] = (tenant, seq[:point])
                continue
            assert restore.method == "recompute" and g.spec.restore != "checkpoint"
            start = restore.replay_start
            rebuilt = start <= cached and start <= max(0, point - g.spec.replay_len)
            self.states[g.name][restore.state_slot] = (tenant, seq[:point]) if rebuilt else ("not rebuilt", start)

    def _apply_copies(self) -> None:
        for name, copies in self.m.take_copies().items():
            slots = self.content[name]
            for copy in copies:
                for offset in range(BS):
                    src = copy.src * BS + offset
                    if src in slots:
                        slots[copy.dst * BS + offset] = slots[src]
                    else:
                        slots.pop(copy.dst * BS + offset, None)

    def _slot(self, rid: str, group: str, pos: int) -> int:
        first = self.m.part(rid, group).first_block
        return self.m.block_ids(rid, group)[pos // BS - first] * BS + pos % BS

    def _forward(self, rid: str, start: int, end: int) -> None:
        """Write positions [start, end) in every attention group; advance the live state,
        snapshotting it where the step asks."""
        tenant, seq = self.tenant[rid], self.seq[rid]
        for g in self.m.attention_groups:
            for pos in range(start, end):
                self.content[g.name][self._slot(rid, g.name, pos)] = (g.name, tenant, tuple(seq[: pos + 1]))
        for g in self.m.dual_groups:
            state_slot = self.m.part(rid, g.name).state_slot
            assert self.states[g.name][state_slot] == (tenant, tuple(seq[:start])), "the state the step starts from"
            table = self.m.block_ids(rid, g.name)
            for k in range(start // g.span, end // g.span):  # the spans the step completes
                self.content[g.name][table[k]] = (g.name, tenant, tuple(seq[: (k + 1) * g.span]))
            for position, slot in self.m.part(rid, g.name).checkpoints:  # snapshots of the state
                assert start < position <= end and position % g.span == 0
                self.states[g.name][self._ckpt_key(slot)] = (tenant, tuple(seq[:position]))
            self.states[g.name][state_slot] = (tenant, tuple(seq[:end]))
        rec = self.content["rec"]
        live = self.m.part(rid, "rec").state_slot
        assert rec[live] == (tenant, tuple(seq[:start])), "the state the step starts from"
        for position, slot in self.m.part(rid, "rec").checkpoints:
            assert start < position <= end
            rec[slot] = (tenant, tuple(seq[:position]))
        rec[live] = (tenant, tuple(seq[:end]))

    def _ckpt_key(self, slot: int) -> object:
        """Where the model keeps a dual pool's checkpoint of `slot` (slots are numbered after the state blocks)."""
        return slot

    def _apply_spills(self) -> None:
        """The kept turn-end states an admission or a fork spilled (its state block taken),
        copied into their checkpoints, as the runner does before anything writes the state
        blocks (`take_spills`; the model copied none: a spilled turn end's hit found no
        checkpoint)."""
        for g in self.m.dual_groups:
            states = self.states[g.name]
            for state_slot, checkpoint_slot in g.take_spills():
                states[self._ckpt_key(checkpoint_slot)] = states[state_slot]

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    # ---- rules -------------------------------------------------------------------------

    @rule(
        target=requests,
        base=st.sampled_from(BASES),
        cut=st.integers(1, 20),
        suffix=tokens,
        tenant=st.sampled_from(["", "", "t2"]),
        budget=st.sampled_from([None, None, 3]),
    )
    def admit(self, base, cut, suffix, tenant, budget):
        prompt = base[:cut] + suffix
        rid = self._new_id()
        self.prompts.add((tuple(prompt), tenant))
        before = self._queues()
        expected_hit = self.m.lookup_prefix(prompt, tenant_salt=tenant)
        admission = self.m.admit(rid, prompt, budget, tenant_salt=tenant)
        if admission is None:
            assert self._queues() == before and rid not in self.m
            return None
        point = admission.num_cached_tokens
        assert point == expected_hit and point <= len(prompt) - 1
        self.seq[rid], self.tenant[rid] = list(prompt), tenant
        self._apply_spills()
        self._apply_copies()
        live, src = self.m.part(rid, "rec").state_slot, self.m.part(rid, "rec").restore.checkpoint_slot
        if point:
            assert src is not None
            self.content["rec"][live] = self.content["rec"][src]
        else:
            assert src is None
            self.content["rec"][live] = (tenant, ())
        self._restore_dual(rid, point)
        self._forward(rid, point, point + admission.num_scheduled_tokens)
        self.m.commit(rid, admission.num_scheduled_tokens)
        return rid

    @rule(rid=requests, extra=st.lists(st.integers(0, 9), min_size=0, max_size=7))
    def extend(self, rid, extra):
        if rid not in self.m:
            return
        self.m.append_token_ids(rid, extra)
        self.seq[rid] += extra
        start = self.m.num_computed_tokens(rid)
        todo = self.m.num_tokens(rid) - start
        if self.m.reserve(rid, todo) is None:
            return  # the tokens stay known; a later step computes them
        self._apply_copies()
        self._forward(rid, start, start + todo)
        self.m.commit(rid, todo)

    @rule(rids=st.lists(requests, min_size=1, max_size=4, unique=True), tok=st.integers(0, 9))
    def decode(self, rids, tok):
        live = [r for r in rids if r in self.m]
        if not live:
            return
        counts = []
        for rid in live:
            if self.m.num_tokens(rid) == self.m.num_computed_tokens(rid):
                self.m.append_token_ids(rid, [tok])
                self.seq[rid].append(tok)
            counts.append(self.m.num_tokens(rid) - self.m.num_computed_tokens(rid))
        before = self._queues()
        if not self.m.reserve_step(live, counts):
            assert self._queues() == before
            return
        self._apply_copies()
        starts = [self.m.num_computed_tokens(r) for r in live]
        for rid, start, n in zip(live, starts, counts, strict=True):
            self._forward(rid, start, start + n)
        self.m.commit_step(live, counts, [tok] * len(live))
        for rid in live:
            self.seq[rid].append(tok)

    @rule(target=requests, parent=requests)
    def fork(self, parent):
        if parent not in self.m:
            return None
        child = self._new_id()
        before = self._queues()
        if not self.m.fork(parent, child):
            assert child not in self.m and self._queues() == before
            full = [self.m.groups["rec"].pool.num_free, *(g.state_pool.num_free for g in self.m.dual_groups)]
            assert 0 in full, "a fork fails only for want of a state"
            return None
        self._apply_spills()
        n = self.m.num_computed_tokens(parent)
        self.seq[child] = self.seq[parent][:n]
        self.tenant[child] = self.tenant[parent]
        rec = self.content["rec"]
        rec[self.m.part(child, "rec").state_slot] = rec[self.m.part(parent, "rec").state_slot]
        for g in self.m.dual_groups:
            states = self.states[g.name]
            states[self.m.part(child, g.name).state_slot] = states[self.m.part(parent, g.name).state_slot]
        return child

    @rule(rid=requests)
    def mark_turn_end(self, rid):
        """The runner copies the live state into each slot the call hands out."""
        if rid not in self.m:
            return
        rec = self.content["rec"]
        for slot in self.m.mark_turn_end(rid).values():
            rec[slot] = rec[self.m.part(rid, "rec").state_slot]

    @rule(rid=consumes(requests), how=st.sampled_from(["finish", "cancel", "preempt"]))
    def release(self, rid, how):
        live = rid in self.m
        assert self.m.release(rid, how) is live
        assert self.m.release(rid, "cancel") is False  # a second release is a no-op

    def _lookups(self) -> dict[tuple[tuple[int, ...], str], int]:
        return {(p, t): self.m.lookup_prefix(list(p), tenant_salt=t) for p, t in self.prompts}

    @rule()
    def reset_prefix_cache(self):
        """Refused, nothing changed, while a request is admitted; else no prompt hits after it."""
        live = bool(self.m.request_ids)
        before, hits = self._queues(), self._lookups()
        assert self.m.reset_prefix_cache() is not live
        if live:
            assert self._queues() == before and self._lookups() == hits
        else:
            assert not any(self._lookups().values())

    @rule(how=st.sampled_from(["finish", "cancel", "preempt"]))
    def release_all_and_reset(self, how):
        """Every request released (a finish keeps its turn ends), then the reset: no prompt hits."""
        for rid in self.m.request_ids:
            self.m.release(rid, how)
        self.m.check_integrity()
        assert self.m.reset_prefix_cache() is True
        self.m.check_integrity()
        assert not any(self._lookups().values())
        assert self.m.reset_prefix_cache() is True  # (again: nothing left to forget)

    # ---- invariants --------------------------------------------------------------------

    @invariant()
    def integrity(self):
        self.m.check_integrity()

    @invariant()
    def every_group_reads_the_right_prefix(self):
        rec = self.content["rec"]
        for rid in self.m.request_ids:
            tenant, seq = self.tenant[rid], self.seq[rid]
            n = self.m.num_computed_tokens(rid)
            assert self.m.token_ids(rid)[:n] == seq[:n]
            for g in self.m.attention_groups:
                for pos in range(g.spec.first_needed(n), n):
                    slot = self._slot(rid, g.name, pos)
                    assert self.content[g.name].get(slot) == (g.name, tenant, tuple(seq[: pos + 1])), (rid, g.name, pos)
            assert rec.get(self.m.part(rid, "rec").state_slot) == (tenant, tuple(seq[:n])), rid
            for g in self.m.dual_groups:
                table = self.m.block_ids(rid, g.name)
                for k in range(n // g.span):
                    assert self.content[g.name].get(table[k]) == (g.name, tenant, tuple(seq[: (k + 1) * g.span])), (
                        rid,
                        g.name,
                        k,
                    )
                assert self.states[g.name].get(self.m.part(rid, g.name).state_slot) == (tenant, tuple(seq[:n])), rid

    @invariant()
    def free_counts_add_up(self):
        held = self.m.group_held_blocks()
        by_pool: dict[object, int] = {}
        for name, g in self.m.groups.items():
            by_pool[g.pool] = by_pool.get(g.pool, 0) + held[name]
        for pool, num_held in by_pool.items():
            assert num_held + pool.num_free == pool.num_blocks

    def teardown(self):
        for rid in self.m.request_ids:
            self.m.release(rid)
        self.m.check_integrity()
        for g in self.m.groups.values():
            assert g.pool.num_free == g.pool.num_blocks
        for g in self.m.dual_groups:
            assert g.state_pool.num_free == g.state_pool.num_blocks


Lifecycle.TestCase.settings = settings(
    max_examples=max(1, int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "300")) // 3),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestHybridLifecycle = Lifecycle.TestCase


class ConstantHashLifecycle(Lifecycle):
    """Every block and checkpoint hashes alike: only the content guard stands between a
    hit and a wrong one."""

    def __init__(self) -> None:
        super().__init__()
        for g in self.m.groups.values():
            g.pool.hasher.digest = lambda data: b"\x00" * 16


ConstantHashLifecycle.TestCase.settings = settings(
    max_examples=max(1, int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "300")) // 6),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestConstantHashHybridLifecycle = ConstantHashLifecycle.TestCase


class SharedPoolLifecycle(Lifecycle):
    """The window and full groups draw from one pool of 18 blocks (the simulator's layout):
    a block the window lets go can serve the full group's next step, and a slot's content
    names the group that wrote it, so a block read by the other group shows up."""

    def _build(self) -> HybridCacheManager:
        specs = [(AttentionGroupSpec("swa", BS, window=6), None), (AttentionGroupSpec("full", BS), None), SPECS[2]]
        return HybridCacheManager(specs, CacheDescriptor("prop"), shared_blocks=18, turn_end_checkpoints=True)


SharedPoolLifecycle.TestCase.settings = settings(
    max_examples=max(1, int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "300")) // 3),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSharedPoolHybridLifecycle = SharedPoolLifecycle.TestCase


class DualPoolLifecycle(Lifecycle):
    """A window group, a full group, V4's dual pool (spans of 8: 8 classical blocks, 4 state
    blocks, a hit replays 2 tokens) and a recurrent group with a checkpoint every 4 tokens:
    the recurrent and attention groups offer points inside spans (4, 12, 20, turn ends),
    which the dual pool must pass over; few state blocks, so admissions and forks wait."""

    def _build(self) -> HybridCacheManager:
        specs = [
            SPECS[0],
            SPECS[1],
            (DualPoolGroupSpec("v4", 8, replay_len=2), (8, 4)),
            (RecurrentGroupSpec("rec", 4), 12),
        ]
        return HybridCacheManager(specs, CacheDescriptor("prop"), turn_end_checkpoints=True)


DualPoolLifecycle.TestCase.settings = settings(
    max_examples=max(1, int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "300")) // 3),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestDualPoolHybridLifecycle = DualPoolLifecycle.TestCase


class DualPoolCheckpointLifecycle(DualPoolLifecycle):
    """The dual pool restoring from checkpoints in 2 slots of their own (chosen by cost per
    admission, or always), among groups whose points may lie below its own hit."""

    restore = "auto"

    def _build(self) -> HybridCacheManager:
        v4 = DualPoolGroupSpec("v4", 8, replay_len=2, restore=self.restore, num_checkpoints=2)
        specs = [SPECS[0], SPECS[1], (v4, (8, 4)), (RecurrentGroupSpec("rec", 4), 12)]
        return HybridCacheManager(specs, CacheDescriptor("prop"), turn_end_checkpoints=True)


class DualPoolOnlyCheckpointLifecycle(DualPoolCheckpointLifecycle):
    restore = "checkpoint"


DualPoolCheckpointLifecycle.TestCase.settings = DualPoolLifecycle.TestCase.settings
TestDualPoolCheckpointLifecycle = DualPoolCheckpointLifecycle.TestCase
DualPoolOnlyCheckpointLifecycle.TestCase.settings = DualPoolLifecycle.TestCase.settings
TestDualPoolOnlyCheckpointLifecycle = DualPoolOnlyCheckpointLifecycle.TestCase


class DualPoolPooledCheckpointLifecycle(DualPoolLifecycle):
    """The dual pool's checkpoints pooled in its classical pool, a block each (they share its
    LRU order with the cached spans), restoring from them only: the configuration whose
    checkpoint records a reset of the pool alone broke (`reset_prefix_cache`)."""

    def _build(self) -> HybridCacheManager:
        v4 = DualPoolGroupSpec("v4", 8, replay_len=2, restore="checkpoint", checkpoint_blocks=1)
        specs = [SPECS[0], SPECS[1], (v4, (10, 4)), (RecurrentGroupSpec("rec", 4), 12)]
        return HybridCacheManager(specs, CacheDescriptor("prop"), turn_end_checkpoints=True)

    def _ckpt_key(self, slot: int) -> object:
        return ("checkpoint", slot)  # (a classical block's id: apart from the state blocks' numbers)


DualPoolPooledCheckpointLifecycle.TestCase.settings = DualPoolLifecycle.TestCase.settings
TestDualPoolPooledCheckpointLifecycle = DualPoolPooledCheckpointLifecycle.TestCase


class ConstantHashDualPoolLifecycle(DualPoolLifecycle, ConstantHashLifecycle):
    """The dual-pool lifecycle with every hash alike: the content guard alone keeps spans apart."""


ConstantHashDualPoolLifecycle.TestCase.settings = ConstantHashLifecycle.TestCase.settings
TestConstantHashDualPoolLifecycle = ConstantHashDualPoolLifecycle.TestCase


class _HitsInsideSpans(DualPoolGroup):
    """A deliberately broken dual pool: it serves any point whose complete spans before it
    are cached, and restores by replaying the window before the point, as if the unfinished
    span's entries were rebuilt too."""

    def serves(self, hits, point):
        return point // self.span <= len(hits.block_ids)

    def upper_bound(self, hits):
        return (len(hits.block_ids) + 1) * self.span - 1

    def plan_admit(self, hits, point, end):
        plan, need = super().plan_admit(hits, point // self.span * self.span, end)
        plan.replay_start = self.spec.replay_start(point) if point else None
        return plan, need


@pytest.mark.parametrize("broken", [False, True])
def test_the_dual_pool_model_catches_a_hit_inside_a_span(broken):
    machine = DualPoolLifecycle()
    if broken:
        machine.m.groups["v4"].__class__ = _HitsInsideSpans
    machine.admit(base=BASES[0], cut=13, suffix=[], tenant="", budget=None)
    machine.integrity()
    machine.every_group_reads_the_right_prefix()
    # 13 tokens computed: blocks of 4 end at 4, 8, 12, recurrent checkpoints at 4, 8, 12,
    # one complete span (8); the follow-up's last point is 13 - 1 = 12 (a token to compute).
    points = machine.m.group_hit_points(BASES[0][:14])
    every = [0, 4, 8, 12]
    assert points == {"swa": every, "full": every, "v4": every if broken else [0, 8], "rec": every}
    if not broken:
        rid = machine.admit(base=BASES[0], cut=14, suffix=[], tenant="", budget=None)
        assert machine.m.stats.num_hit_tokens == 8 and machine.m.num_computed_tokens(rid) == 14
        machine.every_group_reads_the_right_prefix()
        return
    # Hit 12: the replay of [10, 12) does not rebuild the entries of the span's first two
    # tokens [8, 10), which no cached block holds.
    with pytest.raises(AssertionError, match="the state the step starts from"):
        machine.admit(base=BASES[0], cut=14, suffix=[], tenant="", budget=None)
