"""The persistent step buffers (attention/backends/step_buffers.py): hand-drawn steps, and
every step of engines that fork (copy-on-write tails), hit the prefix cache and preempt,
checked against the cache's own step tables (the CSR and slots the backends plan from)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kvpool.attention.backends.step_buffers import StepBuffers
from kvpool.engine.engine import Engine
from kvpool.engine.llama_runner import llama_runner
from kvpool.engine.sampling import SamplingParams
from random_llama import DESCRIPTOR, random_ids, random_llama


def test_a_prefill_then_decodes_write_only_the_entries_that_change():
    b = StepBuffers(max_num_seqs=4, max_num_tokens=16, max_blocks_per_seq=4, block_size=4, dummy_block=9)
    # "a": 6 prompt tokens in blocks [5, 2]; "b": 3 tokens in block [7]
    v = b.update(["a", "b"], [0, 0], [6, 3], [[5, 2], [7]])
    assert (v.num_seqs, v.num_tokens, v.max_query_len) == (2, 9, 6)
    assert v.seq_rows.tolist() == [0, 1] and v.ctx_lens.tolist() == [6, 3]
    assert v.query_start.tolist() == [0, 6, 9]
    # slot = block * 4 + offset: positions 0..5 of [5, 2], then 0..2 of [7]
    assert v.slot_mapping.tolist() == [20, 21, 22, 23, 8, 9, 28, 29, 30]
    assert v.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert b.block_tables[0, :2].tolist() == [5, 2] and b.block_tables[1, :1].tolist() == [7]
    assert b.num_table_writes == 3
    # decodes in the other order: each keeps its row; "b" crosses into a new block 4
    v = b.update(["b", "a"], [3, 6], [4, 7], [[7], [5, 2]])
    assert v.seq_rows.tolist() == [1, 0] and v.slot_mapping.tolist() == [31, 10]
    assert b.num_table_writes == 5  # one entry each: the block each step writes in
    v = b.update(["b"], [4], [5], [[7, 4]])
    assert v.slot_mapping.tolist() == [16] and b.block_tables[1, :2].tolist() == [7, 4]
    assert b.num_table_writes == 6
    # "a" is preempted and readmitted on other blocks: a whole row again, row 0 reused
    b.forget("a")
    v = b.update(["a"], [4], [7], [[3, 6]])
    assert v.seq_rows.tolist() == [0] and b.block_tables[0, :2].tolist() == [3, 6]
    assert v.slot_mapping.tolist() == [24, 25, 26]
    assert b.num_table_writes == 8
    b.check_integrity({"a": [3, 6], "b": [7, 4]})
    # padded to a bucket of 4 decodes: the padding writes and reads only the dummy block's slot 0
    b.update(["a", "b"], [7, 5], [8, 6], [[3, 6], [7, 4]])
    p = b.pad(4)
    assert p.seq_rows.tolist() == [0, 1, 4, 4] and p.ctx_lens.tolist() == [8, 6, 1, 1]
    assert p.query_start.tolist() == [0, 1, 2, 3, 4]
    assert p.slot_mapping.tolist() == [27, 17, 36, 36] and p.positions.tolist() == [7, 5, 0, 0]
    assert b.block_tables[4].tolist() == [9, 9, 9, 9]
    b.check_integrity({"a": [3, 6], "b": [7, 4]})


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda b: b.update(["a", "b", "c"], [0] * 3, [1] * 3, [[0]] * 3), "3 sequences, more than max_num_seqs 2"),
        (lambda b: b.update(["a"], [0], [13], [[0, 1, 2, 3]]), "needs 4 blocks, more than max_blocks_per_seq 3"),
        (lambda b: b.update(["a"], [0], [9], [[0, 1]]), r"positions \[0, 9\) are not a step its 2 blocks"),
        (lambda b: b.update(["a"], [2], [2], [[0]]), r"positions \[2, 2\)"),
        (lambda b: b.update(["a", "b"], [0, 0], [5, 4], [[0, 1], [2]]), "more than max_num_tokens 8"),
        (lambda b: b.pad(2), "no dummy block"),
    ],
)
def test_a_step_the_buffers_cannot_hold_is_refused_naming_it(call, match):
    with pytest.raises(ValueError, match=match):
        call(StepBuffers(max_num_seqs=2, max_num_tokens=8, max_blocks_per_seq=3, block_size=4))


def test_rows_run_out_only_while_every_row_is_held():
    b = StepBuffers(max_num_seqs=2, max_num_tokens=8, max_blocks_per_seq=2, block_size=4)
    b.update(["a", "b"], [0, 0], [1, 1], [[0], [1]])
    with pytest.raises(ValueError, match="no free row for 'c'"):
        b.update(["c"], [0], [1], [[2]])
    b.forget("a")
    assert b.update(["c"], [0], [1], [[2]]).seq_rows.tolist() == [0]
    b.check_integrity()


def snapshot(b: StepBuffers) -> tuple:
    """Everything a step can change in the buffers: every tensor's values, the rows held and
    free, the step's counts, what `advance` continues, the counters."""
    tensors = (b.block_tables, b.seq_rows, b.ctx_lens, b.query_start, b.slot_mapping, b.positions)
    return (
        [t.clone() for t in tensors],
        dict(b._rows),
        list(b._free_rows),
        (b.num_seqs, b.num_tokens, b._last, b._last_num_tokens, b.num_table_writes, b.num_advanced),
    )


def assert_same_snapshot(a: tuple, b: tuple) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True)) and a[1:] == b[1:]


@pytest.mark.parametrize(
    "ids, starts, ends, tables, match",
    [
        # a new request "c" (a row free for it) before a request whose table is too short
        (["a", "c", "b"], [1, 0, 1], [2, 3, 9], [[0], [4], [1]], r"'b' positions \[1, 9\) are not a step"),
        # two new requests, one row free: the second is refused, the first must take none
        (["c", "d"], [0, 0], [1, 1], [[4], [5]], "no free row for 'd'"),
        # a new request, then the step's tokens run past max_num_tokens
        (["c", "a"], [0, 1], [3, 7], [[4], [0, 2]], "more than max_num_tokens 8"),
    ],
)
def test_a_refused_step_leaves_the_buffers_exactly_as_they_were(ids, starts, ends, tables, match):
    """`update` checks the whole step before it writes anything: the rows, tables and vectors
    of a refused step are those of the step before it (a request refused after another was
    given a row used to keep that row)."""
    b = StepBuffers(max_num_seqs=3, max_num_tokens=8, max_blocks_per_seq=3, block_size=4, dummy_block=9)
    b.update(["a", "b"], [0, 0], [1, 1], [[0], [1]])
    before = snapshot(b)
    with pytest.raises(ValueError, match=match):
        b.update(ids, starts, ends, tables)
    assert_same_snapshot(before, snapshot(b))
    b.check_integrity({"a": [0], "b": [1]})
    # and the step after it is the one it would have been
    assert b.update(["c", "a"], [0, 1], [1, 2], [[4], [0]]).seq_rows.tolist() == [2, 0]


def _host_state(b: StepBuffers, tables: dict[str, list[int]]) -> tuple:
    """What a kernel reads of the last step: its vectors, and each of its requests' row up to
    the blocks its context covers."""
    v = b.view(b.num_seqs, b.num_tokens)
    rows = v.seq_rows.tolist()
    rids = {row: rid for rid, row in b._rows.items()}
    covered = [-(-end // b.block_size) for end in v.ctx_lens.tolist()]
    return (
        [rids[r] for r in rows],
        v.ctx_lens.tolist(),
        v.query_start.tolist(),
        v.slot_mapping.tolist(),
        v.positions.tolist(),
        [b.block_tables[r, :k].tolist() for r, k in zip(rows, covered, strict=True)],
        [tables[rids[r]][:k] for r, k in zip(rows, covered, strict=True)],
    )


def test_advance_writes_what_update_writes_step_by_step():
    """Random decode runs over two buffers, one advancing in place where it can, the other
    always rewritten by `update`: after every step both hold the same vectors and rows, and
    those rows are the tables'. Requests open blocks (block size 4), join, leave, reorder,
    take a prefill chunk, and have a tail block replaced (copy-on-write: no advance then)."""
    rng = random.Random(3)
    a, b = (StepBuffers(max_num_seqs=6, max_num_tokens=32, max_blocks_per_seq=12, block_size=4) for _ in range(2))
    tables: dict[str, list[int]] = {}
    ends: dict[str, int] = {}
    next_block = [100]

    def block() -> int:
        next_block[0] += 1
        return next_block[0]

    def admit(rid: str) -> None:
        ends[rid] = 0
        tables[rid] = []

    for rid in "abcd":
        admit(rid)
    advanced = 0
    for step in range(300):
        cow = False
        event = rng.random()
        if event < 0.04 and len(ends) > 1:  # one leaves
            gone = rng.choice(sorted(ends))
            del ends[gone], tables[gone]
            a.forget(gone)
            b.forget(gone)
        elif event < 0.08 and len(ends) < 6:
            admit(f"r{step}")
        elif event < 0.11:  # a shared tail block is copied before this step writes it
            rid = rng.choice(sorted(ends))
            if ends[rid] % 4:
                tables[rid][ends[rid] // 4] = block()
                cow = True
        order = sorted(ends)
        if event > 0.97:
            rng.shuffle(order)
        # a new request prefills 1-5 tokens; a running one decodes one (a chunk of 2 at times)
        q = {rid: (rng.randint(1, 5) if ends[rid] == 0 else 2 if event > 0.99 else 1) for rid in order}
        starts = [ends[rid] for rid in order]
        new_ends = [ends[rid] + q[rid] for rid in order]
        for rid, end in zip(order, new_ends, strict=True):
            while len(tables[rid]) * 4 < end:
                tables[rid].append(block())
            ends[rid] = end
        rows = [tables[rid] for rid in order]
        ids = tuple(order)
        if not cow and a.advance(ids, starts, new_ends, lambda some: [tables[r] for r in some]):
            advanced += 1
        else:
            a.update(ids, starts, new_ends, rows)
        b.update(ids, starts, new_ends, rows)
        assert _host_state(a, tables) == _host_state(b, tables), step
        got = _host_state(a, tables)
        assert got[5] == got[6], step  # the rows are the tables'
        a.check_integrity({rid: tables[rid] for rid in order})
        for rid in order:  # a request of 40 tokens finishes (12 blocks of 4 a row)
            if ends[rid] >= 40:
                del ends[rid], tables[rid]
                a.forget(rid)
                b.forget(rid)
        if not ends:
            admit(f"s{step}")
    assert advanced == a.num_advanced + a.num_advanced_changed and a.num_advanced > 150 and a.num_advanced_changed > 0
    assert a.num_table_writes < b.num_table_writes


def test_update_of_churning_steps_equals_a_naive_plan_of_each_step():
    """Random steps of a batch that churns: requests join with prompts of several blocks
    (chunked over steps at times), decode, leave, copy a shared tail, change order. After
    every `update`, the step's vectors equal a naive plan made from the tables alone (token
    by token: position, slot = table[position // 4] * 4 + position % 4), and the entries it
    wrote are exactly the ones the step can have changed: a joining request's whole row, a
    running one's [start // 4, ceil(end / 4))."""
    rng = random.Random(7)
    b = StepBuffers(max_num_seqs=6, max_num_tokens=64, max_blocks_per_seq=16, block_size=4, dummy_block=0)
    ends: dict[str, int] = {}  # request -> computed tokens
    prompts: dict[str, int] = {}  # request -> prompt length, while it is being prefilled
    tables: dict[str, list[int]] = {}
    held: set[str] = set()  # requests the buffers have seen since they last joined
    next_block = iter(range(1, 10**6))
    for step in range(400):
        event = rng.random()
        if event < 0.15 and ends:  # one leaves
            gone = rng.choice(sorted(ends))
            del ends[gone], tables[gone]
            prompts.pop(gone, None)
            held.discard(gone)
            b.forget(gone)
        if len(ends) < 6 and (event > 0.7 or not ends):  # one joins, its prompt 1-30 tokens
            rid = f"r{step}"
            ends[rid], prompts[rid], tables[rid] = 0, rng.randint(1, 30), []
        if event < 0.2:  # a shared tail block copied before this step writes it
            rid = rng.choice(sorted(ends))
            if ends[rid] % 4:
                tables[rid][ends[rid] // 4] = next(next_block)
        order = sorted(ends)
        rng.shuffle(order)
        # a prompt in chunks of up to 12 tokens; a running request decodes one
        q = [min(prompts[r] - ends[r], rng.randint(1, 12)) if r in prompts else 1 for r in order]
        starts = [ends[r] for r in order]
        new_ends = [e + k for e, k in zip(starts, q, strict=True)]
        for rid, end in zip(order, new_ends, strict=True):
            while len(tables[rid]) * 4 < end:
                tables[rid].append(next(next_block))
        # the entries the step may have changed, each counted once
        want_writes = sum(
            -(-e // 4) - (s // 4 if r in held else 0) for r, s, e in zip(order, starts, new_ends, strict=True)
        )
        writes = b.num_table_writes
        v = b.update(order, starts, new_ends, [tables[r] for r in order])
        assert b.num_table_writes - writes == want_writes, step
        positions = [p for s, e in zip(starts, new_ends, strict=True) for p in range(s, e)]
        owners = [r for r, s, e in zip(order, starts, new_ends, strict=True) for _ in range(s, e)]
        assert v.positions.tolist() == positions, step
        slots = [tables[r][p // 4] * 4 + p % 4 for r, p in zip(owners, positions, strict=True)]
        assert v.slot_mapping.tolist() == slots, step
        assert v.ctx_lens.tolist() == new_ends and v.query_start.tolist() == [0, *itertools.accumulate(q)], step
        assert (v.num_seqs, v.num_tokens, v.max_query_len) == (len(order), len(positions), max(q)), step
        b.check_integrity({r: tables[r] for r in order})
        for rid, end in zip(order, new_ends, strict=True):
            ends[rid] = end
            held.add(rid)
            if rid in prompts and end == prompts[rid]:
                del prompts[rid]
            elif end >= 48:  # a request of 48 tokens finishes (12 blocks of the row's 16)
                del ends[rid], tables[rid]
                held.discard(rid)
                b.forget(rid)


def test_advance_refuses_after_padding_overwrote_the_last_step():
    b = StepBuffers(max_num_seqs=4, max_num_tokens=8, max_blocks_per_seq=2, block_size=4, dummy_block=9)
    tables = {"a": [3], "b": [5]}
    b.update(("a", "b"), [0, 0], [1, 1], [tables["a"], tables["b"]])
    b.update(("a", "b"), [1, 1], [2, 2], [tables["a"], tables["b"]])  # a decode: `advance` may follow
    b.clear()
    b.pad(4)  # (a capture pads from an empty step: rows [0, 4) become padding)
    assert not b.advance(("a", "b"), [2, 2], [3, 3], lambda ids: [tables[r] for r in ids])
    assert b.num_advanced == 0
    b.update(("a", "b"), [2, 2], [3, 3], [tables["a"], tables["b"]])
    assert b.advance(("a", "b"), [3, 3], [4, 4], lambda ids: [tables[r] for r in ids])
    assert b.view(2, 2).slot_mapping.tolist() == [3 * 4 + 3, 5 * 4 + 3]


def _checked_engine(num_blocks: int, block_size: int, max_num_seqs: int, **kw) -> tuple[Engine, list[int]]:
    """An engine whose runner fills step buffers; every step's buffers are compared with the
    cache's step tables (CSR and slots) before the forward. Returns it and a step counter."""
    runner = llama_runner(random_llama("cpu", torch.float32), num_blocks, block_size, DESCRIPTOR, **kw)
    # (rows to spare: a request's forks count against max_num_seqs now)
    runner.step_buffers = buffers = StepBuffers(4 * max_num_seqs, 256, num_blocks, block_size)
    forward = runner.executor.forward
    checked = [0]

    def checked_forward(chunks, cache, all_logits=False):
        ids = [c.request_id for c in chunks]
        starts = [c.start for c in chunks]
        ends = [c.start + len(c.token_ids) for c in chunks]
        want = cache.step_tables(ids, starts, ends)
        v = buffers.view(len(chunks), sum(len(c.token_ids) for c in chunks))
        assert v.slot_mapping.tolist() == want.slots
        assert v.ctx_lens.tolist() == ends
        assert v.positions.tolist() == [p for s, e in zip(starts, ends, strict=True) for p in range(s, e)]
        indptr, indices = want.csr.indptr, want.csr.indices
        for i, row in enumerate(v.seq_rows.tolist()):
            assert v.block_tables[row, : indptr[i + 1] - indptr[i]].tolist() == indices[indptr[i] : indptr[i + 1]]
        buffers.check_integrity({r: cache.block_ids(r) for r in ids})
        checked[0] += 1
        return forward(chunks, cache, all_logits)

    runner.executor.forward = checked_forward
    return Engine(runner, max_num_batched_tokens=64, max_num_seqs=max_num_seqs), checked


def test_every_step_of_forks_and_prefix_hits_equals_the_caches_tables():
    # 7: the second batch's sequences (1 + 3 + 3 samples) all run, every child forked (a child
    # past the cap would wait and be admitted through the prefix cache: more hit tokens)
    e, checked = _checked_engine(num_blocks=64, block_size=4, max_num_seqs=7)
    shared = random_ids(10, seed=1)
    # n = 3 samples share the prompt's partial tail block: each first write copies it
    params = SamplingParams(max_tokens=7, ignore_eos=True, temperature=30.0, n=3, seed=4)
    # the first request alone, then three that hit its prompt's full blocks
    for batch in ([0], [1, 2, 3]):
        for i in batch:
            prompt = shared + random_ids(3 + 2 * i, seed=10 + i)
            e.add_request(prompt, params if i % 2 else SamplingParams(max_tokens=9))
        while e.has_unfinished():
            e.step()
            e.runner.check_integrity()
    assert e.runner.cache.stats.num_hit_tokens == 3 * 8
    assert checked[0] == e.num_steps > 10
    assert e.runner.step_buffers.num_advanced > 0  # (decodes one token on, taken in place)


def test_every_step_of_preempted_and_readmitted_requests_equals_the_caches_tables():
    # 10 blocks of 4 = 40 slots for four sequences of ~20 tokens each: preemption is forced
    e, checked = _checked_engine(num_blocks=10, block_size=4, max_num_seqs=4)
    for i in range(4):
        e.add_request(random_ids(9 + i, seed=i), SamplingParams(max_tokens=10, ignore_eos=True))
    while e.has_unfinished():
        e.step()
        e.runner.check_integrity()
    assert e.num_preemptions > 0
    assert checked[0] == e.num_steps


def test_plan_tables_are_views_of_one_area_made_once_a_shape():
    """A step plan's tables (`plan_tables`): the values end to end, each table padded to a
    multiple of TABLE_ALIGN entries, split by the parts' lengths into views of the
    persistent plan area that each start 16-byte aligned, the same views for the same
    lengths (holding the last call's values), other views for other lengths; a call whose
    values do not fill its padded lengths is named."""
    b = StepBuffers(max_num_seqs=4, max_num_tokens=8, max_blocks_per_seq=3, block_size=4)
    first = b.plan_tables([1, 2, 0, 0, 3, 4, 5, 0], (2, 0, 3))
    assert [t.tolist() for t in first] == [[1, 2], [], [3, 4, 5]]
    assert all(t.dtype == torch.int32 for t in first)
    assert [t.storage_offset() for t in first] == [0, 4, 4]
    again = b.plan_tables([9, 8, 0, 0, 7, 6, 5, 0], (2, 0, 3))
    assert [id(t) for t in again] == [id(t) for t in first]
    assert [t.tolist() for t in first] == [[9, 8], [], [7, 6, 5]]
    other = b.plan_tables([1, 2, 3, 0, 4, 5, 0, 0], (3, 2))
    assert [t.tolist() for t in other] == [[1, 2, 3], [4, 5]]
    assert [t.storage_offset() for t in other] == [0, 4]
    with pytest.raises(
        ValueError, match=r"5 values for tables of \[2, 2\], each padded to a multiple of 4 \(the plan area holds 69\)"
    ):
        b.plan_tables([1, 2, 3, 4, 5], (2, 2))
    with pytest.raises(ValueError, match=r"72 values for tables of \[72\]"):
        b.plan_tables([0] * 72, (72,))


def test_leading_views_are_the_vectors_first_entries_made_once_a_length():
    b = StepBuffers(max_num_seqs=4, max_num_tokens=8, max_blocks_per_seq=3, block_size=4)
    b.update(["a", "b"], [0, 5], [3, 6], [[7], [8, 9]])  # slots 28, 29, 30 then 37; positions 0, 1, 2, 5
    slots, positions = b.leading_slots(4), b.leading_positions(4)
    assert slots.tolist() == [28, 29, 30, 37] and positions.tolist() == [0, 1, 2, 5]
    assert b.leading_slots(4) is slots and b.leading_positions(4) is positions
    b.update(["a"], [3], [4], [[7]])  # the same views hold the next step's values
    assert b.leading_slots(1).tolist() == [31] and b.leading_positions(1).tolist() == [3]
    assert slots.tolist()[0] == 31 and positions.tolist()[0] == 3


def test_every_step_after_a_commit_fault_equals_the_caches_tables():
    # A commit that raises (before the cache commits, or after) releases the step's
    # sequences to be recomputed; the buffers are not cleared as a whole (`may_reserve_again`
    # is not called on this path): each released request's row goes with `release()`'s
    # `forget`. Every later step's buffers must still equal the cache's step tables, and a
    # fresh StepBuffers given the same step (`update`) must read the same slots, lengths and
    # table entries; the run's tokens equal a run without the fault.
    prompts = [random_ids(5 + 3 * i, seed=20 + i) for i in range(3)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def run(fault_step: int | None, where: str = "") -> tuple[list[list[int]], int]:
        e, checked = _checked_engine(num_blocks=32, block_size=4, max_num_seqs=4)
        buffers, forward = e.runner.step_buffers, e.runner.executor.forward

        def also_fresh(chunks, cache, all_logits=False):
            ids = [c.request_id for c in chunks]
            starts = [c.start for c in chunks]
            ends = [c.start + len(c.token_ids) for c in chunks]
            num_tokens = sum(ends) - sum(starts)
            fresh = StepBuffers(buffers.max_num_seqs, 256, 32, 4)
            fresh.update(ids, starts, ends, [cache.block_ids(r) for r in ids])
            got, want = buffers.view(len(ids), num_tokens), fresh.view(len(ids), num_tokens)
            for name in ("slot_mapping", "ctx_lens", "positions", "query_start"):
                assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
            for i in range(len(ids)):
                num_blocks = -(-ends[i] // 4)
                row, fresh_row = int(got.seq_rows[i]), int(want.seq_rows[i])
                assert got.block_tables[row, :num_blocks].tolist() == want.block_tables[fresh_row, :num_blocks].tolist()
            return forward(chunks, cache, all_logits)

        e.runner.executor.forward = also_fresh
        ids = [e.add_request(p, params) for p in prompts]
        commit = e.runner.commit_step
        step_no = 0
        while e.has_unfinished():
            step_no += 1
            if step_no == fault_step:

                def faulty(*args):
                    if where == "committed":
                        commit(*args)
                    raise RuntimeError("injected commit fault")

                e.runner.commit_step = faulty
                with pytest.raises(RuntimeError, match="injected commit fault"):
                    e.step()
                del e.runner.commit_step
            else:
                e.step()
            e.runner.check_integrity()
        assert checked[0] == step_no
        return [e.output(r).completions[0].token_ids for r in ids], e.stats.num_fault_recomputes

    twin, _ = run(None)
    # the prompts' prefill, a decode advanced in place, the one after it (a decode again, or a
    # recompute behind a decode): the commit raising before the cache commits, and after
    for where, fault_step in itertools.product(("commit", "committed"), (1, 3, 4)):
        outputs, num_recomputes = run(fault_step, where)
        assert outputs == twin and num_recomputes > 0, (where, fault_step)


def test_the_host_contexts_are_the_held_steps_ends_through_update_and_advance():
    # `host_ctx_lens` is what the Llama executor plans a held columns' step from (in place of
    # the runner's ends): after update, an in-place advance and a changed batch's advance it
    # must read each sequence's end, in the step's order
    b = StepBuffers(max_num_seqs=4, max_num_tokens=16, max_blocks_per_seq=4, block_size=4, dummy_block=9)
    tables = {"a": [5, 2], "b": [7, 4], "c": [3]}
    b.update(["a", "b"], [0, 0], [6, 3], [tables["a"], tables["b"][:1]])
    assert b.host_ctx_lens(2).tolist() == [6, 3]
    b.clear()
    assert b.advance(["a", "b"], [6, 3], [7, 4], lambda ids: [tables[i] for i in ids])  # (after a prefill)
    assert b.host_ctx_lens(2).tolist() == [7, 4]
    b.clear()
    assert b.advance(["a", "b"], [7, 4], [8, 5], lambda ids: [tables[i] for i in ids])
    assert b.host_ctx_lens(2).tolist() == [8, 5] and b.num_advanced == 1  # (in place)
    b.clear()
    changed = b.num_advanced_changed
    b.forget("a")  # "a" leaves, "c" joins with a 3-token prompt: a changed batch moved on
    assert b.advance(["b", "c"], [5, 0], [6, 3], lambda ids: [tables[i] for i in ids])
    assert b.num_advanced_changed == changed + 1
    assert b.host_ctx_lens(2).tolist() == [6, 3] and b.host_ctx_lens(1).tolist() == [6]
    b.check_integrity({"b": [7, 4], "c": [3]})
