"""The simulator at fleet scale streams: requests in (a generated workload makes each
session when its first turn arrives) and finished ones out (the report keeps running sums
and three latencies a request, not the records). Streaming changes no figure: the report
equals what the list of every finished request gives (the former all-in-memory path), a
workload made lazily equals the one its documented draws give up front, and a run over
the lazy workload equals the run over the same sessions held as a tuple, in any order."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvpool.cache import CacheDescriptor, DSV4CacheManager, FullAttentionManager
from kvpool.cache.coordinator import pack_prompt
from kvpool.cache.types import CheckedPrompt
from kvpool.engine.sampling import SamplingParams
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
from kvpool.pool.hashing import token_bytes
from kvpool.sim.cost import CostModel
from kvpool.sim.executor import AnswerSampler, answer_seed
from kvpool.sim.simulator import MAX_PREFIXES_HELD, SimConfig, simulate, turn_prompt
from kvpool.spec.dsv4 import DSV4Spec
from kvpool.spec.gpus import get_gpu
from kvpool.spec.models import load_preset
from kvpool.workload.arrivals import poisson_arrivals
from kvpool.workload.metrics import latency_report, num_within_slo, ratio
from kvpool.workload.sessions import (
    CHAT_OUTPUT_LEN,
    CHAT_SYSTEM_LEN,
    CHAT_USER_LEN,
    GeneratedSessions,
    Session,
    Turn,
    Workload,
    chat_workload,
)
from kvpool.workload.tokens import answer_ids, int_table, stream_key, text_ids, token_at
from session_census import census

DESC = CacheDescriptor("sim-stream", weights_version="v1", layout_id="test")
DSV4_SPEC = DSV4Spec.from_config(SMALL_DSV4_CONFIG)  # span 16

VOCAB = 1000
SAME = ("sim_wall_s", "sim_us_per_step_by_quarter", "alloc_latency_us_p50", "alloc_latency_us_p99")


def _setup(replicas: int = 2, routing: str = "prefix-aware"):
    model, gpu = load_preset("llama-3.1-8b"), get_gpu("h100")
    config = SimConfig(replicas=replicas, routing=routing, slo_ttft_ms=40.0, slo_tpot_ms=8.5)
    return model, gpu, config, CostModel(model, gpu)


def _figures(report: dict) -> dict:
    """The report but its wall-clock figures (the simulator's own time, allocation latency)."""
    return {k: v for k, v in report.items() if k not in SAME}


def test_streamed_report_equals_the_figures_of_every_record():
    model, gpu, config, cost = _setup()
    workload = chat_workload(40, 3, 8.0, model.vocab_size, seed=4)
    records = []
    report = simulate(model, gpu, workload, config, cost, on_finish=records.append)
    assert len(records) == report["num_finished"] == report["num_requests"] == 120
    # what build_report computed from the list of records before it streamed them
    start = min(r.arrival_s for r in records)
    span = max(r.arrival_s + r.latency_s for r in records) - start
    generated = sum(r.output_len for r in records)
    good = num_within_slo(records, config.slo_ttft_ms, config.slo_tpot_ms)
    assert 0 < good < len(records)  # the SLOs split the requests: the count is tested
    assert report["wall_s"] == round(span, 3)
    assert report["num_generated_tokens"] == generated
    assert report["throughput_tok_s"] == ratio(generated, span, 2)
    assert report["goodput_req_s"] == ratio(good, span, 4)
    assert report["slo_attainment"] == ratio(good, len(records), 4)
    assert {k: report[k] for k in latency_report(records, 2)} == latency_report(records, 2)
    assert report["_series"]["ttft_ms"] == sorted(r.ttft_s * 1e3 for r in records)
    assert report["_series"]["tpot_ms"] == sorted(r.tpot_s * 1e3 for r in records if r.tpot_s is not None)
    per_replica = [sum(r.output_len for r in records if r.replica == i) for i in range(2)]
    assert [row["generated_tokens"] for row in report["per_replica"]] == per_replica
    assert all(per_replica)


def test_generated_chat_equals_its_documented_draws_made_up_front():
    """Session i of chat_workload against the draws of its docstring, in their order, with
    every user message built as the whole workload once built them."""
    num, turns, seed = 25, 3, 11
    w = chat_workload(num, turns, 5.0, VOCAB, seed=seed)
    assert isinstance(w.sessions, GeneratedSessions) and len(w.sessions) == num
    rng = np.random.default_rng(seed)
    starts = poisson_arrivals(num, 5.0, rng)
    system_lens = CHAT_SYSTEM_LEN.sample(rng, 4).tolist()
    picks = rng.integers(4, size=num).tolist()
    user_lens = CHAT_USER_LEN.sample(rng, num * turns).tolist()
    output_lens = CHAT_OUTPUT_LEN.sample(rng, num * turns).tolist()
    thinks = rng.exponential(5.0, size=num * turns).tolist()
    for i, s in enumerate(w.sessions):
        assert (s.session_id, s.start_s) == (f"chat{i}", starts[i])
        assert s.prefix_ids == tuple(text_ids(f"system{picks[i]}", system_lens[picks[i]], VOCAB))
        for j, t in enumerate(s.turns):
            k = i * turns + j
            assert t.user_ids == tuple(text_ids(f"chat{i}-u{j}", user_lens[k], VOCAB))
            assert (t.output_len, t.think_s) == (output_lens[k], thinks[k] if j else 0.0)
    assert w.sessions[-1] == w.sessions[num - 1] and w.sessions[1:3] == (w.sessions[1], w.sessions[2])
    # iteration makes them SESSIONS_PER_PASS at a time (25: a pass of 16, one of 9); one at a
    # time by index is its twin
    assert list(w.sessions) == [w.sessions[i] for i in range(num)]
    with pytest.raises(IndexError, match="session 25 of 25"):
        w.sessions[num]
    # longest_request from the arrays: the first of the longest, as the loop over sessions finds it
    eager = Workload("chat", tuple(w.sessions), VOCAB)
    assert w.longest_request() == eager.longest_request() and w.num_requests == eager.num_requests == 75


def test_generated_sessions_start_in_order():
    with pytest.raises(ValueError, match="must not decrease"):
        GeneratedSessions("x", [1.0, 0.5], [()], [0, 0], 1, [3, 3], [2, 2], None, VOCAB)
    with pytest.raises(ValueError, match="2 sessions of 1 turns: got 1 picks"):
        GeneratedSessions("x", [0.5, 1.0], [()], [0], 1, [3, 3], [2, 2], None, VOCAB)


@pytest.mark.parametrize("routing", ["prefix-aware", "round-robin"])
def test_a_run_over_made_sessions_equals_the_run_over_them_held_in_any_order(routing):
    model, gpu, config, cost = _setup(routing=routing)
    lazy = chat_workload(30, 3, 6.0, model.vocab_size, seed=2)
    shuffled = list(lazy.sessions)
    random.Random(0).shuffle(shuffled)
    held = Workload("chat", tuple(shuffled), model.vocab_size, lazy.params)
    a, b = simulate(model, gpu, lazy, config, cost), simulate(model, gpu, held, config, cost)
    assert _figures(a) == _figures(b)
    assert a["num_finished"] == 90 and a["prefix_hit_tokens"] > 0


def test_the_run_holds_the_sessions_in_flight_not_every_session():
    """Counted on the heap of live objects as requests finish: the sessions alive are those
    made (read) so far less those done, a few, not the workload's 120."""
    model, gpu, config, cost = _setup(replicas=1)
    c = census(model.vocab_size)
    c.check_in_flight(simulate(model, gpu, c.workload, config, cost, on_finish=c.on_finish))


def test_the_inlined_answer_sampler_is_token_at():
    """AnswerSampler inlines token_at: a request's answer is answer_ids(its id), and sample
    j > 0 the stream f"{seed}/{j}" names, at every position."""
    sampler = AnswerSampler(VOCAB)
    for rid in ("chat0-t0", "chat7-t3", "req123-t0"):
        params = SamplingParams(max_tokens=50, seed=answer_seed(rid))
        assert [sampler(None, params, 0, p) for p in range(50)] == answer_ids(rid, 50, VOCAB)
        key = stream_key(f"{params.seed}/2")
        assert [sampler(None, params, 2, p) for p in range(50)] == [token_at(key, p, VOCAB) for p in range(50)]


def test_the_answer_sampler_held_answers_are_token_at_in_any_order():
    """The answers AnswerSampler makes whole and holds give token_at's token at every
    position, however the calls interleave: requests side by side, a position read again,
    past max_tokens (token_at itself), after the last token dropped the answer, and when
    the held answers are cleared at max_streams."""
    rng = random.Random(7)
    sampler = AnswerSampler(VOCAB, max_streams=3)
    requests = [SamplingParams(max_tokens=rng.randrange(1, 40), seed=answer_seed(f"r{i}")) for i in range(6)]
    calls = [(params, p) for params in requests for p in range(params.max_tokens + 3)] * 2
    rng.shuffle(calls)
    for params, p in calls:
        assert sampler(None, params, 0, p) == token_at(params.seed % (1 << 64), p, VOCAB), (params, p)
        assert len(sampler._answers) <= 3
    params = requests[0]
    tokens = [sampler(None, params, 0, p) for p in range(params.max_tokens)]  # in order: the engine's
    assert params.seed not in sampler._answers  # dropped with its last token
    assert tokens == [token_at(params.seed % (1 << 64), p, VOCAB) for p in range(params.max_tokens)]


class _Row:
    """A batch row's owner for AnswerSampler.sample: its params, sample index, origin and
    length now (an engine's sequence)."""

    def __init__(self, params: SamplingParams, sample_index: int, origin: int) -> None:
        self.params, self.sample_index, self.origin, self.length = params, sample_index, origin, origin


def test_the_answer_samplers_batch_form_is_a_call_a_row():
    """AnswerSampler.sample (the engine's batched steps) gives each row the token its
    per-row call gives (its twin), over random steps: rows joining, leaving, moving, a row
    left out of a step and back, samples j > 0, rows past max_tokens, and two rows of one
    seed; rows(which) only for the rows of owners it has not seen."""
    rng = random.Random(11)
    ints = int_table(VOCAB).tolist()
    batch, twin = AnswerSampler(VOCAB, ints), AnswerSampler(VOCAB, ints)
    pool = [
        _Row(
            SamplingParams(max_tokens=rng.randrange(1, 30), seed=answer_seed(f"r{i % 9}")),
            i % 3 == 0,
            rng.randrange(1, 50),
        )
        for i in range(14)
    ]
    asked: list[list[int]] = []  # the rows each rows() call asked for

    def rows(which=None):
        asked.append(which)
        picked = [owners[i] for i in which]
        return [r.params for r in picked], [r.sample_index for r in picked], [r.origin for r in picked]

    owners: list[_Row] = []
    seen: set[_Row] = set()
    num_changes = 0
    for _ in range(300):
        last = owners
        if rng.random() < 0.3:  # the batch changes: rows join, leave or move
            owners = rng.sample(pool, rng.randrange(0, 8))
        num_asked = len(asked)
        tokens = batch.sample([None] * len(owners), owners, rows, lambda owners=owners: [r.length for r in owners])
        assert tokens == [twin(None, r.params, r.sample_index, r.length - r.origin) for r in owners]
        assert all(t is ints[t] for t in tokens)
        new = [i for i, r in enumerate(owners) if r not in seen]  # rows of owners never sampled before
        assert asked[num_asked:] == ([new] if new else [])  # rows() reads the joiners' rows only
        seen.update(owners)
        if owners != last:
            num_changes += 1
        for r in owners:  # the engine appends each row's token
            r.length += 1
    # each owner's row read once: kept while it is away and when it comes back
    assert sum(map(len, asked)) == len(seen) > 10 and num_changes > 60
    # many owners through small batches: the rows of owners gone are forgotten (at most 16
    # held past the batch's), the tokens the same
    many = [_Row(SamplingParams(max_tokens=9, seed=answer_seed(f"m{i}")), i % 2, 4) for i in range(90)]
    for step in range(40):
        owners = many[2 * step : 2 * step + 3]
        tokens = batch.sample([None] * 3, owners, rows, lambda owners=owners: [r.length for r in owners])
        assert tokens == [twin(None, r.params, r.sample_index, r.length - r.origin) for r in owners]
        assert len(batch._kept) <= 3 + 16
        for r in owners:
            r.length += 1
    # a batch that drains (rows leave, none joins: a replica's last requests) forgets them too
    draining = [_Row(SamplingParams(max_tokens=60, seed=answer_seed(f"d{i}")), 0, 4) for i in range(40)]
    for step in range(40):
        owners = draining[step:]
        tokens = batch.sample([None] * len(owners), owners, rows, lambda owners=owners: [r.length for r in owners])
        assert tokens == [twin(None, r.params, r.sample_index, r.length - r.origin) for r in owners]
        assert len(batch._kept) <= len(owners) + 16
        for r in owners:
            r.length += 1
    assert any(r.length - r.origin > r.params.max_tokens for r in pool)  # read past max_tokens
    with pytest.raises(ValueError, match="1 logit rows but 2 owners"):
        batch.sample([None], pool[:2], rows, lambda: [1, 1])
    assert twin.sample_rows([None, None], [pool[0].params, pool[1].params], [0, 2], [3, 4]) == [
        twin(None, pool[0].params, 0, 3),
        twin(None, pool[1].params, 2, 4),
    ]


def _key(r: _Row) -> int:
    """Row `r`'s stream key, as the per-row call makes it (token_at's key)."""
    return r.params.seed % (1 << 64) if not r.sample_index else stream_key(f"{r.params.seed}/{r.sample_index}")


class _Rebuilding(AnswerSampler):
    """AnswerSampler whose every changed batch is made whole (`_rebuild`): `_batch`'s twin."""

    def _batch(self, owners, rows):
        self._rebuild(owners, rows)


def test_a_batch_edited_in_place_equals_the_batch_made_whole():
    """Batches that change as the engine's do (rows end anywhere, rows join at the end, now
    and then a preempted row back or the batch made anew): `_batch` edits the last batch's
    lists in place, and every step's tokens, lists and kept rows equal those of the twin
    that makes them whole, and a call a row; rows() reads only owners never seen."""
    rng = random.Random(5)
    ints = int_table(VOCAB).tolist()
    batch, twin = AnswerSampler(VOCAB, ints), _Rebuilding(VOCAB, ints)
    rebuilt = []
    batch._rebuild = lambda owners, rows: (rebuilt.append(len(owners)), AnswerSampler._rebuild(batch, owners, rows))
    made = 0
    asked: list[list[int]] = []

    def new_row() -> _Row:
        nonlocal made
        made += 1
        params = SamplingParams(max_tokens=rng.randrange(1, 60), seed=answer_seed(f"e{made % 40}"))
        return _Row(params, int(made % 5 == 0), rng.randrange(1, 80))

    def rows(which, asked=asked):
        asked.append(which)
        picked = [owners[i] for i in which]
        return [r.params for r in picked], [r.sample_index for r in picked], [r.origin for r in picked]

    twin_asked: list[list[int]] = []

    def twin_rows(which):
        return rows(which, twin_asked)

    owners = [new_row() for _ in range(30)]
    away: list[_Row] = []  # rows that left for a while (preempted): they come back at the end
    seen: set[int] = set()
    num_changed = num_in_place = 0
    for step in range(400):
        changed = step and rng.random() < 0.5
        if changed:
            owners = list(owners)
            for _ in range(rng.choice((1, 1, 2, 3, 12))):  # rows end (or leave) anywhere
                if owners:
                    gone = owners.pop(rng.randrange(len(owners)))
                    if rng.random() < 0.2:
                        away.append(gone)
            owners += [new_row() for _ in range(rng.choice((0, 1, 1, 2)))]  # rows join at the end
            if away and rng.random() < 0.3:
                owners.append(away.pop(0))
            if rng.random() < 0.05:  # a batch of its own
                owners = [new_row() for _ in range(rng.randrange(0, 40))]
        num_asked, num_rebuilt = len(asked), len(rebuilt)
        lengths = [r.length for r in owners]
        tokens = batch.sample([None] * len(owners), owners, rows, lambda lengths=lengths: lengths)
        assert tokens == twin.sample([None] * len(owners), owners, twin_rows, lambda lengths=lengths: lengths)
        assert tokens == [twin(None, r.params, r.sample_index, r.length - r.origin) for r in owners]
        assert batch._owners == owners and batch.batch_rows() == twin.batch_rows()
        assert batch.batch_rows() == [(_key(r), r.origin) for r in owners]
        assert batch._kept == twin._kept
        # the rows read: the twin's, those of owners not kept (never seen, or forgotten while away)
        assert asked == twin_asked
        new = [i for i, r in enumerate(owners) if id(r) not in seen]
        assert set(new) <= {i for which in asked[num_asked:] for i in which}
        seen.update(map(id, owners))
        num_changed += bool(changed)
        num_in_place += bool(changed) and len(rebuilt) == num_rebuilt
        for r in owners:
            r.length += 1
    assert num_in_place > 0.8 * num_changed > 150 and len(rebuilt) > 5  # most changes edited in place


def test_a_batch_that_grows_past_its_columns_is_a_call_a_row():
    """Rows join a batch of 250 in steps of 10 (edited in place: `_append`): its columns grow
    past their 256 rows, and each step's tokens are a call a row's, the batch's rows the
    naive keys and origins, no batch rebuilt."""
    ints = int_table(VOCAB).tolist()
    batch, twin = AnswerSampler(VOCAB, ints), AnswerSampler(VOCAB, ints)
    rebuilt: list[int] = []
    batch._rebuild = lambda owners, rows: (rebuilt.append(len(owners)), AnswerSampler._rebuild(batch, owners, rows))
    made = [
        _Row(
            SamplingParams(max_tokens=40 + i % 7 if i < 250 else 200 + i % 5, seed=answer_seed(f"g{i}")),
            i % 9 == 0,
            5 + i,
        )
        for i in range(500)
    ]

    def rows(which):
        picked = [owners[i] for i in which]
        return [r.params for r in picked], [r.sample_index for r in picked], [r.origin for r in picked]

    for step in range(26):
        owners = made[: 250 + 10 * step]
        tokens = batch.sample([None] * len(owners), owners, rows, lambda owners=owners: [r.length for r in owners])
        assert tokens == [twin(None, r.params, r.sample_index, r.length - r.origin) for r in owners]
        assert batch.batch_rows() == [(_key(r), r.origin) for r in owners]
        for r in owners:
            r.length += 1
    assert batch._cols.shape[1] >= 500 and not rebuilt  # every batch appended to the last, the first to none


def test_a_batch_carried_one_token_on_by_the_executor_is_a_call_a_row():
    """With the engine's executor (`carried_ends`: a step's ends list is the last step's, one
    on, row by row), a step of the same owners moves the last step's hashes one position on,
    no length read: each step's tokens are a call a row's, through steps as the engine makes
    them (StepChunks over its decode columns, the executor's clock read before the sampler),
    rows that leave and join, a prompt chunk after the decodes, a step whose clock is not
    read (no word from the executor: every length read) and lengths handed as a copy. Where
    the rows changed, the lengths' int64s are the executor's positions + 1 (`step_ends`): the
    lengths are read only where they are not its step's ends list."""
    from kvpool.engine.runner import ScheduledChunk, StepChunks
    from kvpool.sim.executor import CostExecutor, VirtualClock

    rng = random.Random(7)
    ints = int_table(VOCAB).tolist()
    clock = VirtualClock()
    executor = CostExecutor(
        VOCAB,
        step_time=lambda work, moved: 1e-3 * len(work),
        decode_step_time=lambda positions, moved: 1e-3 * len(positions),
        kv_read_bytes=lambda n: n,
        clock=clock,
        block_bytes=4,
        kv_capacity_bytes=0,
    )
    batch, twin = AnswerSampler(VOCAB, ints, executor=executor), AnswerSampler(VOCAB, ints)
    made = 0

    def new_row() -> _Row:
        nonlocal made
        made += 1
        row = _Row(SamplingParams(max_tokens=rng.randrange(1, 40), seed=answer_seed(f"c{made}")), made % 4 == 0, 3)
        row.length = 3 + rng.randrange(1, 30)  # (its prompt computed: its decodes start after it)
        return row

    def rows(which):
        picked = [owners[i] for i in which]
        return [r.params for r in picked], [r.sample_index for r in picked], [r.origin for r in picked]

    owners = [new_row() for _ in range(12)]
    starts = [r.length - 1 for r in owners]  # each row one token behind: its last is the decode's
    num_fast = 0
    read: list[int] = []  # the lengths lists read (made int64s by the sampler)
    batch._int64s = lambda ends, n: (read.append(n), AnswerSampler._int64s(ends, n))[1]
    last_kind = 0
    for _ in range(300):
        kind = rng.randrange(20)  # 0, 6..19: a step of the columns' rows alone
        rest = [ScheduledChunk("p", [7] * 50, 100, False)] if kind == 1 else []
        ends = [s + 1 for s in starts]
        chunks = StepChunks([f"{id(r)}" for r in owners], [7] * len(owners), starts, rest)
        chunks.columns = (chunks.lead_ids, starts, ends if not rest else ends + [150])
        executor.forward(chunks, None, False)
        if kind != 2:  # (the engine reads its clock as the forward returns)
            clock()
        x = batch._x
        lengths = ends if kind != 3 else list(ends)
        num_read = len(read)
        tokens = batch.sample([None] * len(owners), owners, rows, lambda lengths=lengths: lengths)
        assert tokens == [twin(None, r.params, r.sample_index, r.length - r.origin) for r in owners]
        num_fast += batch._x is x
        # read where the lengths are not the priced step's ends (a copy, a mixed step's, a
        # step priced with the next: an unread clock)
        assert (len(read) > num_read) == (kind in (1, 2, 3) or last_kind == 2)
        last_kind = kind
        for r in owners:  # the engine appends each row's token
            r.length += 1
        if kind in (4, 5):  # rows end anywhere, rows join at the end: the engine's columns made anew
            kept = [i for i in range(len(owners)) if rng.random() > 0.15] or [0]
            owners = [owners[i] for i in kept] + [new_row() for _ in range(rng.randrange(0, 3))]
            starts = [r.length - 1 for r in owners]
        else:
            starts = ends  # the columns carried: this step's ends are the next one's starts
    assert num_fast > 100  # most steps: the rows of the last two, carried


def test_the_batch_refuses_lengths_that_are_not_its_rows_positions():
    """Lengths below a row's origin, fewer or more than the rows, or not ints: a ValueError
    (or the TypeError of a row's position that is not an int) naming them, the batch kept."""
    ints = int_table(VOCAB).tolist()
    sampler = AnswerSampler(VOCAB, ints)
    owners = [_Row(SamplingParams(max_tokens=9, seed=answer_seed(f"b{i}")), 0, 4) for i in range(3)]

    def rows(which):
        picked = [owners[i] for i in which]
        return [r.params for r in picked], [r.sample_index for r in picked], [r.origin for r in picked]

    for lengths in ([4, 3, 5], [4, 5], [4, 5, 6, 7]):
        with pytest.raises(ValueError, match=r"AnswerSampler: 3 rows but lengths minus origins"):
            sampler.sample([None] * 3, owners, rows, lambda lengths=lengths: lengths)
    with pytest.raises(TypeError):
        sampler.sample([None] * 3, owners, rows, lambda: [4, 5.0, 6])
    assert sampler.sample([None] * 3, owners, rows, lambda: [4, 5, 2**40]) == [
        sampler(None, r.params, 0, p) for r, p in zip(owners, [0, 1, 2**40 - 4], strict=True)
    ]
    assert sampler.sample([], [], rows, lambda: []) == []
    # lengths as any iterable of ints (a generator, read once): the same tokens; a float in one: the TypeError
    assert sampler.sample([None] * 3, owners, rows, lambda: (p for p in [6, 5, 4])) == [
        sampler(None, r.params, 0, p) for r, p in zip(owners, [2, 1, 0], strict=True)
    ]
    with pytest.raises(TypeError):
        sampler.sample([None] * 3, owners, rows, lambda: (p for p in [4, 5.0, 6]))


def test_prompts_and_answers_share_one_int_per_token():
    """With the simulator's int table, a prompt's answers and a sampled token are the
    table's objects (a token kept costs a pointer), and the values are those without it."""
    table = int_table(VOCAB)
    s = chat_workload(2, 3, 1.0, VOCAB, seed=5).sessions[1]
    shared, plain = s.prompt_ids(2, VOCAB, table), s.prompt_ids(2, VOCAB)
    assert shared == plain
    # made from the previous turn's prompt (the simulator's way): the same values and objects
    extended = s.prompt_ids(2, VOCAB, table, previous=s.prompt_ids(1, VOCAB, table))
    assert extended == shared and all(a is b for a, b in zip(extended, shared, strict=True))
    # prefix | user_0 | answer_0 | user_1 | answer_1 | user_2: the answers' positions
    t0, t1 = s.turns[0], s.turns[1]
    a0 = len(s.prefix_ids) + len(t0.user_ids)
    a1 = a0 + t0.output_len + len(t1.user_ids)
    answers = list(range(a0, a0 + t0.output_len)) + list(range(a1, a1 + t1.output_len))
    assert all(shared[i] is table[shared[i]] for i in answers)
    assert not all(plain[i] is table[plain[i]] for i in answers)  # .tolist() made new ints
    ints = table.tolist()
    params = SamplingParams(max_tokens=9, seed=answer_seed("chat1-t2"))
    tokens = [AnswerSampler(VOCAB, ints)(None, params, 0, p) for p in range(9)]
    assert tokens == answer_ids("chat1-t2", 9, VOCAB) and all(t is ints[t] for t in tokens)
    with pytest.raises(ValueError, match="ints holds 3 tokens, not the vocabulary's 1000"):
        AnswerSampler(VOCAB, [0, 1, 2])


def test_a_turns_prompt_extended_from_the_last_equals_the_whole_prompt_packed():
    """turn_prompt: a turn's prompt made from the previous one (consumed: extended in place)
    equals the twin's, pack_prompt of the whole history (ids, the same int objects, the
    bytes), turn after turn, over sessions of many lengths, with the previous prompt's packing
    extended (the loop's way) or without it, and with the previous turn's answer as the
    simulator's sampler gave it (or cut short: then made again); a list of another length, a
    packing of another length, or turn 0, is refused."""
    table = int_table(VOCAB)
    sampler = AnswerSampler(VOCAB, table.tolist())
    sessions = chat_workload(6, 5, 2.0, VOCAB, seed=9).sessions
    for k, s in enumerate(sessions):
        previous = packed = answer = None
        for turn in range(len(s.turns)):
            twin = pack_prompt(s.prompt_ids(turn, VOCAB, table))
            prompt = turn_prompt(s, turn, VOCAB, table, previous, packed, answer)
            assert tuple(prompt.token_ids) == twin.token_ids and prompt.packed == twin.packed
            assert type(prompt.packed) is bytes
            assert prompt.mm_items == () and prompt.hashes == {}
            assert all(a is b for a, b in zip(prompt.token_ids, twin.token_ids, strict=True))  # the same objects
            # pack_prompt's kind, which the engine's add_request trusts: the twin's ids a
            # tuple (turn 0 here), a later turn's the list `previous` extended in place
            # (consumed, not copied) and handed over
            assert type(prompt) is CheckedPrompt
            if previous is None:
                assert type(prompt.token_ids) is tuple
            else:
                assert prompt.token_ids is previous
            # as the engine's output gives it back: the list it was handed, or its copy of a tuple
            previous = prompt.token_ids if type(prompt.token_ids) is list else list(prompt.token_ids)
            packed = prompt.packed if k % 2 else None
            # the engine's completion: the tokens its sampler read, all of them or cut short
            params = SamplingParams(max_tokens=s.turns[turn].output_len, seed=answer_seed(s.request_id(turn)))
            answer = [sampler(None, params, 0, p) for p in range(params.max_tokens)] if k % 3 else None
            if answer and (k + turn) % 4 == 0:
                answer = answer[:-1]
    # A session's user ids of numpy's ints (a hand-made one): its prompts' ids are Python
    # ints all the same, on both of turn 1's paths (the answer given, or made again)
    odd = Session("np", 0.0, tuple(Turn(tuple(np.arange(3 * j + 1, 3 * j + 4)), 2) for j in range(2)))
    first = turn_prompt(odd, 0, VOCAB, table)
    for answer in (None, [5, 6]):
        prompt = turn_prompt(odd, 1, VOCAB, table, list(first.token_ids), first.packed, answer)
        assert [type(t) for t in prompt.token_ids] == [int] * 8 and prompt.token_ids[-3:] == [4, 5, 6]
        assert prompt.packed == token_bytes(list(prompt.token_ids))
    s = sessions[0]
    whole = turn_prompt(s, 1, VOCAB, table)
    with pytest.raises(ValueError, match=r"previous holds \d+ tokens; turn 1 of session 'chat0' has \d+ tokens"):
        turn_prompt(s, 2, VOCAB, table, whole.token_ids[:-1])
    with pytest.raises(ValueError, match=r"previous_packed holds \d+ bytes, not the \d+ of turn 1's \d+ tokens"):
        turn_prompt(s, 2, VOCAB, table, list(whole.token_ids), whole.packed[:-4])
    with pytest.raises(ValueError, match="previous_packed or previous_memo without previous"):
        turn_prompt(s, 1, VOCAB, table, None, b"")
    with pytest.raises(ValueError, match="previous_packed or previous_memo without previous"):
        turn_prompt(s, 1, VOCAB, table, None, None, None, {})
    with pytest.raises(ValueError, match="turn -1 of session 'chat0' has no tokens"):
        turn_prompt(s, 0, VOCAB, table, [])
    with pytest.raises(ValueError, match="turn 0 of session 'chat0' extends no earlier prompt"):
        s.turn_tail(0, VOCAB)


def test_turn_zero_packed_with_its_shared_prefix_held_equals_the_whole_prompt_packed():
    """turn_prompt(prefixes=...): turn 0's prompt from its shared prefix's ids and packing,
    held once per prefix, equals the twin's (pack_prompt of the whole prompt): the ids (the
    same int objects), the bytes; the sessions of one system prompt share one entry; a
    prefix of numpy's ints gives Python ints; the memo is emptied past MAX_PREFIXES_HELD."""
    table = int_table(VOCAB)
    sessions = chat_workload(12, 2, 2.0, VOCAB, seed=3, num_system_prompts=2).sessions
    held: dict = {}
    for s in sessions:
        twin = pack_prompt(s.prompt_ids(0, VOCAB, table))
        prompt = turn_prompt(s, 0, VOCAB, table, prefixes=held)
        # (its ids a list of its own, handed over: the held prefix's tuple copied into it)
        assert type(prompt) is CheckedPrompt and type(prompt.token_ids) is list and type(prompt.packed) is bytes
        assert tuple(prompt.token_ids) == twin.token_ids and prompt.packed == twin.packed
        assert all(a is b for a, b in zip(prompt.token_ids, twin.token_ids, strict=True))
        assert prompt.mm_items == () and prompt.hashes == {}
        assert held[id(s.prefix_ids)][0] is s.prefix_ids
    assert len(held) == len({id(s.prefix_ids) for s in sessions}) == 2
    odd = Session("np", 0.0, (Turn((7, 8), 2),), prefix_ids=tuple(np.arange(3, 6)))
    prompt = turn_prompt(odd, 0, VOCAB, table, prefixes=held)
    assert prompt.token_ids == [3, 4, 5, 7, 8] and [type(t) for t in prompt.token_ids] == [int] * 5
    assert prompt.packed == token_bytes([3, 4, 5, 7, 8])
    others = [Session(f"p{i}", 0.0, (Turn((1,), 1),), prefix_ids=(i, i)) for i in range(MAX_PREFIXES_HELD)]
    for other in others:
        turn_prompt(other, 0, VOCAB, table, prefixes=held)
    assert len(held) <= MAX_PREFIXES_HELD
    assert turn_prompt(others[0], 0, VOCAB, table, prefixes=held).token_ids == [0, 0, 1]
    with pytest.raises(ValueError, match=r"token id 4294967296 is outside \[0, 2\*\*32\)"):
        turn_prompt(Session("big", 0.0, (Turn((1,), 1),), prefix_ids=(2**32,)), 0, VOCAB, table, prefixes={})
    # a float id is refused, as pack_prompt refuses it (never truncated to an int the session did not hold)
    for floats in (
        Session("f", 0.0, (Turn((7, 8), 1),), prefix_ids=(3.5, 4)),
        Session("g", 0.0, (Turn((9.7,), 1),), prefix_ids=(3, 4)),
    ):
        with pytest.raises(TypeError):
            pack_prompt(floats.prompt_ids(0, VOCAB, table))
        with pytest.raises(TypeError):
            turn_prompt(floats, 0, VOCAB, table, prefixes={})


def _serve_turn(m, request_id: str, prompt, answer: list[int]):
    """A turn in cache `m` as the simulator's engine runs it: admitted with `prompt` (a
    LookupPrompt), its rest computed, its answer decoded a token a step, released. Returns
    the admission and the block ids it held at the end."""
    ids = list(prompt.token_ids)
    admission = m.admit(request_id, ids, prompt=prompt)
    assert admission is not None
    m.commit_step([request_id], [len(ids) - admission.num_cached_tokens], [answer[0]])  # (its first token)
    for token in answer[1:]:
        assert m.reserve_step([request_id], [1])
        m.commit_step([request_id], [1], [token])
    held = m.block_ids(request_id)
    m.release(request_id)
    m.check_integrity()
    return admission, held


@pytest.mark.parametrize("kind", ["full", "v4"])
def test_a_turns_prompt_with_the_last_turns_memo_looks_up_as_one_packed_afresh(kind: str) -> None:
    """turn_prompt with the previous turn's lookup memo (the simulator's way: its hashes and
    the runs its pools' walks accepted, taken as this prompt's): every lookup and admission
    of each turn equals a twin cache's over the same prompt packed afresh (its own memo) and
    the plain lookup, turn after turn, where the cache's index changed in between (the
    turn's own blocks published; a filler request between some turns evicting the runs the
    memo remembers), and the memo carried is the one the last turn's lookups filled."""
    table = int_table(VOCAB)
    sampler = AnswerSampler(VOCAB, table.tolist())
    if kind == "full":
        m, twin = (FullAttentionManager(180, 64, DESC) for _ in range(2))
    else:
        m, twin = (DSV4CacheManager(DSV4_SPEC, 420, 4, DESC) for _ in range(2))
    filler = [VOCAB + i for i in range(150 * 64 if kind == "full" else 330 * 16)]  # ids no prompt holds
    num_walked = 0
    for k, s in enumerate(chat_workload(2, 5, 2.0, VOCAB, seed=9).sessions):
        previous = packed = answer = memo = None
        for turn in range(len(s.turns)):
            prompt = turn_prompt(s, turn, VOCAB, table, previous, packed, answer, memo)
            fresh = pack_prompt(list(prompt.token_ids))
            if memo is not None:
                assert prompt.hashes is memo
                num_walked += len(memo) > 1  # hashes and a run a walk accepted (not only a first miss's)
            hit = m.lookup_packed(prompt)
            assert hit == twin.lookup_packed(fresh) == twin.lookup_prefix(list(prompt.token_ids))
            assert turn == 0 or hit > 0
            params = SamplingParams(max_tokens=s.turns[turn].output_len, seed=answer_seed(s.request_id(turn)))
            answer = [sampler(None, params, 0, p) for p in range(params.max_tokens)]
            served = _serve_turn(m, s.request_id(turn), prompt, answer)
            assert served == _serve_turn(twin, s.request_id(turn), fresh, answer)
            if (k + turn) % 2:  # a filler's blocks evict most of the cached ones
                for c in (m, twin):
                    assert c.admit(f"fill{k}-{turn}", filler) is not None
                    c.release(f"fill{k}-{turn}")
            previous, packed, memo = list(prompt.token_ids), prompt.packed, prompt.hashes
    assert num_walked >= 6


def test_a_run_spaces_the_collectors_young_collections_and_restores_its_thresholds():
    import gc

    from kvpool.sim.simulator import YOUNG_COLLECTION_EVERY, spaced_collections

    model, gpu, config, cost = _setup()
    workload = chat_workload(6, 2, 8.0, model.vocab_size, seed=4)
    before = gc.get_threshold()
    seen = []  # the thresholds while the run's requests finish
    plain = simulate(model, gpu, workload, config, cost)  # (a first run: same figures after)
    report = simulate(model, gpu, workload, config, cost, on_finish=lambda r: seen.append(gc.get_threshold()))
    # (the young spacing doubles after a collection that freed nothing: test below)
    spacings = {YOUNG_COLLECTION_EVERY << k for k in range(7)}
    assert seen and all(young in spacings and (middle, old) == (before[1], 1) for young, middle, old in seen)
    assert gc.get_threshold() == before
    assert _figures(report) == _figures(plain)
    # restored after a failing run too; a collector that is off is left alone
    with pytest.raises(RuntimeError), spaced_collections(1234):
        assert gc.get_threshold() == (1234, before[1], 1)
        raise RuntimeError("a run that fails")
    assert gc.get_threshold() == before
    gc.disable()
    try:
        with spaced_collections(1234):
            assert gc.get_threshold() == before and not gc.isenabled()
    finally:
        gc.enable()
    # runs that overlap and end out of order (threads): the last one out restores
    first, second = spaced_collections(1234), spaced_collections(99)
    first.__enter__()
    second.__enter__()
    assert gc.get_threshold() == (1234, before[1], 1)
    first.__exit__(None, None, None)
    assert gc.get_threshold() == (1234, before[1], 1)  # the second run still going
    second.__exit__(None, None, None)
    assert gc.get_threshold() == before


def test_collections_that_free_nothing_are_spaced_further_and_one_that_frees_resets_them():
    import gc

    from kvpool.sim.simulator import MAX_BACK_OFF, _back_off, spaced_collections

    before = gc.get_threshold()
    gc.collect()  # the garbage made before: not this test's collections' to find
    with spaced_collections(1000):
        assert gc.get_threshold() == (1000, before[1], 1) and _back_off in gc.callbacks
        kept = []
        for k in range(1, 9):  # each collection finds only live objects: twice as far apart after it
            gc.collect(0)
            assert gc.get_threshold()[0] == 1000 * min(1 << k, MAX_BACK_OFF)
            kept.append([[] for _ in range(10)])
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle  # garbage that only a collection frees: back to the base
        assert gc.collect(0) >= 1
        assert gc.get_threshold() == (1000, before[1], 1)
    assert gc.get_threshold() == before and _back_off not in gc.callbacks
    gc.collect(0)  # the callback is gone: nothing changes the thresholds
    assert gc.get_threshold() == before


@pytest.mark.parametrize("routing", ["prefix-aware", "round-robin"])
def test_every_prompt_the_engine_admits_in_a_run_is_packed_as_its_ids(routing, monkeypatch):
    # turn_prompt's CheckedPrompt carries the last turn's packing, which the engine trusts
    # without reading the ids again: a wrong carried packing (zeros, one token off) would
    # cache blocks under other ids than those computed. Every admission of a multi-turn run
    # is checked here against its ids packed afresh (planted: the packing carried as
    # bytes(len(prompt.packed)), or one carried token off, fails it). Its ids are a list
    # handed over, which the engine keeps as the request's sequence's: no copy of it (a copy
    # planted in add_request fails the identity below), and the next turn extends that list
    # (pop_output gives it back cut to the prompt)
    from kvpool.engine.engine import Engine

    admitted = []
    add_request = Engine.add_request

    def checked_add(self, prompt, *args, **kwargs):
        assert type(prompt) is CheckedPrompt and type(prompt.token_ids) is list
        assert prompt.packed == token_bytes(prompt.token_ids), args[1] if len(args) > 1 else kwargs
        admitted.append(len(prompt.token_ids))
        rid = add_request(self, prompt, *args, **kwargs)
        req = self.requests[rid]
        assert req.seqs[0].token_ids is prompt.token_ids
        return rid

    monkeypatch.setattr(Engine, "add_request", checked_add)
    model, gpu, config, cost = _setup(routing=routing)
    report = simulate(model, gpu, chat_workload(20, 3, 6.0, model.vocab_size, seed=4), config, cost)
    assert report["num_finished"] == len(admitted) == 60
