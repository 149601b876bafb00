"""Runs a V4-architecture model on the dual pool: cache manager (ids) + pools (tensors).

`DSV4Runner` is the one V4 runner. The engine drives it through the ModelRunner protocol
(engine/runner.py: admit with prefix hit + state restore, reserve, execute, commit, fork,
release), as it drives engine/llama_runner.py's LlamaRunner; the tests, `kvpool verify
dsv4` and the benchmarks drive the same object directly: `add_request` (admit, the state
restored at once), `step` (a batch of chunks of any sizes: prefill, chunked prefill,
decode, logits of every computed token), `release`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpool.attention.backends import select_backend
from kvpool.attention.dsv4_paged import ChunkPlan
from kvpool.cache import Admission, CacheDescriptor, CacheUsage, DSV4CacheManager, ReleaseReason, Reservation
from kvpool.cache.dual_pool import RestoreMethod
from kvpool.engine.runner import ScheduledChunk
from kvpool.engine.tier_bridge import TierBridge
from kvpool.models.tiny_dsv4 import TinyDSV4
from kvpool.spec.dsv4 import CSA_RATIO
from kvpool.storage.dsv4 import DSV4Pools, V4EntryPool
from kvpool.tiers import BlockDescriptor, Tier, TierStack
from kvpool.tiers.swa import SWAStrategy, snapshot_descriptor, snapshot_key


@dataclass(frozen=True)
class StepResult:
    """Logits of every token a request computed in the step: [num_tokens, vocab] fp32."""

    request_id: str
    start: int
    logits: Tensor


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

    def _measured(self) -> bool:
        return self.num_copies > 0 and self.num_replayed_tokens > 0

    def checkpoint_cost(self) -> float:
        return self.copy_s / self.num_copies if self._measured() else 0.0

    def compute_cost(self, num_tokens: int, context_len: int) -> float:
        if self._measured():
            return num_tokens * self.replay_s / self.num_replayed_tokens
        return float(num_tokens)


@dataclass
class SWAMoves:
    """What the persistent tiers took and gave back: classical blocks and window snapshots
    written through, and the snapshots a hit restored its state from."""

    num_blocks_persisted: int = 0
    block_bytes_persisted: int = 0
    num_snapshots_persisted: int = 0
    snapshot_bytes_persisted: int = 0
    persist_s: float = 0.0  # the steps' share: gathers and hand-overs (the writes run behind)
    num_restores: int = 0  # hits whose state came from snapshots
    num_loaded: int = 0  # snapshots read for them
    load_bytes: int = 0
    load_s: float = 0.0
    num_misses: int = 0  # hits that wanted a snapshot the tiers did not hold (recomputed instead)


def descriptor_for(model: TinyDSV4, kv_format: str = "exact", indexer_format: str = "fp8") -> CacheDescriptor:
    """The classical blocks' descriptor: the storage dtype, or V4's fp8 serving layout with
    its indexer-key format (storage/dsv4.py V4EntryPool)."""
    spec = model.spec
    dtype = str(model.dtype).removeprefix("torch.")
    if kv_format == "fp8":
        dtype = f"{dtype}:entries-fp8e4m3-ue8m0x64-rope-bf16:index-{indexer_format}"
    return CacheDescriptor(
        model_id=spec.name,
        weights_version=f"seed={model.seed}",
        layout_id=f"dsv4-dual-pool:span{spec.span}:win{spec.window}:{dtype}",
        rope_id="dsv4-yarn",
    )


class DSV4Runner:
    """The engine's ModelRunner protocol (kvpool.engine.runner) for a V4-architecture model on
    the dual pool, so the same scheduler runs it: admit (with prefix hit + state restore),
    reserve, execute, commit, fork, release. `fork` returns False when no state block is
    free (a V4 child needs its own): the engine then queues the child, which is admitted
    later through the prefix cache like a preempted sequence. `add_request` and `step` run
    it without an engine (a step's reservation, forward and commit in one call)."""

    def __init__(
        self,
        model: TinyDSV4,
        num_classical_blocks: int = 64,
        num_state_blocks: int = 16,
        *,
        restore: RestoreMethod = "recompute",
        num_checkpoints: int = 0,
        enable_prefix_caching: bool = True,
        replay_chunk: int = 256,
        hot_set_entries: int | None = None,
        host_tier: Tier | None = None,
        persistent_tiers: Sequence[Tier] = (),
        swa: SWAStrategy | None = None,
        kv_format: str = "exact",
        indexer_format: str = "fp8",
    ) -> None:
        """kv_format: the classical pool's entries exact in the model's dtype ("exact"), or
        in V4's serving layout ("fp8": non-RoPE dims FP8 E4M3 with a power-of-two scale per
        64, RoPE dims BF16; indexer keys `indexer_format`, FP8 or MXFP4: storage/dsv4.py).
        hot_set_entries: HiSparse (storage/dsv4.py HotSet): the CSA main entries each CSA
        layer keeps on the device; the rest of the CSA main pool is in host memory.
        persistent_tiers: the disk and Redis tiers, below the host tier: every classical
        block that completes is written through to them, and, by the SWA strategy `swa`
        (tiers/swa.py; zero by default), window snapshots at block boundaries, from which
        a prefix hit restores its state instead of recomputing it."""
        if persistent_tiers and restore != "recompute":
            raise ValueError("persistent tiers restore a V4 hit's state by their SWA strategy: restore='recompute'")
        if kv_format == "fp8" and (host_tier is not None or persistent_tiers):
            raise ValueError("--kv-dtype fp8: the tiers keep exact classical blocks only")
        # the report's name of the storage format
        self.kv_format = "float32" if kv_format == "exact" else f"fp8 (V4 layout, {indexer_format} indexer keys)"
        self.model = model
        self.spec = model.spec
        self.pools = DSV4Pools(
            model.spec,
            num_classical_blocks,
            num_state_blocks,
            num_checkpoints,
            dtype=model.dtype,
            hot_set_entries=hot_set_entries,
            entry_format=kv_format,
            indexer_format=indexer_format,
        )
        # V4's sparse attention over these pools, chosen once (attention/backends)
        device = self.pools.state[0].ring.device.type
        self.attention = select_backend("dsv4-sparse", f"dsv4-{kv_format}", device).backend(self.pools)
        descriptor = descriptor_for(model, kv_format, indexer_format)
        self.restore_cost = MeasuredRestoreCost()  # restore="auto": what copies and replays took here
        self.cache = DSV4CacheManager(
            model.spec,
            num_classical_blocks,
            num_state_blocks,
            descriptor,
            enable_prefix_caching=enable_prefix_caching,
            restore=restore,
            num_checkpoints=num_checkpoints,
            restore_cost=self.restore_cost,
        )
        # host_tier: classical blocks the pool evicts are saved to it, and before an
        # admission the spans it holds after the device hit are brought back into the pool's
        # prefix cache (written, checked, then published), where the admission hits them
        self.bridge = TierBridge(
            host_tier, persistent_tiers, model.spec.span, enable_prefix_caching=enable_prefix_caching
        )
        # the names the reports, benchmarks and tests read: the bridge's own objects, not copies
        self.host_tier, self.persistent_tiers = self.bridge.host_tier, self.bridge.persistent_tiers
        self.tier, self.tier_index, self.tier_moves = self.bridge.tier, self.bridge.index, self.bridge.moves
        if self.tier is not None:
            self.cache.record_evictions()
        if self.persistent_tiers:  # disk, Redis: an entry that is not a block of these pools is a corrupt miss
            blocks = {name: (t.dtype, tuple(t.shape)) for name, t in self._block_tensors(0).items()}
            self.bridge.expect_blocks(descriptor, blocks)
        self.swa = (swa or SWAStrategy()).check(self.spec.span) if self.persistent_tiers else None
        self.replay_chunk = replay_chunk
        self.num_replayed_tokens = 0  # tokens recomputed by prefix-hit restores (for reports)
        self.replay_s = 0.0
        self.swa_moves = SWAMoves()
        # deferred restores by recompute, by request, oldest first: (admission, first
        # position to recompute, first window position the state holds)
        self._replays: dict[str, tuple[Admission, int, int]] = {}
        span = model.spec.span
        self.vocab_size = model.vocab_size
        # The unfinished span lives in the state block, so one sequence holds up to
        # num_classical_blocks full spans plus span - 1 tokens.
        self.capacity_tokens = num_classical_blocks * span + span - 1
        self.max_model_len = min(model.spec.max_position_embeddings, self.capacity_tokens)
        self._num_states_taken = 0
        self.num_steps_run = 0  # engine steps executed (for per-step HiSparse figures)

    # ----- requests -------------------------------------------------------------------

    def add_request(self, request_id: str, token_ids: Sequence[int], *, tenant_salt: str = "") -> Admission | None:
        """Admit (nothing reserved yet: `step` does that) and restore the state of any prefix
        hit at once; None when no state block is free."""
        return self._admit(request_id, token_ids, 0, tenant_salt=tenant_salt, defer_replay=False)

    def admit(
        self, seq_id: str, token_ids: Sequence[int], max_new_tokens: int, *, tenant_salt: str = ""
    ) -> Admission | None:
        """The protocol's admit: a restore by recompute is deferred to the start of the next
        `execute` (the engine's admission stays bookkeeping; the replay is compute, done in
        the step that needs the state)."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        return self._admit(seq_id, token_ids, max_new_tokens, tenant_salt=tenant_salt, defer_replay=True)

    def _admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        max_new_tokens: int | None,
        *,
        tenant_salt: str,
        defer_replay: bool,
    ) -> Admission | None:
        """The cache's admission (prefix hit, first step reserved), then the state restore,
        now or (defer_replay) at the start of the next `run_reservations`."""
        if self.tier is not None:
            self._prefetch(token_ids, tenant_salt)
        adm = self.cache.admit(request_id, token_ids, max_new_tokens, tenant_salt=tenant_salt)
        if self.tier is not None:
            self._offload_evicted()  # before the step writes the blocks the admission took
        if adm is None:
            return None
        self._num_states_taken += 1
        restore = adm.restore
        assert restore is not None
        self.pools.reset_state(restore.state_slot)
        if restore.method == "checkpoint":
            assert restore.checkpoint_slot is not None
            self._copy_state(restore.checkpoint_slot, restore.state_slot)
        elif restore.method == "recompute":
            start = valid_from = restore.replay_start  # the zero strategy: nothing before start
            point = self._restore_window(request_id, adm)
            if point:  # the state at `point` came from window snapshots: recompute the rest
                start, valid_from = point, 0
            if start >= adm.num_cached_tokens:
                pass
            elif defer_replay:
                self._replays[request_id] = (adm, start, valid_from)  # a newer admission replaces it
            else:
                self._replay(adm, list(token_ids), start, valid_from)
        return adm

    # ----- the host tier ------------------------------------------------------------------

    def _block_tensors(self, block_id: int) -> dict[str, Tensor]:
        """One classical block's tensors, every compressed layer (CSA main + indexer, HCA)."""
        out: dict[str, Tensor] = {}
        for layer, cl in enumerate(self.pools.classical):
            if cl.main is not None:
                out[f"main{layer}"] = cl.main[block_id]
            if cl.idx is not None:
                out[f"idx{layer}"] = cl.idx[block_id]
        return out

    def _offload_evicted(self) -> None:
        """Write the cached blocks the pool just evicted to the tier, one block at a time
        (each block's tensors are views into the pools: no gather to share)."""
        assert self.tier is not None
        start = time.perf_counter()
        for block_id, block in self.cache.take_evicted():
            entry = self.bridge.unheld(block)
            if entry is not None and self.tier.put(*entry, self._block_tensors(block_id)):
                self.tier_moves.num_offloaded += 1
        self.tier_moves.offload_s += time.perf_counter() - start

    def _prefetch(self, token_ids: Sequence[int], tenant_salt: str) -> None:
        """The spans after the device hit that the tier holds valid: into fresh classical
        blocks, checked, then published as cached blocks for the admission to hit."""
        assert self.tier is not None and self.tier_index is not None
        hit, candidates = self.cache.prefetch_candidates(token_ids, tenant_salt=tenant_salt)
        num_found = self.tier_index.find(candidates) if candidates else 0
        if not num_found:
            return
        block_ids = self.cache.install(num_found, hold=hit)
        self._offload_evicted()  # the fresh blocks may be evicted ones: save them first
        if block_ids is None:
            return
        start = time.perf_counter()
        num_loaded = 0
        for block_id, block in zip(block_ids, candidates, strict=False):
            tensors = self.bridge.get(block)
            if tensors is None:
                break
            for name, dst in self._block_tensors(block_id).items():
                if tensors[name].shape != dst.shape:
                    raise AssertionError(
                        f"a tier block's {name} of shape {tensors[name].shape} passed the layout check"
                    )
                dst.copy_(tensors[name])
            for cl in self.pools.classical:
                if cl.hot is not None:
                    cl.hot.invalidate_block(block_id)
            num_loaded += 1
        self.cache.publish_installed(block_ids, candidates[:num_found], num_loaded)
        self.tier_moves.num_loaded += num_loaded
        self.tier_moves.load_s += time.perf_counter() - start

    def _replay(self, adm: Admission, token_ids: list[int], start: int, valid_from: int) -> None:
        """Recompute tokens [start, P) on top of the hit's cached entries (section 6), the
        window holding positions from `valid_from` on (0: the state at `start` is exact)."""
        restore = adm.restore
        assert restore is not None
        began = time.perf_counter()
        table = adm.block_ids[: adm.num_cached_tokens // self.spec.span]
        pos = start
        while pos < adm.num_cached_tokens:
            n = min(self.replay_chunk, adm.num_cached_tokens - pos)
            plan = ChunkPlan(pos, n, restore.state_slot, table, (), replay=True, valid_from=valid_from)
            self.model.forward_paged(token_ids[pos : pos + n], [plan], self.attention)
            pos += n
        self.num_replayed_tokens += adm.num_cached_tokens - start
        self.replay_s += time.perf_counter() - began
        self.restore_cost.num_replayed_tokens = self.num_replayed_tokens
        self.restore_cost.replay_s = self.replay_s

    def _copy_state(self, src: int, dst: int) -> None:
        """A checkpoint restored or snapshot: one state slot copied, timed for "auto"."""
        began = time.perf_counter()
        self.pools.copy_state(src, dst)
        self.restore_cost.num_copies += 1
        self.restore_cost.copy_s += time.perf_counter() - began

    # ----- the persistent tiers: blocks and window snapshots ----------------------------------

    def _snapshot_entry(self, block) -> tuple[bytes, BlockDescriptor]:
        """(tier key, descriptor) of the window snapshot at the end of prefix block `block`."""
        assert self.swa is not None and self.tier_index is not None
        rows = self.swa.window_rows(self.spec.span, self.spec.window)
        key, descriptor = self.tier_index.describe(block)
        return snapshot_key(key, rows), snapshot_descriptor(key, descriptor, rows)

    def _restore_window(self, request_id: str, adm: Admission) -> int:
        """The state at the latest snapshot the SWA strategy can restore this hit from (an
        earlier one when a snapshot is missing), written into the request's state block;
        that boundary, or 0 (none: recompute)."""
        if self.swa is None or self.tier is None:
            return 0
        spec = self.spec
        points = self.swa.restore_points(adm.num_cached_tokens, spec.span, spec.window, spec.num_layers)
        if not points:
            return 0
        began = time.perf_counter()
        chain = self.cache.prefix_blocks(request_id)
        moves = self.swa_moves
        for point, needed in points:
            snapshots = []
            for boundary in needed:
                key, descriptor = self._snapshot_entry(chain[boundary // spec.span - 1])
                tensors = self.tier.get(key, descriptor) if self.tier.lookup(key, descriptor) else None
                if tensors is None:
                    moves.num_misses += 1
                    break
                snapshots.append((boundary, tensors))
            else:
                assert adm.restore is not None
                self.pools.restore_window(adm.restore.state_slot, point, snapshots)
                moves.num_restores += 1
                moves.num_loaded += len(snapshots)
                moves.load_bytes += sum(t.numel() * t.element_size() for _, ts in snapshots for t in ts.values())
                moves.load_s += time.perf_counter() - began
                return point
        moves.load_s += time.perf_counter() - began
        return 0

    def _snapshots_wanted(self, request_id: str, res: Reservation) -> dict[int, tuple[bytes, BlockDescriptor]]:
        """Boundaries the step crosses where the SWA strategy keeps a snapshot that the
        persistent tiers lack: boundary -> (tier key, descriptor)."""
        if self.swa is None or self.swa.kind == "zero":
            return {}
        span = self.spec.span
        positions = self.swa.snapshot_positions(res.start, res.start + res.num_tokens, span)
        if not positions:
            return {}
        assert isinstance(self.tier, TierStack)
        chain = self.cache.prefix_blocks(request_id)
        wanted = {}
        for boundary in positions:
            key, descriptor = self._snapshot_entry(chain[boundary // span - 1])
            if not self.tier.persisted(key, descriptor):
                wanted[boundary] = (key, descriptor)
        return wanted

    def commit(
        self, request_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]
    ) -> None:
        """The cache's commit_step, then the classical blocks it completed written through
        to the persistent tiers (those they hold already skipped)."""
        if not self.persistent_tiers:
            self.cache.commit_step(request_ids, num_tokens, next_token_ids)
            return
        before = [len(self.cache.block_ids(r)) for r in request_ids]
        self.cache.commit_step(request_ids, num_tokens, next_token_ids)
        began = time.perf_counter()
        moves = self.swa_moves
        for request_id, num_before in zip(request_ids, before, strict=True):
            block_ids = self.cache.block_ids(request_id)
            if len(block_ids) == num_before:
                continue
            chain = self.cache.prefix_blocks(request_id)
            for k in range(num_before, len(block_ids)):
                if not self.cache.pool.is_published(chain[k]):
                    continue  # a hash collision's copy: findable by nobody
                entry = self.bridge.unpersisted(chain[k])
                if entry is not None:
                    num_bytes = self.bridge.persist(*entry, self._block_tensors(block_ids[k]))
                    moves.num_blocks_persisted += num_bytes > 0
                    moves.block_bytes_persisted += num_bytes
        moves.persist_s += time.perf_counter() - began

    def flush_tiers(self, timeout: float | None = None) -> bool:
        return self.bridge.flush(timeout)

    def close(self) -> None:
        self.bridge.close()

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.cache.append_token_ids(request_id, token_ids)

    def release(self, request_id: str, reason: ReleaseReason = "finish") -> bool:
        """The cache's release; a restore still waiting to replay goes with it."""
        self._replays.pop(request_id, None)
        return self.cache.release(request_id, reason)

    def num_computed_tokens(self, request_id: str) -> int:
        return self.cache.num_computed_tokens(request_id)

    # ----- steps ----------------------------------------------------------------------

    def reserve(self, request_ids: Sequence[str], num_new_tokens: Sequence[int]) -> bool:
        """The cache's reserve_step, then the blocks it evicted saved to the tier."""
        fits = self.cache.reserve_step(request_ids, num_new_tokens)
        if self.tier is not None:
            self._offload_evicted()
        return fits

    def step(self, work: Sequence[tuple[str, int]]) -> list[StepResult] | None:
        """Compute `num_tokens` more tokens for each (request_id, num_tokens); the tokens must
        already be in the request (prompt or appended). None when the classical pool cannot
        hold the step (nothing changes)."""
        ids = [request_id for request_id, _ in work]
        counts = [n for _, n in work]
        if not self.reserve(ids, counts):
            return None
        reservations = [self._pending(request_id) for request_id in ids]
        logits = self.run_reservations(ids)
        self.commit(ids, counts, [None] * len(ids))
        return [StepResult(r, res.start, lg) for r, res, lg in zip(ids, reservations, logits, strict=True)]

    def _pending(self, request_id: str) -> Reservation:
        res = self.cache.pending_reservation(request_id)
        assert res is not None, f"request {request_id!r} has no reservation"
        return res

    def run_reservations(self, request_ids: Sequence[str]) -> list[Tensor]:
        """Forward passes for the requests' pending reservations. A chunk is cut at its
        checkpoint positions (the state must be snapshot exactly there); any cut gives the
        same state."""
        for request_id, (adm, start, valid_from) in self._replays.items():
            if request_id in self.cache:  # (a release through the cache alone leaves it here)
                self._replay(adm, self.cache.token_ids(request_id), start, valid_from)
        self._replays.clear()
        span = self.spec.span
        work = []
        snapshots: dict[str, dict[int, tuple[bytes, BlockDescriptor]]] = {}
        for request_id in request_ids:
            res = self._pending(request_id)
            table = self.cache.block_ids(request_id) + list(res.new_block_ids)
            work.append((request_id, res, table, self.cache.state_slot(request_id)))
            if self.swa is not None and res.new_block_ids:
                snapshots[request_id] = self._snapshots_wanted(request_id, res)
        cursor = {request_id: res.start for request_id, res, _, _ in work}
        pieces: dict[str, list[Tensor]] = {request_id: [] for request_id in request_ids}
        while True:
            plans, ids, owners = [], [], []
            for request_id, res, table, slot in work:
                pos, end = cursor[request_id], res.start + res.num_tokens
                if pos >= end:
                    continue
                cuts = [p for p, _ in res.checkpoints] + list(snapshots.get(request_id, ()))
                stop = min([end] + [p for p in cuts if p > pos])
                plans.append(ChunkPlan(pos, stop - pos, slot, table[: pos // span], table[pos // span : stop // span]))
                ids.extend(self.cache.token_ids(request_id)[pos:stop])
                owners.append((request_id, res, slot))
            if not plans:
                break
            out = self.model.forward_paged(ids, plans, self.attention)
            offset = 0
            for (request_id, res, slot), plan in zip(owners, plans, strict=True):
                pieces[request_id].append(out[offset : offset + plan.num_tokens])
                offset += plan.num_tokens
                stop = plan.start + plan.num_tokens
                cursor[request_id] = stop
                for position, checkpoint_slot in res.checkpoints:
                    if position == stop:
                        self._copy_state(slot, checkpoint_slot)
                wanted = snapshots.get(request_id, {}).get(stop)
                if wanted is not None:  # the state at a boundary the SWA strategy keeps
                    assert self.swa is not None
                    began = time.perf_counter()
                    rows = self.swa.window_rows(span, self.spec.window)
                    num_bytes = self.bridge.persist(*wanted, self.pools.window_snapshot(slot, stop, rows))
                    self.swa_moves.num_snapshots_persisted += num_bytes > 0
                    self.swa_moves.snapshot_bytes_persisted += num_bytes
                    self.swa_moves.persist_s += time.perf_counter() - began
        return [torch.cat(pieces[request_id]) for request_id in request_ids]

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        self.bridge.check_integrity()
        for cl in self.pools.classical:
            if cl.hot is not None:
                cl.hot.check_integrity()

    def execute(self, chunks: Sequence[ScheduledChunk]) -> Tensor:
        """Logits [num chunks with needs_logits, vocab] fp32, in chunk order."""
        for c in chunks:
            res = self._pending(c.seq_id)
            assert res.start == c.start and res.num_tokens == len(c.token_ids), "chunk != reservation"
        logits = self.run_reservations([c.seq_id for c in chunks])
        self.num_steps_run += 1
        rows = [lg[-1] for c, lg in zip(chunks, logits, strict=True) if c.needs_logits]
        if not rows:
            return torch.zeros(0, self.vocab_size)
        return torch.stack(rows)

    def fork(self, parent_id: str, child_id: str) -> bool:
        if not self.cache.fork(parent_id, child_id):
            return False
        self._num_states_taken += 1
        self.pools.copy_state(self.cache.state_slot(parent_id), self.cache.state_slot(child_id))
        return True

    def num_allocations(self) -> int:
        return self.cache.pool.num_allocated + self._num_states_taken

    def kv_read_bytes(self, num_context_tokens: int) -> int:
        """One query's reads over `num_context_tokens` of history (DEEPSEEK_V4.md sections 2-4):
        per layer the window (up to n_win entries); on HCA layers every compressed entry; on
        CSA layers every indexer key and the top-k entries it selects."""
        spec, pools = self.spec, self.pools
        total = 0
        for ratio, st, cl in zip(spec.layer_ratios, pools.state, pools.classical, strict=True):
            entry = st.ring[0, 0].numel() * st.ring.element_size()
            total += min(num_context_tokens, spec.window) * entry
            if isinstance(cl.main, V4EntryPool):  # compressed entries in the fp8 layout
                entry = cl.main.bytes_per_entry
            num_entries = num_context_tokens // ratio if ratio else 0
            if ratio == CSA_RATIO:
                assert st.tail_idx is not None
                key = st.tail_idx[0, 0].numel() * st.tail_idx.element_size()
                if isinstance(cl.idx, V4EntryPool):
                    key = cl.idx.bytes_per_entry
                total += num_entries * key + min(num_entries, spec.index_topk) * entry
            elif ratio:
                total += num_entries * entry
        return total

    def usage(self) -> CacheUsage:
        return self.cache.usage()

    def tier_reports(self) -> dict[str, dict[str, object]]:
        """{"hisparse": its figures} ({} when off): the CSA main bytes kept off the device,
        the entries the indexer selected and those fetched from the host copy, per step."""
        reports: dict[str, dict[str, object]] = {}
        hisparse = hisparse_report(self.pools, self.num_steps_run)
        if hisparse is not None:
            reports["hisparse"] = hisparse
        span, loaded = self.spec.span, self.tier_moves
        if self.host_tier is not None:  # hit tokens: the prefix tokens whose blocks came from a tier
            reports["host_tier"] = self.bridge.host_report(loaded.num_loaded * span, {})
        reports.update(self.bridge.persistent_reports(hit_tokens_per_get=None))
        if self.persistent_tiers:
            assert self.swa is not None
            moves = self.swa_moves
            reports["tiers"] = {
                "lookup_order": self.bridge.lookup_order(),
                "blocks_loaded": loaded.num_loaded,
                "hit_tokens_loaded": loaded.num_loaded * span,
                "load_ms": round(loaded.load_s * 1e3, 3),
            }
            stored_tokens = moves.num_blocks_persisted * span
            reports["swa"] = {
                "strategy": self.swa.kind,
                "period": self.swa.period,
                "blocks_persisted": moves.num_blocks_persisted,
                "block_bytes_persisted": moves.block_bytes_persisted,
                "snapshots_persisted": moves.num_snapshots_persisted,
                "snapshot_bytes_persisted": moves.snapshot_bytes_persisted,
                # bytes written per token of the blocks written: entries + window snapshots
                "bytes_per_cached_token": round(
                    (moves.block_bytes_persisted + moves.snapshot_bytes_persisted) / stored_tokens, 1
                )
                if stored_tokens
                else None,
                "persist_ms": round(moves.persist_s * 1e3, 3),
                "restores_from_snapshots": moves.num_restores,
                "snapshots_loaded": moves.num_loaded,
                "snapshot_bytes_loaded": moves.load_bytes,
                "snapshot_load_ms": round(moves.load_s * 1e3, 3),
                "snapshot_misses": moves.num_misses,
                "replayed_tokens": self.num_replayed_tokens,
                "replay_ms": round(self.replay_s * 1e3, 3),
            }
        return reports

    def cache_stats(self) -> dict[str, float]:
        pools, cache = self.pools, self.cache
        return {
            "kv_capacity_tokens": self.capacity_tokens,
            "kv_capacity_bytes": pools.classical_block_bytes() * cache.num_blocks
            + pools.state_block_bytes() * cache.num_state_blocks,
            "block_size": self.spec.span,
            "num_blocks": cache.num_blocks,
            "classical_block_bytes": pools.classical_block_bytes(),
            "state_blocks": cache.num_state_blocks,
            "state_block_bytes": pools.state_block_bytes(),
            "prefix_queried_tokens": cache.stats.num_queried_tokens,
            "prefix_hit_tokens": cache.stats.num_hit_tokens,
            "prefix_hit_rate": cache.stats.hit_rate,
            "readmitted_hit_tokens": cache.stats.num_readmitted_hit_tokens,
            "hash_collisions": cache.pool.num_collisions,
            "replayed_tokens": self.num_replayed_tokens,
        }


def hisparse_report(pools: DSV4Pools, num_steps: int) -> dict[str, object] | None:
    hots = [cl for cl in pools.classical if cl.hot is not None]
    if not hots:
        return None
    host_bytes = sum(cl.main.numel() * cl.main.element_size() for cl in hots if cl.main is not None)
    hot_bytes = sum(cl.hot.num_bytes for cl in hots if cl.hot is not None)
    selected = sum(cl.hot.num_selected for cl in hots if cl.hot is not None)
    fetched = sum(cl.hot.num_fetched for cl in hots if cl.hot is not None)
    fetched_bytes = sum(cl.hot.num_fetched_bytes for cl in hots if cl.hot is not None)
    steps = max(num_steps, 1)
    return {
        "hot_set_entries": hots[0].hot.capacity if hots[0].hot is not None else 0,
        "csa_layers": len(hots),
        "csa_main_bytes_on_host": host_bytes,
        "hot_set_bytes": hot_bytes,
        "device_bytes_saved": host_bytes - hot_bytes,
        "entries_selected": selected,
        "entries_fetched": fetched,
        "bytes_fetched": fetched_bytes,
        "entries_fetched_per_step": round(fetched / steps, 2),
        "bytes_fetched_per_step": round(fetched_bytes / steps, 1),
    }
