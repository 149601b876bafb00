"""The cache layouts the simulator compares, each a real cache manager sized from the
planner's KV pool (`kvpool plan`'s ledger) for one replica:

  paged       uniform paging: a FullAttentionManager over blocks of `block_size` tokens.
              For DeepSeek-V4 that means every kind of state at one per-token geometry,
              as a single-layout engine would hold it: per token the compressed entries'
              share of a classical block plus the sliding window's entry of every layer,
              and the window is never freed (the compressor tails, small, are left out);
  contiguous  every request reserves its maximum length up front (`max_model_len`): one
              "block" of max_model_len tokens per request, nothing shared, as engines
              before paging held their cache;
  dual        DeepSeek-V4's classical + state pools (DSV4CacheManager): compressed entries
              in blocks of `block_size` (a multiple of 128) with prefix hits at block
              boundaries, one state block per running request (window + compressor tails),
              `max_num_seqs` of them, carved out of the pool first. A prefix hit rebuilds
              the state by recompute (replaying the last n_win x layers tokens) or from a
              state snapshot taken at a block boundary: `v4_restore` "auto" (the default)
              chooses per admission whichever the cost model prices lower (sim/cost.py
              RestoreCostModel), "recompute" / "checkpoint" always that one. Snapshots
              are pooled by default (`num_checkpoints` None: each one the state at its
              boundary, the window and the CSA compressors' carried rows, about a quarter
              of a state block for V4-Flash, in ceil(its bytes / block) classical blocks
              cached in the pool's free memory and evicted in its LRU order with the cached
              classical blocks, cache/dual_pool.py), or `num_checkpoints` whole state blocks
              carved out of the pool up front. A request that finishes inside a span
              keeps its state block (free, evicted last: `turn_ends`, on by default),
              and the session's next turn hits there and adopts it: nothing is copied
              or replayed, and the hit reaches up to span - 1 tokens past paging's;
  hybrid      models with sliding-window layers (Gemma-2, gpt-oss): the hybrid coordinator
              (HybridCacheManager) with a full-attention group and a window group per
              window, all drawing from one shared pool of pages of one byte size, so a
              window group holds about W tokens of a long request (its blocks leave as the
              request advances and go back to the one free queue) while a full group
              holds the whole context. One page size needs groups with equal layer counts:
              each kind's layers are split into groups of g layers, g the gcd of the kinds'
              counts (Gemma-2-9B: 21 full + 21 window; gpt-oss-120b: 18 + 18).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvpool.cache import AttentionGroupSpec, CacheDescriptor, DSV4CacheManager, FullAttentionManager, HybridCacheManager
from kvpool.capacity.planner import Plan
from kvpool.sim.cost import CostModel, RestoreCostModel
from kvpool.sim.routing import LAYOUTS
from kvpool.spec import dsv4 as dsv4_spec


@dataclass
class BuiltLayout:
    name: str
    cache: FullAttentionManager | DSV4CacheManager | HybridCacheManager
    block_bytes: int  # bytes of one block (contiguous: one request's reservation)
    state_block_bytes: int  # V4 dual: one state block; else 0
    pool_bytes: int  # the replica's KV pool (per GPU of its TP group)
    block_size: int  # tokens per block (contiguous: max_model_len; dual: the classical span)
    capacity_tokens: int  # the longest sequence one replica's cache holds alone
    checkpoint_bytes: int = 0  # V4 dual: what one state snapshot holds (a copy moves it)
    tail_bytes: int = 0  # kvpool's chunked formats: full-precision tails, max_num_seqs of them, in pool_bytes

    @property
    def num_state_blocks(self) -> int:
        """V4 dual: the state blocks (one per running request); else 0."""
        return self.cache.usage().num_state_blocks if self.state_block_bytes else 0

    @property
    def kv_capacity_bytes(self) -> int:
        return self.block_bytes * self.cache.num_blocks + self.state_block_bytes * self.num_state_blocks


def default_layout(plan: Plan) -> str:
    """dual for V4, hybrid for a model with sliding-window layers, else paged."""
    if plan.model.attention == "dsv4":
        return "dual"
    return "hybrid" if any(g.window is not None for g in plan.layout.groups) else "paged"


def check_pool(plan: Plan) -> int:
    """The plan's KV pool bytes; ValueError naming the model and the GPUs when it has none."""
    pool = int(plan.ledger.pool_bytes)
    if pool <= 0:
        fix = "pick a smaller model" if plan.gpu.kind == "cpu" else "raise --tensor-parallel-size"
        cow = plan.ledger.details.get("transient", {}).get("cow_reserve", 0.0)
        if cow > plan.weights.per_gpu_bytes:
            # (a large block's copy-on-write reserve, not the weights, left no pool: --block-size
            # 4096 on Llama-3.1-8B reserves 256 x 512 MiB, and "raise TP" misled)
            # (the planner's ledger counts its own 256 running requests, not --max-num-seqs)
            num_seqs = round(cow / plan.layout.bytes_per_block_all_groups)
            fix = (
                f"the copy-on-write reserve, one block of {plan.layout.block_size} tokens for each of the "
                f"planner's {num_seqs} running requests, takes {cow / 2**30:.1f} GiB: lower --block-size"
            )
        raise ValueError(
            f"{plan.model.name} leaves no KV pool on {plan.tp} x {plan.gpu.name} (weights "
            f"{plan.weights.per_gpu_bytes / 2**30:.1f} GiB per device): {fix}"
        )
    return pool


def build_layout(
    plan: Plan,
    name: str,
    *,
    enable_prefix_caching: bool,
    max_num_seqs: int,
    max_model_len: int,
    v4_restore: str = "auto",
    num_checkpoints: int | None = 0,
    num_blocks: int | None = None,
    cost: CostModel | None = None,
    turn_ends: bool = True,
) -> BuiltLayout:
    """The manager of layout `name` over the plan's pool. ValueError when the layout does not
    apply to the model or the pool holds nothing of it. num_blocks (paged only): exactly
    that many blocks, at most what the pool holds (to replay an engine's own pool).
    cost (dual): prices each admission's state restore when v4_restore is "auto" (None:
    by token counts, cache/dual_pool.py TokenCost). turn_ends (dual): a request that
    finishes inside a span keeps its state block for a follow-up turn to adopt."""
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}; one of {', '.join(LAYOUTS)}")
    if num_blocks is not None and name != "paged":
        raise ValueError(f"num_blocks sizes the paged layout only, not {name!r}")
    model, layout = plan.model, plan.layout
    pool = check_pool(plan)
    q = layout.block_size
    descriptor = CacheDescriptor(model_id=model.name, layout_id=f"sim:{name}:{q}:{layout.kv_dtype}:tp{plan.tp}")
    v4 = model.dsv4
    if name == "dual":
        if v4 is None:
            raise ValueError(
                f"layout 'dual' is DeepSeek-V4's classical + state pools; {model.name} is {model.attention}"
            )
        state = int(layout.state_block_bytes)
        block = int(layout.bytes_per_block_all_groups)
        num_states = min(max_num_seqs, pool // (state + block))
        # checkpoint slots are state blocks too, carved out before the classical blocks;
        # pooled checkpoints (None) take ceil(state / block) classical blocks each, when free
        slots = num_checkpoints or 0
        num_blocks = (pool - (num_states + slots) * state) // block
        if num_states <= 0 or num_blocks <= 0:
            raise ValueError(
                f"a pool of {pool:,} bytes holds no state block of {state:,} bytes "
                f"(and {slots} checkpoints) and a block"
            )
        pooled = num_checkpoints is None and v4_restore != "recompute"
        spec = dsv4_spec.DSV4Spec.from_config(v4.to_dict(), name=v4.name, block_span=q)
        # A slot is a whole state block (as the engine's); a pooled snapshot holds only the
        # state at its span boundary: the window and the CSA compressors' carried rows
        # (spec.boundary_state_bytes), not the tails a boundary leaves empty.
        boundary = layout.state_bytes_per_request - spec.compressor_state_bytes() + spec.boundary_compressor_bytes()
        checkpoint = math.ceil(boundary) if pooled else state
        manager = DSV4CacheManager(
            spec,
            num_blocks,
            num_states,
            descriptor,
            enable_prefix_caching=enable_prefix_caching,
            restore=v4_restore,
            num_checkpoints=slots,
            checkpoint_blocks=-(-checkpoint // block) if pooled else 0,
            spill_blocks=-(-state // block) if pooled else 0,  # a spilled turn end: the whole state block
            restore_cost=None if cost is None else RestoreCostModel(cost, checkpoint),
            turn_end_checkpoints=turn_ends,
        )
        # the unfinished span lives in the state block (engine/dsv4_runner.py)
        capacity = num_blocks * q + q - 1
        return BuiltLayout(name, manager, block, state, pool, q, capacity, checkpoint)
    tails = int(layout.tail_bytes_per_request)
    if tails and name != "contiguous":  # (a contiguous slot is request_bytes: its tails are in it)
        # kvpool's chunked formats: the full-precision tails of every request that may run
        # (the planner's per-request state, capacity/kv.py), kept out of the blocks' bytes
        reserved = max_num_seqs * tails
        if pool - reserved < layout.bytes_per_block_all_groups:
            raise ValueError(
                f"the full-precision tails of {max_num_seqs:,} running requests ({tails:,} B each, "
                f"{layout.kv_dtype}) leave no KV pool of the {pool / 2**30:,.2f} GiB: lower --max-num-seqs"
            )
        pool -= reserved
        built = _build_after_tails(plan, name, pool, descriptor, enable_prefix_caching, max_model_len, num_blocks)
        return dataclasses.replace(built, pool_bytes=pool + reserved, tail_bytes=reserved)
    return _build_after_tails(plan, name, pool, descriptor, enable_prefix_caching, max_model_len, num_blocks)


def _build_after_tails(
    plan: Plan,
    name: str,
    pool: int,
    descriptor: CacheDescriptor,
    enable_prefix_caching: bool,
    max_model_len: int,
    num_blocks: int | None,
) -> BuiltLayout:
    """The paged, hybrid and contiguous layouts over `pool` bytes (the chunked formats'
    tails already taken out)."""
    layout, v4 = plan.layout, plan.model.dsv4
    q = layout.block_size
    if name == "hybrid":
        return _hybrid(plan, pool, descriptor, enable_prefix_caching, max_model_len)
    if name == "contiguous":
        block = int(layout.request_bytes(max_model_len))
        num_slots = pool // block
        if num_slots <= 0:
            raise ValueError(f"a pool of {pool:,} bytes holds no request of {max_model_len:,} tokens ({block:,} bytes)")
        manager = FullAttentionManager(num_slots, max_model_len, descriptor, enable_prefix_caching=False)
        return BuiltLayout(name, manager, block, 0, pool, max_model_len, num_slots * max_model_len)
    # paged
    block = int(layout.bytes_per_block_all_groups)
    if v4 is not None:
        # the window's entry of every layer, per token, kept for the whole sequence
        dtype = dsv4_spec.SERVING if layout.kv_dtype == "fp8" else "bfloat16"
        window_per_token = v4.swa_state_bytes(dtype) / v4.window
        block = int(block + q * window_per_token)
    fits = pool // block
    if fits <= 0:
        raise ValueError(f"a pool of {pool:,} bytes holds no block of {block:,} bytes")
    if num_blocks is not None and num_blocks > fits:
        raise ValueError(f"num_blocks {num_blocks:,} exceeds the {fits:,} blocks of {block:,} bytes the pool holds")
    num_blocks = fits if num_blocks is None else num_blocks
    manager = FullAttentionManager(num_blocks, q, descriptor, enable_prefix_caching=enable_prefix_caching)
    return BuiltLayout(name, manager, block, 0, pool, q, num_blocks * q)


def _hybrid(
    plan: Plan, pool: int, descriptor: CacheDescriptor, enable_prefix_caching: bool, max_model_len: int
) -> BuiltLayout:
    """The coordinator over one shared pool: per page group of the planner's layout, groups of
    g layers (g = gcd of the layer counts), so that every group's page has one byte size."""
    groups = plan.layout.groups
    if not any(g.window is not None for g in groups):
        raise ValueError(
            f"layout 'hybrid' is for models with sliding-window layers; {plan.model.name} has none (use paged)"
        )
    per_layer = {g.block_bytes_per_layer for g in groups}
    if len(per_layer) != 1 or any(g.tokens_per_entry != 1 for g in groups):
        raise ValueError(
            f"layout 'hybrid' needs one block geometry per layer; {plan.model.name} has {sorted(per_layer)}"
        )
    num_layers = math.gcd(*(g.num_layers for g in groups))
    page = num_layers * per_layer.pop()
    num_blocks = pool // page
    if num_blocks <= 0:
        raise ValueError(f"a pool of {pool:,} bytes holds no page of {page:,} bytes")
    specs: list[tuple[AttentionGroupSpec, int | None]] = []
    for g in groups:
        count = g.num_layers // num_layers
        for i in range(count):
            specs.append((AttentionGroupSpec(g.name if count == 1 else f"{g.name}.{i}", g.block_size, g.window), None))
    manager = HybridCacheManager(
        specs, descriptor, enable_prefix_caching=enable_prefix_caching, shared_blocks=num_blocks
    )
    bs = manager.block_size
    capacity = _hybrid_capacity(manager, max_model_len)
    return BuiltLayout("hybrid", manager, page, 0, pool, bs, capacity)


def _hybrid_capacity(manager: HybridCacheManager, max_model_len: int) -> int:
    """The longest sequence one replica's shared pool holds alone: each window group keeps
    the blocks of its window (one more when unaligned, one for the step's next position),
    each full group the whole sequence. Without a full group: max_model_len."""
    bs = manager.block_size
    full = [g for g in manager.attention_groups if g.spec.window is None]
    windows = [g.spec.window for g in manager.attention_groups if g.spec.window is not None]
    left = manager.num_blocks - sum(-(-w // bs) + 2 for w in windows)
    if not full:
        return max_model_len if left >= 0 else 0
    return max(0, left // len(full)) * bs
