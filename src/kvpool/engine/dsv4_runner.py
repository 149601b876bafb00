"""A V4-architecture model on the dual pool: `DSV4Executor`, the tensor side of the one
ModelRunner (engine/runner.py), and `dsv4_runner`, which builds that runner.

The cache (DSV4CacheManager) keeps the ids and decides the hits and restore methods; the
runner applies them (a checkpoint copied, a replay deferred to the step that needs the
state, a window restored from the persistent tiers' snapshots) and cuts each step at the
state checkpoints and the window snapshots it takes; the executor owns the pools
(storage/dsv4.py) and V4's sparse attention over them (attention/backends), and does the
forwards, replays, state copies and block moves it is told to. The engine drives the
runner through its protocol; the tests, `kvpool verify dsv4` and the benchmarks drive the
same object directly: `add_request` (admit, the state restored at once), `step` (a batch
of chunks of any sizes: prefill, chunked prefill, decode, logits of every computed token),
`release`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from kvpool.attention.backends import StepMetadata, select_backend
from kvpool.attention.dsv4_paged import ChunkPlan
from kvpool.cache import BlockCopy, CacheDescriptor, DSV4CacheManager
from kvpool.cache.dual_pool import RestoreCost, RestoreMethod
from kvpool.engine.memory import StepPeaks
from kvpool.engine.runner import MeasuredRestoreCost, ModelRunner, ScheduledChunk, last_token_rows
from kvpool.engine.tier_bridge import TierBridge
from kvpool.models.tiny_dsv4 import TinyDSV4
from kvpool.spec.dsv4 import CSA_RATIO
from kvpool.storage.dsv4 import DSV4Pools, V4EntryPool
from kvpool.tiers import Tier
from kvpool.tiers.swa import SWAStrategy


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


def dsv4_runner(
    model: TinyDSV4,
    num_classical_blocks: int = 64,
    num_state_blocks: int = 16,
    *,
    restore: RestoreMethod = "recompute",
    num_checkpoints: int = 0,
    checkpoint_blocks: int = 0,
    restore_cost: RestoreCost | None = None,
    enable_prefix_caching: bool = True,
    replay_chunk: int = 256,
    hot_set_entries: int | None = None,
    host_tier: Tier | None = None,
    persistent_tiers: Sequence[Tier] = (),
    swa: SWAStrategy | None = None,
    kv_format: str = "exact",
    indexer_format: str = "fp8",
    turn_end_checkpoints: bool = False,
    preemption: str = "recompute",
) -> ModelRunner:
    """The one runner over a DSV4CacheManager and a DSV4Executor. Its `fork` returns False
    when no state block is free (a V4 child needs its own): the engine then queues the
    child, which is admitted later through the prefix cache like a preempted request.

    restore: how a prefix hit's state is rebuilt (cache/dual_pool.py): "recompute",
    "checkpoint" or "auto" (by `restore_cost`), from snapshots in `num_checkpoints` slots
    of their own or pooled, `checkpoint_blocks` classical blocks each (the executor keeps a
    pooled snapshot's state in a row of its own: storage/dsv4.py).
    restore_cost: what "auto" prices a restore by; None: the runner's own timings
    (MeasuredRestoreCost). A given one is the cache's alone (a test hands one cost to a
    real and a simulated runner); the runner still times its copies and replays.

    kv_format: the classical pool's entries exact in the model's dtype ("exact"), or
    in V4's serving layout ("fp8": non-RoPE dims FP8 E4M3 with a power-of-two scale per
    64, RoPE dims BF16; indexer keys `indexer_format`, FP8 or MXFP4: storage/dsv4.py).
    hot_set_entries: HiSparse (storage/dsv4.py HotSet): the CSA main entries each CSA
    layer keeps on the device; the rest of the CSA main pool is in host memory.
    host_tier: classical blocks the pool evicts are saved to it, and before an
    admission the spans it holds after the device hit are brought back into the pool's
    prefix cache (written, checked, then published), where the admission hits them.
    persistent_tiers: the disk and Redis tiers, below the host tier: every classical
    block that completes is written through to them, and, by the SWA strategy `swa`
    (tiers/swa.py; zero by default), window snapshots at block boundaries, from which
    a prefix hit restores its state instead of recomputing it.
    turn_end_checkpoints: a request that finishes inside a span leaves its state block
    kept (cache/dual_pool.py); a follow-up turn hits there and takes the block over as
    its own state, neither reset nor copied.
    preemption: "recompute" (a preempted request's spans stay findable, its state is
    restored as a hit's), "swap" (needs `host_tier`: its spans the tier lacks and its state
    are written there, and the state comes back on resume: nothing replayed) or "auto"
    (swap when moving the state costs less than recomputing, by the measured rates)."""
    if persistent_tiers and restore != "recompute":
        raise ValueError("persistent tiers restore a V4 hit's state by their SWA strategy: restore='recompute'")
    if kv_format == "fp8" and (host_tier is not None or persistent_tiers):
        raise ValueError("--kv-cache-dtype fp8: the tiers keep exact classical blocks only")
    spec = model.spec
    descriptor = descriptor_for(model, kv_format, indexer_format)
    measured = MeasuredRestoreCost()  # what copies and replays took here (restore="auto" by default)
    bridge = TierBridge(host_tier, persistent_tiers, spec.span, enable_prefix_caching=enable_prefix_caching)
    cache = DSV4CacheManager(
        spec,
        num_classical_blocks,
        num_state_blocks,
        descriptor,
        enable_prefix_caching=enable_prefix_caching,
        restore=restore,
        num_checkpoints=num_checkpoints,
        checkpoint_blocks=checkpoint_blocks,
        restore_cost=measured if restore_cost is None else restore_cost,
        lower_tier=bridge.index,  # (None without tiers) its evicted blocks are saved to the host tier
        record_published=bool(bridge.persistent_tiers),  # written through as they complete
        turn_end_checkpoints=turn_end_checkpoints,
    )
    executor = DSV4Executor(
        model,
        num_classical_blocks,
        num_state_blocks,
        num_checkpoints,
        hot_set_entries,
        kv_format,
        indexer_format,
        replay_chunk,
        # a pooled snapshot's state row per classical block, only where the cache takes them
        pooled_checkpoints=checkpoint_blocks > 0 and cache.groups["v4"].checkpointing,
    )
    # The unfinished span lives in the state block, so one request holds up to
    # num_classical_blocks full spans plus span - 1 tokens.
    capacity = num_classical_blocks * spec.span + spec.span - 1
    return ModelRunner(
        cache,
        executor,
        bridge,
        descriptor=descriptor,
        block_size=spec.span,
        capacity_tokens=capacity,
        max_model_len=min(spec.max_position_embeddings, capacity),
        restore_cost=measured,
        checkpoint_base=executor.pools.checkpoint_base,
        swa=swa,
        preemption=preemption,
    )


class DSV4Executor:
    """A V4 model's tensors: the classical and state pools (num_checkpoints checkpoint
    slots after the num_state_blocks state blocks, or with pooled_checkpoints a state row
    per classical block for the pooled snapshots) and the sparse attention over them."""

    keeps_block_state = False
    has_state = True

    def __init__(
        self,
        model: TinyDSV4,
        num_classical_blocks: int,
        num_state_blocks: int,
        num_checkpoints: int,
        hot_set_entries: int | None,
        kv_format: str,
        indexer_format: str,
        replay_chunk: int = 256,
        *,
        pooled_checkpoints: bool = False,
    ) -> None:
        self.model = model
        self.spec = model.spec
        self.vocab_size = model.vocab_size
        # the report's name of the storage format
        self.kv_format = "float32" if kv_format == "exact" else f"fp8 (V4 layout, {indexer_format} indexer keys)"
        self.pools = DSV4Pools(
            model.spec,
            num_classical_blocks,
            num_state_blocks,
            num_checkpoints,
            dtype=model.dtype,
            hot_set_entries=hot_set_entries,
            entry_format=kv_format,
            indexer_format=indexer_format,
            pooled_checkpoints=pooled_checkpoints,
        )
        # V4's sparse attention over these pools, chosen once (attention/backends)
        device = self.pools.state[0].ring.device.type
        self.attention = select_backend("dsv4-sparse", f"dsv4-{kv_format}", device).backend(self.pools)
        self.replay_chunk = replay_chunk  # tokens a replay computes per forward
        self.peaks = StepPeaks()
        self.block_layout = {name: (t.dtype, tuple(t.shape)) for name, t in self._block_tensors(0).items()}
        self.block_bytes = self.pools.classical_block_bytes()

    def _block_tensors(self, block_id: int) -> dict[str, Tensor]:
        """One classical block's tensors, every compressed layer (CSA main + indexer, HCA):
        views into the pools."""
        out: dict[str, Tensor] = {}
        for layer, cl in enumerate(self.pools.classical):
            if cl.main is not None:
                out[f"main{layer}"] = cl.main[block_id]
            if cl.idx is not None:
                out[f"idx{layer}"] = cl.idx[block_id]
        return out

    # ---- the forward --------------------------------------------------------------------

    def forward(self, chunks: Sequence[ScheduledChunk], cache: DSV4CacheManager, all_logits: bool) -> Tensor:
        """One forward over pieces of the requests' pending reservations (the runner cuts a
        reservation at its checkpoints: the state is snapshot between pieces); logits
        [num chunks with needs_logits, vocab] (all_logits: every token's, [N, vocab])."""
        span = self.spec.span
        plans = []
        for c in chunks:
            table = cache.block_ids(c.request_id)  # (the reserved step's new blocks included)
            pos, stop = c.start, c.start + len(c.token_ids)
            slot = cache.part(c.request_id).state_slot
            plans.append(ChunkPlan(pos, stop - pos, slot, table[: pos // span], table[pos // span : stop // span]))
        rows = None if all_logits else last_token_rows(chunks)
        return self._forward([t for c in chunks for t in c.token_ids], plans, rows)

    def _forward(self, token_ids: Sequence[int], plans: list[ChunkPlan], logit_rows: list[int] | None) -> Tensor:
        """The model's forward over the chunks `plans` (token_ids: theirs, in order)."""
        step = self.attention.begin_step(plans)
        ids = torch.tensor(list(token_ids), dtype=torch.long)
        return self.model.forward(ids, step.positions, StepMetadata(step, logit_rows))

    def replay(self, token_ids: Sequence[int], start: int, block_ids: Sequence[int], state_slot: int, valid_from: int):
        """Recompute the state of `state_slot` over tokens [start, start + len(token_ids)) on
        top of the cached classical blocks `block_ids` (section 6), `replay_chunk` tokens a
        forward (no logits); the window holds positions from `valid_from` on (0: the state
        at `start` is exact)."""
        table = tuple(block_ids)
        end = start + len(token_ids)
        pos = start
        while pos < end:
            n = min(self.replay_chunk, end - pos)
            plan = ChunkPlan(pos, n, state_slot, table, (), replay=True, valid_from=valid_from)
            self._forward(token_ids[pos - start : pos - start + n], [plan], [])
            pos += n

    def copy_blocks(self, copies: Mapping[str, Sequence[BlockCopy]]) -> None:
        raise AssertionError("classical blocks are immutable: the dual pool never copies one")

    # ---- state ---------------------------------------------------------------------------

    def reset_state(self, slot: int) -> None:
        self.pools.reset_state(slot)

    def copy_state(self, src: int, dst: int) -> None:
        self.pools.copy_state(src, dst)

    def copy_whole_state(self, src: int, dst: int) -> None:
        """A spilled turn end's copy: the state slot whole, as every copy here."""
        self.copy_state(src, dst)

    def window_snapshot(
        self, slot: int, boundary: int, num_rows: int, *, unfinished_span: bool = False
    ) -> dict[str, Tensor]:
        """The state of `slot` at block boundary `boundary` (unfinished_span: any position)
        as a tier entry (views)."""
        return self.pools.window_snapshot(slot, boundary, num_rows, unfinished_span=unfinished_span)

    def restore_window(self, slot: int, boundary: int, snapshots: list[tuple[int, dict[str, Tensor]]]) -> None:
        self.pools.restore_window(slot, boundary, snapshots)

    def drop_blocks(self, block_ids: Sequence[int]) -> None:
        pass

    # ---- the tiers' block moves ------------------------------------------------------------

    def to_host(self, block_ids: Sequence[int]) -> list[dict[str, Tensor]]:
        """Each block's tensors, views into the pools (a tier copies what it keeps)."""
        return [self._block_tensors(b) for b in block_ids]

    def to_device(self, block_ids: Sequence[int], blocks: Sequence[dict[str, Tensor]]) -> None:
        for block_id, tensors in zip(block_ids, blocks, strict=True):
            for name, dst in self._block_tensors(block_id).items():
                if tensors[name].shape != dst.shape:
                    raise AssertionError(
                        f"a tier block's {name} of shape {tensors[name].shape} passed the layout check"
                    )
                dst.copy_(tensors[name])
            for cl in self.pools.classical:
                if cl.hot is not None:
                    cl.hot.invalidate_block(block_id)

    # ---- figures ---------------------------------------------------------------------------

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

    def check_integrity(self) -> None:
        for cl in self.pools.classical:
            if cl.hot is not None:
                cl.hot.check_integrity()

    def cache_stats(self, cache: Any) -> dict[str, float]:
        pools = self.pools
        # every state row: the state blocks', then the checkpoints' (slots, or pooled rows)
        return {
            "kv_capacity_bytes": pools.classical_block_bytes() * cache.num_blocks
            + pools.state_block_bytes() * pools.num_slots,
            "classical_block_bytes": pools.classical_block_bytes(),
            "state_blocks": cache.usage().num_state_blocks,
            "state_block_bytes": pools.state_block_bytes(),
        }

    def reports(self, num_steps: int) -> dict[str, dict[str, object]]:
        """{"hisparse": its figures} ({} when off): the CSA main bytes kept off the device,
        the entries the indexer selected and those fetched from the host copy, per step."""
        hisparse = hisparse_report(self.pools, num_steps)
        return {"hisparse": hisparse} if hisparse is not None else {}


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
