"""`StepBuffers.advance` on a changed batch (attention/backends/step_buffers.py) against its
naive twin, `update`: random steps of an engine-like batch (requests finish at any
position, join at the end with prompts chunked over steps, are preempted and readmitted,
sit a step out, roll back tokens, copy a shared tail at a step's start, change order) drive two buffers, one
advancing where the runner lets it (no copy-on-write this step) and one always rewritten by
`update`; after every step both hold the same rows, free rows, vectors and table rows, and
those rows are the tables'."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.attention.backends.step_buffers import LONG_BLOCKS, StepBuffers

BS = 4  # tokens a block
WIDTH = 12  # blocks a row: a request of 48 tokens finishes
CHANGED: list[int] = []  # each example's steps taken by advance on a changed batch


def _state(b: StepBuffers) -> tuple:
    """Everything a step leaves for the kernels and for the next step: rows held and free,
    the step's vectors, and each of its sequences' table row up to the blocks it covers."""
    v = b.view(b.num_seqs, b.num_tokens)
    rows = v.seq_rows.tolist()
    covered = [-(-end // BS) for end in v.ctx_lens.tolist()]
    return (
        dict(b._rows),
        list(b._free_rows),
        (b.num_seqs, b.num_tokens),
        rows,
        v.ctx_lens.tolist(),
        v.query_start.tolist(),
        v.slot_mapping.tolist(),
        v.positions.tolist(),
        [b.block_tables[r, :k].tolist() for r, k in zip(rows, covered, strict=True)],
    )


def _send_to_a_twin(b: StepBuffers) -> np.ndarray:
    """b's sends to the device, as a CUDA step buffers' make them (the changed table entries,
    `_send`), applied to a numpy twin of the device's tables instead: [rows, width] int32."""
    twin = b.block_tables.numpy().copy()

    def send(changed_idx, changed_val, num_tokens: int) -> None:
        twin.reshape(-1)[np.asarray(changed_idx, dtype=np.int64)] = np.asarray(changed_val, dtype=np.int64)

    b._on_cpu = False  # (every step sends its changes, as on a GPU)
    b._send = send
    return twin


@pytest.mark.parametrize("long_blocks, device", [(LONG_BLOCKS, False), (0, False), (LONG_BLOCKS, True), (0, True)])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_advance_of_changed_batches_equals_update_after_every_step(long_blocks, device, data):
    """(device: the entries each step sends to a CUDA device's tables, applied to a twin of
    them, give the host's rows: what a kernel reads there.)"""
    a, b = (
        StepBuffers(max_num_seqs=8, max_num_tokens=40, max_blocks_per_seq=WIDTH, block_size=BS, dummy_block=0)
        for _ in range(2)
    )
    a.long_blocks = long_blocks  # (0: every other request's slots from its row, in numpy)
    device_tables = _send_to_a_twin(a) if device else None
    running: list[str] = []  # the engine's order: arrival, joiners appended
    computed: dict[str, int] = {}  # request -> tokens computed
    prompt: dict[str, int] = {}  # request -> its prompt length while it prefills
    tables: dict[str, list[int]] = {}
    blocks = iter(range(1, 10**6))
    waiting: list[str] = []  # preempted requests, readmitted from scratch
    num = 0
    for step in range(data.draw(st.integers(10, 40), label="steps")):
        # between steps: requests finish or are preempted (forgotten), at any position
        for rid in list(running):
            event = data.draw(st.sampled_from(["stay"] * 6 + ["finish", "preempt"]), label=f"{rid}")
            if event != "stay" or computed[rid] >= WIDTH * BS - 8:
                running.remove(rid)
                del computed[rid], tables[rid]
                prompt.pop(rid, None)
                a.forget(rid)
                b.forget(rid)
                if event == "preempt":
                    waiting.append(rid)
        # joiners, appended: readmitted ones first, then new ones with prompts of 1-20 tokens
        for _ in range(data.draw(st.integers(0, 3), label="joiners")):
            if len(running) == 8:
                break
            rid = waiting.pop(0) if waiting else f"r{num}"
            num += 1
            running.append(rid)
            computed[rid], tables[rid] = 0, []
            prompt[rid] = data.draw(st.integers(1, 20), label="prompt")
        if not running:
            continue
        order = list(running)
        if data.draw(st.integers(0, 9), label="reorder") == 0:
            order = data.draw(st.permutations(order), label="order")
        if len(order) > 1 and data.draw(st.integers(0, 6), label="sit out") == 0:
            order.remove(data.draw(st.sampled_from(order), label="sits out"))  # not scheduled this step
        if data.draw(st.integers(0, 6), label="rollback") == 0:  # (a speculative step's rejected tokens)
            rid = data.draw(st.sampled_from(order), label="rolls back")
            back = min(computed[rid], data.draw(st.integers(1, 6), label="tokens back"))
            if rid not in prompt and back:
                computed[rid] -= back  # its blocks past the kept tokens freed; others appended later
                del tables[rid][-(-computed[rid] // BS) :]
        # a shared partial tail copied at this step's start (copy-on-write): no advance then
        cow = False
        if data.draw(st.integers(0, 6), label="cow") == 0:
            rid = data.draw(st.sampled_from(order), label="cow rid")
            if computed[rid] % BS:
                tables[rid][computed[rid] // BS] = next(blocks)
                cow = True
        # each a chunk of its prompt (1-8 tokens) or one decode token, within 40 tokens a step
        starts, ends, budget = [], [], 40
        for rid in list(order):
            left = prompt[rid] - computed[rid] if rid in prompt else 1
            q = min(left, data.draw(st.integers(1, 8), label="chunk") if rid in prompt else 1, budget)
            if q == 0:
                order.remove(rid)
                continue
            budget -= q
            starts.append(computed[rid])
            ends.append(computed[rid] + q)
        if not order:
            continue
        for rid, end in zip(order, ends, strict=True):
            while len(tables[rid]) * BS < end:
                tables[rid].append(next(blocks))
        ids = tuple(order)
        if cow or not a.advance(ids, starts, ends, lambda some: [tables[r] for r in some]):
            a.update(ids, starts, ends, [tables[r] for r in ids])
        b.update(ids, starts, ends, [tables[r] for r in ids])
        assert _state(a) == _state(b), step
        a.check_integrity({r: tables[r] for r in ids})
        for buffers in (a, b):  # (what a buffered plan takes for decodes without reading them: num_lead)
            lead = buffers.num_lead
            assert lead <= len(ids) and all(e - s == 1 for s, e in zip(starts[:lead], ends[:lead], strict=True))
        if device_tables is not None:
            rows = a.view(a.num_seqs, a.num_tokens).seq_rows.tolist()
            for rid, row, end in zip(ids, rows, ends, strict=True):
                assert device_tables[row, : -(-end // BS)].tolist() == tables[rid][: -(-end // BS)], (step, rid)
        elif a.num_tokens == a.num_seqs and data.draw(st.booleans(), label="pad"):
            a.pad(8)  # a graph's bucket: rows past the step become padding
            b.pad(8)
        a.clear()  # (the forward took the step)
        b.clear()
        for rid, end in zip(ids, ends, strict=True):
            computed[rid] = end
            if rid in prompt and end == prompt[rid]:
                del prompt[rid]
    assert a.num_table_writes <= b.num_table_writes
    CHANGED.append(a.num_advanced_changed)


def test_the_random_steps_took_the_changed_batch_path():
    """(after the property above, in file order: its examples did exercise the path)"""
    assert len(CHANGED) > 100 and sum(CHANGED) > 5 * len(CHANGED)


def test_a_changed_batch_moves_the_kept_rows_and_writes_only_the_joiners_rows():
    """A hand-drawn churn: four requests decode; the second finishes and a new one joins.
    The step is taken by `advance`: the kept rows keep their rows and move one token on
    (the third opens a block: its one new entry written), the joiner takes the freed row
    and its whole table row; nothing else of the tables is read or written."""
    b = StepBuffers(max_num_seqs=4, max_num_tokens=16, max_blocks_per_seq=4, block_size=4, dummy_block=0)
    tables = {"a": [10, 11], "b": [20], "c": [30, 31], "d": [40], "e": [50, 51]}
    b.update(("a", "b", "c", "d"), [5, 2, 6, 1], [6, 3, 8, 2], [tables[r] for r in "abcd"])
    assert b.seq_rows.tolist()[:4] == [0, 1, 2, 3]
    b.forget("b")
    tables["c"].append(32)  # c's next token (position 8) opens its third block
    writes = b.num_table_writes
    read: list[list[str]] = []

    def table_of(ids: list[str]) -> list[list[int]]:
        read.append(list(ids))
        return [tables[r] for r in ids]

    assert b.advance(("a", "c", "d", "e"), [6, 8, 2, 0], [7, 9, 3, 5], table_of)
    assert b.num_advanced_changed == 1 and read == [["e", "c"]]
    v = b.view(4, 8)
    assert v.seq_rows.tolist() == [0, 2, 3, 1]  # e takes b's row
    assert v.ctx_lens.tolist() == [7, 9, 3, 5]
    assert v.query_start.tolist() == [0, 1, 2, 3, 8]
    assert v.positions.tolist() == [6, 8, 2, 0, 1, 2, 3, 4]
    assert v.slot_mapping.tolist() == [11 * 4 + 2, 32 * 4, 40 * 4 + 2, 200, 201, 202, 203, 51 * 4]
    assert b.num_table_writes - writes == 1 + 2  # c's third entry, e's two
    assert b.block_tables[1, :2].tolist() == [50, 51] and b.block_tables[2, :3].tolist() == [30, 31, 32]
    b.check_integrity(tables)


@pytest.mark.parametrize("long_blocks", [LONG_BLOCKS, 0])
def test_a_changed_batch_past_max_num_tokens_and_one_block_wider_than_a_step(long_blocks):
    """Positions, flat-table indices and a block's offsets are not bounded by a step's
    tokens: a step of at most 4 tokens in blocks of 8, a kept request at position 21, a
    joining one whose prompt chunk [16, 19) follows a cached prefix (its first two blocks)."""
    b = StepBuffers(max_num_seqs=2, max_num_tokens=4, max_blocks_per_seq=4, block_size=8, dummy_block=0)
    b.long_blocks = long_blocks
    tables = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9]}
    b.update(("a", "b"), [20, 20], [21, 21], [tables["a"], tables["b"]])
    b.forget("b")
    assert b.advance(("a", "c"), [21, 16], [22, 19], lambda ids: [tables[r] for r in ids])
    assert b.num_advanced_changed == 1
    v = b.view(2, 4)
    assert v.seq_rows.tolist() == [0, 1] and v.ctx_lens.tolist() == [22, 19]
    assert v.query_start.tolist() == [0, 1, 4]
    assert v.positions.tolist() == [21, 16, 17, 18]
    assert v.slot_mapping.tolist() == [3 * 8 + 5, 9 * 8, 9 * 8 + 1, 9 * 8 + 2]
    assert b.block_tables[1, :3].tolist() == [7, 8, 9]  # c's whole row: it joined
    b.check_integrity(tables)
