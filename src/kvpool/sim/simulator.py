"""The serving simulator: N engine replicas behind a router, on virtual clocks.

Each replica is the engine itself (`kvpool.engine.Engine`: its `schedule()` and `step()`,
unchanged) over the engine's runner (sim/runner.py) holding the real cache manager of the
chosen layout (sim/layouts.py), with the cost executor (sim/executor.py) pricing each step
by the roofline cost model (sim/cost.py) in place of the model's tensors. The
event loop is discrete-event: the next event is either an arrival (routed to a replica
and queued in its engine at its arrival time) or the step of the replica whose clock is
earliest; a step moves that replica's clock by its cost. A session's next turn arrives
`think_s` after its previous turn finished, so its prompt (the history, with the answers
the simulated model gave) can hit that replica's prefix cache.

Routing: sim/routing.py.

Per step the simulator's own work is the engine's (bounded by the running batch), a heap
operation and O(1) samples. Memory follows the requests in flight, not the run: requests
stream in (a generated workload makes each session when its first turn arrives, and a
finished turn's prompt is kept while its session thinks, for the next turn to extend) and
finished ones stream out (popped from the engine, the session dropped after its last turn,
the report's figures kept as running sums and three latencies a request:
sim/report.py FinishedRequests).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import operator
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from kvpool.cache.coordinator import pack_prompt
from kvpool.cache.dual_pool import RESTORE_METHODS
from kvpool.cache.types import _CHECKED_KEY, CheckedPrompt, LookupPrompt
from kvpool.capacity.ledger import LedgerAssumptions
from kvpool.capacity.planner import Plan, plan
from kvpool.engine.engine import Engine
from kvpool.engine.runner import ModelRunner
from kvpool.engine.sampling import SamplingParams
from kvpool.pool.block_pool import MatchMemo
from kvpool.pool.hashing import TOKEN_BYTES, token_bytes
from kvpool.sim.cost import CostModel
from kvpool.sim.executor import AnswerSampler, CostExecutor, VirtualClock, answer_seed
from kvpool.sim.layouts import LAYOUTS, BuiltLayout, build_layout, default_layout
from kvpool.sim.report import FinishedRequests, RequestRecord, build_report
from kvpool.sim.routing import ROUTINGS, Router
from kvpool.sim.runner import sim_runner
from kvpool.spec.gpus import GPUSpec
from kvpool.spec.models import ModelSpec
from kvpool.workload.sessions import Session, Workload
from kvpool.workload.tokens import int_table

_OCCUPANCY_POINTS = 2000  # occupancy samples kept per replica (thinned as the run goes)


@dataclass(frozen=True)
class SimConfig:
    layout: str | None = None  # None: dual for V4, paged otherwise
    block_size: int | None = None  # None: the planner's default for the model
    enable_prefix_caching: bool = True
    tp: int = 1  # GPUs of one replica (its tensor-parallel group)
    replicas: int = 1
    routing: str = "round-robin"
    load_cap: float = 1.5
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the workload's longest request
    num_blocks: int | None = None  # paged: this many blocks instead of the planner's pool (an engine's own)
    kv_dtype: str = "auto"
    weight_dtype: str = "auto"  # the planner's weight bytes (kvpool.capacity.weights formats)
    v4_restore: str = "auto"  # V4 dual: how a prefix hit rebuilds the state (cache/dual_pool.py RESTORE_METHODS)
    num_checkpoints: int | None = None  # V4 snapshots: this many slots of their own (None: pooled)
    v4_turn_ends: bool = True  # V4 dual: a finished turn's state block kept for the next turn to adopt
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 100.0

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; one of {', '.join(LAYOUTS)}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown routing {self.routing!r}; one of {', '.join(ROUTINGS)}")
        for name in ("tp", "replicas", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.block_size is not None and self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.v4_restore not in RESTORE_METHODS:
            raise ValueError(f"v4_restore must be one of {RESTORE_METHODS}, got {self.v4_restore!r}")
        if self.num_checkpoints is not None and self.num_checkpoints < 0:
            raise ValueError(f"num_checkpoints must be >= 0, got {self.num_checkpoints}")
        if not self.load_cap >= 1:
            raise ValueError(f"load_cap must be >= 1, got {self.load_cap}")

    @property
    def checkpoint_slots(self) -> int | None:
        """V4 state snapshots (checkpoint, auto restore): None (pooled: in the classical
        pool's free memory, as many as it holds), or `num_checkpoints` slots carved out of
        the pool; 0 for recompute."""
        return 0 if self.v4_restore == "recompute" else self.num_checkpoints


@dataclass
class Replica:
    index: int
    engine: Engine
    runner: ModelRunner
    executor: CostExecutor  # the runner's forward, priced: busy time, replays, copies
    clock: VirtualClock
    layout: BuiltLayout
    num_routed: int = 0
    peak_running: int = 0
    occupancy: list[tuple[float, float]] = field(default_factory=list)  # (t, used blocks / blocks)
    _every: int = 1
    frag_samples: list[float] = field(default_factory=list)
    # hybrid: (running sequences, blocks each group holds), sampled with the fragmentation
    group_samples: list[tuple[int, dict[str, int]]] = field(default_factory=list)

    @property
    def load(self) -> int:
        return len(self.engine.running) + len(self.engine.waiting)

    def sample(self) -> None:
        """After each of this replica's steps (its own count: replicas step in any order)."""
        step = self.engine.num_steps
        self.peak_running = max(self.peak_running, len(self.engine.running))
        if step % self._every == 0:
            cache = self.runner.cache  # blocks some request holds now: O(1), the pool's free count
            self.occupancy.append((self.clock(), (cache.num_blocks - cache.num_free_blocks) / cache.num_blocks))
            if len(self.occupancy) > _OCCUPANCY_POINTS:
                self.occupancy = self.occupancy[::2]
                self._every *= 2
        if step % 256 == 1:  # usage() walks the blocks held: a sample, not every step (from the first)
            self.frag_samples.append(self.runner.usage().fragmentation)
            if self.layout.name == "hybrid":  # the blocks each group holds (walks them)
                self.group_samples.append((len(self.engine.running), self.runner.cache.group_held_blocks()))


def engine_assumptions(max_num_seqs: int, max_num_batched_tokens: int, host_mode: str) -> LedgerAssumptions:
    """The ledger's assumptions under the engine's limits and host mode, as `kvpool plan
    --max-num-seqs / --max-num-batched-tokens / --no-cuda-graphs` takes them: the limits size
    the activations and the CUDA graphs, an eager host (host_mode "eager") keeps no graph
    memory; the rest is LedgerAssumptions' defaults."""
    return LedgerAssumptions(
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, cuda_graphs=host_mode == "graph"
    )


def plan_replica(model: ModelSpec, gpu: GPUSpec, config: SimConfig, host_mode: str) -> Plan:
    """The planner's pool for one replica (tp GPUs); the context asked of it is the model's.
    The engine limits and the cost model's `host_mode` size the ledger (engine_assumptions),
    as `kvpool plan` sizes it: a step of 65,536 tokens leaves a smaller pool than one of
    8,192, an eager host a larger one (no CUDA graphs)."""
    return plan(
        model,
        gpu,
        num_gpus=config.tp,
        tp=config.tp,
        block_size=config.block_size,
        kv_dtype=config.kv_dtype,
        weight_dtype=config.weight_dtype,
        assumptions=engine_assumptions(config.max_num_seqs, config.max_num_batched_tokens, host_mode),
    )


def _make_replica(
    index: int,
    model: ModelSpec,
    p: Plan,
    config: SimConfig,
    cost: CostModel,
    max_len: int,
    ints: Sequence[int] | None = None,
) -> Replica:
    """Replica `index`; `ints`: the token ints its sampler answers with (None: its own)."""
    clock = VirtualClock()
    bandwidth = cost.gpu.hbm_bandwidth_bytes_per_s * cost.bandwidth_efficiency  # COW copies move bytes
    name = config.layout or default_layout(p)
    built = build_layout(
        p,
        name,
        enable_prefix_caching=config.enable_prefix_caching,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_len,
        v4_restore=config.v4_restore,
        num_checkpoints=config.checkpoint_slots,
        num_blocks=config.num_blocks,
        cost=cost,
        turn_ends=config.v4_turn_ends,
    )
    executor = CostExecutor(
        model.vocab_size,
        step_time=lambda work, moved: cost.step_time(work) + moved / bandwidth,
        decode_step_time=lambda positions, moved: cost.decode_step_time(positions) + moved / bandwidth,
        split_step_time=lambda positions, rest, moved: _plus(cost.split_step_time(positions, rest), moved / bandwidth),
        kv_read_bytes=cost.kv_read_bytes,
        clock=clock,
        block_bytes=built.block_bytes,
        kv_capacity_bytes=built.kv_capacity_bytes,
        num_state_blocks=built.num_state_blocks,
        checkpoint_bytes=built.checkpoint_bytes,
        has_state=built.num_state_blocks > 0,
        state_bytes=built.state_block_bytes,
    )
    runner = sim_runner(built, executor, max_len)
    answers = AnswerSampler(model.vocab_size, ints, executor=executor)
    engine = Engine(
        runner,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        clock=clock,
        sampler=answers,
        # a step's tokens in one call (the answers' batch form): the engine's batched decode
        # path, a GPU engine's
        batched_sampling=True,
        step_sampler=answers,
    )
    return Replica(index, engine, runner, executor, clock, built)


def _plus(seconds: float | None, more: float) -> float | None:
    """seconds + more, where seconds is a price (None: none, the caller prices the step otherwise)."""
    return None if seconds is None else seconds + more


def check_request_lens(model: ModelSpec, workload: Workload, max_model_len: int | None, flag: str = "") -> None:
    """ValueError naming the longest request (its trace line, for a trace) when it exceeds the
    model's context or `max_model_len`; `flag` is how the caller spells max_model_len."""
    longest = workload.longest_request()
    if longest is None:
        return
    limit = model.max_position_embeddings
    if longest.num_tokens > limit:
        raise ValueError(
            f"{longest.describe()} needs {longest.num_tokens:,} tokens (prompt + output); {model.name} holds {limit:,}"
        )
    if max_model_len is not None and max_model_len < longest.num_tokens:
        raise ValueError(
            f"{flag or 'max_model_len'} {max_model_len:,} is shorter than the workload's longest request: "
            f"{longest.describe()} needs {longest.num_tokens:,} tokens (prompt + output)"
        )


def make_replicas(
    model: ModelSpec, p: Plan, workload: Workload, config: SimConfig, cost: CostModel, count: int
) -> tuple[list[Replica], np.ndarray]:
    """`count` replicas of plan `p` for `workload` (its lengths checked: check_request_lens),
    and the int table their prompts and answers share: one object per token id (the cache and
    the engine keep tokens, and a fresh int per token costs 32 bytes more than a pointer).
    ValueError when the workload's longest request does not fit one replica's cache."""
    longest = workload.max_request_len()
    max_len = config.max_model_len or longest
    table = int_table(model.vocab_size)
    ints = table.tolist()
    replicas = [_make_replica(i, model, p, config, cost, max_len, ints) for i in range(count)]
    for r in replicas:
        if r.runner.max_model_len < longest:
            raise ValueError(
                f"the workload's longest request ({longest:,} tokens) does not fit one replica's cache "
                f"({r.runner.capacity_tokens:,} tokens, layout {r.layout.name})"
            )
    return replicas, table


# Young collections this far apart during a run (`spaced_collections`), and at most this many
# times further while collections free nothing
YOUNG_COLLECTION_EVERY = 50_000
MAX_BACK_OFF = 64
_spacing = threading.Lock()
_spaced_depth = 0  # the runs inside spaced_collections now
_spaced_saved: tuple[int, int, int] | None = None  # the thresholds the first of them found
_spaced_every = 0  # the young spacing the first of them set (its base)


def _back_off(phase: str, info: dict[str, int]) -> None:
    """The collector's callback while runs are spaced: after a collection that freed nothing,
    the young collections twice as far apart (at most MAX_BACK_OFF times the base); after one
    that freed something, at the base again."""
    if phase != "stop" or not _spaced_every:
        return
    young, middle, old = gc.get_threshold()
    if info["collected"] or info["uncollectable"]:
        every = _spaced_every
    else:
        every = min(2 * young, MAX_BACK_OFF * _spaced_every)
    if every != young:
        gc.set_threshold(every, middle, old)


@contextmanager
def spaced_collections(every: int = YOUNG_COLLECTION_EVERY) -> Iterator[None]:
    """Python's cyclic collector, for the length of a run, collecting its young objects every
    `every` container allocations net instead of 700, twice as far apart after each
    collection that freed nothing (up to MAX_BACK_OFF x `every`, back to `every` after one
    that freed something: `_back_off`), and considering the whole heap after every second
    middle collection (threshold 1, not 10), where the heap's own rule still gates it (the
    objects that lived long grew by a quarter since the last): the thresholds only, restored
    after, and the callback removed; a collector that is off, or set to 0, is left as it is.

    Why: a run's heap is mostly bookkeeping that lives long (cached blocks and their chains,
    the running requests' token lists), and the default (700, 10, 10) walks it often; once
    a popped request no longer waits for the collector (Engine.pop_output unlinks it from
    its sequences), the garbage only a collection frees does not grow with the requests,
    so spacing the collections out costs no memory (the CPU and peak-RSS figures of a
    12,000-request V4 chat run, measured with gc.callbacks: commit 5b19842's message). A
    10,000-request V4 chat run's collections at a fixed 50,000 (18 young, 1 middle, 1 whole
    heap) freed no object at all: a young collection walks the objects that survived since
    the last, most of them cached blocks and their tuples, so spacing them further saves
    the walks of the objects that die in between and the middle and whole-heap collections
    they lead to (the figures: this commit's message).
    Collections free memory only: nothing the simulation computes depends on when they run."""
    global _spaced_depth, _spaced_saved, _spaced_every
    with _spacing:  # runs may overlap (threads, nested calls): the first in sets, the last out restores
        if not _spaced_depth:
            young, middle, _ = _spaced_saved = gc.get_threshold()
            if not gc.isenabled() or young == 0:
                _spaced_saved = None
            else:
                gc.set_threshold(every, middle, 1)
                _spaced_every = every
                gc.callbacks.append(_back_off)
        _spaced_depth += 1
    try:
        yield
    finally:
        with _spacing:
            _spaced_depth -= 1
            if not _spaced_depth and _spaced_saved is not None:
                gc.callbacks.remove(_back_off)
                _spaced_every = 0
                gc.set_threshold(*_spaced_saved)
                _spaced_saved = None


@spaced_collections()
def simulate(
    model: ModelSpec,
    gpu: GPUSpec,
    workload: Workload,
    config: SimConfig,
    cost: CostModel,
    progress: Callable[[int, int], None] | None = None,
    on_finish: Callable[[RequestRecord], None] | None = None,
) -> dict:
    """Run `workload` to the end; the report (sim/report.py keys) with per-replica figures.
    `progress(finished, total)` after each step; `on_finish(record)` as each request
    finishes (the report keeps no record: sim/report.py FinishedRequests)."""
    started = time.perf_counter()
    check_request_lens(model, workload, config.max_model_len)
    p = plan_replica(model, gpu, config, cost.host_mode)
    replicas, table = make_replicas(model, p, workload, config, cost, config.replicas)
    router = Router(config.routing, replicas, config.load_cap)
    total = workload.num_requests
    finished = FinishedRequests(config.slo_ttft_ms, config.slo_tpot_ms)
    arrivals = Arrivals(workload)  # turns as they arrive; a turn's next one pushed as it finishes
    # request id -> (session, turn, replica, arrival, its prompt's packing and lookup memo
    # where a turn follows)
    in_flight: dict[str, tuple[Session, int, int, float, bytes | None, MatchMemo | None]] = {}
    # session id -> the prompt of its finished turn (the engine's list, from its output), its
    # packing and lookup memo (kept in in_flight while a turn with a next one runs) and its
    # answer (the engine's completion: the table's ints its sampler read), while the next
    # turn thinks: that turn's prompt extends them (`turn_prompt`) instead of making every
    # earlier answer again, packing every earlier id again and hashing every earlier block
    # again (its first lookup then walks the runs the last turn's accepted)
    latest: dict[str, tuple[list[int], bytes | None, list[int], MatchMemo | None]] = {}
    # session id -> the replica its finished turn ran on, while the next turn thinks: the
    # router looks there first (the longest hit, most likely), which spares lookups elsewhere
    went: dict[str, int] = {}
    # the shared prefixes' ids and packing (`turn_prompt`): a session's turn 0 packs its own tokens only
    prefixes: dict[int, tuple[tuple[int, ...], tuple[int, ...], bytes]] = {}
    timeline = StepTimeline()
    # (clock, index) of each replica with requests, one entry each: the next to step is the
    # earliest (ties to the lower index). A replica's clock moves only in its own steps and,
    # idle, to an arrival, so its entry is pushed after each step and when work arrives.
    ready: list[tuple[float, int]] = []
    # when the next arrival comes (None: none left): it changes only as arrivals are popped
    # and pushed (a finished turn's next one), so it is asked then, not every step
    t = arrivals.next_time()
    while t is not None or ready:
        if t is not None and (not ready or t <= ready[0][0]):
            _, (session, turn) = arrivals.pop()
            arrival, t = t, arrivals.next_time()
            # packed once: the router's lookups and the chosen engine's admission share its
            # packing and block hashes
            prompt = turn_prompt(
                session,
                turn,
                model.vocab_size,
                table,
                *latest.pop(session.session_id, (None, None, None, None)),
                prefixes=prefixes,
            )
            rep = router.route(prompt, session.tenant, went.pop(session.session_id, None))
            rep.num_routed += 1
            idle = not rep.engine.has_unfinished()
            if idle:
                rep.clock.now = max(rep.clock(), arrival)  # an idle replica waits for the arrival
            rid = session.request_id(turn)
            out_len = session.turns[turn].output_len
            params = SamplingParams(max_tokens=out_len, ignore_eos=True, seed=answer_seed(rid))
            rep.engine.add_request(prompt, params, rid, arrival_time=arrival, tenant=session.tenant)
            follows = turn + 1 < len(session.turns)
            in_flight[rid] = (
                session,
                turn,
                rep.index,
                arrival,
                prompt.packed if follows else None,
                prompt.hashes if follows else None,
            )
            if idle:
                heapq.heappush(ready, (rep.clock(), rep.index))
            continue
        next_step = replicas[heapq.heappop(ready)[1]]
        done = next_step.engine.step()
        timeline.tick()
        next_step.sample()
        for rid in done:
            out = next_step.engine.pop_output(rid)
            session, turn, index, arrival, packed, memo = in_flight.pop(rid)
            record = RequestRecord.of(out, index, arrival, out.num_cached_tokens)
            finished.add(record)
            if on_finish is not None:
                on_finish(record)
            if turn + 1 < len(session.turns):
                latest[session.session_id] = (out.prompt_token_ids, packed, out.completions[0].token_ids, memo)
                went[session.session_id] = index
            arrivals.next_turn(session, turn, next_step.clock())
        if done:
            t = arrivals.next_time()
        if next_step.engine.has_unfinished():
            heapq.heappush(ready, (next_step.clock(), next_step.index))
        if progress is not None:
            progress(finished.num_finished, total)
    report = build_report(model, gpu, p, config, replicas, finished, total, time.perf_counter() - started, cost)
    report["sim_us_per_step_by_quarter"] = timeline.quarters()
    return report


def turn_prompt(
    session: Session,
    turn: int,
    vocab_size: int,
    table: np.ndarray,
    previous: list[int] | None = None,
    previous_packed: bytes | None = None,
    previous_answer: list[int] | None = None,
    previous_memo: MatchMemo | None = None,
    *,
    prefixes: dict[int, tuple[tuple[int, ...], tuple[int, ...], bytes]] | None = None,
) -> LookupPrompt:
    """Turn `turn`'s prompt, packed as `pack_prompt` packs it; its ints are `table`'s
    (tokens.int_table(vocab_size)). Made from `previous` or a held prefix, its ids are a
    list handed over (types.CheckedPrompt; the twin's, pack_prompt's, a tuple): the engine
    whose add_request takes it keeps that list as the request's token list, not a copy, and
    pop_output gives it back cut to the prompt; pass it to one engine, once, and read it no
    more (added twice, two requests would share one list, and a step would fail).
    `previous`: the prompt of turn - 1 as the engine's output gave it back
    (`RequestOutput.prompt_token_ids`, the caller's once popped), which is consumed:
    extended in place into this prompt by what the turn adds (answer_{turn-1} | user_turn,
    ~370 tokens of a ~2,100-token chat prompt at the medians), so one list goes from turn
    to turn with no copy of the history. `previous_packed`: that prompt's packing (its
    LookupPrompt's `packed`, token_bytes of `previous`): this one's is it and the tail's
    bytes (the answer's from its token array, no int read), instead of every id of the
    history read again (an id's int a likely cache miss: most of a long prompt's packing
    time in a fleet run). The
    twin, what None does, `pack_prompt(session.prompt_ids(...))`, copies the history twice
    (prompt_ids' list, pack_prompt's) before packing it. `previous_answer` (with `previous`):
    turn - 1's answer as the engine gave it (its completion's token ids: the simulator's
    sampler read them from the stream `turn_tail` makes, the table's ints), appended and
    packed instead of that stream made again and its ids gathered from the table; where it
    is not the turn's output_len tokens (a request cut short), the stream's.
    `previous_memo` (with `previous`): turn - 1's LookupPrompt's lookup memo (`hashes`,
    which its lookups and admission filled), taken as this prompt's: this prompt extends
    that one, so its blocks there chain to the same hashes, and a run a pool's walk
    accepted for those bytes is still checked block by block against the index before it
    is taken again (`BlockPool.match`); the lookups are the same, without the hashing and
    the guard's walk of the history again. ValueError for turn 0, a `previous` not of turn
    - 1's length, or a `previous_packed` not of its bytes' length.
    `prefixes` (turn 0): the caller's memo of the shared prefixes' ids and packing, by the
    prefix tuple's id (each entry holds that tuple, so that its id stays its own): a
    workload's few system prompts or documents (thousands of tokens each) are checked and
    packed once, not again for each session; turn 0's prompt is then its prefix's ids and
    bytes with the user's appended, as the twin (None) packs them."""
    if previous is None:
        if previous_packed is not None or previous_memo is not None:
            raise ValueError("previous_packed or previous_memo without previous: of which prompt?")
        prefix = session.prefix_ids
        if prefixes is not None and turn == 0 and prefix:
            held = prefixes.get(id(prefix))
            if held is None or held[0] is not prefix:
                if len(prefixes) >= MAX_PREFIXES_HELD:  # (a trace's prefixes may be each session's own)
                    prefixes.clear()
                packed = pack_prompt(prefix)  # (its checks, its ints, its bytes: once per prefix)
                held = prefixes[id(prefix)] = (prefix, packed.token_ids, packed.packed)
            user = _ints(session.turns[0].user_ids)
            ids = list(held[1])  # (the prefix's ids stay held: the session's own list, then handed over)
            ids += user
            return CheckedPrompt(ids, (), held[2] + token_bytes(user), {}, key=_CHECKED_KEY)
        return pack_prompt(session.prompt_ids(turn, vocab_size, table), request_id=session.request_id(turn))
    expected = session.prompt_len(turn - 1) if turn else 0
    if not turn or len(previous) != expected:
        raise ValueError(
            f"previous holds {len(previous)} tokens; turn {turn - 1} of session {session.session_id!r} "
            f"has {expected if turn else 'no'} tokens"
        )
    if previous_packed is not None and len(previous_packed) != TOKEN_BYTES * expected:
        raise ValueError(
            f"previous_packed holds {len(previous_packed)} bytes, not the {TOKEN_BYTES * expected} of "
            f"turn {turn - 1}'s {expected} tokens"
        )
    memo = {} if previous_memo is None else previous_memo
    # A CheckedPrompt, as pack_prompt's: its ids Python ints that are its bytes' ids, which
    # the engine's add_request then takes without reading them again (and, a list handed
    # over, without copying them: a copy of a chat prompt (~2,100 ids at the medians, above) and its free touch every
    # id's int, likely cache misses at a fleet run's scale). `previous`
    # (and its packing) and `previous_answer` are the engine's ints (its checked prompt, its
    # sampler's tokens: not read again, an id a likely cache miss by now); the user's ids
    # are checked here: token_bytes, the ValueError for an id outside [0, 2**32)
    # (pack_prompt's check; the engine's add_request checks the vocabulary), and ints
    # (`_ints`) as pack_prompt makes them
    if previous_answer is not None and turn < len(session.turns):
        if len(previous_answer) == session.turns[turn - 1].output_len:
            user = _ints(session.turns[turn].user_ids)
            ids = previous
            ids += previous_answer
            ids += user
            if previous_packed is None:
                return CheckedPrompt(ids, (), token_bytes(ids), memo, key=_CHECKED_KEY)
            packed = b"".join((previous_packed, token_bytes(previous_answer), token_bytes(user)))
            return CheckedPrompt(ids, (), packed, memo, key=_CHECKED_KEY)
    answer, user = session.turn_tail(turn, vocab_size)
    user = _ints(user)
    ids = previous
    ids += table[answer.astype(np.intp)].tolist()
    ids += user
    if previous_packed is None:
        return CheckedPrompt(ids, (), token_bytes(ids), memo, key=_CHECKED_KEY)
    # the answer's ids are below vocab_size (stream_tokens' draws), so its uint32 cast is
    # exact; token_bytes' little-endian uint32 layout
    packed = b"".join((previous_packed, answer.astype("<u4").tobytes(), token_bytes(user)))
    return CheckedPrompt(ids, (), packed, memo, key=_CHECKED_KEY)


# shared prefixes whose packing `turn_prompt` keeps at most (a workload has a few; a trace's
# sessions may each bring their own, which a held copy would not serve again)
MAX_PREFIXES_HELD = 64


def _ints(ids: Sequence[int]) -> Sequence[int]:
    """`ids` as Python ints (a turn's few added tokens): `sum` stays an exact int over them in
    one C pass, so only ids of another type are converted: numpy's integers by their index, as
    pack_prompt takes them; a float or another non-integer is a TypeError, as there."""
    return ids if type(sum(ids)) is int else list(map(operator.index, ids))


class Arrivals:
    """The requests and events to come, in time order, streamed (simulate, simulate_pd):
    sessions in the order of their turn 0's arrival, each made when it is next
    (`Workload.in_arrival_order`), and timed events in a heap (time, order, kind, payload):
    a session's later turn ("arrive", (session, turn)) or what a caller pushes. A turn 0
    arriving with an event goes first. A session is dropped once its last turn finished:
    nothing here grows with the requests already done."""

    def __init__(self, workload: Workload) -> None:
        self._sessions = workload.in_arrival_order()
        self._upcoming = next(self._sessions, None)
        self._later: list[tuple[float, int, str, object]] = []
        self._order = itertools.count()

    def __bool__(self) -> bool:
        return self._upcoming is not None or bool(self._later)

    def _turn_zero_first(self) -> bool:
        up = self._upcoming
        return up is not None and (not self._later or up.start_s <= self._later[0][0])

    def next_time(self) -> float | None:
        """When the next event comes (None: none left)."""
        if self._turn_zero_first():
            return self._upcoming.start_s  # type: ignore[union-attr]
        return self._later[0][0] if self._later else None

    def pop(self) -> tuple[str, object]:
        """The next event as (kind, payload): ("arrive", (session, turn)) or a pushed one."""
        if self._turn_zero_first():
            session = self._upcoming
            self._upcoming = next(self._sessions, None)
            return "arrive", (session, 0)
        _, _, kind, payload = heapq.heappop(self._later)
        return kind, payload

    def push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._later, (t, next(self._order), kind, payload))

    def next_turn(self, session: Session, turn: int, now: float) -> None:
        """`turn` of `session` finished at `now`: its next turn arrives after its think time."""
        if turn + 1 < len(session.turns):
            self.push(now + session.turns[turn + 1].think_s, "arrive", (session, turn + 1))


class StepTimeline:
    """(steps done, wall clock) every 1,024 steps, for `quarters`."""

    def __init__(self) -> None:
        self.num_steps = 0
        self._points = [(0, time.perf_counter())]

    def tick(self) -> None:
        self.num_steps += 1
        if self.num_steps % 1024 == 0:
            self._points.append((self.num_steps, time.perf_counter()))

    def quarters(self) -> list[float]:
        """The simulator's own wall time per step in each quarter of the run (by steps): flat
        when a step's cost does not grow with the requests already finished."""
        timeline = self._points
        if len(timeline) < 5:
            return []
        n = len(timeline) - 1
        out = []
        for q in range(4):
            (s0, t0), (s1, t1) = timeline[q * n // 4], timeline[(q + 1) * n // 4]
            out.append(round((t1 - t0) / (s1 - s0) * 1e6, 1) if s1 > s0 else 0.0)
        return out
