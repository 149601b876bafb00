"""The decodes' sums of `CostModel.step_cost` from integer sums per context (`_decode_scan`,
the fast path a fleet simulation takes every step) against its naive twin, the loop over
every decode and attention term: the same StepCost, bit for bit, on every preset."""

from __future__ import annotations

import dataclasses
import random
import re

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpool.sim.cost import CostModel
from kvpool.spec.gpus import get_gpu
from kvpool.spec.models import PRESET_NAMES, load_preset

H200 = get_gpu("H200")


def _twin(cm: CostModel) -> CostModel:
    """A copy of `cm` that adds every decode in the loop (no `_decode_scale`)."""
    loop = dataclasses.replace(cm)
    loop.__dict__["_decode_scale"] = None  # the cached property, set before its first read
    return loop


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_the_decode_sums_equal_the_loops_bit_for_bit_on_every_preset(name: str) -> None:
    model = load_preset(name)
    rng = random.Random(name)
    models = []
    for kv_dtype in ("auto", "fp8"):
        for tp in (1, 2):
            try:
                models.append(CostModel(model, H200, kv_dtype=kv_dtype, tp=tp))
            except ValueError:  # a format or a split the model cannot take
                continue
    assert models
    for cm in models:
        assert cm._decode_scale is not None  # the fast path is taken
        loop = _twin(cm)
        top = model.max_position_embeddings
        for batch in (1, 7, 256):
            decodes = [(1, rng.randrange(1, top + 1)) for _ in range(batch)]
            prefills = [(n, n + rng.randrange(0, 4096)) for n in (2, 512)]
            for chunks in (decodes, prefills + decodes, decodes[:3] + prefills + decodes[3:]):
                assert cm.step_cost(chunks) == loop.step_cost(chunks), (name, cm.kv_dtype, cm.tp, batch)


def test_sums_past_2_to_the_53_leave_the_fast_path_for_the_loop() -> None:
    cm = CostModel(load_preset("deepseek-v4-flash"), H200, tp=2)
    assert cm._decode_scale == 4  # V4's write bytes per token: 28,962.25
    huge = [(1, 10**12)] * 3  # each reads 10^12 // 4 compressed entries of its CSA indexer keys
    assert cm._decode_scan(huge) is None
    assert cm._decode_scan(huge[:1] + [(1, 5000)]) is None
    assert cm._decode_scan([(1, 5000)]) is not None
    assert cm.step_cost(huge) == _twin(cm).step_cost(huge)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "deepseek-v4-flash"])
def test_a_bad_chunk_is_named_on_the_fast_path_as_by_the_loop(name: str) -> None:
    cm = CostModel(load_preset(name), H200, tp=2)
    for chunks, message in (
        ([], "a step needs at least one chunk, got none"),
        ([(1, 9), (0, 5)], "chunk 1: num_new_tokens must be >= 1, got 0"),
        ([(1, 9), (3, 2)], "chunk 1: context_len=2 is shorter than its num_new_tokens=3"),
        ([(1, 5.0)], "chunk 0: context_len must be an integer, got 5.0"),
        ([(True, 5)], "chunk 0: num_new_tokens must be an integer, got True"),
        ([(1, 2, 3)], r"chunk 0 must be \(num_new_tokens, context_len\), got \(1, 2, 3\)"),
    ):
        for model in (cm, _twin(cm)):
            with pytest.raises(ValueError, match=f"^{message}$"):
                model.step_cost(chunks)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_step_time_is_the_step_costs_time_bit_for_bit_on_every_preset(name: str) -> None:
    """step_time prices a step of decodes only from terms kept per batch size: the same float
    as step_cost's time_s, for graph and eager steps, any TP, batches on both sides of the
    graph's largest, and steps with a prefill chunk (which take step_cost itself)."""
    model = load_preset(name)
    rng = random.Random(f"{name}/time")
    models = [CostModel(model, H200, host_mode=mode) for mode in ("graph", "eager")]
    try:
        models.append(CostModel(model, H200, tp=2, kv_dtype="fp8"))
    except ValueError:  # a format the model cannot take
        pass
    top = model.max_position_embeddings
    for cm in models:
        for batch in (1, 2, 7, cm.graph_max_batch, cm.graph_max_batch + 1):
            for _ in range(2):  # the second step of a size reads the kept terms
                decodes = [(1, rng.randrange(1, top + 1)) for _ in range(batch)]
                assert cm.step_time(decodes) == cm.step_cost(decodes).time_s, (name, cm.host_mode, cm.tp, batch)
            mixed = decodes[:1] + [(300, 300 + rng.randrange(0, 4096))] + decodes[1:]
            assert cm.step_time(mixed) == cm.step_cost(mixed).time_s, (name, cm.host_mode, cm.tp, batch)
    # the kept terms are per batch size: two sizes' steps over the same contexts differ
    cm = models[0]
    assert cm.step_time([(1, 4000)] * 3) != cm.step_time([(1, 4000)] * 4)


# ----- decode_step_time: a step of decodes from one numpy sum over a table by position -----

_V4 = CostModel(load_preset("deepseek-v4-flash"), H200, tp=2)


_BANDWIDTH = 3.3e12  # the bytes a second of the state copies between steps, in the executors below


def _cost_executor(fast: bool, split: bool = False):
    """A CostExecutor of ten blocks pricing by _V4, the copies' bytes at _BANDWIDTH. fast: its
    decode-step twin (and, with split, its split-step twin, step_time then refusing to be
    called: the twins must price every step); else step_time alone, the naive pricing."""
    from kvpool.sim.executor import CostExecutor, VirtualClock

    cm = _V4

    def naive(work, moved):
        return cm.step_time(work) + moved / _BANDWIDTH

    def unused(work, moved):
        raise AssertionError(f"step_time called for {work}: the fast twins price every step here")

    def decode(positions, moved):
        return cm.decode_step_time(positions) + moved / _BANDWIDTH

    def split_step(positions, others, moved):
        seconds = cm.split_step_time(positions, others)
        return None if seconds is None else seconds + moved / _BANDWIDTH

    return CostExecutor(
        10,
        step_time=unused if fast and split else naive,
        decode_step_time=decode if fast else None,
        split_step_time=split_step if fast and split else None,
        kv_read_bytes=lambda n: n,
        clock=VirtualClock(),
        block_bytes=4,
        kv_capacity_bytes=0,
        checkpoint_bytes=1 << 20,
    )


_LLAMA = CostModel(load_preset("llama-3.1-8b"), H200)


def _naive(cm: CostModel, positions: list[int]) -> float:
    """A step of one decode at each position, priced by the loop over every decode and term."""
    return _twin(cm).step_cost([(1, p + 1) for p in positions]).time_s


@settings(max_examples=60, deadline=None)
@given(
    which=st.sampled_from(["v4", "llama"]),
    positions=st.lists(st.integers(0, 200_000), min_size=1, max_size=600),
    repeat=st.booleans(),
)
def test_decode_step_time_is_the_loops_time_bit_for_bit(which: str, positions: list[int], repeat: bool) -> None:
    cm = _V4 if which == "v4" else _LLAMA
    if repeat:  # the same positions again: every entry read from the memo
        cm.decode_step_time(positions)
    assert cm.decode_step_time(positions) == cm.step_time([(1, p + 1) for p in positions]) == _naive(cm, positions)
    assert len(cm._decode_table[0]) > max(positions)  # (the sum over the table priced it)


def test_decode_step_time_names_a_bad_position_as_step_time_does() -> None:
    cm = CostModel(load_preset("deepseek-v4-flash"), H200, tp=2)
    cm.decode_step_time([5])  # position 5's entry kept: a float 5.0 would find it in the memo
    for positions, message in (
        ([], "a step needs at least one chunk, got none"),
        ([5.0], "chunk 0: context_len must be an integer, got 6.0"),
        ([7, -1], "chunk 1: context_len=0 is shorter than its num_new_tokens=1"),
        # 9 first seen: its entry is made before the negative position is met
        ([9, 5, -1], "chunk 2: context_len=0 is shorter than its num_new_tokens=1"),
        ([6, 7.0], "chunk 1: context_len must be an integer, got 8.0"),  # a float after ints
        ([5, np.int64(7)], re.escape(f"chunk 1: context_len must be an integer, got {np.int64(8)!r}")),
    ):
        with pytest.raises(ValueError, match=f"^{message}$"):
            cm.decode_step_time(positions)
    with pytest.raises(TypeError):  # as step_time's (1, p + 1) raises it
        cm.decode_step_time([5, "7"])
    assert cm.decode_step_time([True, 5]) == cm.step_time([(1, 2), (1, 6)])  # True + 1 is the int 2


def test_decode_step_time_leaves_its_sums_for_the_loop_past_2_to_the_53_or_2_to_the_11_decodes() -> None:
    cm = CostModel(load_preset("deepseek-v4-flash"), H200, tp=2)
    huge = [10**12] * 3  # each reads 10^12 // 4 compressed entries of its CSA indexer keys
    assert cm.decode_step_time(huge) == _naive(cm, huge)
    assert len(cm._decode_table[0]) < 10**12  # a table of entries past 2^53 is not made
    assert cm._decode_sums(huge) is None and cm._decode_sums([5000, 10**12]) is None
    many = [4000 + i % 7 for i in range(1 << 11)]  # 2^11 decodes: past the table sums' bound
    assert cm._decode_sums(many) is None and cm._decode_sums(many[:-1]) is not None
    assert cm.decode_step_time(many) == _naive(cm, many)
    assert cm.decode_step_time(many[:-1]) == _naive(cm, many[:-1])


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_the_decode_tables_rows_are_the_memos_entries_on_every_preset(name: str) -> None:
    """Row p of `_decode_table` (made in numpy, a range of positions at once, as the table
    grows) is `_decode_entry(p + 1)`, the integers `_decode_scan` adds (made a context at a
    time in Python), at every position of the table, grown a few times over."""
    model = load_preset(name)
    for tp, kv_dtype in ((1, "auto"), (2, "fp8")):
        try:
            cm = CostModel(model, H200, kv_dtype=kv_dtype, tp=tp)
        except ValueError:  # a format or a split the model cannot take
            continue
        twin = dataclasses.replace(cm)  # its own memo: entries made one by one
        for top in (3, 1500, 2049, 9000):  # grown: to 1,024 rows, 2,048, 4,096, then 9,000
            assert cm._decode_sums([top - 1]) is not None
        table = cm._decode_table[0]
        assert table.dtype == np.float64 and len(table) == 9000  # (integers below 2^53: exact floats)
        rows = [twin._decode_entry(p + 1) for p in range(len(table))]
        assert table.tolist() == [list(row) for row in rows], name
        assert max(map(max, rows)) < 1 << 53


def test_the_decode_sums_refuse_what_the_table_cannot_add() -> None:
    """None, never a wrong sum, for a position that is negative, not an int, past the
    table's bound, or 2^11 positions; the sums of the others are the memo's, added in Python."""
    cm = CostModel(load_preset("deepseek-v4-flash"), H200, tp=2)
    twin = dataclasses.replace(cm)
    positions = [0, 7, 4095, 131_071, 7]
    sums = [sum(twin._decode_entry(p + 1)[k] for p in positions) for k in (0, 1)]
    assert cm._decode_sums(positions) == tuple(sums)
    for bad in ([-1], [5, -3], [5.0], [5, np.int64(7)], [2**70], [1 << 21], [5] * (1 << 11)):
        assert cm._decode_sums(bad) is None, bad
    assert len(cm._decode_table[0]) == 131_072  # grown to the positions asked for, not past the bound
    assert cm._decode_sums([(1 << 21) - 1]) is not None  # the last position the table holds
    assert len(cm._decode_table[0]) == 1 << 21


@settings(max_examples=30, deadline=None)
@given(
    steps=st.lists(st.tuples(st.lists(st.integers(0, 50_000), min_size=1, max_size=40), st.integers(0, 3)), max_size=8)
)
def test_the_executors_decode_pricing_is_its_naive_pricing_bit_for_bit(steps) -> None:
    """CostExecutor prices a step of one-token chunks by `decode_step_time`; without it, by
    `step_time` over (tokens, context) per chunk: the clocks read the same floats, step after
    step, with the bytes the state copies between the steps move, and steps with a prefill
    chunk (which take step_time either way)."""
    from kvpool.engine.runner import ScheduledChunk

    executors = [_cost_executor(fast) for fast in (True, False)]
    for k, (starts, num_copies) in enumerate(steps):
        chunks = [ScheduledChunk(f"r{i}", [7], start, True) for i, start in enumerate(starts)]
        if k % 3 == 2:  # a prefill chunk among the decodes
            chunks.append(ScheduledChunk("p", list(range(300)), 1000, True))
        for ex in executors:
            for _ in range(num_copies):
                ex.copy_state(0, 1)
            assert ex.forward(chunks, None, False) == [None] * len(chunks)
        fast, naive = (ex.clock() for ex in executors)
        assert fast == naive and executors[0].busy_s == executors[1].busy_s


# ----- split_step_time: a mixed step's decodes from the table's sums, its other chunks by the loop -----


@settings(max_examples=60, deadline=None)
@given(
    which=st.sampled_from(["v4", "llama"]),
    positions=st.lists(st.integers(0, 200_000), max_size=300),
    others=st.lists(st.tuples(st.integers(2, 4096), st.integers(0, 100_000)), min_size=1, max_size=4),
    data=st.data(),
)
def test_split_step_time_is_the_steps_time_in_any_order_bit_for_bit(which, positions, others, data) -> None:
    """A step of decodes at `positions` and the other chunks, wherever those fall among the
    decodes: split_step_time is step_time's float over the step in that order and the loop's
    (the twin without `_decode_scale`, which adds every decode in the step's order)."""
    cm = _V4 if which == "v4" else _LLAMA
    rest = [(n, n + extra) for n, extra in others]
    step = [(1, p + 1) for p in positions]
    for chunk in rest:  # each after the last one placed: their own order kept
        at = data.draw(st.integers(0, len(step)))
        step.insert(at, chunk)
    seconds = cm.split_step_time(positions, rest)
    assert seconds is not None
    assert seconds == cm.step_time(step) == _twin(cm).step_cost(step).time_s


def _split_models(name: str) -> list[CostModel]:
    """`name`'s cost models for the split twin: graph and eager, TP 2 with an fp8 cache, and on
    an H100 (gpt-oss's MXFP4 experts there: the MoE tiles' terms)."""
    model = load_preset(name)
    models = [CostModel(model, H200, host_mode=mode) for mode in ("graph", "eager")]
    for kwargs in ({"tp": 2, "kv_dtype": "fp8"}, {"gpu": get_gpu("H100")}):
        try:
            models.append(CostModel(model, kwargs.pop("gpu", H200), **kwargs))
        except ValueError:  # a format the model cannot take
            pass
    return models


_SPLIT_MODELS = {name: _split_models(name) for name in PRESET_NAMES}


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(PRESET_NAMES),
    positions=st.lists(st.integers(0, 300_000), max_size=300),
    # prompt chunks (tokens, cached before them): both sides of every term's cap and window
    others=st.lists(
        st.tuples(
            st.one_of(st.integers(2, 9), st.integers(2, 8192)),
            st.one_of(st.integers(0, 200), st.integers(0, 300_000)),
        ),
        min_size=1,
        max_size=4,
    ),
    data=st.data(),
)
def test_split_time_is_the_step_costs_time_bit_for_bit_on_every_preset(name, positions, others, data) -> None:
    """split_step_time's own pricing of a mixed step (`_split_time`: its prefill chunks'
    entries from factors made once, the token count's figures kept per count, no StepCost)
    is step_cost's time_s over the step in any order and the loop's (no `_decode_scale`), bit
    for bit, on every preset: windows, top-k and capped terms, MLA's decompression, MoE tiles,
    TP, graph and eager; again with the count's figures kept (the second pricing)."""
    rest = [(n, n + cached) for n, cached in others]
    step = [(1, p + 1) for p in positions]
    for chunk in rest:  # each after the last one placed: their own order kept
        step.insert(data.draw(st.integers(0, len(step))), chunk)
    num_tokens = len(positions) + sum(n for n, _ in rest)
    for cm in _SPLIT_MODELS[name]:
        # its parts (which the time's maxima and sums may hide): the prefill chunks' sums and
        # the token count's figures, against step_cost's over the step without its decodes' sums
        part = cm._step_cost(rest, (num_tokens, (0.0, 0.0), rest), len(step))
        linear_flops, prefill_flops, prefill_bytes = cm._prefill_sums(num_tokens, rest, len(step))
        tile_flops, _, weight, comm_s = cm._token_terms(num_tokens)
        if tile_flops is not None:
            linear_flops += tile_flops
        assert (linear_flops, prefill_flops, prefill_bytes) == (part.linear_flops, part.attention_flops, part.kv_bytes)
        assert (weight, comm_s) == (part.weight_bytes, part.comm_s)
        expected = cm.step_cost(step).time_s
        assert expected == _twin(cm).step_cost(step).time_s
        for _ in range(2):  # the second reads the token count's kept figures
            assert cm.split_step_time(positions, rest) == expected, (name, cm.gpu.name, cm.tp, cm.host_mode)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_split_times_prefill_sums_are_the_loops_at_every_terms_cap_and_window(name: str) -> None:
    """`_prefill_sums` (the closed forms of a prefill chunk's entries) against `_step_cost`'s
    loop for chunks whose cached prefix and context end on each side of every term's cap x
    tokens per entry (where a query's entries stop growing) and of a window: the same three
    floats, and the same time from split_step_time."""
    for cm in _SPLIT_MODELS[name]:
        edges = {1, 2, 3}
        for t in cm.attention_terms:
            if t.cap is not None:
                edges |= {t.cap * t.tokens_per_entry + d for d in (-2, -1, 0, 1, 2)}
        for lo in sorted(e for e in edges if e >= 0):
            for n in (2, 3, 5, 130, 2049):
                rest = [(n, lo + n), (2, lo + 2)]
                num_tokens = 7 + n + 2
                part = cm._step_cost(rest, (num_tokens, (0.0, 0.0), rest), 9)
                linear_flops, prefill_flops, prefill_bytes = cm._prefill_sums(num_tokens, rest, 9)
                tile_flops = cm._token_terms(num_tokens)[0]
                linear_flops += 0.0 if tile_flops is None else tile_flops
                assert (linear_flops, prefill_flops, prefill_bytes) == (
                    part.linear_flops,
                    part.attention_flops,
                    part.kv_bytes,
                ), (name, lo, n)
                step = [(1, 900 + i) for i in range(7)] + rest
                assert cm.split_step_time(list(range(899, 906)), rest) == cm.step_cost(step).time_s


def test_split_step_time_leaves_what_it_cannot_tell_to_step_time() -> None:
    """None, never a wrong float or another error, for what step_time names or where the sums
    are not exact: the executor then prices the step with step_time."""
    cm = CostModel(load_preset("deepseek-v4-flash"), H200, tp=2)
    good = [(300, 1300)]
    assert cm.split_step_time([5, 9], good) == cm.step_time([(1, 6), (300, 1300), (1, 10)])
    for positions, others in (
        ([5], []),  # no other chunk: decode_step_time's step
        ([5.0], good),  # a float position (its int's entry is kept)
        ([-1], good),
        ([9, 5, -1], good),  # a negative position after one first seen
        ([6, 7.0], good),
        ([5, np.int64(9)], good),  # a numpy integer (its int's entry is kept)
        ([5, "9"], good),
        ([5], [(1, 9)]),  # a decode among the others
        ([5], [(300, 299)]),  # shorter than its tokens
        ([5], [(300.0, 1300)]),
        ([5], [(300, 1300, 1)]),
        ([5], [[300, 1300]]),
        ([10**12] * 3, good),  # sums past 2^53
        ([4000] * (1 << 11), good),  # 2^11 decodes: past the table sums' bound
    ):
        assert cm.split_step_time(positions, others) is None, (positions[:3], others)
    assert _twin(cm).split_step_time([5], good) is None  # no `_decode_scale`: the loop's order matters


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(1, 50_000), min_size=1, max_size=40),  # the decodes' positions
            st.integers(0, 3),  # state copies before the step
            # replays (tokens, start): one token is a decode
            st.lists(st.tuples(st.one_of(st.just(1), st.integers(2, 300)), st.integers(0, 5000)), max_size=2),
            st.integers(0, 3),  # 1: a prefill chunk among the decodes; 2: and a later piece; 3: pieces only
            st.integers(0, 39),  # where the prefill chunk goes, and which decode a later piece extends
        ),
        max_size=8,
    )
)
def test_the_executors_fast_pricing_is_its_naive_pricing_bit_for_bit(steps) -> None:
    """CostExecutor prices a step of one-token chunks by `decode_step_time` and any other
    (a prefill chunk among the decodes, a step in pieces, replays before it) by
    `split_step_time`; without them, by `step_time` over `_work`'s (tokens, context) per
    chunk: the clocks read the same floats, step after step, with the bytes the state copies
    between the steps move."""
    from kvpool.engine.runner import ScheduledChunk

    executors = [_cost_executor(fast, split=True) for fast in (True, False)]
    for starts, num_copies, replays, kind, at in steps:
        chunks = [ScheduledChunk(f"r{i}", [7], start, True) for i, start in enumerate(starts)]
        if kind in (1, 2):
            chunks.insert(at % (len(chunks) + 1), ScheduledChunk("p", list(range(300)), 1000, True))
        pieces = []
        if kind >= 2:  # the step cut at a checkpoint: a decode's request computes on, and a new one
            c = chunks[at % len(chunks)]
            end = c.start + len(c.token_ids)
            pieces = [[ScheduledChunk(c.request_id, [7] * 5, end, True)], [ScheduledChunk("q", [7] * 9, 40, True)]]
        for ex in executors:
            for _ in range(num_copies):
                ex.copy_state(0, 1)
            for num_tokens, start in replays:
                ex.replay([7] * num_tokens, start, [], 0, 0)
            assert ex.forward(chunks, None, False) == [None] * len(chunks)
            for piece in pieces:
                ex.forward(piece, None, False)
        fast, naive = (ex.clock() for ex in executors)
        assert fast == naive and executors[0].busy_s == executors[1].busy_s
        assert not executors[0]._later and not executors[0]._replays  # taken with the step


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(1, 50_000), max_size=40),  # the leading decodes' starts (the columns)
            # the chunks after them: a decode (one token) or a prompt's chunk, (tokens, start)
            st.lists(st.tuples(st.one_of(st.just(1), st.integers(2, 300)), st.integers(0, 5000)), max_size=4),
            st.integers(0, 2),  # state copies before the step
            st.booleans(),  # the engine set the columns
            # bits: 1 a replay before the step; later pieces (the step cut at checkpoints): 2 a
            # request not in the first forward, 4 the rest's first chunk divided (its first
            # piece in the rest), 8 a leading decode's request (never the engine's: a decode
            # is one token; the general path prices it)
            st.integers(0, 15),
        ),
        max_size=8,
    )
)
def test_the_executors_pricing_of_step_chunks_is_its_naive_pricing_bit_for_bit(steps) -> None:
    """The engine's StepChunks (its leading decodes held as columns, the rows that joined
    after them) priced from the leading starts and the rest's chunks, no column read, also
    when the step came in pieces (runner._forward_cut: a divided chunk's first piece in the
    rest, its later pieces, a request only in a later piece) and with replays: the clock
    reads step_time's float over the same chunks as a plain list, step after step (with
    copies' bytes)."""
    from kvpool.engine.runner import ScheduledChunk, StepChunks

    fast, twin = _cost_executor(True, split=True), _cost_executor(False)
    for k, (starts, rest, num_copies, with_columns, extra) in enumerate(steps):
        ids = [f"r{i}" for i in range(len(starts))]
        tokens = [7] * len(starts)
        others = [ScheduledChunk(f"j{i}", [7] * n, start, True) for i, (n, start) in enumerate(rest)]
        if not starts and not others:
            continue
        chunks = StepChunks(ids, tokens, starts, others)
        if with_columns:  # as the engine sets them: every chunk's id, start and end
            chunks.columns = (
                ids + [c.request_id for c in others],
                starts + [c.start for c in others],
                [s + 1 for s in starts] + [c.start + len(c.token_ids) for c in others],
            )
        plain = [ScheduledChunk(i, [t], s, True) for i, t, s in zip(ids, tokens, starts, strict=True)] + others
        for ex, step in ((fast, chunks), (twin, plain)):
            for _ in range(num_copies):
                ex.copy_state(0, 1)
            if extra & 1:
                ex.replay([7] * 40, 100 + k, [], 0, 0)
            assert ex.forward(step, None, False) == [None] * len(plain)
            pieces = []
            if extra & 4 and others:  # the rest's first chunk goes on past its first piece
                c = others[0]
                end = c.start + len(c.token_ids)
                pieces += [
                    ScheduledChunk(c.request_id, [7] * 3, end, False),
                    ScheduledChunk(c.request_id, [7] * 2, end + 3, True),
                ]
            if extra & 2:  # a request with no chunk in the first forward
                pieces.append(ScheduledChunk("q", [7] * (k % 3 + 1), 40, True))
            if extra & 8 and starts:  # a leading decode's request
                pieces.append(ScheduledChunk(ids[-1], [7] * 4, starts[-1] + 1, True))
            for piece in pieces:  # (a forward a piece: their requests' parts reach further)
                ex.forward([piece], None, False)
        assert fast.clock() == twin.clock() and fast.busy_s == twin.busy_s
        assert not fast._later and not fast._replays  # taken with the step
        # the leading chunks never made on the fast path (the general one transposes them
        # where the engine set no columns)
        assert chunks._rows is None or (extra & 8 and starts and not with_columns)


# ----- the executor's carried positions: the engine's decode columns one token on, as an array -----


@settings(max_examples=60, deadline=None)
@given(which=st.sampled_from(["v4", "llama"]), positions=st.lists(st.integers(0, 200_000), min_size=1, max_size=600))
def test_the_decode_sums_of_an_int64_array_are_its_lists(which: str, positions: list[int]) -> None:
    """decode_step_time and `_decode_sums` read an int64 array [n] as the list of its ints:
    the same sums and float; an array they cannot read (another dtype or shape, a negative
    position) goes where its list goes (None; step_time's float or its error)."""
    cm = _V4 if which == "v4" else _LLAMA
    at = np.array(positions, dtype=np.int64)
    assert cm._decode_sums(at) == cm._decode_sums(positions) is not None
    assert cm.decode_step_time(at) == cm.decode_step_time(positions) == _naive(cm, positions)
    for other in (at.astype(np.int32), at.astype(np.float64), at.reshape(1, -1)):
        assert cm._decode_sums(other) is None
    assert cm.decode_step_time(at.astype(np.int32)) == _naive(cm, positions)  # its ints, by the loop
    with pytest.raises(ValueError, match="context_len=0 is shorter than its num_new_tokens=1"):
        cm.decode_step_time(np.array(positions + [-1], dtype=np.int64))


def test_an_array_passed_again_is_read_as_it_is_now() -> None:
    """`_decode_sums` keeps the uint64 view of the array it was last given (the executor's,
    moved on in place): the same array changed in place between calls is read as it is then,
    a position past the table's end (grown for it) or negative (None, as its list) included."""
    cm = CostModel(load_preset("deepseek-v4-flash"), H200, tp=2)
    at = np.array([5, 900, 17], dtype=np.int64)
    end = len(cm._decode_table[0]) if cm._decode_sums(at) is not None else 0
    assert end > 900
    for change in (1, 1, end, -5 * end, 3):  # one on, twice; past the end; negative; back
        at += change
        if change == -5 * end:
            at[:] = (5, -1, 17)
        assert cm._decode_sums(at) == cm._decode_sums(at.tolist()), change
        assert cm._decode_view[0] is at
    assert cm._decode_sums(np.array([-1], dtype=np.int64)) is None  # another array: its own view
    assert len(cm._decode_table[0]) > end  # (grown for the positions past it)


class _Engine:
    """Decode steps as engine.py hands them to the runner: StepChunks over its decode columns
    (ids, starts) with the columns set (ends: each start + 1), the next step's starts being
    this step's ends list (the columns carried) unless rows leave or join (new lists)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.ids = [f"r{i}" for i in range(rng.randrange(1, 30))]
        self.starts = [rng.randrange(0, 9000) for _ in self.ids]
        self.made = len(self.ids)

    def step(self, rest: list) -> tuple:
        from kvpool.engine.runner import StepChunks

        ends = [s + 1 for s in self.starts]
        chunks = StepChunks(self.ids, [7] * len(self.ids), self.starts, rest)
        chunks.columns = (
            self.ids + [c.request_id for c in rest],
            self.starts + [c.start for c in rest],
            ends if not rest else ends + [c.start + len(c.token_ids) for c in rest],
        )
        return chunks, ends

    def carry(self, ends: list[int]) -> None:
        self.starts = ends  # (the engine's columns: the step's ends are the next one's starts)

    def change(self, ends: list[int]) -> None:
        """Rows end anywhere and join at the end: new lists."""
        rng = self.rng
        keep = [i for i in range(len(self.ids)) if rng.random() > 0.2] or [0]
        self.ids = [self.ids[i] for i in keep]
        self.starts = [ends[i] for i in keep]
        for _ in range(rng.randrange(0, 3)):
            self.made += 1
            self.ids.append(f"r{self.made}")
            self.starts.append(rng.randrange(0, 9000))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), kinds=st.lists(st.integers(0, 9), min_size=1, max_size=40))
@example(seed=3, kinds=[0, 0, 0, 3, 7, 5, 0, 0, 0, 2, 0, 0, 1, 0, 0, 4, 0, 0, 0, 6, 8, 9, 0, 0, 7, 0, 0, 1])
def test_the_executors_carried_positions_price_as_the_lists_bit_for_bit(seed: int, kinds: list[int]) -> None:
    """Engine-made decode steps through CostExecutor: a step whose positions list is the last
    common step's ends list (the engine's columns carried) is priced from the executor's
    array, one on (no list read but its first and last), and the clock reads the twin's float (step_time
    over the chunks as a plain list), step after step, through rows that leave and join,
    mixed steps (a prompt chunk after the decodes, a replay before them: their leading
    decodes from the array too; a decode after them: the list), copies, and a positions list
    whose first row is changed in place (the first/last guard: the list itself priced)."""
    from kvpool.engine.runner import ScheduledChunk

    rng = random.Random(seed)
    fast, twin = _cost_executor(True, split=True), _cost_executor(False)
    seen: list[type] = []  # the type of the positions each step's pricing got
    decode, split = fast.decode_step_time, fast.split_step_time
    fast.decode_step_time = lambda positions, moved: (seen.append(type(positions)), decode(positions, moved))[1]
    fast.split_step_time = lambda positions, rest, moved: (seen.append(type(positions)), split(positions, rest, moved))[
        1
    ]
    engine = _Engine(rng)
    num_carried = num_mixed = 0
    for kind in kinds:
        rest = []
        if kind == 1:  # a prompt's chunk after the decodes
            rest = [ScheduledChunk("p", [7] * 300, 2000, True)]
        elif kind == 7:  # a row that joined: its decode after the columns' rows
            rest = [ScheduledChunk("d", [7], 3000, True)]
        if kind == 2:  # the engine changed its list in place (it never does): the first/last guard sees it
            engine.starts[0] += 2
        chunks, ends = engine.step(rest)
        plain = [ScheduledChunk(i, [7], s, True) for i, s in zip(engine.ids, engine.starts, strict=True)] + rest
        # the positions list is the last common step's ends list (and not changed since)
        carried = fast.step_ends is not None and fast.step_ends[0] is engine.starts and kind != 2
        lead_at = fast.step_ends[1] if fast.step_ends is not None else None
        for ex, step in ((fast, chunks), (twin, plain)):
            if kind == 3:
                ex.copy_state(0, 1)
            if kind == 4:  # a state replayed before the step: a chunk of 40 tokens priced with it
                ex.replay([7] * 40, 100, [], 0, 0)
            ex.forward(step, None, False)
        num_seen = len(seen)
        assert fast.clock() == twin.clock() and fast.busy_s == twin.busy_s
        assert len(seen) == num_seen + 1  # (priced by the twins: step_time is never called)
        common = not rest and kind != 4
        if common:  # an array: the last common step's one on where the rows are its rows (not changed)
            assert seen[-1] is np.ndarray
            num_carried += carried
            assert (lead_at is not None and fast.step_ends[1] is lead_at) == carried  # moved on in place, or made
            # the sampler's word: these ends are the last step's, one on, where its array moved on
            assert (fast.carried_ends is not None) == carried
            if carried:
                assert fast.carried_ends == (engine.starts, ends)
            # the sampler's lengths: this step's ends list and its positions' int64s
            assert fast.step_ends[0] is ends and fast.step_ends[1].tolist() == engine.starts
        else:  # a mixed step: the leading decodes' array one on where no decode came after them
            assert (seen[-1] is np.ndarray) == (carried and kind != 7)
            num_mixed += carried and kind != 7
            assert fast.carried_ends is None and fast.step_ends is None
        if kind in (5, 6):
            engine.change(ends)
        else:
            engine.carry(ends)
    # two common steps of carried rows: the second moves the array on (a mixed step after one)
    if any(kinds[i : i + 2] == [0, 0] for i in range(len(kinds))):
        assert num_carried > 0
    if any(kinds[i : i + 2] in ([0, 1], [0, 4]) for i in range(len(kinds))):
        assert num_mixed > 0
