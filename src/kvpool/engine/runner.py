"""The model runner: one class for every model, its cache decisions in one place.

The scheduler (engine/engine.py) never sees block ids, tensors or the model's family. It
asks the runner to admit a request (with prefix lookup), to reserve room for the next
tokens of a whole step, to execute the step's token chunks and return logits, to commit
the computed tokens (with each request's sampled next token), and to release a request
(finish, cancel, preempt).

`ModelRunner` owns three things:
  - `cache`: the cache coordinator of cache/ (FullAttentionManager for a Llama,
    HybridCacheManager over the groups of a hybrid model, DSV4CacheManager for V4's dual
    pool); it keeps every id and decides every allocation, hit, copy and restore method;
  - `bridge`: the one TierBridge (engine/tier_bridge.py) to the host, disk and Redis tiers;
  - `executor`: the model's tensor work (engine/llama_runner.py `LlamaExecutor`,
    engine/hybrid_runner.py `HybridExecutor`, engine/dsv4_runner.py `DSV4Executor`).
Everything that is a decision lives here, once: admission (with the lower-tier loads, V4's
prefetch and install, the swap-in of a preempted request's tail), the state restore of an
admission (fresh, from a checkpoint, from the tiers' window snapshots, by a replay deferred
to the step that needs the state), reservation (with the offload of the blocks it
evicted), the step (V4: cut at the state checkpoints and window snapshots it takes),
commit (with the write-through of the blocks it published), release (with the swap-out
decision of a preemption), fork (with the state copy), and the figures.

`pieces` (a cache with a V4 dual-pool group, read off the cache) marks what is V4's
alone: a step cut into pieces at its state checkpoints and window snapshots (the executor
copies no state inside a forward; a hybrid model's executor copies its recurrent
checkpoints itself), the window snapshots (they need the executor's window), and the
report's `replayed_tokens`. The tier figures need no mark: a lower tier's blocks come
back by prefetch (the bridge counts them) or by an admission's loads. The moves
themselves (eviction saves, loads, prefetch, write-through, swap, window snapshots) are
the bridge's, called here with the cache and the executor.

The executor interface (`Executor` below) is what a model's tensors must do and nothing
more; it never changes the cache (it may read the tables the cache holds, to turn them
into its attention backend's plan) and decides nothing, so a cost executor can price
every call without tensors:
  - `forward(chunks, cache, all_logits)`: one forward over the step's chunks, each
    computing positions [start, start + len(token_ids)) of one request over a context of
    start + len(token_ids) tokens, the chunk's blocks already reserved; returns logits
    [rows, vocab]: the last token of each chunk with needs_logits, or (all_logits) every
    token of every chunk, in chunk order.
  - `copy_blocks(copies)`: apply the cache's copy-on-write copies {group: [BlockCopy]}
    before anything writes (a cost: two block moves per copy).
  - `to_host(block_ids)` / `to_device(block_ids, blocks)`: one dict of tensors per block
    (the tier entry's layout, `block_layout`), read from or written into the device blocks.
  - `reset_state(slot)`, `copy_state(src, dst)`: a per-request state slot (recurrent or V4
    state block) zeroed, or copied from another (a checkpoint restored or taken, a fork);
    `copy_whole_state(src, dst)`: a copy of a whole state block off the span grid (a V4
    spilled turn end, out or back: `StateRestore.whole`), priced apart by the simulator.
  - `replay(token_ids, start, block_ids, state_slot, valid_from)`: recompute a V4 state
    over tokens [start, start + len(token_ids)) on top of cached blocks (a cost: a forward
    of those tokens with their context).
  - V4 only: `window_snapshot(slot, boundary, num_rows, unfinished_span=False)` (the state
    at a block boundary as a tier entry; unfinished_span: at any position, a swap's state
    entry), `restore_window(slot, boundary, snapshots)` (the state set from
    them); `spec` (the model's DSV4Spec).
  - `drop_blocks(block_ids)`: blocks nobody holds any more (a quantized pool's tails).
  - `kv_read_bytes(num_context_tokens)`, `cache_stats(cache)` (the report's figures of
    the executor's tensors, and of the cache as its model reports it), `reports(num_steps)`
    (optional: the executor's own tier report, V4's "hisparse"), `check_integrity()`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, compress, pairwise, repeat
from operator import add, attrgetter, sub
from typing import Any, NamedTuple, Protocol, overload

import torch

from kvpool.attention.backends.step_buffers import StepBuffers
from kvpool.cache import Admission, BlockCopy, CacheDescriptor, CacheUsage, ReleaseReason
from kvpool.cache.types import LookupPrompt
from kvpool.engine.memory import StepPeaks
from kvpool.engine.tier_bridge import TierBridge
from kvpool.tiers import BlockDescriptor
from kvpool.tiers.swa import SWAStrategy

PREEMPTION_MODES: tuple[str, ...] = ("recompute", "swap", "auto")
_NEEDS_LOGITS, _NUM_ALLOCATED = attrgetter("needs_logits"), attrgetter("num_allocated")


def _join_rows(outs: Sequence[Any], order: list[int] | None) -> Any:
    """The logits rows of several forwards joined, then (order) those rows in that order:
    tensors [rows, vocab] joined as one, or the lists of rows a cost executor returns
    (sim/executor.py `CostExecutor.forward`: the engine indexes one row per token)."""
    if isinstance(outs[0], torch.Tensor):
        joined = torch.cat(outs)
        return joined if order is None else joined[torch.tensor(order, dtype=torch.long)]
    rows = list(chain.from_iterable(outs))
    return rows if order is None else [rows[i] for i in order]


class ScheduledChunk(NamedTuple):
    """One sequence's work in a step: compute KV for positions [start, start + len(token_ids)).
    `request_id` is the id the cache knows the sequence by (the engine's `seq_id`: a request's
    sample, "req-1/0"), as every runner and cache call names it.
    (A named tuple: the engine makes one per sequence per step, a frozen dataclass costs 3x.)"""

    request_id: str
    token_ids: list[int]
    start: int
    needs_logits: bool  # True when the chunk ends at the sequence's last known token (sample next)


class StepChunks(Sequence[ScheduledChunk]):
    """A step's chunks as the engine plans a step that begins with its decode columns: the
    leading decodes held as columns, chunk i < len(lead_tokens) being
    ScheduledChunk(lead_ids[i], [lead_tokens[i]], lead_starts[i], True), then the other
    chunks as they are (`rest`). The leading chunks are made only when something reads
    them as chunks (iterating, indexing below them: `rows`); a reader of columns takes
    `columns` (every chunk's request id, start and end = start + len(token_ids), which the
    engine sets once the step is planned) through `step_columns`, and the count of chunks
    needing logits through `num_logits`. A sequence equal to the list of its chunks; the
    columns are never changed (the engine makes new ones each step)."""

    __slots__ = ("lead_ids", "lead_tokens", "lead_starts", "rest", "columns", "_rows")

    def __init__(
        self,
        lead_ids: Sequence[str],
        lead_tokens: Sequence[int],
        lead_starts: Sequence[int],
        rest: Sequence[ScheduledChunk] = (),
    ) -> None:
        if not len(lead_ids) == len(lead_tokens) == len(lead_starts):
            raise ValueError(f"StepChunks: {len(lead_ids)} ids, {len(lead_tokens)} tokens, {len(lead_starts)} starts")
        self.lead_ids, self.lead_tokens, self.lead_starts = lead_ids, lead_tokens, lead_starts
        self.rest: list[ScheduledChunk] = list(rest)
        # (request ids, starts, ends) of every chunk, in order: set by the planner, None till then
        self.columns: tuple[Sequence[str], Sequence[int], Sequence[int]] | None = None
        self._rows: list[ScheduledChunk] | None = None

    def append(self, chunk: ScheduledChunk) -> None:
        """A chunk after the others (the columns, if set, no longer cover it: unset)."""
        self.rest.append(chunk)
        if self._rows is not None:
            self._rows.append(chunk)
        self.columns = None

    def rows(self) -> list[ScheduledChunk]:
        """Every chunk as a ScheduledChunk, in order (the leading ones made here, once:
        tuple.__new__ over the zipped columns, a named tuple's own __new__ being Python)."""
        rows = self._rows
        if rows is None:
            lead = zip(self.lead_ids, map(list, zip(self.lead_tokens)), self.lead_starts, repeat(True))
            rows = self._rows = list(map(tuple.__new__, repeat(ScheduledChunk), lead))
            rows += self.rest
        return rows

    def __len__(self) -> int:
        return len(self.lead_tokens) + len(self.rest)

    def __iter__(self) -> Iterator[ScheduledChunk]:
        return iter(self.rows())

    @overload
    def __getitem__(self, index: int) -> ScheduledChunk: ...

    @overload
    def __getitem__(self, index: slice) -> list[ScheduledChunk]: ...

    def __getitem__(self, index: int | slice) -> ScheduledChunk | list[ScheduledChunk]:
        """A chunk, or a list of them; the `rest` alone are read without making the leading ones."""
        k = len(self.lead_tokens)
        if self._rows is None:
            if isinstance(index, slice):
                start = index.start
                # (the common slice, chunks[i:] past the leading chunks: the rest's own slice,
                # without the Python-level len() that `indices` asks for)
                if index.stop is None and index.step is None and start is not None and start >= k:
                    return self.rest[start - k :]
                start, stop, step = index.indices(len(self))
                if step == 1 and start >= k:
                    return self.rest[start - k : max(stop - k, 0)]
            else:
                i = index + len(self) if index < 0 else index
                if k <= i < len(self):
                    return self.rest[i - k]
        return self.rows()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepChunks):
            return self.rows() == other.rows()
        if isinstance(other, list):
            return self.rows() == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # (mutable, as a list)

    def __repr__(self) -> str:
        return f"StepChunks({self.rows()!r})"


def step_columns(chunks: Sequence[ScheduledChunk]) -> tuple[Sequence[str], Sequence[int], Sequence[int]]:
    """The chunks' request ids, starts and ends (start + len(token_ids)): a `StepChunks`'
    columns where the engine set them, else the chunks transposed in C-level passes (the
    twin: the test runner of tests/test_engine_scheduler.py holds every StepChunks' columns
    to it)."""
    if type(chunks) is StepChunks and chunks.columns is not None:
        return chunks.columns
    if not chunks:
        return (), (), []
    # (a chunk is a named tuple of four fields: strict would check nothing, at a fifth of the pass)
    ids, token_ids, starts, _ = zip(*chunks, strict=False)
    return ids, starts, list(map(add, starts, map(len, token_ids)))


def num_logits(chunks: Sequence[ScheduledChunk]) -> int:
    """How many of the chunks need logits: a `StepChunks`' leading decodes all do (counted
    without making them), the other chunks' needs_logits counted."""
    if type(chunks) is StepChunks:
        return len(chunks.lead_tokens) + sum(map(_NEEDS_LOGITS, chunks.rest))
    return sum(map(_NEEDS_LOGITS, chunks))


def prefill_step_tokens(chunks: Sequence[ScheduledChunk]) -> int:
    """The step's number of tokens where some chunk computes more than one (a step with a
    prefill chunk), else 0. A `StepChunks`' leading decodes (one token each) are counted,
    not made: only its other chunks are read (any other sequence of chunks is read whole,
    the twin: tests/test_step_chunks.py holds the two to each other)."""
    if type(chunks) is StepChunks:
        rest = chunks.rest
        if all(len(chunk.token_ids) == 1 for chunk in rest):
            return 0
        return len(chunks.lead_tokens) + sum(len(chunk.token_ids) for chunk in rest)
    if any(len(chunk.token_ids) > 1 for chunk in chunks):
        return sum(len(chunk.token_ids) for chunk in chunks)
    return 0


def last_token_rows(chunks: Sequence[ScheduledChunk]) -> list[int]:
    """The row of each chunk's last token in the step's tokens (the chunks' in order), for
    the chunks that need logits: where an all-token forward's logits are sampled."""
    rows, offset = [], 0
    for c in chunks:
        offset += len(c.token_ids)
        if c.needs_logits:
            rows.append(offset - 1)
    return rows


@dataclass(frozen=True)
class StepResult:
    """Logits of every token a request computed in a `step`: [num_tokens, vocab] fp32."""

    request_id: str
    start: int
    logits: torch.Tensor


class MeasuredRestoreCost:
    """The "auto" restore priced by the runner's own timings, in seconds (cache/dual_pool.py
    `RestoreCost`): a checkpoint copy at the mean of the state copies it has made, computing
    at the seconds per token of its replays; until both are measured, in tokens (TokenCost:
    a copy is free), as preemption's "auto" swaps until it knows both of its rates."""

    def __init__(self) -> None:
        self.num_copies = 0
        self.copy_s = 0.0
        self.num_replayed_tokens = 0
        self.replay_s = 0.0

    @property
    def version(self) -> tuple[int, float, int, float]:
        """Every total the prices are made of (`RestoreCost.version`): each copy and replay
        the runner times moves a count, so a lookup cut under other prices is never taken
        again by an admission (whoever writes the totals, no bump to forget)."""
        return (self.num_copies, self.copy_s, self.num_replayed_tokens, self.replay_s)

    def _measured(self) -> bool:
        return self.num_copies > 0 and self.num_replayed_tokens > 0

    def checkpoint_cost(self) -> float:
        return self.copy_s / self.num_copies if self._measured() else 0.0

    def compute_cost(self, num_tokens: int, context_len: int) -> float:
        if self._measured():
            return num_tokens * self.replay_s / self.num_replayed_tokens
        return float(num_tokens)


class Executor(Protocol):
    """A model's tensor work on its cache's storage (the module docstring says what each
    call means and costs). `block_layout`: one block's tensors as a tier keeps them (name
    -> dtype, shape), {} for a cache no tier serves; `block_bytes`: their bytes."""

    model: Any
    attention: Any
    kv_format: str  # the report's name of the storage format
    vocab_size: int
    peaks: StepPeaks  # the largest step's allocations, for the memory ledger
    block_layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    block_bytes: int
    keeps_block_state: bool  # True: `drop_blocks` must hear of blocks nobody holds any more
    has_state: bool  # requests hold a state slot (recurrent, V4): reset, restored, copied on fork

    def forward(self, chunks: Sequence[ScheduledChunk], cache: Any, all_logits: bool) -> torch.Tensor: ...

    def copy_blocks(self, copies: Mapping[str, Sequence[BlockCopy]]) -> None: ...

    def to_host(self, block_ids: Sequence[int]) -> list[dict[str, torch.Tensor]]: ...

    def to_device(self, block_ids: Sequence[int], blocks: Sequence[dict[str, torch.Tensor]]) -> None: ...

    def reset_state(self, slot: int) -> None: ...

    def copy_state(self, src: int, dst: int) -> None: ...

    def copy_whole_state(self, src: int, dst: int) -> None: ...

    def replay(
        self, token_ids: Sequence[int], start: int, block_ids: Sequence[int], state_slot: int, valid_from: int
    ) -> None: ...

    def drop_blocks(self, block_ids: Sequence[int]) -> None: ...

    def kv_read_bytes(self, num_context_tokens: int) -> int: ...

    def cache_stats(self, cache: Any) -> dict[str, float]: ...

    def check_integrity(self) -> None: ...


class ModelRunner:
    """The engine's runner over `cache` (a coordinator of cache/, whose lower tier is the
    bridge's index), `executor` (the model's tensors) and `bridge` (the tiers: a host tier
    below the device pool (kvpool.tiers.HostTier), to which the cached blocks the pool
    evicts are written and from which an admission loads the prefix it holds; the disk and
    Redis tiers below it, to which every block that becomes a full cached block is written
    through in the background). capacity_tokens: the most tokens one request can hold
    alone; max_model_len: the longest request (prompt + output); block_size: tokens per
    block (as the tiers key them). preemption: what a
    preempted request's cache becomes (PREEMPTION_MODES): "recompute" (its full blocks stay
    findable in the prefix cache and the tier like anyone's, the rest is computed again),
    "swap" (its blocks are written to the host tier at once, its partial tail block too,
    V4 its state (window, pending compressor rows, unfinished span's entries) as a state
    entry, and loaded back when it resumes: a V4 resume replays nothing), "auto" (swap
    when moving the bytes costs less than recomputing the tokens, by the rates this runner
    has measured). checkpoint_base: the
    executor's state slot of the cache's checkpoint slot s is checkpoint_base + s (V4's
    pooled checkpoints: s is the snapshot's first classical block, storage/dsv4.py)."""

    def __init__(
        self,
        cache: Any,
        executor: Executor,
        bridge: TierBridge,
        *,
        descriptor: CacheDescriptor,
        block_size: int,
        capacity_tokens: int,
        max_model_len: int,
        preemption: str = "recompute",
        checkpoint_base: int = 0,
        restore_cost: MeasuredRestoreCost | None = None,
        swa: SWAStrategy | None = None,
    ) -> None:
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption {preemption!r}; one of {', '.join(PREEMPTION_MODES)}")
        if preemption != "recompute" and bridge.host_tier is None:
            raise ValueError(f"preemption {preemption!r} needs a host tier (--host-cache-gib) and prefix caching")
        self.cache = cache
        # the cache's pools (fixed at its construction), whose allocations the engine counts
        # around every admit and reserve_step: `cache.pools` makes a new list a call
        self._pools = tuple(cache.pools)
        self.executor = executor
        self.block_size = block_size
        self.vocab_size = executor.vocab_size
        self.capacity_tokens = capacity_tokens
        self.max_model_len = max_model_len
        self.preemption = preemption
        self.pieces = bool(cache.dual_groups)  # V4's dual pool: steps in pieces, window snapshots
        # The group whose state slot the executor keeps (recurrent layers, else V4's dual
        # pool; None: no state), named in the cache's `part` (no default of several groups)
        stateful = [*cache.recurrent_groups, *cache.dual_groups]
        self.state_group = stateful[0].name if stateful else None
        self.restore_cost = restore_cost if restore_cost is not None else MeasuredRestoreCost()
        self.checkpoint_base = checkpoint_base
        self.num_replayed_tokens = 0  # tokens recomputed by prefix-hit restores (for reports)
        self.replay_s = 0.0
        # deferred restores by recompute, by request, oldest first: (the hit's tokens, the
        # state slot, first position to recompute, first window position the state holds)
        self._replays: dict[str, tuple[int, int, int, int]] = {}
        # requests whose admission raised and whose release then raised too (`_admit`): the
        # cache may still hold them; their next admission (or release) releases them first
        self._abandoned: set[str] = set()
        self.num_steps_run = 0  # engine steps executed (for per-step figures)
        self._prefill_tokens = 0  # tokens of the steps that carried a prefill chunk, and their seconds (auto)
        self._prefill_s = 0.0
        # the step metadata in persistent buffers (attention/backends/step_buffers.py) that a
        # GPU backend or a CUDA graph reads, the executor's when it keeps them (the Llama
        # executor's decode modes); None: the backends plan from the step's tables
        self.step_buffers: StepBuffers | None = getattr(executor, "step_buffers", None)
        self.bridge = bridge
        # the names the CLI, P/D and the tests read: the bridge's own objects, not copies
        self.host_tier, self.persistent_tiers = self.bridge.host_tier, self.bridge.persistent_tiers
        self.tier, self.tier_index, self.tier_moves = self.bridge.tier, self.bridge.index, self.bridge.moves
        # first: a tier size error comes alone (not after expect_blocks' line on what the directory holds)
        self.bridge.check_sizes(executor.block_bytes, descriptor, executor.block_layout)
        if self.persistent_tiers:  # disk, Redis: an entry that is not a block of this storage is a corrupt miss
            self.bridge.expect_blocks(descriptor, executor.block_layout)
        # window snapshots at block boundaries (dual pool with persistent tiers, tiers/swa.py)
        if self.pieces and self.persistent_tiers:
            self.bridge.swa = (swa or SWAStrategy()).check(block_size)
        self.swa, self.swa_moves = self.bridge.swa, self.bridge.swa_moves
        if self.host_tier is not None:
            if hasattr(self.host_tier, "reclaim"):
                self.host_tier.reclaim(descriptor)  # a tier kept from an engine of other weights

    @property
    def model(self) -> Any:
        return self.executor.model

    @property
    def attention(self) -> Any:
        """The executor's attention backend (attention/backends)."""
        return self.executor.attention

    @property
    def kv_format(self) -> str:
        return self.executor.kv_format

    # ---- requests ------------------------------------------------------------------------

    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        max_new_tokens: int | None,
        *,
        tenant_salt: str = "",
        prompt: LookupPrompt | None = None,
        check_packing: bool = True,
        share_ids: bool = False,
    ) -> Admission | None:
        """Look up the cached prefix of `token_ids` (under the tenant's salt: no tenant hits
        another's), take it (loading what a lower tier holds of it), restore the request's
        state, and reserve room for up to `max_new_tokens` of the rest (None: all of it).
        None: no room now, nothing changed. A restore by recompute is deferred to the start
        of the next `execute` (the admission stays bookkeeping; the replay is compute, done
        in the step that needs the state). `prompt`: `token_ids` packed already
        (`HybridCacheManager.admit`, as `check_packing` and `share_ids`: the engine's sequence
        list, to which it appends each sampled id before the step's `commit_step`)."""
        if max_new_tokens is not None and max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        return self._admit(
            request_id,
            token_ids,
            max_new_tokens,
            tenant_salt,
            defer_replay=True,
            prompt=prompt,
            check_packing=check_packing,
            share_ids=share_ids,
        )

    def add_request(self, request_id: str, token_ids: Sequence[int], *, tenant_salt: str = "") -> Admission | None:
        """V4's dual pool: admit with nothing reserved yet (`step` does that) and the state of
        any prefix hit restored at once; None when no state block is free."""
        return self._admit(request_id, token_ids, 0, tenant_salt, defer_replay=False)

    def _admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        max_new_tokens: int | None,
        tenant_salt: str,
        defer_replay: bool,
        prompt: LookupPrompt | None = None,
        check_packing: bool = True,
        share_ids: bool = False,
    ) -> Admission | None:
        if self._abandoned and request_id in self._abandoned:  # an earlier try's release raised (below)
            self.release(request_id, "cancel")
        if self.tier is not None:
            self.bridge.prefetch(self.cache, self.executor, token_ids, tenant_salt)
        adm = self.cache.admit(
            request_id,
            token_ids,
            max_new_tokens,
            tenant_salt=tenant_salt,
            prompt=prompt,
            check_packing=check_packing,
            share_ids=share_ids,
        )
        if adm is None:
            return None
        self._spill_states()
        # All or nothing: what raises past the cache's admit (a tier's save, load or swap-in, a
        # state restore) releases the request, its swap records and deferred replay with it, so
        # the caller, which saw no admission, may admit it again (else: "already admitted")
        try:
            return self._complete_admission(request_id, adm, token_ids, defer_replay)
        except BaseException:
            # (listed until the release returned: one that raises too, Ctrl-C landing in it, is
            # done at the request's next admission, which would otherwise find it admitted)
            self._abandoned.add(request_id)
            self.cache.give_up_admission(request_id)  # (its stats taken back: admitted again, it counts once)
            self.release(request_id, "cancel")
            raise

    def _complete_admission(
        self, request_id: str, adm: Admission, token_ids: Sequence[int], defer_replay: bool
    ) -> Admission:
        """What an admission the cache made still needs: the evicted blocks saved, the lower
        tier's loads, a swapped-out tail or state back, the state restore."""
        if self.tier is not None:
            # The fresh blocks may be evicted cached ones: save what they held before the
            # loads (or the step) overwrite them.
            self.bridge.save_evicted(self.cache, self.executor)
            loads = [load for part in adm.groups.values() for load in part.loads]
            if loads:
                adm = self.cache.complete_loads(request_id, self.bridge.load(self.executor, loads))
            adm = self.bridge.swap_in(self.cache, self.executor, request_id, adm)
        if any(part.restore is not None for part in adm.groups.values()):
            self._restore_state(request_id, adm, token_ids, defer_replay)
        return adm

    def _restore_state(self, request_id: str, adm: Admission, token_ids: Sequence[int], defer_replay: bool) -> None:
        """The state restore the cache chose for the admission (of its default stateful
        group): a fresh state, the checkpoint copied into the live slot, (V4) a replay of
        the hit's tokens on top of its cached blocks, from the latest window snapshot the
        persistent tiers restore, now or in the next step, or (V4) nothing at all: an
        adopted turn-end state block holds the hit's state already, and so does one the
        swap-in of a preempted request wrote from its state entry."""
        restore = self.cache.part(request_id, self.state_group).restore
        assert restore is not None
        if restore.method in ("adopt", "swap"):  # neither reset nor copied: it is the state at the hit
            return
        if restore.method == "checkpoint":  # (the copy overwrites the whole slot)
            assert restore.checkpoint_slot is not None
            self._copy_state(self.checkpoint_base + restore.checkpoint_slot, restore.state_slot, whole=restore.whole)
            return
        self.executor.reset_state(restore.state_slot)
        if restore.method == "recompute":
            start = valid_from = restore.replay_start  # the zero strategy: nothing before start
            point = self.bridge.restore_window(
                self.cache, self.executor, request_id, adm.num_cached_tokens, restore.state_slot
            )
            if point:  # the state at `point` came from window snapshots: recompute the rest
                start, valid_from = point, 0
            if start >= adm.num_cached_tokens:
                pass
            elif defer_replay:  # (a newer admission replaces it)
                self._replays[request_id] = (adm.num_cached_tokens, restore.state_slot, start, valid_from)
            else:
                self._replay(request_id, list(token_ids), adm.num_cached_tokens, restore.state_slot, start, valid_from)

    def _replay(
        self, request_id: str, token_ids: list[int], num_cached: int, state_slot: int, start: int, valid_from: int
    ) -> None:
        """Recompute tokens [start, num_cached) of the request's prefix hit into `state_slot`
        on top of its cached blocks (DEEPSEEK_V4.md section 6), timed for the "auto" restore."""
        began = time.perf_counter()
        table = self.cache.block_ids(request_id)[: num_cached // self.block_size]
        self.executor.replay(token_ids[start:num_cached], start, table, state_slot, valid_from)
        self.num_replayed_tokens += num_cached - start
        self.replay_s += time.perf_counter() - began
        self.restore_cost.num_replayed_tokens = self.num_replayed_tokens
        self.restore_cost.replay_s = self.replay_s

    def _spill_states(self) -> None:
        """The kept turn-end states the cache spilled to pooled checkpoints (cache/dual_pool.py)
        copied there, before the state blocks they leave are written."""
        for state_slot, checkpoint_slot in self.cache.take_spills():
            self._copy_state(state_slot, self.checkpoint_base + checkpoint_slot, whole=True)

    def _copy_state(self, src: int, dst: int, *, whole: bool = False) -> None:
        """A checkpoint restored or taken: one state slot copied, timed for "auto". whole: a
        state off the span grid (a spilled turn end), which the simulator's executor prices as
        a whole state block (`copy_whole_state`; the engine's copies are whole rows anyway)."""
        began = time.perf_counter()
        (self.executor.copy_whole_state if whole else self.executor.copy_state)(src, dst)
        self.restore_cost.num_copies += 1
        self.restore_cost.copy_s += time.perf_counter() - began

    def reserve_step(self, request_ids: Sequence[str], num_new_tokens: Sequence[int]) -> bool:
        """Room for the next num_new_tokens[i] tokens of each admitted request; all or
        nothing. The cached blocks the reservation evicted are saved to the tier first."""
        fits = self.cache.reserve_step(request_ids, num_new_tokens)
        if self.tier is not None:
            self.bridge.save_evicted(self.cache, self.executor)
        return fits

    def may_reserve_again(self) -> bool:
        """After a step that raised before its commit (its forward, its sampler): the step
        buffers hold no step, and True when the next step may reserve the step's requests
        again as they are: a cache not of exact steps (a repeated reservation of the same step
        replaces the held one) whose executor holds no per-request state. False otherwise: a
        cache of exact steps (the hybrid's attention groups cannot undo a
        step), or an executor whose state a forward that ran, whole or in part, moved past the
        step (V4's compressor, a recurrent layer's; every exact-steps runner here has one): the
        engine then releases the step's requests and recomputes them."""
        if self.step_buffers is not None:
            self.step_buffers.clear()
        return not self.cache.exact_steps and not self.executor.has_state

    def will_recompute(self, request_id: str) -> None:
        """The engine releases the request next, to admit it again and recompute it (a step's
        fault): the cache counts that admission nothing (`HybridCacheManager.will_recompute`)."""
        self.cache.will_recompute(request_id)

    def append_token_ids(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Sampled tokens join the request (their KV is computed by a later step)."""
        self.cache.append_token_ids(request_id, token_ids)

    def commit_step(
        self, request_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]
    ) -> None:
        """The step's tokens have their KV written; each request's sampled token (None: no
        token, or the request has finished) joins it. The blocks the step completed are
        written through to the persistent tiers."""
        self.cache.commit_step(request_ids, num_tokens, next_token_ids)
        if self.persistent_tiers:
            self.bridge.write_through(self.cache, self.executor)

    def fork(self, parent_id: str, child_id: str) -> bool:
        """A child sharing every computed token of the parent (copy-on-write on write), its
        state copied from the parent's. False (nothing changed) when the child cannot get a
        state slot of its own; the engine then recomputes it like a preempted request."""
        if not self.cache.fork(parent_id, child_id):
            return False
        self._spill_states()
        if self.executor.has_state:
            part = self.cache.part
            self.executor.copy_state(
                part(parent_id, self.state_group).state_slot, part(child_id, self.state_group).state_slot
            )
        return True

    def release(self, request_id: str, reason: ReleaseReason = "finish") -> bool:
        """Free the request's cache: reason is "finish", "cancel" or "preempt"; a preempted
        request is swapped out first when the preemption mode says so, a restore still
        waiting to replay goes. Once only: False for a request the runner does not hold."""
        released = self._release(request_id, reason)
        self._abandoned.discard(request_id)  # (after the release: one that raises stays listed)
        return released

    def _release(self, request_id: str, reason: ReleaseReason) -> bool:
        # (each part may be done again: the engine repeats a release that raised)
        self.bridge.drop_swapped(request_id, self.cache)
        if self.step_buffers is not None:
            self.step_buffers.forget(request_id)
        if request_id not in self.cache:
            self._replays.pop(request_id, None)
            return self.cache.release(request_id, reason)
        # a replay still deferred: the state block does not hold the request's state yet
        # (forgotten after the swap-out, so that a repeat swaps out as the first try would)
        replay_pending = request_id in self._replays
        if reason == "preempt" and self._should_swap(request_id):
            self.bridge.swap_out(self.cache, self.executor, request_id, with_state=not replay_pending)
        self._replays.pop(request_id, None)
        if not self.executor.keeps_block_state:
            return self.cache.release(request_id, reason)
        held = self.cache.block_ids(request_id)
        released = self.cache.release(request_id, reason)
        # a partly written block nobody holds any more: its tensor side state goes with it
        self.executor.drop_blocks([b for b in held if self.cache.pool.refcount(b) == 0])
        return released

    def num_computed_tokens(self, request_id: str) -> int:
        return self.cache.num_computed_tokens(request_id)

    def reset_prefix_cache(self) -> bool:
        """The cache's `reset_prefix_cache` (HybridCacheManager): every cached prefix of the
        device pool forgotten. False, nothing changed, while the cache holds a request or a
        swapped-out request waits to resume (its tail or state in the host tier); the tiers
        below keep their entries."""
        if self.bridge.swapped or self.bridge.swapped_states:
            return False
        return self.cache.reset_prefix_cache()

    # ---- the step -------------------------------------------------------------------------

    def execute(self, chunks: Sequence[ScheduledChunk], all_logits: bool = False) -> torch.Tensor:
        """Run one step over the chunks' reservations. Returns logits [num chunks with
        needs_logits, vocab] in chunk order (all_logits: every token's, [N, vocab]): fp32, or
        fp64 for an fp64 model."""
        start = time.perf_counter()
        copies = self.cache.take_copies()
        if copies:
            self.executor.copy_blocks(copies)  # copy-on-write copies before anything writes
        if self.pieces:
            out = self._forward_in_pieces(chunks, all_logits)
        else:
            buffers = self.step_buffers
            if buffers is not None:  # the step's metadata into the persistent buffers
                ids, starts, ends = step_columns(chunks)
                # checked before anything is written: a refused step leaves the buffers as they were
                self._check_step(ids, starts, ends)
                # the last decode step one token on, no copy-on-write: only opened blocks are read
                if copies or not buffers.advance(ids, starts, ends, self.cache.tables):
                    if buffers.fits(ids, sum(ends) - sum(starts)):
                        buffers.update(ids, starts, ends, self.cache.tables(ids))
                    else:  # a step larger than the buffers: eager, its requests' rows written whole next time
                        buffers.skip(ids)
            out = self.executor.forward(chunks, self.cache, all_logits)
        self.num_steps_run += 1
        if self.preemption == "auto":  # the prefill rate
            num_tokens = prefill_step_tokens(chunks)
            if num_tokens:
                self._prefill_tokens += num_tokens
                self._prefill_s += time.perf_counter() - start
        return out

    def _check_step(self, request_ids: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> None:
        """`cache.step_tables`' check, with its message, for a step planned from the step
        buffers (which hold whatever they are given): each request's positions continue its
        computed prefix within its reservation:
          [0, computed) written | [start = computed, end) this step | end <= reserved
        A step past its reservation would write K/V into blocks the request does not hold,
        one past the computed count would read K/V never written. The coordinator finds the
        request at fault in one pass (~0.07 us a request); its counts are read only then."""
        i = self.cache.first_off_step(request_ids, starts, ends)
        if i is None:
            return
        request_id, start, end = request_ids[i], starts[i], ends[i]
        computed, reserved = self.cache.num_computed_tokens(request_id), self.cache.num_reserved_tokens(request_id)
        if start == end == computed:
            raise ValueError(
                f"request {request_id!r}: an empty chunk at position {start}: a step planned from "
                "the step buffers computes at least one token a request"
            )
        raise ValueError(
            f"request {request_id!r}: positions [{start}, {end}) do not continue its "
            f"{computed} computed tokens within the reserved [0, {reserved})"
        )

    def run(self, work: Sequence[tuple[str, list[int], int]]) -> list[torch.Tensor]:
        """One forward over reserved chunks (request id, token ids, start): logits
        [len(token ids), vocab] of every chunk position."""
        chunks = [ScheduledChunk(request_id, ids, start, False) for request_id, ids, start in work]
        logits = self.execute(chunks, all_logits=True)
        out, offset = [], 0
        for _, ids, _ in work:
            out.append(logits[offset : offset + len(ids)])
            offset += len(ids)
        return out

    def step(self, work: Sequence[tuple[str, int]]) -> list[StepResult] | None:
        """V4's dual pool: compute `num_tokens` more tokens for each (request_id, num_tokens);
        the tokens must already be in the request (prompt or appended): a step's reservation,
        forward and commit in one call. None when the pool cannot hold the step (nothing
        changes)."""
        ids = [request_id for request_id, _ in work]
        counts = [n for _, n in work]
        if not self.reserve_step(ids, counts):
            return None
        chunks = self._reserved_chunks(ids)
        logits = self._forward_in_pieces(chunks, all_logits=True).split(counts)
        self.commit_step(ids, counts, [None] * len(ids))
        return [StepResult(c.request_id, c.start, lg) for c, lg in zip(chunks, logits, strict=True)]

    def run_reservations(self, request_ids: Sequence[str]) -> list[torch.Tensor]:
        """V4's dual pool: forward passes for the requests' pending reservations; logits
        [num_tokens, vocab] of every token each computed."""
        chunks = self._reserved_chunks(request_ids)
        logits = self._forward_in_pieces(chunks, all_logits=True)
        return list(logits.split([len(c.token_ids) for c in chunks]))

    def _reserved_chunks(self, request_ids: Sequence[str]) -> list[ScheduledChunk]:
        """Each request's reserved positions [computed, reserved) as a chunk."""
        chunks = []
        for request_id in request_ids:
            start, end = self.cache.num_computed_tokens(request_id), self.cache.num_reserved_tokens(request_id)
            assert end > start, f"request {request_id!r} has no reservation"
            chunks.append(ScheduledChunk(request_id, self.cache.token_ids(request_id)[start:end], start, True))
        return chunks

    def _forward_in_pieces(self, chunks: Sequence[ScheduledChunk], all_logits: bool) -> torch.Tensor:
        """V4's dual pool: the deferred replays first, then the chunks (each its request's
        whole reservation) in forwards cut at their checkpoint positions (the state is
        copied to the checkpoint slot exactly there) and at the window snapshots the SWA
        strategy keeps (persisted there); any cut gives the same state. A step with no cut
        inside a chunk is one forward. Logits as `execute` returns them: [rows, vocab] of
        every chunk token (all_logits) or of the last token of each chunk with
        needs_logits, in chunk order."""
        for request_id, replay in self._replays.items():
            if request_id in self.cache:  # (a release through the cache alone leaves it here)
                self._replay(request_id, self.cache.token_ids(request_id), *replay)
        self._replays.clear()
        # by request, only where the step has any: the positions to cut at, the checkpoint
        # slots to copy the state to, the window snapshots to persist
        cuts: dict[str, list[int]] = {}
        checkpoints: dict[str, tuple[tuple[int, int], ...]] = {}
        snapshots: dict[str, dict[int, tuple[bytes, BlockDescriptor]]] = {}
        whole = True  # no cut strictly inside a chunk: the step is one forward
        # (each chunk is its request's reservation, the cache checks; only the steps that took
        # blocks or checkpoints come back: a decode inside its span took nothing)
        ids, starts, ends = step_columns(chunks)
        taken = self.cache.step_reservations(ids, starts, ends)
        for request_id, res in taken.items():
            (part,) = res.groups.values()  # V4: the one dual-pool group's new blocks and checkpoints
            at = [p for p, _ in part.checkpoints]
            if self.swa is not None and part.new_block_ids:
                snapshots[request_id] = self.bridge.snapshots_wanted(self.cache, self.executor, request_id, res)
                at += list(snapshots[request_id])
            if at:
                checkpoints[request_id] = part.checkpoints
                cuts[request_id] = at
                whole = whole and all(not res.start < p < res.start + res.num_tokens for p in at)
        if whole:
            out = self.executor.forward(chunks, self.cache, all_logits)
            for request_id in cuts:  # (in chunk order, as `taken`)
                res = taken[request_id]
                self._after_piece(request_id, res.start + res.num_tokens, checkpoints, snapshots)
            return out
        return self._forward_cut(chunks, all_logits, ids, starts, ends, cuts, checkpoints, snapshots)

    def _forward_cut(
        self,
        chunks: Sequence[ScheduledChunk],
        all_logits: bool,
        ids: Sequence[str],
        starts: Sequence[int],
        ends: Sequence[int],
        cuts: dict[str, list[int]],
        checkpoints: dict[str, tuple[tuple[int, int], ...]],
        snapshots: dict[str, dict[int, tuple[bytes, BlockDescriptor]]],
    ) -> torch.Tensor:
        """`_forward_in_pieces` for a step with a cut inside a chunk (ids, starts, ends: the
        chunks' columns, `step_columns`). Forward k takes piece k
        of every chunk that has one: the first forward every chunk with tokens, as it is
        where nothing cuts it, the later ones only the pieces of the chunks a cut divides.
        A chunk's last piece carries its needs_logits (the others' are False), so without
        all_logits each forward computes only the rows the step returns. Python per piece
        only for the `cuts` requests (a prefill chunk that crosses checkpoints beside a batch
        of decodes: the decodes cost C-level passes). The engine's `StepChunks` (every chunk
        with tokens) go to the first forward as a `StepChunks` too, with its columns: its
        leading decodes (one token: no cut falls strictly inside one) neither made as chunks
        nor transposed again, only the divided chunks of its `rest` replaced by their first
        pieces (the list of its chunks, the twin, takes the general path: tests/
        test_step_chunks.py holds the two to each other). Logits as `_forward_in_pieces`
        returns them."""
        lens = list(map(sub, ends, starts))  # lens[i] is len(chunks[i].token_ids)
        # the first forward: chunk i is todo[first_at[i]] (chunks without tokens compute
        # nothing)
        first_lens = list(lens)  # each chunk's tokens in the first forward
        lead = 0  # (a StepChunks: its leading chunks, which no cut divides)
        first_ends: list[int] | None = None  # (a StepChunks: each chunk's end in the first forward)
        todo: list[ScheduledChunk] | StepChunks
        if 0 in lens:
            first_at: Sequence[int] = list(accumulate(map(bool, lens), initial=-1))[1:]
            todo = [c for c, n in zip(chunks, lens, strict=True) if n]
        elif type(chunks) is StepChunks and chunks.columns is not None:
            lead, first_at, first_ends = len(chunks.lead_tokens), range(len(chunks)), list(ends)
            todo = StepChunks(chunks.lead_ids, chunks.lead_tokens, chunks.lead_starts, chunks.rest)
        else:
            first_at = range(len(chunks))
            todo = list(chunks)
        # each divided chunk's later pieces [a, b), in chunk order (the `cuts` requests are):
        # [start, b0) first | [b0, b1) | ... | [b_last, end) with its needs_logits
        later: list[tuple[int, list[tuple[int, int]]]] = []  # (chunk, its pieces after the first)
        stops: list[tuple[str, int]] = []  # each `cuts` request's first piece's end
        i = -1
        for request_id in cuts:  # (in chunk order, as `taken`: each found after the last)
            i = ids.index(request_id, i + 1)
            n = lens[i]
            if not n:
                continue
            # (the chunk's start from the columns: a decode that reaches a checkpoint is in
            # `cuts` too, and indexing a StepChunks below its `rest` makes every leading chunk)
            start = starts[i]
            end = start + n
            bounds = sorted({p for p in cuts[request_id] if start < p < end})
            stops.append((request_id, bounds[0] if bounds else end))
            if bounds:
                c = chunks[i]  # (a chunk a cut divides: more than one token, never a leading decode)
                first_lens[i] = bounds[0] - c.start
                piece = ScheduledChunk(request_id, c.token_ids[: first_lens[i]], c.start, False)
                if first_ends is None:
                    todo[first_at[i]] = piece
                else:  # a StepChunks' rest (a leading chunk is one token: nothing inside it to cut)
                    assert i >= lead, f"a cut inside the one-token chunk of {request_id!r}"
                    todo.rest[i - lead] = piece
                    first_ends[i] = bounds[0]
                bounds.append(end)
                later.append((i, list(pairwise(bounds))))
        if first_ends is not None:
            assert type(todo) is StepChunks
            todo.columns = (ids, starts, first_ends)
        outs = [self.executor.forward(todo, self.cache, all_logits)]
        for request_id, stop in stops:
            self._after_piece(request_id, stop, checkpoints, snapshots)
        # the later forwards; (forward, rows in its output) of each later piece (all_logits),
        # and (forward, row) of each divided chunk's last token where it needs logits
        piece_rows: dict[int, list[tuple[int, int, int]]] = {i: [] for i, _ in later}
        last_rows: dict[int, tuple[int, int]] = {}
        for k in range(1, 1 + max((len(pieces) for _, pieces in later), default=0)):
            todo, wanted = [], []
            for i, pieces in later:
                if k <= len(pieces):
                    a, b = pieces[k - 1]
                    c = chunks[i]
                    last = k == len(pieces) and c.needs_logits
                    todo.append(ScheduledChunk(c.request_id, c.token_ids[a - c.start : b - c.start], a, last))
                    wanted.append((i, last))
            outs.append(self.executor.forward(todo, self.cache, all_logits))
            offset = row = 0
            for (i, last), piece in zip(wanted, todo, strict=True):
                n = len(piece.token_ids)
                piece_rows[i].append((k, offset, offset + n))
                offset += n
                if last:
                    last_rows[i] = (k, row)
                    row += 1
                self._after_piece(piece.request_id, piece.start + n, checkpoints, snapshots)
        if all_logits:  # chunk i's rows in the first forward's output: [ends0[i] - first_lens[i], ends0[i])
            ends0 = list(accumulate(first_lens))
            rows: list[torch.Tensor] = []
            for i in range(len(chunks)):
                rows.append(outs[0][ends0[i] - first_lens[i] : ends0[i]])
                rows.extend(outs[k][a:b] for k, a, b in piece_rows.get(i, ()))
            return torch.cat(rows) if rows else torch.zeros(0, self.vocab_size)
        # the rows wanted, each chunk with needs_logits its last token's, in chunk order: the
        # first forward's (its undivided chunks', in chunk order), each divided chunk's put in
        # its place from the forward of its last piece
        # (a StepChunks' leading chunks all need logits: only its rest is read)
        rest = chunks.rest if type(chunks) is StepChunks and lead else chunks
        needs = list(map(_NEEDS_LOGITS, rest))  # needs[i] is chunks[lead + i].needs_logits
        assert 0 not in compress(lens[lead:], needs), "a chunk without tokens has no logits"
        if not last_rows:
            return outs[0]
        base = list(accumulate(map(len, outs), initial=0))
        order = list(range(len(outs[0])))
        for i, (k, row) in sorted(last_rows.items()):  # (in chunk order: each one's place counts those before it)
            order.insert(lead + needs[: i - lead].count(True), base[k] + row)
        return _join_rows(outs, None if order == list(range(base[-1])) else order)

    def _after_piece(
        self,
        request_id: str,
        stop: int,
        checkpoints: dict[str, tuple[tuple[int, int], ...]],
        snapshots: dict[str, dict[int, tuple[bytes, BlockDescriptor]]],
    ) -> None:
        """The state at `stop`, where a piece of the request's step ended: copied to the
        checkpoint slots the reservation names there, persisted as the window snapshot the
        SWA strategy keeps there."""
        for position, checkpoint_slot in checkpoints.get(request_id, ()):
            if position == stop:
                state_slot = self.cache.part(request_id, self.state_group).state_slot
                self._copy_state(state_slot, self.checkpoint_base + checkpoint_slot)
        wanted = snapshots.get(request_id, {}).get(stop)
        if wanted is not None:
            self.bridge.persist_snapshot(self.cache, self.executor, request_id, stop, wanted)

    # ---- the tiers -----------------------------------------------------------------------

    def _should_swap(self, request_id: str) -> bool:
        if self.preemption == "recompute":
            return False
        if self.preemption == "swap":
            return True
        # auto: the bytes to move at the copy rate against the tokens at the prefill rate,
        # both as this runner measured them (swap until both are known)
        moves = self.tier_moves
        copy_s, copied = moves.offload_s + moves.load_s, (moves.num_offloaded + moves.num_loaded)
        if not copied or not self._prefill_tokens:
            return True
        nc = self.cache.num_computed_tokens(request_id)
        if self.pieces:
            # V4: the spans come back as hits either way (the blocks the pool evicts are
            # saved), so a swap moves the state entry out and back (the entries' mean size
            # so far, else a block's) at the copy rate per byte (the moves' seconds over the
            # blocks' and the state entries' bytes), against recomputing what a resume
            # without it does: the replay window before the last span boundary and the
            # unfinished span's tokens
            (group,) = self.cache.dual_groups
            boundary = nc - nc % self.block_size
            block_bytes = self.executor.block_bytes
            state_bytes = block_bytes
            if moves.num_states_swapped_out:
                state_bytes = moves.state_bytes_swapped_out / moves.num_states_swapped_out
            moved = copied * block_bytes + moves.state_bytes_swapped_out + moves.state_bytes_swapped_in
            move_s = 2 * state_bytes * copy_s / moved
            recompute_s = (boundary - group.spec.replay_start(boundary) + nc % self.block_size) * (
                self._prefill_s / self._prefill_tokens
            )
            return move_s < recompute_s
        move_s = -(-nc // self.block_size) * copy_s / copied
        recompute_s = nc * self._prefill_s / self._prefill_tokens
        return move_s < recompute_s

    def flush_tiers(self, timeout: float | None = None) -> bool:
        """Wait for the persistent tiers' background writes (before a process exits)."""
        return self.bridge.flush(timeout)

    def close(self) -> None:
        self.bridge.close()

    def tier_reports(self) -> dict[str, dict[str, object]]:
        """The executor's reports (V4: "hisparse"), then {"<name>_tier": its report} per
        tier, with "tiers" (the lookup order and the moves) when there are persistent
        tiers, and V4's "swa" (blocks and window snapshots written and restored)."""
        own = getattr(self.executor, "reports", None)  # (optional: an executor without figures of its own)
        reports = own(self.num_steps_run) if own is not None else {}
        if self.tier is None:
            return reports
        moves = self.tier_moves
        # the hit tokens a lower tier gave: loaded at admission, or installed before it
        hit_tokens = self.cache.stats.num_lower_tier_hit_tokens + moves.num_prefetched_tokens
        per_get = None if self.swa is not None else self.block_size  # a get is a block, or a window snapshot
        reports.update(self.bridge.persistent_reports(hit_tokens_per_get=per_get))
        if self.persistent_tiers:
            reports["tiers"] = {
                "lookup_order": self.bridge.lookup_order(),
                "lower_tier_hit_tokens": hit_tokens,
                "blocks_persisted": moves.num_persisted,
                "persist_ms": round(moves.persist_s * 1e3, 3),
                "blocks_loaded": moves.num_loaded,
                "load_ms": round(moves.load_s * 1e3, 3),
            }
        if self.host_tier is not None:
            swaps = {
                "preemption": self.preemption,
                "swapped_out": moves.num_swapped_out,
                "swapped_in": moves.num_swapped_in,
                "tail_tokens_restored": moves.num_tail_tokens_restored,
                **(
                    {
                        "states_swapped_out": moves.num_states_swapped_out,
                        "state_bytes_swapped_out": moves.state_bytes_swapped_out,
                    }
                    if self.pieces
                    else {}
                ),
            }
            reports["host_tier"] = self.bridge.host_report(hit_tokens, swaps)
        if self.swa is None:
            return reports
        swa, stored_tokens = self.swa_moves, moves.num_persisted * self.block_size
        reports["swa"] = {
            "strategy": self.swa.kind,
            "period": self.swa.period,
            "blocks_persisted": moves.num_persisted,
            "block_bytes_persisted": moves.persisted_bytes,
            "snapshots_persisted": swa.num_snapshots_persisted,
            "snapshot_bytes_persisted": swa.snapshot_bytes_persisted,
            # bytes written per token of the blocks written: entries + window snapshots
            "bytes_per_cached_token": round((moves.persisted_bytes + swa.snapshot_bytes_persisted) / stored_tokens, 1)
            if stored_tokens
            else None,
            "persist_ms": round((moves.persist_s + swa.persist_s) * 1e3, 3),
            "restores_from_snapshots": swa.num_restores,
            "snapshots_loaded": swa.num_loaded,
            "snapshot_bytes_loaded": swa.load_bytes,
            "snapshot_load_ms": round(swa.load_s * 1e3, 3),
            "snapshot_misses": swa.num_misses,
            "replayed_tokens": self.num_replayed_tokens,
            "replay_ms": round(self.replay_s * 1e3, 3),
        }
        return reports

    # ---- figures ----------------------------------------------------------------------------

    def num_allocations(self) -> int:
        """Blocks and state slots taken from the cache's pools so far. The engine tells the
        admit / reserve_step calls that allocated from the ones that took nothing."""
        return sum(map(_NUM_ALLOCATED, self._pools))  # (the engine asks twice an admit or reserve_step)

    def kv_read_bytes(self, num_context_tokens: int) -> int:
        """Cache bytes one query over `num_context_tokens` tokens of context reads."""
        return self.executor.kv_read_bytes(num_context_tokens)

    def usage(self) -> CacheUsage:
        """What the cache holds now, each physical block counted once."""
        return self.cache.usage()

    def note_bookkeeping(self) -> None:
        """Sample the cache's Python structures (a harness calls it between steps)."""
        self.executor.peaks.note("bookkeeping", self.cache.metadata_bytes())

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        self.bridge.check_integrity()
        self.executor.check_integrity()

    def cache_stats(self) -> dict[str, float]:
        """Capacity and prefix-cache figures for the performance report: the cache's, then
        the executor's (its bytes, and figures of its own)."""
        cache, stats = self.cache, self.cache.stats
        return {
            "kv_capacity_tokens": self.capacity_tokens,
            "kv_capacity_bytes": 0,  # the executor's figure, in this place of the report
            "block_size": self.block_size,
            "num_blocks": cache.num_blocks,
            "prefix_queried_tokens": stats.num_queried_tokens,
            "prefix_hit_tokens": stats.num_hit_tokens,
            "prefix_hit_rate": stats.hit_rate,
            "readmitted_hit_tokens": stats.num_readmitted_hit_tokens,
            "hash_collisions": sum(pool.num_collisions for pool in self.cache.pools),
            **self.executor.cache_stats(cache),
            **({"replayed_tokens": self.num_replayed_tokens} if self.pieces else {}),
        }
