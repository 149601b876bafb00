"""A Llama model on the paged KV pool, behind the ModelRunner protocol."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvpool.attention.backends import PagedStepMetadata, paged_format, select_backend
from kvpool.cache import Admission, CacheDescriptor, CacheUsage, FullAttentionManager, ReleaseReason
from kvpool.engine.memory import StepPeaks
from kvpool.engine.runner import ScheduledChunk
from kvpool.engine.tier_bridge import TierBridge
from kvpool.models.llama import LlamaModel
from kvpool.models.tensor_parallel import check_same_step, step_digest
from kvpool.storage.kv import PagedKVStorage, QuantizedKVStorage
from kvpool.storage.quant import KVSchema, code_dtype, kv_schema
from kvpool.tiers import Tier

PREEMPTION_MODES: tuple[str, ...] = ("recompute", "swap", "auto")


def kv_format_for(model: LlamaModel, name: str | None) -> KVSchema | None:
    """The KV storage format `name` for `model` (spec/kv_formats.py), or None for unquantized
    storage in the model's own dtype (fp32 for an fp32 model, and so on); ValueError for an
    unknown name."""
    if name is None:
        return None
    fmt = kv_schema(name)
    return None if not fmt.scaled and code_dtype(fmt) == model.dtype else fmt


class LlamaRunner:
    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        descriptor: CacheDescriptor,
        *,
        enable_prefix_caching: bool = True,
        decode_path: str | None = None,
        host_tier: Tier | None = None,
        preemption: str = "recompute",
        persistent_tiers: Sequence[Tier] = (),
        kv_format: str | None = None,
    ):
        """decode_path: the attention backend's implementation, "native" / "bags" / "padded"
        (attention/backends); None picks "native" when the model runs the C kernels, else
        "bags". host_tier: a tier below the device pool (kvpool.tiers.HostTier): cached blocks
        the pool evicts are written to it, and an admission loads the prefix it holds (needs
        prefix caching). preemption: what a preempted sequence's cache becomes
        (PREEMPTION_MODES): "recompute" (its full blocks stay findable in the prefix cache and
        the tier like anyone's, the rest is computed again), "swap" (its blocks are written to
        the host tier at once, its partial tail block too, and loaded back when it resumes),
        "auto" (swap when moving the bytes costs less than recomputing the tokens, by the rates
        this runner has measured). persistent_tiers: the disk and Redis tiers, below the host
        tier (kvpool.tiers): every block that becomes a full cached block is written through to
        them in the background, and an admission takes the longest prefix across all tiers.
        kv_format: the KV cache's storage format (storage/quant.py: bf16, fp16, fp8_e4m3,
        fp8_e5m2, int8); None or the model's own dtype: unquantized, in the model's dtype."""
        fmt = kv_format_for(model, kv_format)
        if fmt is not None and (host_tier is not None or persistent_tiers):
            raise ValueError(f"--kv-dtype {fmt.name}: the host, disk and Redis tiers keep unquantized blocks only")
        if model.shard is not None and preemption == "auto":
            raise ValueError(
                "preemption 'auto' decides by this process's timings, which the tensor-parallel ranks differ in"
            )
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"unknown preemption {preemption!r}; one of {', '.join(PREEMPTION_MODES)}")
        if preemption != "recompute" and (host_tier is None or not enable_prefix_caching):
            raise ValueError(f"preemption {preemption!r} needs a host tier (--host-cache-gib) and prefix caching")
        self.preemption = preemption
        # seq -> (computed tokens at preemption, its tail block's tokens): restored on resume
        self._swapped: dict[str, tuple[int, int]] = {}
        self._prefill_tokens = 0  # tokens of the steps that carried a prefill chunk, and their seconds (auto)
        self._prefill_s = 0.0
        cfg = model.config
        self.model = model
        self.bridge = TierBridge(host_tier, persistent_tiers, block_size, enable_prefix_caching=enable_prefix_caching)
        # the names the CLI, P/D and the tests read: the bridge's own objects, not copies
        self.host_tier, self.persistent_tiers = self.bridge.host_tier, self.bridge.persistent_tiers
        self.tier, self.tier_index, self.tier_moves = self.bridge.tier, self.bridge.index, self.bridge.moves
        self.manager = FullAttentionManager(
            num_blocks,
            block_size,
            descriptor,
            enable_prefix_caching=enable_prefix_caching,
            lower_tier=self.tier_index,
            record_published=bool(self.persistent_tiers),
        )
        self.kv_format = fmt.name if fmt is not None else str(model.dtype).removeprefix("torch.")
        self.storage: PagedKVStorage | QuantizedKVStorage
        if fmt is None:
            self.storage = PagedKVStorage(
                cfg.num_layers,
                num_blocks,
                block_size,
                cfg.num_kv_heads,
                cfg.head_dim,
                model.dtype,
                model.device,
                model.kernels,
            )
        else:
            self.storage = QuantizedKVStorage(
                cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, fmt, model.dtype, model.device
            )
        # On CUDA the tier copies run on a stream of their own, ordered against the compute
        # stream by events (`_to_host`, `_to_device`); loads not yet waited for by compute:
        self._copy_stream = torch.cuda.Stream(model.device) if model.device.type == "cuda" else None
        self._loads_in_flight: list[torch.cuda.Event] = []
        if self.persistent_tiers:  # disk, Redis: an entry that is not a block of this storage is a corrupt miss
            k, v = self.storage.k, self.storage.v
            blocks = {"k": (k.dtype, (k.shape[0], *k.shape[2:])), "v": (v.dtype, (v.shape[0], *v.shape[2:]))}
            self.bridge.expect_blocks(descriptor, blocks)
        if self.host_tier is not None:
            if hasattr(self.host_tier, "reclaim"):
                self.host_tier.reclaim(descriptor)  # a tier kept from an engine of other weights
            block_bytes = self.storage.k[:, 0].nbytes + self.storage.v[:, 0].nbytes
            capacity = getattr(self.host_tier, "capacity_bytes", block_bytes)
            if capacity < block_bytes:
                raise ValueError(f"a host tier of {capacity} bytes holds no KV block of {block_bytes} bytes")
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        self.capacity_tokens = num_blocks * block_size
        self.max_model_len = min(cfg.max_position, self.capacity_tokens)
        # The attention backend (attention/backends), chosen once for this storage by the
        # `decode_path` setter: its `begin_step` plans each step and returns the attend the
        # model calls per layer.
        self.decode_path = decode_path
        self.last_decode_path: str | None = None  # the path the last step's decodes took
        self.peaks = StepPeaks()  # the largest step's allocations, for the memory ledger

    @property
    def decode_path(self) -> str:
        """The attention backend's implementation ("native", "bags", "padded")."""
        return self.attention.name

    @decode_path.setter
    def decode_path(self, path: str | None) -> None:
        """Choose the attention backend for this runner's storage and device: `path`, or
        None for the best this process runs (attention/backends PREFERRED)."""
        model = self.model
        fmt = paged_format(self.storage)
        key, backend = select_backend("full", fmt, model.device.type, path, has_kernels=model.kernels is not None)
        self.attention = backend(
            self.storage, model.config.num_heads, model.kernels, model.dtype, self._wait_for_loads, decode_path=key.impl
        )

    # ---- cache bookkeeping (pure Python, through the manager) ---------------------

    def admit(
        self, seq_id: str, token_ids: Sequence[int], max_new_tokens: int, *, tenant_salt: str = ""
    ) -> Admission | None:
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        admission = self.manager.admit(seq_id, token_ids, max_new_tokens, tenant_salt=tenant_salt)
        if admission is None or self.tier is None:
            return admission
        # The fresh blocks may be evicted cached ones: save what they held before the loads
        # (or the step) overwrite them.
        self._offload_evicted()
        if admission.loads:
            admission = self.manager.complete_loads(seq_id, self._load(admission.loads))
        swapped = self._swapped.pop(seq_id, None)
        if swapped is not None:
            admission = self._swap_in_tail(seq_id, admission, *swapped)
        return admission

    def reserve(self, seq_ids: Sequence[str], num_new_tokens: Sequence[int]) -> bool:
        fits = self.manager.reserve_step(seq_ids, num_new_tokens)
        if self.tier is not None:
            self._offload_evicted()
        return fits

    # ---- the host tier ---------------------------------------------------------------

    def _should_swap(self, seq_id: str) -> bool:
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
        nc = self.manager.num_computed_tokens(seq_id)
        move_s = -(-nc // self.block_size) * copy_s / copied
        recompute_s = nc * self._prefill_s / self._prefill_tokens
        return move_s < recompute_s

    def _swap_out(self, seq_id: str) -> None:
        """Write the sequence's computed blocks to the host tier now: its full blocks under
        their content keys (skipped when the tier holds them), its partial tail block under
        the partial content's key; remember what to restore. A block that does not fit is
        simply computed again on resume."""
        assert self.tier is not None and self.tier_index is not None
        m = self.manager
        todo = []
        chain = m.prefix_chain(seq_id)  # the full computed blocks' prefix blocks
        for block_id, block in zip(m.block_ids(seq_id), chain, strict=False):
            entry = self.bridge.unheld(block)
            if entry is not None:
                todo.append((block_id, *entry))
        tail = m.tail_block(seq_id)
        if tail is not None:
            block_id, block, num_tokens = tail
            key, descriptor = self.tier_index.describe(block)
            todo.append((block_id, key, descriptor))
        self._write_to_tier(todo)
        self.tier_moves.num_swapped_out += 1
        if tail is not None and self.tier.holds(todo[-1][1], todo[-1][2]):
            self._swapped[seq_id] = (m.num_computed_tokens(seq_id), tail[2])

    def _swap_in_tail(self, seq_id: str, admission: Admission, num_computed: int, num_tail: int) -> Admission:
        """After the full blocks came back (device or host), the tail block's KV from the
        tier, if it is still there and the prefix before it is exactly the swapped one."""
        assert self.tier is not None and self.tier_index is not None
        if admission.num_cached_tokens != num_computed - num_tail:
            return admission  # fewer full blocks came back: the rest is computed again
        tail = self.manager.tail_block_for_restore(seq_id, num_tail)
        if tail is None:
            return admission
        block_id, block = tail
        start = time.perf_counter()
        tensors = self.bridge.get(block)
        if tensors is None:
            return admission
        self._to_device([block_id], [tensors])
        self.tier.evict(self.tier_index.describe(block)[0])  # a partial block serves this sequence only
        self.tier_moves.load_s += time.perf_counter() - start
        self.tier_moves.num_loaded += 1
        self.tier_moves.num_swapped_in += 1
        self.tier_moves.num_tail_tokens_restored += num_tail
        return self.manager.restore_tail(seq_id, num_tail)

    def tier_reports(self) -> dict[str, dict[str, object]]:
        """{"host_tier": the tier's counters and the runner's moves}, or {} without a tier."""
        if self.tier is None:
            return {}
        moves = self.tier_moves
        reports = self.bridge.persistent_reports(hit_tokens_per_get=self.block_size)
        if reports:
            reports["tiers"] = {
                "lookup_order": self.bridge.lookup_order(),
                "lower_tier_hit_tokens": self.manager.stats.num_lower_tier_hit_tokens,
                "blocks_persisted": moves.num_persisted,
                "persist_ms": round(moves.persist_s * 1e3, 3),
                "blocks_loaded": moves.num_loaded,
                "load_ms": round(moves.load_s * 1e3, 3),
            }
        if self.host_tier is None:
            return reports
        swaps = {
            "preemption": self.preemption,
            "swapped_out": moves.num_swapped_out,
            "swapped_in": moves.num_swapped_in,
            "tail_tokens_restored": moves.num_tail_tokens_restored,
        }
        return {**reports, "host_tier": self.bridge.host_report(self.manager.stats.num_lower_tier_hit_tokens, swaps)}

    def _offload_evicted(self) -> None:
        """Write the cached blocks the allocator just evicted to the tier, in one gather (a
        block whose content the tier already holds is not written again)."""
        assert self.tier is not None and self.tier_index is not None
        todo = []
        for block_id, block in self.manager.take_evicted():
            entry = self.bridge.unheld(block)
            if entry is not None:
                todo.append((block_id, *entry))
        self._write_to_tier(todo)

    def _write_to_tier(self, todo: list[tuple[int, bytes, object]]) -> None:
        """(device block, content key, descriptor) -> the tier, every layer of each block in
        one gather."""
        assert self.tier is not None
        if not todo:
            return
        start = time.perf_counter()
        k, v = self._to_host([block_id for block_id, _, _ in todo])  # [layers, n, ...]: every layer of each block
        for j, (_, key, descriptor) in enumerate(todo):
            if self.tier.put(key, descriptor, {"k": k[:, j], "v": v[:, j]}):
                self.tier_moves.num_offloaded += 1
        self.tier_moves.offload_s += time.perf_counter() - start

    def _load(self, loads: Sequence[tuple[int, object]]) -> int:
        """Copy the admission's lower-tier blocks into their device blocks, in order, up to
        the first the tier no longer holds valid; how many were loaded. A block becomes
        visible (findable, readable) only after this, through `complete_loads`."""
        assert self.tier is not None and self.tier_index is not None
        start = time.perf_counter()
        got: list[tuple[int, dict[str, torch.Tensor]]] = []
        for block_id, block in loads:
            tensors = self.bridge.get(block)
            if tensors is None:
                break
            got.append((block_id, tensors))
        if got:
            k_shape, v_shape = self.storage.k.shape, self.storage.v.shape
            for _, t in got:
                if t["k"].shape != (k_shape[0], *k_shape[2:]) or t["v"].shape != (v_shape[0], *v_shape[2:]):
                    raise AssertionError(
                        f"a tier block of shapes {t['k'].shape}, {t['v'].shape} passed the layout check"
                    )
            self._to_device([block_id for block_id, _ in got], [t for _, t in got])
            self.tier_moves.num_loaded += len(got)
        self.tier_moves.load_s += time.perf_counter() - start
        return len(got)

    def _to_host(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of device blocks `block_ids`, every layer, in host memory: two
        [layers, n, block_size, kv_heads, head_dim] tensors (pinned on CUDA), one gather.

        On CUDA the gather and the copy run on the copy stream, after all the compute
        stream has queued so far (the blocks' last writes) and after any load still in
        flight (same stream); the host waits for the bytes, which it hands to a tier, so
        nothing the compute stream queues later can overwrite the blocks first."""
        storage = self.storage
        ids = torch.tensor(block_ids, dtype=torch.long, device=storage.k.device)
        stream = self._copy_stream
        if stream is None:
            return storage.k[:, ids], storage.v[:, ids]  # (new tensors: the gather copies)
        stream.wait_stream(torch.cuda.current_stream(storage.k.device))
        with torch.cuda.stream(stream):
            out = []
            for pool in (storage.k, storage.v):
                gathered = pool[:, ids]
                host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                host.copy_(gathered, non_blocking=True)
                out.append(host)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        return out[0], out[1]

    def _to_device(self, block_ids: Sequence[int], blocks: Sequence[dict[str, torch.Tensor]]) -> None:
        """Write the tier's tensors of each block ({"k", "v"}: [layers, block_size, kv_heads,
        head_dim]) into device blocks `block_ids`, in one copy per pool.

        On CUDA the copy runs on the copy stream from pinned staging, after the compute
        stream's work so far (earlier readers of these reused blocks), and neither the host
        nor the compute stream waits for it here: the next step waits on its event just
        before the first thing that reads the cache (a copy-on-write copy, or layer 0's
        attention: the embedding and layer 0's projections run meanwhile). A loaded block is
        only ever read after its copy has completed."""
        storage = self.storage
        device = storage.k.device
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        stream = self._copy_stream
        if stream is None:
            storage.k[:, ids] = torch.stack([t["k"] for t in blocks], dim=1)
            storage.v[:, ids] = torch.stack([t["v"] for t in blocks], dim=1)
            return
        staged = []
        for name, pool in (("k", storage.k), ("v", storage.v)):
            host = torch.empty((pool.shape[0], len(blocks), *pool.shape[2:]), dtype=pool.dtype, pin_memory=True)
            torch.stack([t[name] for t in blocks], dim=1, out=host)
            staged.append((pool, host))
        stream.wait_stream(torch.cuda.current_stream(device))
        # `ids` was made on the compute stream: the allocator must not hand its memory to
        # the compute stream's next tensors while the copy stream may still read it
        ids.record_stream(stream)
        with torch.cuda.stream(stream):
            for pool, host in staged:
                pool[:, ids] = host.to(device, non_blocking=True)  # (the host allocator keeps `host` until done)
            done = torch.cuda.Event()
            done.record(stream)
        self._loads_in_flight.append(done)

    def _wait_for_loads(self) -> None:
        """The compute stream waits for the loads in flight (before it reads the cache)."""
        if self._loads_in_flight:
            compute = torch.cuda.current_stream(self.storage.k.device)
            for done in self._loads_in_flight:
                compute.wait_event(done)
            self._loads_in_flight.clear()

    def append_tokens(self, seq_id: str, token_ids: Sequence[int]) -> None:
        self.manager.append_token_ids(seq_id, token_ids)

    def commit(self, seq_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]) -> None:
        self.manager.commit_step(seq_ids, num_tokens, next_token_ids)
        if self.persistent_tiers:
            self._persist_published()

    def _persist_published(self) -> None:
        """The blocks this step completed, copied (one gather) and handed to the persistent
        tiers' background writers; a block every one of them holds is skipped."""
        published = self.manager.take_published()
        if not published:
            return
        start = time.perf_counter()
        todo = []
        for block_id, block in published:
            entry = self.bridge.unpersisted(block)
            if entry is not None:
                todo.append((block_id, *entry))
        if todo:
            k, v = self._to_host([b for b, _, _ in todo])
            for j, (_, key, descriptor) in enumerate(todo):
                self.tier_moves.num_persisted += self.bridge.persist(key, descriptor, {"k": k[:, j], "v": v[:, j]}) > 0
        self.tier_moves.persist_s += time.perf_counter() - start

    def flush_tiers(self, timeout: float | None = None) -> bool:
        return self.bridge.flush(timeout)

    def close(self) -> None:
        self.bridge.close()

    def fork(self, parent_id: str, child_id: str) -> bool:
        return self.manager.fork(parent_id, child_id)  # shares blocks: never needs a free one

    def release(self, seq_id: str, reason: ReleaseReason) -> bool:
        self._swapped.pop(seq_id, None)
        if reason == "preempt" and seq_id in self.manager and self._should_swap(seq_id):
            self._swap_out(seq_id)
        storage = self.storage
        if not isinstance(storage, QuantizedKVStorage) or not storage.num_tails or seq_id not in self.manager:
            return self.manager.release(seq_id, reason)
        held = self.manager.block_ids(seq_id)
        released = self.manager.release(seq_id, reason)
        # a partly written block nobody holds any more: its full-precision tail goes with it
        storage.drop_tails([b for b in held if self.manager.pool.refcount(b) == 0])
        return released

    def num_computed_tokens(self, seq_id: str) -> int:
        return self.manager.num_computed_tokens(seq_id)

    def num_allocations(self) -> int:
        return self.manager.pool.num_allocated

    def kv_read_bytes(self, num_context_tokens: int) -> int:
        return num_context_tokens * self.storage.bytes_per_token

    def usage(self) -> CacheUsage:
        return self.manager.usage()

    def check_integrity(self) -> None:
        self.manager.check_integrity()
        self.bridge.check_integrity()

    def cache_stats(self) -> dict[str, float]:
        m = self.manager
        return {
            "kv_capacity_tokens": self.capacity_tokens,
            "kv_capacity_bytes": self.storage.num_bytes,
            "block_size": self.block_size,
            "num_blocks": m.num_blocks,
            "bytes_per_token": self.storage.bytes_per_token,
            "prefix_queried_tokens": m.stats.num_queried_tokens,
            "prefix_hit_tokens": m.stats.num_hit_tokens,
            "prefix_hit_rate": m.stats.hit_rate,
            "readmitted_hit_tokens": m.stats.num_readmitted_hit_tokens,
            "hash_collisions": m.pool.num_collisions,
            "lower_tier_hit_tokens": m.stats.num_lower_tier_hit_tokens,
            "cached_free_blocks": m.pool.num_free_cached,
        }

    # ---- the forward ---------------------------------------------------------------

    def _note_forward(self, num_tokens: int, attend, logits: torch.Tensor) -> None:
        """What the forward allocated: its step buffers, the attention output (the native
        attend's one buffer; the plain path's `empty_like(q)`, the same shape), the logits."""
        out_bytes = getattr(attend, "out_bytes", None)
        cfg = self.model.config
        if out_bytes is None:
            out_bytes = num_tokens * cfg.num_heads * cfg.head_dim * self.model.dtype.itemsize
        self.peaks.note("activations", self.model.step_buffer_bytes + out_bytes)
        self.peaks.note("logits", logits.nbytes)

    def note_bookkeeping(self) -> None:
        """Sample the manager's Python structures (a harness calls it between steps)."""
        self.peaks.note("bookkeeping", self.manager.metadata_bytes())

    def execute(self, chunks: Sequence[ScheduledChunk], all_logits: bool = False) -> torch.Tensor:
        start = time.perf_counter()
        logits = self._execute(chunks, all_logits)
        if any(len(c.token_ids) > 1 for c in chunks):  # the prefill rate, for preemption="auto"
            self._prefill_tokens += sum(len(c.token_ids) for c in chunks)
            self._prefill_s += time.perf_counter() - start
        return logits

    def _execute(self, chunks: Sequence[ScheduledChunk], all_logits: bool = False) -> torch.Tensor:
        """Run one step; logits [num chunks with needs_logits, vocab] (or every token's, [N, vocab])."""
        m = self.manager
        device = self.model.device
        copies = m.take_copies().get("full", [])  # the one group's copies
        # apply_copies gathers the source blocks' K of every layer, then their V: half a block each
        self.peaks.note("cow_staging", len(copies) * self.storage.bytes_per_block // 2)
        if copies:
            self._wait_for_loads()  # a copy may read a block just loaded
        self.storage.apply_copies(copies)  # COW copies before anything writes
        token_ids: list[int] = []
        positions: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        logit_rows: list[int] = []
        for c in chunks:
            n = len(c.token_ids)
            token_ids.extend(c.token_ids)
            positions.extend(range(c.start, c.start + n))
            q_lens.append(n)
            ctx_lens.append(c.start + n)
            if c.needs_logits:
                logit_rows.append(len(token_ids) - 1)
        # Validates that each chunk continues its computed prefix within its reservation.
        tables = m.step_tables([c.seq_id for c in chunks], [c.start for c in chunks], ctx_lens)
        if self.model.shard is not None:  # tensor parallel: every rank must run the same tokens alike
            seq_ids, starts, ids = [c.seq_id for c in chunks], [c.start for c in chunks], [c.token_ids for c in chunks]
            check_same_step(step_digest(seq_ids, starts, ids, tables.slots), self.model)
        step = self.attention.begin_step(
            PagedStepMetadata(q_lens, ctx_lens, tables.slots, tables.csr.indptr, tables.csr.indices)
        )
        if step.decode_path is not None:
            self.last_decode_path = step.decode_path
        self.peaks.note("step_tables", step.table_bytes)  # the plan's tensors (for the memory ledger)
        self.peaks.note("chunked_prefill", step.prefill_bytes)
        attend = step.attend
        ids_t = torch.tensor(token_ids, dtype=torch.long, device=device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=device)
        hidden = self.model.forward(ids_t, pos_t, attend)
        logits = self.model.logits(hidden if all_logits else hidden[logit_rows])
        self._note_forward(len(token_ids), attend, logits)
        return logits
