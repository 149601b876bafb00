"""The simulator's executor: the engine's runner (engine/runner.py `ModelRunner`) with a cost
model in place of the tensors.

The runner makes every cache decision (admission, restore method, reservation, copies,
preemption, swap, release) exactly as it does for a real model; `CostExecutor` answers the
executor calls, which only ever move or compute tensors, by pricing them:
  - `forward`: the step's chunks, (num new tokens, context length) each, plus the V4
    replays (`replay`) the runner asked for since the last step, through `step_time` with
    the bytes the step's copies move; the virtual clock advances by that time, once per
    step, when it is next read (`VirtualClock.settle`: after the pieces and copies of a
    step the runner cut). Its "logits" are empty rows: `AnswerSampler` draws each
    request's answer from the stream its seed names;
  - `copy_blocks`: copy-on-write copies, each moving a block twice (read + write);
  - `copy_state`: a state copy (a V4 checkpoint restored or taken, a fork's state), moving
    `checkpoint_bytes` twice; `reset_state` costs nothing;
  - `replay`: recomputing a V4 state over tokens [start, start + n) is a chunk of n tokens
    over a context of start + n in the next step;
  - `to_host` / `to_device`: a host tier's moves, counted; entries of `block_bytes` bytes
    (so a host tier's byte limit evicts as it would for the real blocks), not priced: the
    GPU presets carry no host-link bandwidth. (`kvpool simulate` runs without tiers
    (`sim_runner`); only a runner given a host tier, as tests/test_sim_parity.py's, moves.)
  - `window_snapshot` / `restore_window` (V4 with persistent tiers and an SWA strategy,
    and a swap preemption's state entry): a snapshot's bytes (`snapshot_bytes`) read from
    the state, or written into it, priced as bytes moved in the step; the tier entry is
    those bytes.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, count, islice, repeat
from operator import is_, is_not, sub
from typing import Any

import numpy as np
import torch

from kvpool.cache import BlockCopy
from kvpool.engine.batch_sampler import RowsOf
from kvpool.engine.memory import StepPeaks
from kvpool.engine.runner import ScheduledChunk, StepChunks, num_logits, step_columns
from kvpool.engine.sampling import SamplingParams
from kvpool.sim.cost import _ints_only
from kvpool.workload.tokens import MASK64, STREAM_MIX, STREAM_MULT, mix_tokens, stream_key, stream_tokens, token_at

_MOD = 1 << 64  # a signed seed back to its stream key
_MULT_U64 = np.uint64(STREAM_MULT)


@dataclass
class VirtualClock:
    """Seconds since the simulation began; only the simulator moves it. `settle`: prices
    the work issued so far (the executor's step), so a reading is the time after it."""

    now: float = 0.0
    settle: Callable[[], None] | None = None

    def __call__(self) -> float:
        if self.settle is not None:
            self.settle()
        return self.now


class CostExecutor:
    """The executor protocol (engine/runner.py) priced by `step_time((num_new_tokens,
    context_len) per chunk, bytes moved) -> seconds` on `clock`; `kv_read_bytes(context)`:
    the cache bytes one query reads. `decode_step_time(positions, bytes moved) -> seconds`
    (optional): step_time's fast twin for a step of one-token chunks at those positions, the
    same float (sim/cost.py `CostModel.decode_step_time`), a fleet run's common step priced
    without a (tokens, context) tuple per chunk (the positions a list of ints, or on a common
    step of int positions an int64 array [n], moved on in place where the rows are the last
    step's one token on: `_lead_positions`).
    `split_step_time(positions, others, bytes
    moved) -> seconds or None` (optional): the same for a step of decodes at `positions` and
    the chunks `others` ((tokens, context), more than one token each, in the step's order):
    a mixed step, a prefill chunk among the decodes (`CostModel.split_step_time`); None:
    step_time prices it.

    block_bytes: one block's bytes (a copy-on-write copy moves it twice; a host tier entry
    holds it); checkpoint_bytes: what one state copy moves (V4 dual, recurrent);
    has_state: requests hold a state slot (their admissions restore it). V4 window
    snapshots: `spec` (the DSV4Spec: window, layers), `window_row_bytes` (one token's SWA KV
    over every layer) and `boundary_bytes` (the compressor rows pending at a block boundary);
    a swapped-out state inside a span (`window_snapshot` with unfinished_span) prices the rows
    pending there and the unfinished span's entries by the spec, in `state_dtype` (the
    compressors in fp32, fp64 beside fp64 storage, as storage/dsv4.py keeps them)."""

    attention = None  # no attention backend: nothing attends
    keeps_block_state = False

    def __init__(
        self,
        vocab_size: int,
        *,
        step_time: Callable[[Sequence[tuple[int, int]], int], float],
        decode_step_time: Callable[[Sequence[int], int], float] | None = None,
        split_step_time: Callable[[Sequence[int], Sequence[tuple[int, int]], int], float | None] | None = None,
        kv_read_bytes: Callable[[int], int],
        clock: VirtualClock,
        block_bytes: int,
        kv_capacity_bytes: int,
        num_state_blocks: int = 0,
        checkpoint_bytes: int = 0,
        has_state: bool = False,
        state_bytes: int = 0,
        spec: Any = None,
        window_row_bytes: int = 0,
        boundary_bytes: int = 0,
        state_dtype: str = "float32",
    ) -> None:
        self.model = None  # no weights: the cost model stands for them
        self.vocab_size = vocab_size
        self.kv_format = "simulated"
        self.peaks = StepPeaks()
        self.step_time = step_time
        self.decode_step_time = decode_step_time
        self.split_step_time = split_step_time
        self._kv_read_bytes = kv_read_bytes
        self.clock = clock
        clock.settle = self._price_step  # a step is priced when its time is read
        self.block_bytes = block_bytes
        self.block_layout = {"kv": (torch.uint8, (block_bytes,))}  # a tier entry: the block's bytes
        self.kv_capacity_bytes = kv_capacity_bytes
        self.num_state_blocks = num_state_blocks
        self.checkpoint_bytes = checkpoint_bytes
        self.state_bytes = state_bytes  # V4 dual: a whole state block (a spilled turn end's copy)
        self.has_state = has_state
        self.spec = spec
        self.window_row_bytes = window_row_bytes
        self.boundary_bytes = boundary_bytes
        self.state_dtype = state_dtype
        # The step so far: its first forward's chunks as they came (one per request; the
        # common step is that one forward), and, for the requests of its later pieces only,
        # request -> [start, end) they computed in those pieces (`_later`, in the order they
        # came): a later piece costs its own chunks, not a merge of the whole first forward
        self._first: Sequence[ScheduledChunk] = ()
        self._later: dict[str, tuple[int, int]] = {}
        self._replays: list[tuple[int, int]] = []  # (tokens, context) recomputed in the next step
        # The last common step's (its rows' ends list, the positions it priced as an int64
        # array: each end less one, the first and last of its ends), or None: where the next
        # step's positions list is that ends list, its positions are that array one on
        # (`_lead_positions`); the sampler's lengths are the array + 1 where they are that
        # ends list (AnswerSampler reads the first two)
        self.step_ends: tuple[Sequence[int], np.ndarray, int, int] | None = None
        # (the step's positions list, its ends list) where the step is the last one's rows one
        # on (`_lead_positions`): row i's end is the last step's end + 1 (AnswerSampler reads it)
        self.carried_ends: tuple[Sequence[int], Sequence[int]] | None = None
        self._moved = 0  # bytes the copies since the last step move
        self.num_replayed_tokens = 0
        self.num_checkpoint_copies = 0
        self.num_copied_blocks = 0
        self.num_blocks_to_host = 0
        self.num_blocks_to_device = 0
        self.num_window_snapshots = 0  # V4 window snapshots taken, and restores from them
        self.num_window_restores = 0
        self.window_bytes_moved = 0  # the bytes those priced, out of the state and into it
        self.busy_s = 0.0  # the sum of step times: the replica's busy time

    # ---- the step ---------------------------------------------------------------------------

    def forward(self, chunks: Sequence[ScheduledChunk], cache: Any, all_logits: bool) -> torch.Tensor | list[None]:
        """Add the chunks to the step. The "logits" hold nothing (the sampler reads the
        request's seed): a row per chunk that needs logits, as a list (the engine indexes
        one row per sampled token: a list costs a tenth of a tensor's indexing), or
        (all_logits) a row per token as an empty tensor [rows, 0], which the runner cuts
        and joins.

        A step may come in pieces: the runner cuts a V4 reservation at its checkpoint
        positions and copies the state there, between two forwards and after the last. A
        piece extends its request's part of the step; the step is priced, one chunk per
        request, when the clock is next read (the engine reads it as the step's forward
        returns), with every copy made for it."""
        if self._first:  # a later piece: its requests' parts reach further
            later = self._later
            for c in chunks:
                seen = later.get(c.request_id)
                later[c.request_id] = (c.start if seen is None else seen[0], c.start + len(c.token_ids))
        elif chunks:  # its first: kept as it is (one chunk per request), read when priced
            self._first = chunks
        if all_logits:
            return torch.empty(sum(len(c.token_ids) for c in chunks), 0)
        return [None] * num_logits(chunks)  # (a StepChunks' leading decodes counted, not made)

    def _price_step(self) -> None:
        """Advance the clock by the step's price: its chunks, then the replays before it,
        with the bytes its copies moved. (Nothing to price before a step ran: the copies
        and replays issued since wait for the next.)"""
        first = self._first
        if not first:
            return
        self._first = ()
        lead = self.step_ends  # (kept by a common step alone: any other ends the rows' run)
        self.step_ends = self.carried_ends = None
        seconds = None
        if self.decode_step_time is not None or self.split_step_time is not None:
            seconds = self._fast_price(first, lead)
        if seconds is None:  # (`_work` takes `_later` and the replays)
            seconds = self.step_time(self._work(first), self._moved)
        else:
            if self._later:
                self._later = {}
            self._replays.clear()
        self._moved = 0
        self.clock.now += seconds
        self.busy_s += seconds

    def _fast_price(self, first: Sequence[ScheduledChunk], lead: tuple | None = None) -> float | None:
        """`_work`'s step priced by the fast twins, the same float as step_time over it: a
        step of decodes (one forward, every chunk one token) by `decode_step_time`, any other
        by `split_step_time`, its decodes' positions apart from its other chunks, which keep
        `_work`'s order (the decodes' sums do not depend on theirs). None where neither can
        price it (step_time then does). Reads `_later` and the replays, takes nothing. `lead`:
        the last step's `step_ends`, read by the common step's `_lead_positions`."""
        later, replays = self._later, self._replays
        if type(first) is StepChunks:
            # the engine's leading decodes as columns: chunk i < len(lead_starts) is one token
            # at lead_starts[i] (StepChunks' definition), so those are the decodes' positions,
            # with no (start, end) column read, no length made and counted a row
            if not first.rest and not later and not replays:  # the common step: the columns' rows alone
                if self.decode_step_time is not None:
                    return self.decode_step_time(self._lead_positions(first, lead), self._moved)
                return None
            if self.split_step_time is not None:
                split = self._split_rest(first, later, replays, self._carried_lead(first, lead))
                if split is not None:
                    return self._price_split(*split)
        return self._price_columns(first)

    def _lead_positions(self, first: StepChunks, lead: tuple | None) -> Sequence[int] | np.ndarray:
        """The common step's decode positions, `first.lead_starts`, as an int64 array: the
        last common step's, each one on (in place), where these are its rows one token on;
        else the list's ints made one (the list itself where they are not ints, or past int64:
        decode_step_time names or prices them). Sets `step_ends` for the next step (and the
        sampler) and, for the carried rows, `carried_ends`.

        The rows are the last step's one on where `lead_starts` is the very list the last
        common step's columns ended its rows at (`lead`'s; StepChunks' columns: a leading
        decode ends at its start + 1): the engine carries its decode columns that way (a
        step's ends become the next one's starts) and never changes their lists, so it holds
        the last step's positions + 1, row by row. Its first and last are compared: a guard
        against a list moved on in place, not a proof (a row changed in the middle passes it);
        the proof is the engine's contract (StepChunks' columns are never changed, a test
        drives engine-made steps through both paths). Such a step is priced from the array
        with no int read a row (`_decode_sums`' array form). Its twin: the list priced as it
        is (tests/test_sim_cost_decode_sums.py runs engine-made steps through both)."""
        starts = first.lead_starts
        columns = first.columns
        at = _one_on(lead, starts)
        if at is not None:
            if columns is not None:
                self.carried_ends = (starts, columns[2])
        else:
            if not _ints_only(starts):
                return starts  # (decode_step_time names the bad position)
            try:  # (ints, so their int64s: the conversion _decode_sums would make, kept)
                at = np.fromiter(starts, np.int64, len(starts))
            except OverflowError:  # (past int64: decode_step_time's loop prices them)
                return starts
        if columns is not None and len(columns[2]) == len(starts) and starts:
            # (the ends' first and last: the next step's positions list is checked by them)
            self.step_ends = (columns[2], at, starts[0] + 1, starts[-1] + 1)
        return at

    def _carried_lead(self, first: StepChunks, lead: tuple | None) -> np.ndarray | None:
        """A step's leading decodes' positions where `_lead_positions` would find them the
        last common step's rows one on with its array (a mixed step: a prompt's chunk after
        them, a replay before it): that array, one on; else None (`_split_rest` reads the list)."""
        return _one_on(lead, first.lead_starts)

    def _price_columns(self, first: Sequence[ScheduledChunk]) -> float | None:
        """`_fast_price` of any first forward, from its columns: a row a decode or not. (The
        twin of `_split_rest`'s StepChunks path, which tests/test_sim_cost_decode_sums.py
        holds to it.)"""
        later, replays = self._later, self._replays
        # the chunks' columns: the engine's, where it planned them (no chunk read), else transposed
        request_ids, starts, ends = step_columns(first)
        lens = list(map(sub, ends, starts))
        if not later and not replays and lens.count(1) == len(lens):
            if self.decode_step_time is not None:  # the common step
                return self.decode_step_time(starts, self._moved)
            return None
        if self.split_step_time is None:
            return None
        tail = []  # `_work`'s entries after the first forward's: later-only requests, replays
        if later:  # the step came in pieces: its requests' later pieces extend their part
            at = dict(zip(request_ids, range(len(request_ids)), strict=True))
            for request_id, (start, end) in later.items():
                i = at.get(request_id)
                if i is None:  # none in the first forward: after its requests
                    tail.append((end - start, end))
                else:  # from its first piece's start to its last piece's end
                    lens[i] = end - starts[i]
        tail += replays
        positions = [start for n, start in zip(lens, starts, strict=True) if n == 1]
        others = [(n, start + n) for n, start in zip(lens, starts, strict=True) if n != 1]
        for n, end in tail:
            if n == 1:
                positions.append(end - 1)
            else:
                others.append((n, end))
        return self._price_split(positions, others)

    def _price_split(self, positions: list[int] | np.ndarray, others: list[tuple[int, int]]) -> float | None:
        """A step of one decode at each of `positions` and the chunks `others` ((tokens,
        context after them), more than one token each) priced by the fast twins: decodes
        only by `decode_step_time`, else `split_step_time`; None where they cannot."""
        if not others:  # decodes only after all (a piece or replay of one token, rows that joined)
            return None if self.decode_step_time is None else self.decode_step_time(positions, self._moved)
        return self.split_step_time(positions, others, self._moved)  # type: ignore[misc]

    def _split_rest(
        self,
        first: StepChunks,
        later: Mapping[str, tuple[int, int]],
        replays: Sequence[tuple[int, int]],
        lead_at: np.ndarray | None = None,
    ) -> tuple[list[int] | np.ndarray, list[tuple[int, int]]] | None:
        """`_price_columns`' (positions, others) of a StepChunks first forward, read from its
        leading decodes' starts and its rest alone (rows that joined: their first decodes, a
        prompt's chunk; a divided chunk's first piece): a decode, one token, is never cut, so
        the requests of the later pieces (`later`) are the rest's or none of the first
        forward's (after its requests, as `_work` puts them), then the replays. The leading
        decodes' positions as they are (no row read), the others in `_work`'s order (the
        decodes' sums do not depend on where they fall). None where a later piece's request
        is a leading decode's or two of the rest's (`_price_columns` then prices the step).
        `lead_at`: the leading decodes' positions as an int64 array (`_carried_lead`), the
        positions where no other chunk is a decode (else the list of them all)."""
        rest = first.rest
        positions: list[int] = []  # the decodes after the leading ones
        others = []
        if later:
            rest_ids = {c.request_id for c in rest}
            if len(rest_ids) != len(rest):  # a request with two chunks: `_work`'s dict extends its last
                return None
        for c in rest:
            n = len(c.token_ids)
            if later:
                seen = later.get(c.request_id)
                if seen is not None:  # from its first piece's start to its last piece's end
                    n = seen[1] - c.start
            if n == 1:
                positions.append(c.start)
            else:
                others.append((n, c.start + n))
        for request_id, (start, end) in later.items():
            if request_id in rest_ids:
                continue
            if request_id in first.lead_ids:  # (not from the engine, whose decodes are one token: the twin prices it)
                return None
            if end - start == 1:  # none in the first forward: after its requests
                positions.append(end - 1)
            else:
                others.append((end - start, end))
        for n, end in replays:
            if n == 1:
                positions.append(end - 1)
            else:
                others.append((n, end))
        if lead_at is not None and not positions:
            return lead_at, others
        return list(first.lead_starts) + positions, others

    def _work(self, first: Sequence[ScheduledChunk]) -> list[tuple[int, int]]:
        """The step's (tokens, context after them): one chunk per request, in the order
        requests came, then the replays before it; `_later` and the replays taken."""
        work = [(len(c.token_ids), c.start + len(c.token_ids)) for c in first]
        if self._later:  # the step came in pieces: its requests' later pieces extend their part
            at = {c.request_id: i for i, c in enumerate(first)}
            for request_id, (start, end) in self._later.items():
                i = at.get(request_id)
                if i is None:  # none in the first forward: after its requests
                    work.append((end - start, end))
                else:  # from its first piece's start to its last piece's end
                    start = first[i].start
                    work[i] = (end - start, end)
            self._later = {}
        if self._replays:
            work.extend(self._replays)  # the states rebuilt over their cached prefixes
            self._replays.clear()
        return work

    def copy_blocks(self, copies: Mapping[str, Sequence[BlockCopy]]) -> None:
        num = sum(len(cs) for cs in copies.values())
        self.num_copied_blocks += num
        self._moved += 2 * num * self.block_bytes  # read the source, write the copy

    def reset_state(self, slot: int) -> None:
        pass  # a fresh state: nothing moves

    def copy_state(self, src: int, dst: int) -> None:
        self.num_checkpoint_copies += 1
        self._moved += 2 * self.checkpoint_bytes

    def copy_whole_state(self, src: int, dst: int) -> None:
        """A state copy off the span grid (a spilled turn end, out or back): the whole block."""
        self.num_checkpoint_copies += 1
        self._moved += 2 * self.state_bytes

    def replay(
        self, token_ids: Sequence[int], start: int, block_ids: Sequence[int], state_slot: int, valid_from: int
    ) -> None:
        """Recompute a state over tokens [start, start + len(token_ids)): priced in the next
        step as a chunk of those tokens over their context."""
        num_tokens = len(token_ids)
        self._replays.append((num_tokens, start + num_tokens))
        self.num_replayed_tokens += num_tokens

    # ---- the host tier ---------------------------------------------------------------------

    def to_host(self, block_ids: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """An entry of `block_bytes` bytes per block (no bytes behind it until a tier copies it)."""
        self.num_blocks_to_host += len(block_ids)
        entry = torch.zeros(1, dtype=torch.uint8).expand(self.block_bytes)
        return [{"kv": entry} for _ in block_ids]

    def to_device(self, block_ids: Sequence[int], blocks: Sequence[dict[str, torch.Tensor]]) -> None:
        self.num_blocks_to_device += len(block_ids)

    def drop_blocks(self, block_ids: Sequence[int]) -> None:
        pass

    # ---- V4's window snapshots (persistent tiers) --------------------------------------------

    def snapshot_bytes(self, boundary: int, num_rows: int) -> int:
        """A window snapshot at `boundary` (storage/dsv4.py `window_snapshot`): the window
        rows of its last min(num_rows, boundary, n_win) tokens, every layer, and the
        compressor rows pending there; inside a span (a swapped-out state) also the
        unfinished span's entries (`DSV4Spec.pending_state_bytes`)."""
        window = min(num_rows, boundary, self.spec.window) * self.window_row_bytes
        if boundary % self.spec.span == 0:
            return window + self.boundary_bytes
        compressor = "float64" if self.state_dtype in ("float64", "fp64") else "float32"
        return window + int(self.spec.pending_state_bytes(boundary, self.state_dtype, compressor))

    def window_snapshot(
        self, slot: int, boundary: int, num_rows: int, *, unfinished_span: bool = False
    ) -> dict[str, torch.Tensor]:
        """The tier entry: `snapshot_bytes` bytes (none behind them until a tier copies them)."""
        num_bytes = self.snapshot_bytes(boundary, num_rows)
        self.num_window_snapshots += 1
        self.window_bytes_moved += num_bytes
        self._moved += num_bytes  # read from the state
        return {"window": torch.zeros(1, dtype=torch.uint8).expand(num_bytes)}

    def restore_window(self, slot: int, boundary: int, snapshots: list[tuple[int, dict[str, torch.Tensor]]]) -> None:
        self.num_window_restores += 1
        num_bytes = sum(t.numel() * t.element_size() for _, ts in snapshots for t in ts.values())
        self.window_bytes_moved += num_bytes
        self._moved += num_bytes  # into the state

    # ---- figures ---------------------------------------------------------------------------

    def kv_read_bytes(self, num_context_tokens: int) -> int:
        return self._kv_read_bytes(num_context_tokens)

    def cache_stats(self, cache: Any) -> dict[str, float]:
        return {
            "kv_capacity_bytes": self.kv_capacity_bytes,
            "state_blocks": self.num_state_blocks,
            "replayed_tokens": self.num_replayed_tokens,
            "copied_blocks": self.num_copied_blocks,
            "checkpoint_copies": self.num_checkpoint_copies,
        }

    def check_integrity(self) -> None:
        assert self.busy_s >= 0 and self._moved >= 0


def _one_on(lead: tuple | None, starts: Sequence[int]) -> np.ndarray | None:
    """`lead`'s positions array, each one on (in place: the executor's own; the pricing keeps
    it and a uint64 view of it, CostModel._decode_view, which read its buffer as it is now),
    where `starts` is its ends list, as long as the array, with the first and last it had
    (`_lead_positions`); else None."""
    if lead is None or starts is not lead[0]:
        return None
    at = lead[1]
    if len(at) != len(starts) or starts[0] != lead[2] or starts[-1] != lead[3]:
        return None
    at += 1
    return at


def answer_seed(request_id: str) -> int:
    """The sampling seed that names `request_id`'s answer stream (workload/tokens.py
    `stream_key`, as a signed 64-bit seed)."""
    key = stream_key(request_id)
    return key - (1 << 64) if key >= 1 << 63 else key


class AnswerSampler:
    """The engine's sampler for the simulator: token `position` of the answer stream the
    request's seed names (`answer_seed`: deterministic per request, so a later turn of a
    session carries exactly the answer its prefix cache holds); sample j > 0 of a request
    with n > 1 answers a stream of its own. The logits row is not read.

    Called once per generated token (millions in a fleet run): a request's first call makes
    its whole answer, max_tokens tokens, in one vectorised pass (workload/tokens.py
    `stream_tokens`), and each call then reads its position from it; the answer goes when
    its last token is read (the request ends there: ignore_eos), and all of them when more
    than `max_streams` are held (a request that ends early: they are remade on demand, the
    same tokens). Past its max_tokens, and for sample j > 0, a token is `token_at` inlined.
    Its naive twin: token_at, which tests/test_sim_stream.py compares it with.

    `sample` is its batch form (engine/batch_sampler.py `StepSampler`): a step's rows at once,
    the same tokens as a call a row (its twin, which tests/test_sim_stream.py compares it
    with), so the engine takes its batched decode path, one call a step. It holds no stream:
    a row's token is token_at(its key, its position) made for the whole batch in numpy from
    two int64 columns (each row's key + STREAM_MULT and origin), a stream past max_tokens
    being the same hash (the per-row call's own rule there), so a row that joins costs its
    key, not its answer's tokens (making them and taking each one's int object, a likely
    cache miss at a fleet run's scale, cost ~50 us a join)."""

    def __init__(
        self,
        vocab_size: int,
        ints: Sequence[int] | None = None,
        max_streams: int = 65536,
        executor: CostExecutor | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        # the token ints, one object each (tokens.int_table: shared with the prompts and the
        # other replicas), so a token kept costs a pointer, not a new int
        self._ints = list(range(vocab_size)) if ints is None else ints
        if len(self._ints) != vocab_size:
            raise ValueError(f"ints holds {len(self._ints)} tokens, not the vocabulary's {vocab_size}")
        # the same objects in an object array: a step's token ids index it in numpy
        self._int_array = np.array(self._ints, dtype=object)
        self.max_streams = max_streams
        self._answers: dict[int, list[int]] = {}  # seed -> its answer's tokens, while its request runs
        # `sample`'s batch: the last step's owners, and id(owner) -> (start, origin, owner) for
        # the owners of the last batches (start: the row's stream key + STREAM_MULT, wrapping,
        # as int64 bits; the entry holds its owner, so no id in it is another object's; pruned
        # to the batch's when it holds 16 more). `_cols` [2, capacity] int64, rows [0,
        # len(_owners)) used, holds each row's start and origin (`_starts`, a uint64 view, and
        # `_origins`: views of those rows), so a step's tokens are made from the lengths alone.
        self._owners: list[object] = []
        self._kept: dict[int, tuple[int, int, object]] = {}
        self._cols = np.zeros((2, 256), dtype=np.int64)
        self._views()
        # `executor`: the engine's executor (the same engine's), whose `carried_ends` tells
        # a step whose lengths list is the last step's, row by row, one on. Then, for the same
        # owners, the last step's hashes' first terms (`_x`, [n] uint64: key + (position + 1)
        # x STREAM_MULT, made from the lengths list `_ends`) move one position on: no length read
        self._executor = executor
        self._x = np.zeros(0, dtype=np.uint64)
        self._ends: list[int] | None = None

    def _views(self) -> None:
        """`_starts`, `_origins`: the batch's rows of `_cols` (after it changed)."""
        cols, n = self._cols, len(self._owners)
        self._starts, self._origins = cols[0, :n].view(np.uint64), cols[1, :n]

    def __call__(self, row: object, params: SamplingParams, sample_index: int, position: int) -> int:
        if not sample_index:
            answer = self._answers.get(params.seed)
            if answer is None:
                answer = self._answer(params)
            if position < len(answer) - 1:
                return answer[position]
            if position == len(answer) - 1:  # its last token: the request ends with it
                del self._answers[params.seed]
                return answer[position]
            key = params.seed % _MOD
        else:
            key = stream_key(f"{params.seed}/{sample_index}")
        x = (key + (position + 1) * STREAM_MULT) & MASK64  # token_at(key, position, vocab_size)
        x ^= x >> 31
        x = (x * STREAM_MIX) & MASK64
        x ^= x >> 29
        return self._ints[x % self.vocab_size]

    def _answer(self, params: SamplingParams) -> list[int]:
        """The request's answer, positions [0, max_tokens), held until its last token is read."""
        if len(self._answers) >= self.max_streams:
            self._answers.clear()
        tokens = stream_tokens([params.seed % _MOD], [params.max_tokens], self.vocab_size)
        answer = self._answers[params.seed] = self._int_array[tokens].tolist()
        return answer

    def sample(
        self,
        logits: Sequence[object],
        owners: Sequence[object],
        rows: RowsOf,
        lengths: Callable[[], Iterable[int]],
    ) -> list[int]:
        """A step's tokens (StepSampler.sample's contract; the logits are not read): row i's
        is `self(None, params[i], sample_indices[i], lengths()[i] - origins[i])`, each row's
        key and origin kept while its owner stays in the batch (the owners that join have
        theirs read with rows(joined)). A step reads only the lengths: in numpy, each row's
        position (its length less its origin, checked non-negative at once) hashed from its
        start (`mix_tokens`) and the tokens gathered from the int table (no Python int made
        or read a row but the lengths and the tokens). Where the engine's executor (`executor`)
        says the lengths list is the last step's, one on, row by row (its `carried_ends`, of
        the engine's decode columns), and the owners are the last step's, not even the lengths
        are read: the last step's first terms move one position on (tests/test_sim_stream.py
        holds it to a call a row)."""
        n = len(owners)
        if len(logits) != n:
            raise ValueError(f"AnswerSampler: {len(logits)} logit rows but {len(owners)} owners")
        last = self._owners
        same = len(last) == n and all(map(is_, owners, last))
        if not same:
            self._batch(owners, rows)
        ends = lengths()
        executor = self._executor
        at = None
        if executor is not None:
            carried = executor.carried_ends
            if same and carried is not None and carried[1] is ends and carried[0] is self._ends:
                # the same rows, each one token on (the executor's `carried_ends`): the last
                # step's first terms one position on, STREAM_MULT more (wrapping)
                self._ends = ends
                x = self._x
                x += _MULT_U64
                return self._int_array[mix_tokens(x.copy(), self.vocab_size).view(np.intp)].tolist()
            known = executor.step_ends
            if known is not None and known[0] is ends and len(known[1]) == n:
                at = known[1] + 1  # the lengths' int64s: the step's positions (the executor's) + 1
        self._ends = None
        if at is None:
            if type(ends) is not list:  # (an iterable is read once: the slow path reads it again)
                ends = list(ends)
            at = self._int64s(ends, n)
            if at is None:
                return self._sample_rows(ends)
        x = (at - self._origins).view(np.uint64)  # the positions (a negative one is past 2^63 as a uint64)
        if n and int(x.max()) >> 63:
            return self._sample_rows(list(ends))
        x *= _MULT_U64  # key + (position + 1) x STREAM_MULT, wrapping: token_at's first term
        x += self._starts
        self._x, self._ends = x.copy(), ends  # (the next step's, where it is these rows one on)
        return self._int_array[mix_tokens(x, self.vocab_size).view(np.intp)].tolist()  # (< vocab: the same bits)

    @staticmethod
    def _int64s(ends: list[int], n: int) -> np.ndarray | None:
        """The lengths as int64s, where they are n ints within int64 (else None: the slow
        path reads them, and names what is wrong)."""
        try:  # (ints only, into int64 at C speed: a float, a str or an int past int64 raise)
            at = np.frombuffer(array("q", ends), np.int64) if n else np.zeros(0, np.int64)
        except (TypeError, OverflowError):
            return None
        return at if len(at) == n else None

    def _sample_rows(self, ends: list[int]) -> list[int]:
        """`sample`'s tokens a row at a time (token_at of each row's key at its position),
        where the lengths are not as many int64s as rows or a position is negative (a
        ValueError naming them)."""
        origins = self._origins.tolist()
        positions = list(map(sub, ends, origins))  # (>= 0: a sequence holds its prompt)
        if len(positions) != len(ends) or len(ends) != len(origins) or min(positions, default=0) < 0:
            raise ValueError(f"AnswerSampler: {len(origins)} rows but lengths minus origins {positions}")
        ints, vocab_size = self._ints, self.vocab_size
        return [
            ints[token_at((start - STREAM_MULT) & MASK64, p, vocab_size)]
            for start, p in zip(self._starts.tolist(), positions, strict=True)
        ]

    def sample_rows(
        self,
        logits: Sequence[object],
        params: Sequence[SamplingParams],
        sample_indices: Sequence[int],
        positions: Sequence[int],
    ) -> list[int]:
        """Rows outside a step's batch (a forked sample's first token): a call each."""
        return [self(None, p, j, position) for p, j, position in zip(params, sample_indices, positions, strict=True)]

    def _batch(self, owners: Sequence[object], rows: RowsOf) -> None:
        """Take `owners` as the batch. Where it is the last batch less some rows, then rows
        appended (the engine's: rows end anywhere, rows join at the end), the last batch is
        edited in place (`_leavers`): the rows that left deleted from `_cols`, the others'
        kept where they are, no row's object read (a new list of every row's entry would
        touch each one: a cache miss a row at a fleet run's scale), the rows after them
        appended (`_append`); else it is made again from `_kept` (`_rebuild`). Either way the
        rows whose owners `_kept` holds are as they were and the others' keys are read
        (`_join`). Its twin: the batch made whole (`_rebuild`), which tests/test_sim_stream.py
        holds it to."""
        last = self._owners
        gone = _leavers(owners, last)
        if gone is None:
            self._rebuild(owners, rows)
            return
        if gone:
            cols, n = self._cols, len(last)
            for i in reversed(gone):  # (a shift of the rows after it: a step ends a few rows of many)
                del last[i]
                cols[:, i : n - 1] = cols[:, i + 1 : n]
                n -= 1
            self._views()
        # last is owners[:len(last)] now: the rows after it joined (or came back)
        start = len(last)
        if start < len(owners):
            kept = self._kept
            entries = list(map(kept.get, map(id, owners[start:])))
            if None in entries:
                self._join(owners, rows, entries, start)
            last += owners[start:]
            self._append(entries)
        elif gone and len(self._kept) > len(owners) + 16:  # a batch that shrank with none joining
            kept = self._kept
            self._kept = {id(owner): kept[id(owner)] for owner in owners}

    def _append(self, entries: list[Any]) -> None:
        """Rows of `entries` (kept entries), the last of `_owners`: their columns set (the
        columns grown where they do not fit)."""
        num_rows = len(self._owners)
        n = num_rows - len(entries)  # the rows before them
        cols = self._cols
        if num_rows > cols.shape[1]:
            grown = np.zeros((2, 2 * num_rows), dtype=np.int64)
            grown[:, :n] = cols[:, :n]
            cols = self._cols = grown
        if len(entries) == 1:  # (a few a step: numpy's scalar writes)
            cols[0, n], cols[1, n] = entries[0][:2]
        else:
            cols[:, n:num_rows] = [[e[0] for e in entries], [e[1] for e in entries]]
        self._views()

    def _join(self, owners: Sequence[object], rows: RowsOf, entries: list[Any], start: int) -> None:
        """Make the entries of the rows `entries` (owners[start:]'s `_kept` entries) lacks:
        entries[i] becomes row start + i's entry, kept in `_kept` (pruned to the batch's
        owners first when it holds over 16 more)."""
        joined = [start + i for i in compress(range(len(entries)), map(is_, entries, repeat(None)))]
        params, sample_indices, origins = rows(joined)
        if not len(params) == len(sample_indices) == len(origins) == len(joined):
            raise ValueError(
                f"AnswerSampler: {len(joined)} rows joined but rows() gave {len(params)} params, "
                f"{len(sample_indices)} sample indices, {len(origins)} origins"
            )
        kept = self._kept
        if len(kept) + len(joined) > len(owners) + 16:  # over 16 owners gone since: forgotten
            kept = self._kept = {id(owner): kept[id(owner)] for owner in owners[:start]}
            kept.update((id(owners[start + i]), e) for i, e in enumerate(entries) if e is not None)
        for i, p, j, origin in zip(joined, params, sample_indices, origins, strict=True):
            key = p.seed % _MOD if not j else stream_key(f"{p.seed}/{j}")
            start_bits = (key + STREAM_MULT) & MASK64
            owner = owners[i]
            entries[i - start] = kept[id(owner)] = (
                start_bits - _MOD if start_bits >> 63 else start_bits,  # (int64 bits: `_cols`)
                origin,
                owner,
            )

    def _rebuild(self, owners: Sequence[object], rows: RowsOf) -> None:
        """`_batch` made whole: every row's entry looked up in `_kept` by its owner, those
        missing made (`_join`), the columns written anew."""
        kept = self._kept
        entries = list(map(kept.get, map(id, owners)))
        if None in entries:  # (an entry is a tuple: `in` compares it with None by identity first)
            self._join(owners, rows, entries, 0)
        elif len(kept) > len(owners) + 16:  # a batch that shrank with none joining (a replica draining)
            self._kept = {id(owner): entry for owner, entry in zip(owners, entries, strict=True)}
        self._owners = list(owners)
        self._cols = np.zeros((2, max(2 * len(owners), 256)), dtype=np.int64)
        if entries:
            self._append(entries)
        else:
            self._views()

    def batch_rows(self) -> list[tuple[int, int]]:
        """Each batch row's (stream key, origin) as `_cols` hold them (tests read the batch
        through it)."""
        return [
            ((start - STREAM_MULT) & MASK64, origin)
            for start, origin in zip(self._starts.tolist(), self._origins.tolist(), strict=True)
        ]


def _leavers(owners: Sequence[object], last: list[object]) -> list[int] | None:
    """The rows of `last` (increasing) whose deletion leaves owners[:k] for some k, found
    by identity in C-level runs between them (a pass each: a step ends a few rows of many);
    None where more than max(4, a quarter of last's rows) would go (a batch of its own:
    `_rebuild` makes it whole). A row that moved is one that left, then came back."""
    gone: list[int] = []
    i = j = 0
    n, m = len(owners), len(last)
    limit = max(4, m // 4)
    while j < m:
        # the run of rows in place from (i, j): owners[i + t] is last[j + t]
        run = next(compress(count(), map(is_not, islice(owners, i, None), islice(last, j, None))), None)
        if run is None:
            run = min(n - i, m - j)
        i += run
        j += run
        if j < m:  # last[j] is not owners[i] (or owners ended): it left
            if len(gone) == limit:
                return None
            gone.append(j)
            j += 1
    return gone
