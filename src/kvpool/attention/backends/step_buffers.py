"""A step's metadata in persistent int32 buffers, allocated once and updated in place.

A GPU backend (and a CUDA graph, engine/cuda_graph.py) reads a step's block tables, slots
and lengths from tensors whose addresses never change. `StepBuffers` keeps them, sized once
for `max_num_seqs` sequences of up to `max_blocks_per_seq` blocks and `max_num_tokens`
tokens a step, on the runner's device:

  block_tables [max_num_seqs + 1, max_blocks_per_seq] int32: one row per running request,
      kept while it runs (a request keeps its row from step to step); the last row is the
      padding row, whose block 0 is the reserved dummy block (`dummy_block`).
  seq_rows     [max_num_seqs] int32: the step's i-th sequence's row of block_tables.
  ctx_lens     [max_num_seqs] int32: its context after the step (cached + new tokens).
  query_start  [max_num_seqs + 1] int32: its new tokens are [query_start[i], query_start[i+1])
      of the step's flat tokens.
  slot_mapping [max_num_tokens] int32: the flat token j's slot, block * block_size + offset.
  positions    [max_num_tokens] int64: the flat token j's position in its sequence.

Incremental: a table row is written only where it can have changed since the request's
last step. The cache changes a running request's table in two ways only (cache/window.py):
it appends blocks, and a copy-on-write replaces the entry of the block a step starts in
(position `start`, a shared partial tail). So a step over positions [start, end) rewrites
the row's entries [start // block_size, ceil(end / block_size)) (one entry for a decode),
and a request the buffers have not seen (new, or readmitted after `forget`) its whole row.
A released request must be forgotten (`forget`): a readmission gets other blocks.
The common step goes further (`advance`): the last decode step's requests, in the same
order, one token on, with no copy-on-write in between (the runner knows: the cache hands it
the step's copies). Rows and query_start then stand, lengths, positions and slots move by
one in place, and only the requests whose token opens a block (one step in block_size) have
their table read and their new entry written.

On CUDA the host keeps a pinned twin of every buffer; a step sends the changed table
entries (flat index, block id) and the per-step vectors with one copy each, and scatters
the entries on the device. On the CPU the host buffers are the device buffers.
"""

from __future__ import annotations

import operator
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate, chain, compress, count
from typing import NamedTuple

import numpy as np
import torch

# a changed batch's other request (joining, a chunk) whose step writes more table entries
# than this is long to `advance`: its entries written as a slice and its slots from its row
# in numpy passes; a short one's are listed in C-level list passes (a pass an entry or a
# block), which for a few blocks is cheaper than update's ~12 numpy passes
LONG_BLOCKS = 8


# Every int32 table a Triton plan hands its kernel starts on a 16-byte boundary (a multiple of
# TABLE_ALIGN entries into its buffer): Triton specializes a pointer argument on whether it
# is 16-byte aligned and compiles the kernel again for each new pattern, so tables cut from
# one buffer at the step's own offsets would compile mid-serving (8 patterns in 300 random
# steps); padded, every plan meets one. The padding entries are zeros nothing reads.
TABLE_ALIGN = 4


def _aligned(n: int) -> int:
    """n table entries rounded up to a multiple of TABLE_ALIGN."""
    return -(-n // TABLE_ALIGN) * TABLE_ALIGN


# the zeros after a table of n entries to the next multiple of TABLE_ALIGN, by n % TABLE_ALIGN
# (a plan lists its tables with them in one list display: no call a table)
_PADS = tuple([0] * (-r % TABLE_ALIGN) for r in range(TABLE_ALIGN))


def split_aligned(packed: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """The tables of sizes[k] entries each that `packed` holds, each padded to a multiple of
    TABLE_ALIGN (`_PADS`): views of it, each starting on a 16-byte boundary of its buffer."""
    return [t[:n] for t, n in zip(packed.split_with_sizes([_aligned(n) for n in sizes]), sizes, strict=True)]


def _leading_view(views: dict[int, torch.Tensor], tensor: torch.Tensor, n: int) -> torch.Tensor:
    """tensor[:n], a view made once an n and kept in `views`, at most 4,096 lengths kept. (A
    tensor view on the host: `python -m timeit -s "import torch; t = torch.zeros(4096,
    dtype=torch.int64); a = t.numpy()" "t[:100]"` 1.8 us, a numpy view "a[:100]" 0.16 us;
    2026-12-06, 2 shared Xeon cores, load ~10.)"""
    view = views.get(n)
    if view is None:
        if len(views) >= 4096:  # (a bound on lengths kept)
            views.clear()
        view = views[n] = tensor[:n]
    return view


class StepView(NamedTuple):
    """One step's slices of the persistent buffers (device tensors, views: no copies).
    num_seqs sequences, num_tokens flat tokens; the tensors as `StepBuffers` describes,
    cut to the step: seq_rows / ctx_lens [num_seqs], query_start [num_seqs + 1],
    slot_mapping / positions [num_tokens], block_tables whole (rows by seq_rows).
    The slices are cut when read: `update` and `pad` return a view every step, and the
    engine's decode step reads none of it (a tensor slice's cost: `_leading_view`)."""

    num_seqs: int
    num_tokens: int
    max_query_len: int
    buffers: StepBuffers

    @property
    def block_tables(self) -> torch.Tensor:
        return self.buffers.block_tables

    @property
    def seq_rows(self) -> torch.Tensor:
        return self.buffers.seq_rows[: self.num_seqs]

    @property
    def ctx_lens(self) -> torch.Tensor:
        return self.buffers.ctx_lens[: self.num_seqs]

    @property
    def query_start(self) -> torch.Tensor:
        return self.buffers.query_start[: self.num_seqs + 1]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.buffers.slot_mapping[: self.num_tokens]

    @property
    def positions(self) -> torch.Tensor:
        return self.buffers.positions[: self.num_tokens]


class StepBuffers:
    """The persistent step metadata (the module docstring draws the tensors).

    dummy_block: a block outside every request's table that padded rows of a captured
    graph write to and read from (None: no padding, `pad` refuses)."""

    @staticmethod
    def num_bytes(max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int, on_cpu: bool) -> tuple[int, int]:
        """(host bytes, device bytes) of the buffers `__init__` allocates for these sizes (on
        the CPU the host buffers are the device's: no device bytes), for a check before the
        allocation (engine/memory.py check_fits)."""
        s, t, tables = max_num_seqs, max_num_tokens, (max_num_seqs + 1) * max_blocks_per_seq
        # vec, pos, tables, plan (each on the device too, off the CPU), and the changes' host list
        shared = 4 * (3 * s + 1 + t) + 8 * t + 4 * tables + 4 * (7 * s + 1 + 2 * t + 24)
        return (shared, 0) if on_cpu else (shared + 2 * 8 * tables, shared)

    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        dummy_block: int | None = None,
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_tokens", max_num_tokens),
            ("max_blocks_per_seq", max_blocks_per_seq),
            ("block_size", block_size),
        ):
            if value <= 0:
                raise ValueError(f"StepBuffers: {name} must be positive, got {value}")
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens
        self.max_blocks_per_seq, self.block_size = max_blocks_per_seq, block_size
        self.device = torch.device(device)
        self.dummy_block = dummy_block
        on_cpu = self.device.type == "cpu"
        pin = not on_cpu and torch.cuda.is_available()

        def host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        s, t = max_num_seqs, max_num_tokens
        # the per-step vectors, packed in one host buffer so that one copy sends them:
        # [seq_rows s | ctx_lens s | query_start s + 1 | slot_mapping t] int32
        self._vec_host = host((3 * s + 1 + t,), torch.int32)
        self._pos_host = host((t,), torch.int64)
        self._tables_host = host((s + 1, max_blocks_per_seq), torch.int32)
        # a step plan's own int32 tables, packed end to end (`plan_tables`): a plan of P <= s
        # sequences and T <= t + s query tiles lists at most 5P + 1 + 2T values, and each of
        # its eight tables at most 3 zeros of padding (TABLE_ALIGN)
        self._plan_host = host((7 * s + 1 + 2 * t + 24,), torch.int32)
        if on_cpu:
            self._vec, self._pos, self.block_tables = self._vec_host, self._pos_host, self._tables_host
            self._plan = self._plan_host
        else:
            self._vec = torch.zeros_like(self._vec_host, device=self.device)
            self._pos = torch.zeros_like(self._pos_host, device=self.device)
            self.block_tables = torch.zeros_like(self._tables_host, device=self.device)
            self._plan = torch.zeros_like(self._plan_host, device=self.device)
            # the changed table entries of a step: [0] flat index, [1] block id
            self._changes_host = host((2, (s + 1) * max_blocks_per_seq), torch.int64)
        self._plan_np = self._plan_host.numpy()
        # the plan area's views by the parts' lengths (a tensor view's cost: `_leading_view`;
        # a plan takes eight): a step's few prompt chunks repeat a handful of shapes.
        # Each: the padded count of values, the views, the area's leading device and host slices
        self._plan_views: dict[tuple[int, ...], tuple[int, tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]] = {}
        self._sent: torch.cuda.Event | None = None  # the last step's copies out of the pinned twins
        self._plan_sent: torch.cuda.Event | None = None  # the last plan's copy out of the pinned plan area
        v = self._vec
        self.seq_rows, self.ctx_lens = v[:s], v[s : 2 * s]
        self.query_start, self.slot_mapping = v[2 * s : 3 * s + 1], v[3 * s + 1 :]
        self.positions = self._pos
        self.block_tables_flat = self.block_tables.view(-1)  # [(s + 1) * max_blocks_per_seq]: the rows end to end
        # the first k sequences' query_start, seq_rows and ctx_lens (views, made once a k: a
        # tensor slice's cost, `_leading_view`; a step's plan takes three)
        self._leading: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._slot_views: dict[int, torch.Tensor] = {}  # slot_mapping[:k] by k (`leading_slots`)
        self._position_views: dict[int, torch.Tensor] = {}  # positions[:k] by k (`leading_positions`)
        # numpy views of the host buffers: an element written from Python through numpy
        # costs a fiftieth of a tensor's __setitem__ (`python -m timeit -s "import torch; t =
        # torch.zeros(4096, dtype=torch.int64); a = t.numpy()" "a[5] = 3"` 0.08 us, "t[5] =
        # 3" 3.9 us; 2026-12-06, 2 shared Xeon cores, load ~10)
        self._vec_np = self._vec_host.numpy()
        self._rows_ctx = self._vec_np[: 2 * s].reshape(2, s)  # seq_rows and ctx_lens as one [2, s] view
        self.long_blocks = LONG_BLOCKS  # (a test sets 0: every other request a long one)
        self._pos_np = self._pos_host.numpy()
        self._tables_np = self._tables_host.numpy()
        self._tables_flat = self._tables_np.reshape(-1)  # (a view: the same memory)
        self._rows: dict[str, int] = {}  # request id -> its row of block_tables
        self._free_rows = list(range(s - 1, -1, -1))  # popped from the end: row 0 first
        self.padding_row = s
        if dummy_block is not None:
            self._tables_np[s, :] = dummy_block
            if not on_cpu:
                self.block_tables[s].fill_(dummy_block)
        self.num_seqs = self.num_tokens = 0  # the last update's
        # the last step's request ids, in order, and its flat tokens, while rows [0, n) and
        # tokens [0, num_tokens) of the vectors hold it (None once they were rewritten
        # otherwise): what `advance` moves on
        self._last: tuple[str, ...] | None = None
        self._last_num_tokens = 0
        # the ends the last step was given, where they came as a list (copied): ctx_lens [0,
        # n) as Python ints, which `_advance_changed` compares the kept requests' starts with;
        # None: read from the vector. (A list's copy, where the vector's tolist makes every
        # int again: at 128 requests `python -m timeit -s "import numpy as np; a =
        # np.arange(1000, 1128); l = a.tolist()" "l[:]"` 0.49 us, "a.tolist()" 3.7 us;
        # 2026-12-06, 2 shared Xeon cores, load ~10.)
        self._last_ends: list[int] | None = None
        self._last_lead = 0  # its leading sequences of one token each (`_stepped`)
        self._gone: list[int] = []  # the last step's sequences whose requests were forgotten since
        self._row_seq = np.zeros(s + 1, dtype=np.int64)  # row -> its sequence in the last step (while it ran there)
        self._on_cpu = on_cpu
        self.num_table_writes = 0  # table entries written so far (the incremental figure)
        self.num_advanced = 0  # steps taken by `advance` (the last decode one token on, in place)
        self.num_advanced_changed = 0  # steps of a changed batch taken by `advance` (kept rows moved)
        # [0, 1, 2, ...]: a decode step's query_start, sequence and token indices (not positions)
        self._arange = np.arange(max(t, s + 1))
        self._offsets = np.arange(block_size)  # a block's slots' offsets
        # (a context's offset in its block by a mask, not a modulo: at 128 requests `python -m
        # timeit -s "import numpy as np; a = np.arange(1000, 1128)" "a & 15"` 1.4 us, "a % 16"
        # 2.2 us; 2026-12-06, 2 shared Xeon cores, load ~10)
        self._pow2 = block_size & (block_size - 1) == 0

    def forget(self, request_id: str) -> None:
        """The request left the cache (finished, cancelled, preempted): its row is free, and a
        readmission writes a whole row again. Unknown ids are ignored (never stepped)."""
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
            # the last step's vectors stand: `advance` keeps its requests but this one
            last = self._last
            if last is not None:
                seq = int(self._row_seq[row])
                if seq < len(last) and last[seq] == request_id:  # (its ids are distinct: `update`)
                    self._gone.append(seq)

    def fits(self, request_ids: Sequence[str], num_tokens: int) -> bool:
        """Whether `update` can take a step of these requests and num_tokens tokens: at most
        max_num_seqs sequences and max_num_tokens tokens, and a free row for each request
        the buffers do not hold yet (the block counts are the caller's to keep within
        max_blocks_per_seq)."""
        if len(request_ids) > self.max_num_seqs or num_tokens > self.max_num_tokens:
            return False
        held = sum(map(self._rows.__contains__, request_ids))  # (no Python frame a request)
        return len(request_ids) - held <= len(self._free_rows)

    def skip(self, request_ids: Sequence[str]) -> None:
        """A step the buffers do not hold (`fits` said no): its requests are forgotten, so
        their next step writes whole rows again (the entries this step changes never reach
        the buffers), and the buffers hold no step until the next `update`."""
        for rid in request_ids:
            self.forget(rid)
        self.clear()
        self._stepped(None, 0)  # (the step the vectors hold is not the last one any more)

    def clear(self) -> None:
        """An empty step (rows stay held): what a capture pads from."""
        self.num_seqs = self.num_tokens = 0
        self._vec_np[2 * self.max_num_seqs] = 0  # query_start[0]

    def update(
        self,
        request_ids: Sequence[str],
        starts: Sequence[int],
        ends: Sequence[int],
        tables: Sequence[Sequence[int]],
    ) -> StepView:
        """The step computing positions [starts[i], ends[i]) of request_ids[i], whose block
        table (the cache's, logical block k at tables[i][k]) covers its first ends[i]
        positions. ValueError naming the problem for a step the buffers cannot hold; the
        whole step is checked before anything is written, so a refused step leaves the
        buffers as they were.

        A request's cost is its own: the step's columns go through numpy (a few C-level
        passes over the ids, no Python loop a request), a held request whose step stays in
        one block writes that one entry, and only the requests that join (a whole row) or
        compute several tokens (the blocks they span) are visited in Python."""
        n = len(request_ids)
        if n > self.max_num_seqs:
            raise ValueError(f"StepBuffers: a step of {n} sequences, more than max_num_seqs {self.max_num_seqs}")
        bs, width, s = self.block_size, self.max_blocks_per_seq, self.max_num_seqs
        if self._sent is not None:
            self._sent.synchronize()  # the pinned twins are read by the last step's copies until then
        # the step's columns: [n] int64 each
        st = np.fromiter(starts, np.int64, n)
        en = np.fromiter(ends, np.int64, n)
        q_lens = en - st
        num_blocks = -(-en // bs)  # the blocks the step's context covers
        held = list(map(self._rows.get, request_ids))  # each request's row, None: it joins now
        # the checks, each a mask over the requests; the first request failing any is named
        # (by the first check it fails, in this order), as a loop over them would
        uncovered = (q_lens <= 0) | (st < 0) | (num_blocks > np.fromiter(map(len, tables), np.int64, n))
        too_wide = num_blocks > width
        token_ends = np.cumsum(q_lens)  # [n]: each request's end among the step's tokens
        over = token_ends > self.max_num_tokens
        free, new_rows = self._free_rows, {}  # new request id -> the free row it takes (after the checks)
        joins: list[int] = []  # the step's positions of those requests (a repeated id joins once)
        no_row = n
        for i in [i for i, row in enumerate(held) if row is None] if None in held else ():
            rid = request_ids[i]
            if rid in new_rows:
                held[i] = new_rows[rid]
                continue
            if len(new_rows) == len(free):
                no_row = i
                break
            held[i] = new_rows[rid] = free[-1 - len(new_rows)]  # the row `free.pop()` gives it
            joins.append(i)
        failing = uncovered | too_wide | over
        first_bad = min(int(failing.argmax()) if failing.any() else n, no_row)
        if first_bad < n:
            i = first_bad
            rid = request_ids[i]
            if uncovered[i]:
                raise ValueError(
                    f"StepBuffers: request {rid!r} positions [{st[i]}, {en[i]}) are not a step its "
                    f"{len(tables[i])} blocks of {bs} cover"
                )
            if too_wide[i]:
                raise ValueError(
                    f"StepBuffers: request {rid!r} needs {num_blocks[i]} blocks, more than max_blocks_per_seq {width}"
                )
            if over[i]:
                raise ValueError(f"StepBuffers: a step of more than max_num_tokens {self.max_num_tokens} tokens")
            raise ValueError(f"StepBuffers: no free row for {rid!r}: {s} requests hold rows (forget released ones)")
        # checked: now written (a refused step left every buffer and row as it was)
        rows = self._rows
        for rid in new_rows:
            rows[rid] = free.pop()
        seq_rows = np.array(held, dtype=np.int64)  # [n]
        # each request's entries [first, num_blocks) are rewritten: [0, first) unchanged since
        # its last step | [first, num_blocks) written now (a joining request: its whole row)
        first = st // bs
        first[joins] = 0
        spans = num_blocks - first  # >= 1: a step's last token lies in block num_blocks - 1 >= first
        one = (spans == 1).nonzero()[0]  # [m]: the decodes, and chunks within one block
        one_tables = map(tables.__getitem__, one.tolist())
        one_blocks = np.fromiter(map(operator.getitem, one_tables, first[one].tolist()), np.int64, len(one))
        changed_idx = seq_rows[one] * width + first[one]  # flat indices into block_tables
        changed_val = one_blocks
        if len(one) < n:  # the requests that span several blocks: a joining one, a prompt chunk
            idx: list[int] = []
            val: list[int] = []
            for i in (spans > 1).nonzero()[0].tolist():
                base, lo, hi = held[i] * width, int(first[i]), int(num_blocks[i])
                idx.extend(range(base + lo, base + hi))
                val.extend(tables[i][lo:hi])
            changed_idx = np.concatenate((changed_idx, np.array(idx, dtype=np.int64)))
            changed_val = np.concatenate((changed_val, np.array(val, dtype=np.int64)))
        self._tables_flat[changed_idx] = changed_val
        self.num_table_writes += len(changed_idx)
        # flat token j of sequence i sits at position starts[i] + (j - query_start[i]), in the
        # block its row now holds at entry position // block_size (entries [0, first) from
        # earlier steps, the rest just written): [num_tokens] int64 each
        num_tokens = int(q_lens.sum())
        vec, pos = self._vec_np, self._pos_np
        query_start = token_ends - q_lens  # [n]
        if num_tokens == n:  # one token a sequence (a decode step): positions are the starts
            positions, entries = st, seq_rows * width + st // bs
        else:
            positions = np.arange(num_tokens) + np.repeat(st - query_start, q_lens)
            entries = np.repeat(seq_rows * width, q_lens) + positions // bs
        vec[:n] = seq_rows
        vec[s : s + n] = en
        vec[2 * s : 2 * s + n] = query_start
        vec[2 * s + n] = num_tokens
        vec[3 * s + 1 : 3 * s + 1 + num_tokens] = self._tables_flat[entries] * bs + positions % bs
        pos[:num_tokens] = positions
        self.num_seqs, self.num_tokens = n, num_tokens
        # what `advance` moves on, where the ids are distinct (`forget` finds a request by its row)
        ids = tuple(request_ids)
        lead = n if num_tokens == n else int((q_lens != 1).argmax())  # (the first of several tokens)
        self._stepped(ids if len(set(ids)) == n else None, num_tokens, lead)
        self._last_ends = list(ends) if type(ends) is list else None
        if not self._on_cpu:
            self._send(changed_idx, changed_val, num_tokens)
        return self.view(n, num_tokens, int(q_lens.max()) if n else 0)

    def advance(
        self,
        request_ids: Sequence[str],
        starts: Sequence[int],
        ends: Sequence[int],
        tables: Callable[[list[str]], Sequence[Sequence[int]]],
    ) -> bool:
        """`update` for a step right after the last one, when nothing but appended blocks
        changed the requests' tables in between (the caller knows: no copy-on-write this
        step), written from the last step's vectors instead of every request's table: the
        buffers then hold exactly what `update` writes. `tables(ids)`: the tables of those
        requests (the cache's `tables`), read only for the rows it must write.

        The last decode step's request ids in the same order, each one token on (starts[i]
        is the last step's ends[i], ends[i] = starts[i] + 1): the rows and query_start
        stand; lengths, positions and slots move by one in place, and only a token that
        starts a block (starts[i] % block_size == 0) has its table read and its new entry
        written. A changed batch (`_advance_changed`): the last step's requests still held
        (finished ones forgotten), in its order, one token on each, then the others (joining
        requests, prompt chunks). False, with nothing written, for any other step (the
        caller then calls `update`)."""
        n = len(request_ids)
        last = self._last
        if not n or last is None:
            return False
        ids = tuple(request_ids)  # (C-level; a changed batch's pass reads this tuple, no copy again)
        if self._gone or self._last_num_tokens != len(last) or ids != last:
            return self._advance_changed(ids, starts, ends, tables)
        if self._sent is not None:
            self._sent.synchronize()  # the pinned twins are read by the last step's copies until then
        s, bs, width = self.max_num_seqs, self.block_size, self.max_blocks_per_seq
        vec = self._vec_np
        st = np.fromiter(starts, np.int64, n)
        # [0, n) of ctx_lens still holds the last step's ends (pad writes only [n, bucket))
        # (comparisons of equal shapes, without np.array_equal's Python-level checks)
        if not ((st == vec[s : s + n]).all() and (np.fromiter(ends, np.int64, n) - st == 1).all()):
            return False
        crossing = (st % bs == 0).nonzero()[0]  # tokens that open a block: [m] int64
        blocks = crossing  # (nothing read when none opens a block)
        if len(crossing):
            first = st[crossing] // bs  # the new entry's index in its row
            if first.max() >= width:
                return False
            opened = crossing.tolist()
            opened_tables = tables([request_ids[i] for i in opened])
            try:  # (a table without its new block: IndexError, and `update` names the problem)
                blocks = np.fromiter(map(operator.getitem, opened_tables, first.tolist()), np.int64, len(opened))
            except IndexError:
                return False
            changed_idx = vec[crossing].astype(np.int64) * width + first  # (seq_rows: vec[:n])
            self._tables_flat[changed_idx] = blocks
            self.num_table_writes += len(opened)
        vec[s : s + n] += 1  # ctx_lens
        self._last_ends = list(ends) if type(ends) is list else None  # (ends: the starts one on, checked above)
        slots = vec[3 * s + 1 : 3 * s + 1 + n]
        slots += 1  # the next slot of the same block, but where a block opens:
        if len(crossing):
            slots[crossing] = blocks * bs
        self._pos_np[:n] = st
        self.num_seqs = self.num_tokens = n
        self.num_advanced += 1
        if not self._on_cpu:
            self._send(changed_idx if len(crossing) else [], blocks, n)
        return True

    def _advance_changed(
        self,
        request_ids: tuple[str, ...],
        starts: Sequence[int],
        ends: Sequence[int],
        tables: Callable[[list[str]], Sequence[Sequence[int]]],
    ) -> bool:
        """`advance` for a changed batch: the engine removes finished requests and appends
        joining ones, so the step opens with the last step's requests still held, in its
        order; the leading run of them that decode one token on from their last context
        (sequences [0, p)) is moved on from the last step's vectors with a few numpy
        passes, and only the rest (sequences [p, n): joining requests, chunks, requests
        back from a step they sat out) is written as `update` writes it, from their tables.
        The tables a kept decode holds are the buffers' up to its last step's blocks (no
        copy-on-write in between: the caller's word), so only a token opening a block
        reads its table. False, nothing written, where it cannot be sure: no kept request
        leads the step, an id repeats, or the step is one `update` refuses (it names why)."""
        last, n = self._last, len(request_ids)
        assert last is not None
        n_prev = len(last)
        rows, free = self._rows, self._free_rows
        s, bs, width = self.max_num_seqs, self.block_size, self.max_blocks_per_seq
        if n > s:
            return False
        vec, rows_ctx = self._vec_np, self._rows_ctx
        # the kept requests: the last step's less those forgotten since (`forget` noted their
        # sequences), in its order; their last contexts, and those one on, as lists ([0,
        # n_prev) of the vectors still hold the last step: pad writes past them)
        gone = sorted(self._gone)
        last_ctx = vec[s : s + n_prev]  # (one view, read three times)
        last_ends = self._last_ends
        kept_ctx = last_ctx.tolist() if last_ends is None else last_ends.copy()  # (the same ints)
        kept_ends = (last_ctx + 1).tolist()
        if len(gone) == 1:  # (the common changed step: one left; two tuple slices, no list)
            g = gone[0]
            del kept_ctx[g], kept_ends[g]
            kept = last[:g] + last[g + 1 :]
        elif gone:
            kept_ids = list(last)
            for j in reversed(gone):
                del kept_ids[j], kept_ctx[j], kept_ends[j]
            kept = tuple(kept_ids)
        else:
            kept = last
        # the step's leading run of them, each one token on: sequences [0, p), C-level passes
        p = min(n, len(kept))
        head = request_ids[:p]  # (a tuple: the whole one where p == n)
        if head != kept[:p]:
            p = _first_false(map(operator.eq, head, kept), p)
        # (a list's slice is a list already: compared without a copy, and the kept lists
        # whole where the run takes every kept request, the common case)
        head_starts = starts[:p]
        if type(head_starts) is not list:
            head_starts = list(head_starts)
        if head_starts != (kept_ctx if p == len(kept_ctx) else kept_ctx[:p]):
            p = _first_false(map(operator.eq, head_starts, kept_ctx), p)
        head_ends = ends[:p]  # (each one on from its start: its start is its last context)
        if type(head_ends) is not list:
            head_ends = list(head_ends)
        if head_ends != (kept_ends if p == len(kept_ends) else kept_ends[:p]):
            p = _first_false(map(operator.eq, head_ends, kept_ends), p)
        if not p:
            return False
        # the run's tokens that open a block (a context a multiple of block_size): found among
        # the last step's contexts in numpy, each one's sequence now its last step's less the
        # forgotten before it (a few a step: a Python pass over them)
        gone_set = set(gone)
        crossing_list = ((last_ctx & (bs - 1) if self._pow2 else last_ctx % bs) == 0).nonzero()[0].tolist()
        if len(gone) == 1:  # (a comprehension, not a loop's statements a token)
            crossing_list = [j - (j > g) for j in crossing_list if j != g]
        elif gone:
            crossing_list = [j - bisect_left(gone, j) for j in crossing_list if j not in gone_set]
        if crossing_list and crossing_list[-1] >= p:  # (ascending: so are the sequences now)
            crossing_list = crossing_list[: bisect_left(crossing_list, p)]
        firsts = [kept_ctx[i] // bs for i in crossing_list]  # the new entries' indices in their rows
        if crossing_list and max(firsts) >= width:
            return False
        # the others: sequences [p, n), as update writes them (a joining request takes the
        # free row update would give it, its whole row written)
        num_others = n - p
        o_ids = list(request_ids[p:])
        o_starts, o_ends = list(starts[p:]), list(ends[p:])
        o_rows = list(map(rows.get, o_ids))
        joined = [row is None for row in o_rows]
        if num_others and (len(set(o_ids)) < num_others or not all(joined) and not set(o_ids).isdisjoint(head[:p])):
            return False  # an id repeated past the run (update lets its sequences share one row)
        new_rows: dict[str, int] = {}
        for j in compress(range(num_others), joined):
            if len(new_rows) == len(free):
                return False
            o_rows[j] = new_rows[o_ids[j]] = free[-1 - len(new_rows)]  # the row `free.pop()` gives it
        wanted = o_ids + [kept[i] for i in crossing_list]  # the others', and the kept tokens' opening a block
        got = tables(wanted) if wanted else ()
        idx: list[int] = []  # the short others' (and the kept tokens') changed entries: flat index, block id
        val: list[int] = []
        o_lens = []
        # a short other (a few blocks): its entries listed, its slots a range a block; a long
        # one (a prompt's chunk): its entries written as a slice, its slots from its row
        longs: list[int] = []  # (the others that are long)
        spans: list[list[range]] = []  # each other's slot ranges ([] for a long one)
        for j in range(num_others):
            start, end, table = o_starts[j], o_ends[j], got[j]
            num_blocks = -(-end // bs)
            if end <= start or start < 0 or num_blocks > len(table) or num_blocks > width:
                return False
            base, lo = o_rows[j] * width, 0 if joined[j] else start // bs
            o_lens.append(end - start)
            if num_blocks - lo > self.long_blocks:
                longs.append(j)
                spans.append([])
                continue
            idx.extend(range(base + lo, base + num_blocks))
            val.extend(table[lo:num_blocks])
            k = start // bs  # [start, end) over blocks k .. num_blocks - 1
            spans.append(
                [
                    range(block * bs + max(start - (k + i) * bs, 0), block * bs + min(end - (k + i) * bs, bs))
                    for i, block in enumerate(table[k:num_blocks])
                ]
            )
        num_tokens = p + sum(o_lens)
        if num_tokens > self.max_num_tokens:
            return False
        if crossing_list:
            try:  # (a table without its new block: IndexError, and `update` names the problem)
                opened = list(map(operator.getitem, got[num_others:], firsts))
            except IndexError:
                return False
            # (their rows' entries: a comprehension over these few, not three nested maps)
            idx += [rows[kept[i]] * width + first for i, first in zip(crossing_list, firsts, strict=True)]
            val += opened
        # checked: now written
        if self._sent is not None:
            self._sent.synchronize()  # the pinned twins are read by the last step's copies until then
        for rid in new_rows:
            rows[rid] = free.pop()
        tables_flat = self._tables_flat
        if self._on_cpu:  # (put takes the lists: no arrays made for the device's copy)
            tables_flat.put(idx, val)
            changed_idx = changed_val = ()
        else:
            changed_idx, changed_val = np.array(idx, dtype=np.int64), np.array(val, dtype=np.int64)
            tables_flat[changed_idx] = changed_val
        self.num_table_writes += len(idx)
        if longs:  # their entries [lo, num_blocks), a slice each
            wide_idx, wide_val = [changed_idx], [changed_val]
            for j in longs:
                start, end = o_starts[j], o_ends[j]
                base, lo, num_blocks = o_rows[j] * width, 0 if joined[j] else start // bs, -(-end // bs)
                tables_flat[base + lo : base + num_blocks] = got[j][lo:num_blocks]
                self.num_table_writes += num_blocks - lo
                if not self._on_cpu:  # (the device's copy takes them as entries)
                    wide_idx.append(np.arange(base + lo, base + num_blocks))
                    wide_val.append(tables_flat[base + lo : base + num_blocks].astype(np.int64))
            if not self._on_cpu:
                changed_idx, changed_val = np.concatenate(wide_idx), np.concatenate(wide_val)
        pos = self._pos_np
        # [0, p): the kept decodes, a token each at their last context, the next slot of
        # the same block but where a block opens, moved in place. The last step's sequences
        # [0, lead) had a token each (sequence j's last slot is token j's); a later one's last
        # slot is its last token's, read before anything moves (a few: the last step's chunks)
        lead, slots_at = self._last_lead, 3 * s + 1
        tails = []  # (its sequence now, its last slot)
        for j in range(lead, n_prev):
            i = j - bisect_left(gone, j)
            if i >= p:
                break
            if j not in gone_set:
                tails.append((i, vec[slots_at + vec[2 * s + j + 1] - 1]))
        # the forgotten sequences' gaps closed: the kept run between gone[t] and gone[t + 1]
        # moves down t + 1 places (rows and contexts; slots where it lies in [0, lead))
        for t, g in enumerate(gone):
            src, stop = g + 1, gone[t + 1] if t + 1 < len(gone) else n_prev
            dst = src - (t + 1)
            stop = min(stop, p + t + 1)  # (only the run's sequences: [0, p) once moved)
            if stop > src:
                rows_ctx[:, dst : dst + stop - src] = rows_ctx[:, src:stop]  # (numpy copies overlaps safely)
                below = min(stop, lead)  # (the slots of sequences [src, below) are tokens [src, below))
                if below > src:
                    vec[slots_at + dst : slots_at + below - (t + 1)] = vec[slots_at + src : slots_at + below]
        slots = vec[slots_at : slots_at + p]
        for i, slot in tails:
            slots[i] = slot
        pos[:p] = rows_ctx[1, :p]
        rows_ctx[1, :p] += 1
        slots += 1
        for i, block in zip(crossing_list, opened, strict=True) if crossing_list else ():
            slots[i] = block * bs
        if p > lead:  # query_start [0, lead] is the arange already
            vec[2 * s + lead + 1 : 2 * s + p + 1] = self._arange[lead + 1 : p + 1]
        # [p, n): the others' seq_rows, ctx_lens and query_start (one other: elements written
        # through numpy, not slices from lists), then their flat tokens [p, num_tokens)
        if num_others == 1:
            vec[p], vec[s + p], vec[2 * s + n] = o_rows[0], o_ends[0], num_tokens
        elif num_others:
            vec[p:n], vec[s + p : s + n] = o_rows, o_ends
            vec[2 * s + p + 1 : 2 * s + n + 1] = list(accumulate(o_lens, initial=p))[1:]
        if num_others:
            if not longs:  # a few blocks: positions a slice each, the slots from their ranges in one pass
                t, arange = p, self._arange
                for start, end in zip(o_starts, o_ends, strict=True):
                    # (a slice of the arange where it reaches: no new array)
                    pos[t : t + end - start] = arange[start:end] if end <= len(arange) else np.arange(start, end)
                    t += end - start
                if num_others == 1:  # (the common joiner: each block's slots a slice of the arange)
                    at = 3 * s + 1 + p
                    for span in spans[0]:
                        lo, hi = span.start, span.stop
                        vec[at : at + hi - lo] = arange[lo:hi] if hi <= len(arange) else np.arange(lo, hi)
                        at += hi - lo
                else:
                    vec[3 * s + 1 + p : 3 * s + 1 + num_tokens] = np.fromiter(
                        chain.from_iterable(chain.from_iterable(spans)), np.int32, num_tokens - p
                    )
            else:  # each other's tokens [t, t + q) apart
                t, arange = p, self._arange
                for j in range(num_others):
                    start, end, q = o_starts[j], o_ends[j], o_lens[j]
                    pos[t : t + q] = arange[start:end] if end <= len(arange) else np.arange(start, end)
                    if spans[j]:
                        vec[3 * s + 1 + t : 3 * s + 1 + t + q] = list(chain.from_iterable(spans[j]))
                    else:  # block b's slots b * bs + [0, bs), from its row just written: [blocks, bs]
                        k, base = start // bs, o_rows[j] * width
                        blocks = tables_flat[base + k : base + -(-end // bs)]
                        slots = np.add.outer(blocks * bs, self._offsets).reshape(-1)
                        vec[3 * s + 1 + t : 3 * s + 1 + t + q] = slots[start - k * bs : end - k * bs]
                    t += q
        self.num_seqs, self.num_tokens = n, num_tokens
        # the leading sequences of one token each: the run, and the others' that lead
        if num_tokens == n:
            lead = n
        elif num_others == 1:  # (its tokens are not one: num_tokens > n)
            lead = p
        else:
            lead = p + _first_false(map((1).__eq__, o_lens), num_others)
        # (sequences [0, first) are the last step's, in their rows: their rows' sequences stand)
        self._stepped(request_ids, num_tokens, lead, min(gone[0], p) if gone else p)
        self._last_ends = list(ends) if type(ends) is list else None
        self.num_advanced_changed += 1
        if not self._on_cpu:
            self._send(changed_idx, changed_val, num_tokens)
        return True

    def _stepped(self, request_ids: tuple[str, ...] | None, num_tokens: int, lead: int = 0, first: int = 0) -> None:
        """The step just written is what `advance` moves on (None: none is): its ids, its
        tokens, its leading sequences of one token each (sequences [0, lead): sequence i's
        token is token i), and each row's sequence in it (what `forget` looks a forgotten
        row up in; `first`: sequences [0, first) are the last step's own in the same rows,
        whose entries stand)."""
        self._last, self._last_num_tokens, self._last_lead = request_ids, num_tokens, lead
        self._last_ends = None  # (the callers that know the ends set them after)
        self._gone = []
        if request_ids is not None:
            n = len(request_ids)
            # (an int64 index: numpy converts an int32 one first; at 128 rows `python -m timeit
            # -s "import numpy as np; x = np.zeros(512, dtype=np.int64); i = np.arange(128,
            # dtype=np.int64); v = np.arange(128)" "x[i] = v"` 0.54 us; i int32 (dtype=np.int32):
            # "x[i] = v" 2.6 us, "x[i.astype(np.int64)] = v" 1.3 us; 2026-12-06, 2 shared
            # Xeon cores, load ~10)
            self._row_seq[self._vec_np[first:n].astype(np.int64)] = self._arange[first:n]

    def _send(self, changed_idx: Sequence[int], changed_val: Sequence[int], num_tokens: int) -> None:
        """The step's changed table entries and vectors to the device: one copy each, in order
        on the current stream (the pinned staging is rewritten only by the next step's
        update, after this step's kernels were queued behind these copies)."""
        k = len(changed_idx)
        if k:
            # the flat buffer's first 2k entries as a contiguous [2, k]: its column slice [:, :k]
            # is strided, which .to() first copies into pageable memory (no pinned, async copy)
            staging = self._changes_host.view(-1)[: 2 * k].view(2, k)
            staging.numpy()[0], staging.numpy()[1] = changed_idx, changed_val
            dev = staging.to(self.device, non_blocking=True)
            self.block_tables.view(-1).index_copy_(0, dev[0], dev[1].to(torch.int32))
        used = 3 * self.max_num_seqs + 1 + num_tokens  # the vectors up to the step's last slot
        self._vec[:used].copy_(self._vec_host[:used], non_blocking=True)
        self._pos[:num_tokens].copy_(self._pos_host[:num_tokens], non_blocking=True)
        self._sent = torch.cuda.Event()
        self._sent.record()

    @property
    def num_lead(self) -> int:
        """The held step's leading sequences of one token each (sequences [0, num_lead):
        sequence i's token is flat token i), as `update` or `advance` wrote them; 0 where
        the buffers hold no step (`clear`, `skip`) or the step was written otherwise since
        (`pad`). (`_last_lead` itself outlives `clear`: it describes the vectors, which
        `advance` moves on after the runner's clear of every step.)"""
        return self._last_lead if self.num_seqs else 0

    def leading(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """query_start[:k], seq_rows[:k], ctx_lens[:k] ([k] int32 each, device views of the
        persistent buffers: the same tensors every step, so they are made once a k)."""
        views = self._leading.get(k)
        if views is None:
            views = self._leading[k] = (self.query_start[:k], self.seq_rows[:k], self.ctx_lens[:k])
        return views

    def plan_tables(self, values: list[int], sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """A step plan's int32 tables in the persistent plan area: `values` the tables end to
        end, each padded with zeros to a multiple of TABLE_ALIGN entries (`_PADS`: every
        table starts 16-byte aligned, so one compiled kernel reads every plan), sizes[k] the
        k-th one's length -> one device view each (made once a `sizes`), written now
        (on CUDA one copy, ordered before the step's kernels on the current stream). They
        hold until the next call: a plan reads them in its own step only."""
        num_values = len(values)
        # (the views made once a `sizes`, with the values' padded count they take: checked
        # against it, not summed again, where the shape was seen)
        known = self._plan_views.get(sizes)
        if known is None or known[0] != num_values:
            if num_values != sum(map(_aligned, sizes)) or num_values > len(self._plan_np):
                raise ValueError(
                    f"StepBuffers.plan_tables: {num_values} values for tables of {list(sizes)}, each padded "
                    f"to a multiple of 4 (the plan area holds {len(self._plan_np)})"
                )
            if len(self._plan_views) >= 256:  # (a bound on shapes kept: prompts of many lengths)
                self._plan_views.clear()
            views = tuple(split_aligned(self._plan[:num_values], sizes))
            # (and the area's leading slices a CUDA step copies, made once too: `_leading_view`)
            known = self._plan_views[sizes] = (num_values, views, self._plan[:num_values], self._plan_host[:num_values])
        _, views, device_area, host_area = known
        # The pinned area is read by the last plan's copy until its event passes. A host wait
        # (Event.synchronize), but on an earlier step's copy, which that step's read of its
        # sampled tokens (queued after it) already waited for: it returns at once. Not
        # `_sent`: in a mixed step that is this step's own vector copy, just queued, which
        # the host would wait for, a second synchronisation a step (audit13 G4), for a
        # buffer the plan does not write
        if self._plan_sent is not None:
            self._plan_sent.synchronize()
        self._plan_np[:num_values] = values
        if not self._on_cpu:
            device_area.copy_(host_area, non_blocking=True)
            self._plan_sent = torch.cuda.Event()
            self._plan_sent.record()
        return views

    def leading_slots(self, num_tokens: int) -> torch.Tensor:
        """slot_mapping[:num_tokens] ([num_tokens] int32, a device view made once a length)."""
        return _leading_view(self._slot_views, self.slot_mapping, num_tokens)

    def leading_positions(self, num_tokens: int) -> torch.Tensor:
        """positions[:num_tokens] ([num_tokens] int64, a device view made once a length)."""
        return _leading_view(self._position_views, self.positions, num_tokens)

    def host_ctx_lens(self, n: int) -> np.ndarray:
        """ctx_lens[:n] on the host ([n] int32, a numpy view of the host twin): the held step's
        sequences' contexts after it, as `update` or `advance` wrote them."""
        s = self.max_num_seqs
        return self._vec_np[s : s + n]

    def host_seq_rows(self) -> np.ndarray:
        """seq_rows on the host [max_num_seqs] int32 (a numpy view of the host twin, which the
        device buffer copies): what a plan reads without a device op."""
        return self._vec_np[: self.max_num_seqs]

    def view(self, num_seqs: int, num_tokens: int, max_query_len: int = 1) -> StepView:
        return StepView(num_seqs, num_tokens, max_query_len, self)

    def pad(self, num_seqs: int) -> StepView:
        """The last update, a decode step (one token a sequence), padded to `num_seqs`
        sequences (a CUDA graph's batch bucket; at most max_num_seqs and, one token each,
        max_num_tokens): each padded sequence is one token at
        position 0 in the padding row, whose only block is the dummy block, so it writes
        its K/V only to the dummy block's slot 0 and reads only that slot."""
        n, s = self.num_seqs, self.max_num_seqs
        if self.dummy_block is None:
            raise ValueError("StepBuffers.pad: no dummy block to pad with (dummy_block=None)")
        if self.num_tokens != n:
            raise ValueError(
                f"StepBuffers.pad: the last step has {self.num_tokens} tokens for {n} sequences, not a decode"
            )
        if not n <= num_seqs <= s:
            raise ValueError(f"StepBuffers.pad: cannot pad {n} sequences to {num_seqs} (max_num_seqs {s})")
        if num_seqs > self.max_num_tokens:  # one token a sequence: slot_mapping and positions end there
            raise ValueError(
                f"StepBuffers.pad: cannot pad to {num_seqs} sequences of one token, more than "
                f"max_num_tokens {self.max_num_tokens}"
            )
        if num_seqs == n:  # (a step that fills its bucket: nothing to pad)
            return self.view(num_seqs, num_seqs)
        vec, pos = self._vec_np, self._pos_np
        if n < self._last_num_tokens:
            self._stepped(None, 0)  # the padding overwrites rows (and tokens) of the last step
        vec[n:num_seqs] = self.padding_row
        vec[s + n : s + num_seqs] = 1
        vec[2 * s + n + 1 : 2 * s + num_seqs + 1] = self._arange[n + 1 : num_seqs + 1]
        vec[3 * s + 1 + n : 3 * s + 1 + num_seqs] = self.dummy_block * self.block_size
        pos[n:num_seqs] = 0
        if not self._on_cpu:
            used = 3 * s + 1 + num_seqs
            self._vec[:used].copy_(self._vec_host[:used], non_blocking=True)
            self._pos[:num_seqs].copy_(self._pos_host[:num_seqs], non_blocking=True)
            self._sent = torch.cuda.Event()
            self._sent.record()
        return self.view(num_seqs, num_seqs)

    def check_integrity(self, tables: dict[str, Sequence[int]] | None = None) -> None:
        """Rows and free rows partition [0, max_num_seqs); what `advance` moves on is the
        vectors' step: the last step's requests still held keep the rows its seq_rows name,
        the forgotten ones are the noted sequences (`forget`), each held one's row names its
        sequence (what `forget` reads); with `tables` (request id -> the cache's table),
        every request's row holds its table's entries up to its last step's blocks (the
        entries a kernel reads), on the host and on the device, and none of them is the
        dummy block (padded rows write it)."""
        used = sorted(self._rows.values())
        assert len(set(used)) == len(used), "a row held twice"
        assert sorted(used + self._free_rows) == list(range(self.max_num_seqs)), "rows lost or duplicated"
        if self.dummy_block is not None:
            assert (self._tables_np[self.padding_row] == self.dummy_block).all(), "the padding row changed"
        last = self._last
        if last is not None:
            assert len(set(last)) == len(last), "the last step's ids repeat"
            seq_rows = self._vec_np[: len(last)].tolist()
            gone = [j for j, rid in enumerate(last) if rid not in self._rows]
            assert sorted(self._gone) == gone, f"forgotten sequences {sorted(self._gone)}, not {gone}"
            for j, rid in enumerate(last):
                assert rid not in self._rows or self._rows[rid] == seq_rows[j], f"{rid}: not the row it stepped in"
                # (what `forget` looks its sequence up by)
                assert rid not in self._rows or self._row_seq[seq_rows[j]] == j, f"{rid}: its row's sequence is not {j}"
            if self._last_ends is not None:  # (the list `_advance_changed` reads for the vector's contexts)
                s = self.max_num_seqs
                assert self._last_ends == self._vec_np[s : s + len(last)].tolist(), "the last ends are not ctx_lens"
        if tables is None:
            return
        s = self.max_num_seqs
        device_tables = self.block_tables.cpu().numpy()
        for i in range(self.num_seqs):
            row = int(self._vec_np[i])
            rid = next(r for r, k in self._rows.items() if k == row)
            num_blocks = -(-int(self._vec_np[s + i]) // self.block_size)
            want = list(tables[rid][:num_blocks])
            # (padded rows write the dummy block: a request that held it would be overwritten)
            assert self.dummy_block is None or self.dummy_block not in want, f"{rid}: its table holds the dummy block"
            assert self._tables_np[row, :num_blocks].tolist() == want, f"{rid}: host row differs from its table"
            assert device_tables[row, :num_blocks].tolist() == want, f"{rid}: device row differs from its table"


def _first_false(flags: Iterable[object], default: int) -> int:
    """The index of the first false flag, `default` if none is (a C-level pass)."""
    return next(compress(count(), map(operator.not_, flags)), default)
