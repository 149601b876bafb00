"""The simulator's runner makes the real runner's cache decisions, step by step.

The engine's scheduler drives two runners in lockstep over the same cache configuration:
the real one (a tiny model computes every token) and the simulator's (the cost model in
place of the forward). Both sample through one deterministic sampler that ignores the
logits, so their token streams agree, and a session's next turn (its previous prompt, the
answer, a new user message) is sent to both when its previous turn finishes on both.
After every step both sides must show the same scheduled chunks (sequence, start,
length), the same block tables (and state slots), the same prefix hits, the same
preemptions, the same free block counts and the same tier moves (blocks and window
snapshots, counted and in bytes); integrity is checked on both.

Layouts: paged (a Llama on the paged pool; recompute preemption, and swap preemption to a
host tier), V4's dual pool (restore by recompute, by checkpoint slots, "auto" over pooled
checkpoints, from a host tier, from a disk tier's window snapshots, by adopting turn
ends, from a swap preemption's state entry), hybrid (window + full attention groups;
recurrent + full attention groups)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import astuple, dataclass, fields, replace
from pathlib import Path

import pytest

from kvpool.cache import DSV4CacheManager, FullAttentionManager, HybridCacheManager
from kvpool.engine.dsv4_runner import descriptor_for as dsv4_descriptor
from kvpool.engine.dsv4_runner import dsv4_runner
from kvpool.engine.engine import Engine
from kvpool.engine.hybrid_runner import descriptor_for as hybrid_descriptor
from kvpool.engine.hybrid_runner import group_specs, hybrid_runner
from kvpool.engine.llama_runner import llama_runner
from kvpool.engine.runner import ModelRunner
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.tier_bridge import TierBridge
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG, TinyDSV4
from kvpool.models.tiny_hybrid import TINY_GEMMA2, TINY_RECURRENT, TinyHybrid
from kvpool.sim.executor import CostExecutor, VirtualClock
from kvpool.storage.dsv4 import DSV4Pools
from kvpool.tiers import DiskTier, HostTier
from kvpool.tiers.swa import SWAStrategy
from kvpool.workload.tokens import stream_key, text_ids, token_at
from random_llama import DESCRIPTOR, random_llama

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the workload: sessions of several turns over one shared system prompt ----------------


@dataclass(frozen=True)
class Workload:
    vocab: int
    system_len: int  # the shared system prompt (prefix hits across sessions)
    num_sessions: int
    num_turns: int  # a turn's prompt extends the previous prompt and answer (hits its own history)
    user_len: int  # each turn's new user message: user_len + session index tokens
    max_tokens: int  # each turn's answer: max_tokens + session index tokens

    def first_prompt(self, session: int) -> list[int]:
        return text_ids("system", self.system_len, self.vocab) + self.user(session, 0)

    def user(self, session: int, turn: int) -> list[int]:
        return text_ids(f"user{session}/{turn}", self.user_len + session, self.vocab)

    def params(self, session: int, turn: int) -> SamplingParams:
        """The answer's stream is named by its seed: one per session and turn."""
        return SamplingParams(max_tokens=self.max_tokens + session, seed=100 * session + turn, ignore_eos=True)


def _sampler(vocab: int) -> Callable:
    def sample(logits, params: SamplingParams, sample_index: int, position: int) -> int:
        """Ignores the logits: token `position` of the session's answer stream."""
        return token_at(stream_key(f"seed{params.seed}/{sample_index}"), position, vocab)

    return sample


# ---- one side: an engine over a runner, and what it shows after each step ------------------


class Side:
    """An engine over `runner`, recording the chunks each step hands to the runner."""

    def __init__(
        self, runner, cache, tables: Callable[[object, str], object], wl: Workload, clock=None, **engine_kw
    ) -> None:
        self.runner, self.cache, self.tables = runner, cache, tables
        self.chunks: list[tuple[str, int, int, bool]] = []
        self.admissions: list[tuple] = []  # every admission so far (the step's are compared)
        execute, admit = runner.execute, runner.admit

        def recording_execute(chunks):
            self.chunks = [(c.request_id, c.start, len(c.token_ids), c.needs_logits) for c in chunks]
            return execute(chunks)

        def recording_admit(seq_id, token_ids, max_new_tokens, **kw):
            adm = admit(seq_id, token_ids, max_new_tokens, **kw)
            if adm is not None:  # the hit, the first step, the table, the restore; each group's part
                groups = tuple((name, part[:5]) for name, part in sorted(adm.groups.items()))
                self.admissions.append((seq_id, *adm[:2], groups))
            return adm

        runner.execute, runner.admit = recording_execute, recording_admit
        kw = {} if clock is None else {"clock": clock}
        self.engine = Engine(runner, sampler=_sampler(wl.vocab), **kw, **engine_kw)
        self.num_compared = 0

    def view(self) -> tuple:
        """What must agree after a step: the chunks, the admissions (hit, table, restore),
        each running sequence's computed tokens and tables, the waiting queue, preemptions,
        prefix hits (first admissions and readmissions), free blocks, the tier moves
        (blocks and window snapshots, counts and bytes; not their seconds)."""
        self.runner.check_integrity()
        stats = self.cache.stats
        admitted, self.num_compared = self.admissions[self.num_compared :], len(self.admissions)
        bridge = self.runner.bridge
        return (
            tuple(self.chunks),
            tuple(admitted),
            tuple((s.seq_id, s.num_computed, self.tables(self.cache, s.seq_id)) for s in self.engine.running),
            tuple(s.seq_id for s in self.engine.waiting),
            self.engine.num_preemptions,
            (stats.num_queried_tokens, stats.num_hit_tokens, stats.num_readmitted_hit_tokens),
            self.cache.usage(),
            _counts(bridge.moves),
            _counts(bridge.swa_moves),
        )


def _counts(moves) -> tuple[tuple[str, int], ...]:
    """A TierMoves' or SWAMoves' counts and bytes, by name (its seconds are wall-clock)."""
    return tuple((f.name, v) for f, v in zip(fields(moves), astuple(moves), strict=True) if not f.name.endswith("_s"))


def _lockstep(real: Side, sim: Side, wl: Workload) -> tuple[list[tuple], dict[str, list[int]]]:
    """Run the workload on both sides step by step; assert equal views after every step.
    Returns the real side's views and every request's answer."""
    prompts: dict[str, list[int]] = {}

    def send(session: int, turn: int, prompt: list[int]) -> None:
        rid = f"s{session}t{turn}"
        prompts[rid] = prompt
        for side in (real, sim):
            side.engine.add_request(prompt, wl.params(session, turn), rid)

    for s in range(wl.num_sessions):
        send(s, 0, wl.first_prompt(s))
    views, answers = [], {}
    while real.engine.has_unfinished() or sim.engine.has_unfinished():
        finished = real.engine.step()
        assert sim.engine.step() == finished, f"step {len(views)}: other requests finished"
        for side in (real, sim):  # a disk tier writes in the background: all of it visible now
            assert side.runner.flush_tiers(timeout=30)
        view = real.view()
        assert sim.view() == view, f"step {len(views)}: the simulator's runner decided otherwise"
        views.append(view)
        for rid in finished:
            outs = [side.engine.output(rid).completions[0].token_ids for side in (real, sim)]
            assert outs[0] == outs[1], rid
            answers[rid] = outs[0]
            session, turn = (int(x) for x in rid[1:].split("t"))
            if turn + 1 < wl.num_turns:
                send(session, turn + 1, prompts[rid] + outs[0] + wl.user(session, turn + 1))
    return views, answers


def _cost_executor(real, clock: VirtualClock, block_bytes: int = 1, **kw) -> CostExecutor:
    """A cost executor on `clock` (a millisecond per chunk, a nanosecond per byte moved)."""
    step_time = lambda work, moved: 1e-3 * len(work) + 1e-9 * moved  # noqa: E731
    return CostExecutor(
        real.vocab_size,
        step_time=step_time,
        kv_read_bytes=lambda n: n,
        clock=clock,
        block_bytes=block_bytes,
        kv_capacity_bytes=0,
        **kw,
    )


def _sim_side(real, cache, bridge: TierBridge, executor: CostExecutor, tables, wl: Workload, **kw) -> Side:
    """The engine's runner over `cache` and the cost executor, configured as `real` is."""
    runner = ModelRunner(
        cache,
        executor,
        bridge,
        descriptor=cache.descriptor,
        block_size=real.block_size,
        capacity_tokens=real.capacity_tokens,
        max_model_len=real.max_model_len,
        preemption=real.preemption,
        swa=real.swa,
    )
    return Side(runner, cache, tables, wl, clock=executor.clock, **kw)


def _check_exercised(views: list[tuple], answers: dict, wl: Workload, restores: dict[str, int] | None = None) -> None:
    """The run had what the parity must cover: every turn answered, prefix hits (shared
    system prompt, each session's history), preemptions; and at least `restores[kind]`
    hits restored each way, as the compared views show them: by the admissions' restore
    methods ("checkpoint", "recompute", "adopt"), and "window snapshots" (a tier's)."""
    assert len(answers) == wl.num_sessions * wl.num_turns
    preemptions, (queried, hits, _) = views[-1][4], views[-1][5]
    assert preemptions > 0, "the workload preempts (else it tests less)"
    assert 0 < hits < queried
    # an admission: (seq_id, hit, first step, ((group, (table, first block, copies, restore, ...)), ...))
    done = Counter(part[3].method for view in views for adm in view[1] if adm[1] for _, part in adm[3] if part[3])
    done["window snapshots"] = dict(views[-1][8])["num_restores"]
    for kind, least in (restores or {}).items():
        assert done[kind] >= least, f"{done[kind]} hits restored by {kind} (of {dict(done)}), want {least}+"


# ---- paged: a Llama on the paged pool ----------------------------------------------------

PAGED = Workload(vocab=512, system_len=20, num_sessions=4, num_turns=3, user_len=5, max_tokens=8)


def _paged_tables(cache, seq_id: str) -> tuple[int, ...]:
    return tuple(cache.block_ids(seq_id))


@pytest.fixture(scope="module")
def llama():
    return random_llama()


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_paged(llama, preemption: str) -> None:
    """Swap: a host tier of 6 blocks, so that it evicts too (the cost executor's entries
    have the real blocks' bytes)."""
    num_blocks, block = 14, 8
    kw = {"max_num_batched_tokens": 32, "max_num_seqs": 4}
    real_runner = llama_runner(llama, num_blocks, block, DESCRIPTOR, preemption=preemption, **_tier(preemption))
    real = Side(real_runner, real_runner.cache, _paged_tables, PAGED, **kw)
    bridge = TierBridge(_tier(preemption).get("host_tier"), (), block, enable_prefix_caching=True)
    cache = FullAttentionManager(num_blocks, block, DESCRIPTOR, lower_tier=bridge.index)
    executor = _cost_executor(real_runner, VirtualClock(), block_bytes=real_runner.executor.block_bytes)
    sim = _sim_side(real_runner, cache, bridge, executor, _paged_tables, PAGED, **kw)
    views, answers = _lockstep(real, sim, PAGED)
    _check_exercised(views, answers, PAGED)
    assert executor.busy_s == executor.clock.now > 0
    if preemption == "swap":
        moves = real_runner.tier_moves
        assert moves.num_swapped_in > 0  # a preempted tail came back from the tier
        assert real_runner.host_tier.stats.num_evictions > 0  # and the tier evicted
        assert sim.runner.tier_moves.num_swapped_in == moves.num_swapped_in
        assert executor.num_blocks_to_device == moves.num_loaded


def _tier(preemption: str) -> dict:
    block_bytes = 4 * 2 * 8 * 2 * 32 * 8  # random_llama: layers x (K, V) x tokens x kv heads x head dim x fp64
    return {} if preemption == "recompute" else {"host_tier": HostTier(6 * block_bytes)}


# ---- V4's dual pool --------------------------------------------------------------------

DUAL = Workload(vocab=256, system_len=40, num_sessions=4, num_turns=3, user_len=6, max_tokens=6)


def _dual_tables(cache, seq_id: str) -> tuple:
    return tuple(cache.block_ids(seq_id)), cache.part(seq_id).state_slot


class _Priced:
    """The "auto" restore's `RestoreCost` (cache/dual_pool.py), one object handed to both
    sides: a checkpoint copy costs as much as computing 40 tokens. With a replay window of
    16 x 4 = 64 tokens, a hit of up to 32 tokens is replayed (the cache's default
    TokenCost, a free copy, would restore the shared system prompt's 32 from its
    checkpoint), a longer one copied from its checkpoint where one is held at the hit or
    up to 24 tokens before it."""

    def checkpoint_cost(self) -> float:
        return 40.0

    def compute_cost(self, num_tokens: int, context_len: int) -> float:
        return float(num_tokens)


@dataclass(frozen=True)
class DualCase:
    """One V4 configuration, the same on both sides."""

    restore: str = "recompute"
    num_checkpoints: int = 0  # checkpoint slots of their own
    checkpoint_blocks: int = 0  # or pooled: classical blocks per checkpoint
    host_blocks: int = 0  # a host tier of this many classical blocks
    swa: SWAStrategy | None = None  # a disk tier (restore "recompute"), window snapshots by this strategy
    turn_ends: bool = False
    preemption: str = "recompute"  # "swap": the host tier takes a preempted request's spans and state
    num_blocks: int = 6
    num_states: int = 3
    max_num_seqs: int = 3
    workload: Workload = DUAL


DUAL_CASES = {
    "recompute": DualCase(),
    "checkpoint": DualCase("checkpoint", num_checkpoints=4),
    # (pooled checkpoints need free classical blocks: a larger pool, longer answers to preempt)
    "auto-pooled": DualCase("auto", checkpoint_blocks=1, num_blocks=12, workload=replace(DUAL, max_tokens=10)),
    "host-tier": DualCase(host_blocks=4),
    # a snapshot every 2 spans: a hit at 32 restores the state from the tier, at 48 from
    # the one at 32 and replays 16 tokens; the blocks the pool evicts come back from disk
    "disk-tier": DualCase(swa=SWAStrategy("periodic", 32)),
    "turn-ends": DualCase(turn_ends=True, num_states=5),  # (3 running at most: the kept ones wait in the other two)
    # a preempted request's state entry (and its spans the tier lacks) go to a host tier of
    # 24 blocks' bytes (a state entry is ~9 blocks' here: 16 window rows x 4 layers), which
    # evicts; a resume at the span boundary before it takes the state back
    "swap": DualCase(host_blocks=24, num_blocks=5, workload=replace(DUAL, max_tokens=10), preemption="swap"),
}


@pytest.mark.parametrize("name", list(DUAL_CASES))
def test_dual(name: str, tmp_path: Path) -> None:
    """checkpoint: 4 checkpoint slots of their own. auto-pooled: the simulator's default,
    checkpoints pooled in the classical pool (when free), each hit's restore chosen by one
    `_Priced` cost on both sides. host-tier: the classical blocks the pool evicts go to a
    host tier of 4 blocks, and come back by prefetch before an admission hits them.
    disk-tier: every block and window snapshot the SWA strategy keeps written through to a
    disk tier (one a side, in tmp_path), hits restored from them. turn-ends: a finished
    turn's state block is kept, and the session's next turn adopts it (nothing moves, on
    either side). swap: a preemption writes the request's state (and the spans the host tier
    lacks) to the tier, and a resume that hits the span boundary before it restores the
    state from there instead of replaying (on both sides, the same bytes)."""
    case = DUAL_CASES[name]
    model = TinyDSV4(SMALL_DSV4_CONFIG, seed=0)
    restore, wl = case.restore, case.workload
    restores = {
        "restore": restore,
        "num_checkpoints": case.num_checkpoints,
        "checkpoint_blocks": case.checkpoint_blocks,
        "restore_cost": _Priced() if restore == "auto" else None,
    }
    num_blocks, num_states = case.num_blocks, case.num_states
    kw = {"max_num_batched_tokens": 48, "max_num_seqs": case.max_num_seqs}
    block_bytes = DSV4Pools(model.spec, 1, 1).classical_block_bytes()
    tiers = [HostTier(case.host_blocks * block_bytes) if case.host_blocks else None for _ in range(2)]
    disks = [[DiskTier(tmp_path / side, 1 << 30)] if case.swa else [] for side in ("real", "sim")]
    real_runner = dsv4_runner(
        model,
        num_blocks,
        num_states,
        **restores,
        host_tier=tiers[0],
        persistent_tiers=disks[0],
        swa=case.swa,
        turn_end_checkpoints=case.turn_ends,
        preemption=case.preemption,
    )
    real = Side(real_runner, real_runner.cache, _dual_tables, wl, **kw)
    bridge = TierBridge(tiers[1], disks[1], model.spec.span, enable_prefix_caching=True)
    cache = DSV4CacheManager(
        model.spec,
        num_blocks,
        num_states,
        dsv4_descriptor(model),
        **restores,
        lower_tier=bridge.index,  # (as the V4 runner does for its tiers)
        record_published=bool(disks[1]),  # (written through as they complete)
        turn_end_checkpoints=case.turn_ends,
    )
    spec = model.spec  # (fp32 pools: each layer's window row, and the CSA compressors' carried rows)
    snapshots = {"spec": spec, "window_row_bytes": spec.num_layers * spec.head_dim * 4}
    snapshots["boundary_bytes"] = int(spec.boundary_compressor_bytes(dtype="float32"))
    executor = _cost_executor(
        real_runner, VirtualClock(), block_bytes=block_bytes, checkpoint_bytes=1, has_state=True, **snapshots
    )
    sim = _sim_side(real_runner, cache, bridge, executor, _dual_tables, wl, **kw)
    views, answers = _lockstep(real, sim, wl)
    # pooled: from pooled snapshots (the real side: from their rows); a disk tier: from its snapshots
    least = {"checkpoint": 3} if case.checkpoint_blocks else {"window snapshots": 3} if case.swa else {}
    _check_exercised(views, answers, wl, least)
    methods = [dict(adm[3])["v4"][3].method for adm in real.admissions if adm[1] > 0]  # the hits' restores
    expected = {"checkpoint", "recompute"} if restore == "auto" else {restore}
    expected |= {"adopt"} if case.turn_ends else set()
    expected |= {"swap"} if case.preemption == "swap" else set()
    assert methods and set(methods) == expected, methods
    if restore == "recompute":
        assert real_runner.num_replayed_tokens > 0 and executor.num_replayed_tokens == real_runner.num_replayed_tokens
        assert executor.num_checkpoint_copies == real_runner.restore_cost.num_copies == 0  # an adoption moves nothing
    else:  # every state copy priced: the restores and the snapshots the steps took
        assert executor.num_checkpoint_copies == real_runner.restore_cost.num_copies > methods.count("checkpoint")
    moves = real_runner.tier_moves
    if case.host_blocks:
        assert moves.num_loaded > 0 and tiers[0].stats.num_evictions > 0  # prefetched; the tier evicted
    if case.preemption == "swap":  # states written and taken back, the same bytes on both sides
        assert moves.num_swapped_in > 0 and moves.num_tail_tokens_restored > 0, moves
        assert sim.runner.tier_moves.state_bytes_swapped_out == moves.state_bytes_swapped_out > 0
    if case.swa:  # snapshots taken and restored from (the real side's bytes priced), blocks back from disk
        swa = real_runner.swa_moves
        assert swa.num_misses == 0 and moves.num_loaded > 0, (swa, moves)
        assert (executor.num_window_snapshots, executor.num_window_restores) == (
            swa.num_snapshots_persisted,
            swa.num_restores,
        )
        assert sim.runner.swa_moves.snapshot_bytes_persisted == swa.snapshot_bytes_persisted > 0
        assert sim.runner.swa_moves.load_bytes == swa.load_bytes > 0
        # and the simulated steps priced those bytes: the real tensors' written and read
        assert executor.window_bytes_moved == swa.snapshot_bytes_persisted + swa.load_bytes
    assert (executor.num_blocks_to_host, executor.num_blocks_to_device) == (
        moves.num_offloaded + moves.num_persisted,
        moves.num_loaded,
    )
    for side in (real, sim):
        side.runner.close()


# ---- hybrid: window or recurrent groups beside full attention ------------------------------

HYBRID = Workload(vocab=96, system_len=20, num_sessions=4, num_turns=3, user_len=5, max_tokens=8)


def _hybrid_tables(cache, seq_id: str) -> tuple:
    tables = tuple(
        (g.name, cache.part(seq_id, g.name).first_block, tuple(cache.block_ids(seq_id, g.name)))
        for g in cache.attention_groups
    )
    slots = tuple(cache.part(seq_id, g.name).state_slot for g in cache.recurrent_groups)
    return tables, slots


@pytest.mark.parametrize("config", [TINY_GEMMA2, TINY_RECURRENT], ids=["window", "recurrent"])
def test_hybrid(config: dict) -> None:
    model = TinyHybrid(config, seed=0)
    num_blocks, num_slots, block, interval = 12, 8, 8, 12
    kw = {"max_num_batched_tokens": 32, "max_num_seqs": 4}
    real_runner = hybrid_runner(model, num_blocks, num_slots, block_size=block, checkpoint_interval=interval)
    real = Side(real_runner, real_runner.cache, _hybrid_tables, HYBRID, **kw)
    cache = HybridCacheManager(
        group_specs(model, block, interval, num_blocks, num_slots), hybrid_descriptor(model, block)
    )
    bridge = TierBridge(None, (), block, enable_prefix_caching=True)
    executor = _cost_executor(real_runner, VirtualClock(), has_state=bool(cache.recurrent_groups))
    sim = _sim_side(real_runner, cache, bridge, executor, _hybrid_tables, HYBRID, **kw)
    views, answers = _lockstep(real, sim, HYBRID)
    _check_exercised(views, answers, HYBRID)
