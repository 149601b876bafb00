"""A tiny hybrid model (models/tiny_hybrid.py) on the hybrid cache coordinator:
`HybridExecutor`, the tensor side of the one ModelRunner (engine/runner.py), and
`hybrid_runner`, which builds that runner.

The coordinator (cache/coordinator.py) keeps the ids; the attention backends chosen at
construction (attention/backends: slot attention per group, the recurrent state update)
keep the tensors; the runner applies what the coordinator records (block copies, state
restores) before the forward that needs them, through the executor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from kvpool.attention.backends import GroupTable, HybridAttention, HybridChunk, StepMetadata, select_backend
from kvpool.cache import BlockCopy, CacheDescriptor
from kvpool.cache.coordinator import HybridCacheManager
from kvpool.cache.recurrent import RecurrentGroupSpec
from kvpool.cache.window import AttentionGroupSpec
from kvpool.engine.memory import StepPeaks
from kvpool.engine.runner import ModelRunner, ScheduledChunk, last_token_rows
from kvpool.engine.tier_bridge import TierBridge
from kvpool.models.tiny_hybrid import TinyHybrid


def descriptor_for(model: TinyHybrid, block_size: int) -> CacheDescriptor:
    dtype = str(model.dtype).removeprefix("torch.")
    return CacheDescriptor(
        model_id=model.name,
        weights_version=f"seed={model.seed}",
        layout_id=f"hybrid:{'-'.join(model.config['layers'])}:bs{block_size}:{dtype}",
        rope_id=f"rope-{model.config['rope_theta']}",
    )


def group_specs(
    model: TinyHybrid, block_size: int, checkpoint_interval: int, num_blocks: int, num_slots: int
) -> list[tuple[AttentionGroupSpec | RecurrentGroupSpec, int]]:
    """The coordinator's groups for a model: one per attention kind, one recurrent group."""
    specs: list[tuple[AttentionGroupSpec | RecurrentGroupSpec, int]] = []
    for name in model.attention_groups():
        window = model.window if name == "window" else None
        specs.append((AttentionGroupSpec(name, block_size, window), num_blocks))
    if model.recurrent_layers():
        specs.append((RecurrentGroupSpec("recurrent", checkpoint_interval), num_slots))
    return specs


def attention_for(model: TinyHybrid, num_blocks: int, block_size: int, num_slots: int) -> HybridAttention:
    """The model's attention backends, chosen once from the registry (attention/backends):
    one per attention group (kind "full" or "window" on a token-slot pool), the recurrent
    state update on the state slots."""
    cfg = model.config
    kvh, nh, hd = cfg["num_kv_heads"], cfg["num_heads"], cfg["head_dim"]
    groups = {}
    for name, layers in model.attention_groups().items():
        backend = select_backend(name, "slots", "cpu").backend
        window = model.window if name == "window" else None
        groups[name] = backend(len(layers), num_blocks, block_size, kvh, hd, model.dtype, window)
    recurrent = select_backend("recurrent", "state", "cpu").backend
    layer_kinds = cfg["layers"]
    return HybridAttention(
        layer_kinds, groups, recurrent(len(model.recurrent_layers()), num_slots, nh, hd, model.dtype)
    )


def hybrid_runner(
    model: TinyHybrid,
    num_blocks: int = 64,
    num_slots: int = 16,
    *,
    block_size: int = 8,
    checkpoint_interval: int = 16,
    enable_prefix_caching: bool = True,
    cache: HybridCacheManager | None = None,
) -> ModelRunner:
    """The one runner over a HybridCacheManager and a HybridExecutor. num_blocks: blocks of
    each attention group's pool; num_slots: recurrent state slots (live states and
    checkpoints). `cache` may be a coordinator built over the same groups (a test passes a
    deliberately broken one). No tier serves a hybrid cache."""
    descriptor = descriptor_for(model, block_size)
    if cache is None:
        cache = HybridCacheManager(
            group_specs(model, block_size, checkpoint_interval, num_blocks, num_slots),
            descriptor,
            enable_prefix_caching=enable_prefix_caching,
        )
    full = [g for g in cache.attention_groups if g.spec.window is None]
    # A request alone can grow until a full-attention group runs out (a window group
    # holds at most its window, plus the step's blocks: the engine cuts a prefill chunk
    # to what the pool takes). Without one, a window group's pool holds a request of any
    # length only where it holds the blocks a window of W positions spans at worst
    # (ceil((W - 1) / block_size) + 1); a smaller pool holds what it holds.
    windows = [g.spec.window for g in cache.attention_groups if g.spec.window is not None]
    spans = max((-(-(w - 1) // block_size) + 1 for w in windows), default=0)
    max_position = model.config["max_position_embeddings"]
    capacity = num_blocks * block_size if full or num_blocks < spans else max_position
    return ModelRunner(
        cache,
        HybridExecutor(model, num_blocks, block_size, num_slots),
        TierBridge(None, (), block_size, enable_prefix_caching=enable_prefix_caching),
        descriptor=descriptor,
        block_size=block_size,
        capacity_tokens=capacity,
        max_model_len=min(max_position, capacity),
    )


class HybridExecutor:
    """A tiny hybrid model's tensors: one slot-attention backend per attention group, the
    recurrent state update on the state slots (`attention_for`). Its forward hands each
    request's tables, read from the coordinator, to the backends, which make the chunk's
    slot plans."""

    keeps_block_state = False
    block_layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}  # no tier serves it
    block_bytes = 0

    def __init__(self, model: TinyHybrid, num_blocks: int, block_size: int, num_slots: int) -> None:
        self.model = model
        self.vocab_size = model.vocab_size
        self.attention = attention_for(model, num_blocks, block_size, num_slots)
        self.has_state = bool(model.recurrent_layers())
        self.kv_format = str(model.dtype).removeprefix("torch.")
        self.peaks = StepPeaks()

    def _chunk(self, cache: HybridCacheManager, c: ScheduledChunk) -> HybridChunk:
        """A chunk's tables in every attention group, its state slot and checkpoints."""
        request_id, start = c.request_id, c.start
        tables = {}
        for g in cache.attention_groups:
            part = cache.part(request_id, g.name)
            tables[g.name] = GroupTable(part.first_block, part.block_ids, g.spec.first_needed(start))
        state = cache.part(request_id, cache.recurrent_groups[0].name) if self.has_state else None
        state_slot, checkpoints = (state.state_slot, tuple(state.checkpoints)) if state is not None else (None, ())
        return HybridChunk(start, len(c.token_ids), tables, state_slot, checkpoints)

    def forward(self, chunks: Sequence[ScheduledChunk], cache: HybridCacheManager, all_logits: bool) -> Tensor:
        """Logits [num chunks with needs_logits, vocab] (all_logits: every token's, [N, vocab])."""
        for c in chunks:
            end = cache.num_reserved_tokens(c.request_id)
            if c.start != cache.num_computed_tokens(c.request_id) or c.start + len(c.token_ids) != end:
                raise ValueError(
                    f"sequence {c.request_id!r}: chunk [{c.start}, {c.start + len(c.token_ids)}) is not its reservation"
                )
        step = self.attention.begin_step([self._chunk(cache, c) for c in chunks])
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
        positions = torch.tensor(
            [p for c in chunks for p in range(c.start, c.start + len(c.token_ids))], dtype=torch.long
        )
        return self.model.forward(ids, positions, StepMetadata(step, None if all_logits else last_token_rows(chunks)))

    def copy_blocks(self, copies: Mapping[str, Sequence[BlockCopy]]) -> None:
        for group, group_copies in copies.items():
            self.attention.groups[group].copy_blocks([(c.src, c.dst) for c in group_copies])

    def to_host(self, block_ids: Sequence[int]) -> list[dict[str, Tensor]]:
        raise AssertionError("no tier serves a hybrid cache")

    def to_device(self, block_ids: Sequence[int], blocks: Sequence[dict[str, Tensor]]) -> None:
        raise AssertionError("no tier serves a hybrid cache")

    def reset_state(self, slot: int) -> None:
        self.attention.recurrent.reset_state(slot)

    def copy_state(self, src: int, dst: int) -> None:
        self.attention.recurrent.copy_state(src, dst)

    def copy_whole_state(self, src: int, dst: int) -> None:
        self.copy_state(src, dst)  # (the slot whole, as every copy here)

    def replay(
        self, token_ids: Sequence[int], start: int, block_ids: Sequence[int], state_slot: int, valid_from: int
    ) -> None:
        raise AssertionError("a hybrid cache never restores a state by replay")

    def drop_blocks(self, block_ids: Sequence[int]) -> None:
        pass

    def kv_read_bytes(self, num_context_tokens: int) -> int:
        """One query's reads: every attention layer's K/V over its visible keys, and every
        recurrent layer's state."""
        total = 0
        for name, backend in self.attention.groups.items():
            window = self.model.window if name == "window" else None
            total += backend.bytes_per_token * (
                num_context_tokens if window is None else min(window, num_context_tokens)
            )
        if self.has_state:
            total += self.attention.recurrent.bytes_per_slot
        return total

    def check_integrity(self) -> None:
        pass

    def cache_stats(self, cache: HybridCacheManager) -> dict[str, float]:
        """num_blocks counts the blocks of every attention group's pool (a block holds its
        group's layers); kv_capacity_bytes is those pools' K/V plus the recurrent state
        slots; the prefix figures are the coordinator's first-admission counters."""
        kv_bytes = sum(g.kv.numel() * g.kv.element_size() for g in self.attention.groups.values())
        recurrent = self.attention.recurrent
        state_bytes = recurrent.state.numel() * recurrent.state.element_size() if self.has_state else 0
        out: dict[str, float] = {
            "kv_capacity_bytes": float(kv_bytes + state_bytes),
            "state_slots": float(sum(g.pool.num_blocks for g in cache.recurrent_groups)),
            "state_slot_bytes": float(recurrent.bytes_per_slot if self.has_state else 0),
            "hit_tokens": float(cache.stats.num_hit_tokens),
        }
        for name, held in cache.group_held_blocks().items():
            out[f"{name}_held"] = float(held)
        return out
