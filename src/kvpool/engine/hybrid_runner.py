"""Runs a tiny hybrid model (models/tiny_hybrid.py) on the hybrid cache coordinator.

`HybridRunner` is the engine's ModelRunner for it (the same scheduler as the Llama and V4
runners) and the glue that `kvpool verify hybrid` and the tests drive: the coordinator
(cache/coordinator.py) keeps the ids; the attention backends chosen at construction
(attention/backends: slot attention per group, the recurrent state update) keep the
tensors; this class applies what the coordinator records (block copies, state restores)
before the forward that needs them and hands each request's tables to the backends, which
make the chunk's slot plans.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvpool.attention.backends import select_backend
from kvpool.cache import Admission, CacheDescriptor, CacheUsage, ReleaseReason
from kvpool.cache.coordinator import HybridCacheManager
from kvpool.cache.recurrent import RecurrentGroupSpec
from kvpool.cache.window import AttentionGroupSpec
from kvpool.engine.runner import ScheduledChunk
from kvpool.models.tiny_hybrid import ChunkPlan, HybridAttention, TinyHybrid


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
    return HybridAttention(groups, recurrent(len(model.recurrent_layers()), num_slots, nh, hd, model.dtype))


class HybridRunner:
    """num_blocks: blocks of each attention group's pool; num_slots: recurrent state slots
    (live states and checkpoints). `cache` may be a coordinator built over the same groups
    (a test passes a deliberately broken one)."""

    def __init__(
        self,
        model: TinyHybrid,
        num_blocks: int = 64,
        num_slots: int = 16,
        *,
        block_size: int = 8,
        checkpoint_interval: int = 16,
        enable_prefix_caching: bool = True,
        cache: HybridCacheManager | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        if cache is None:
            cache = HybridCacheManager(
                group_specs(model, block_size, checkpoint_interval, num_blocks, num_slots),
                descriptor_for(model, block_size),
                enable_prefix_caching=enable_prefix_caching,
            )
        self.cache = cache
        self.attention = attention_for(model, num_blocks, block_size, num_slots)
        self.vocab_size = model.vocab_size
        full = [g for g in cache.attention_groups if g.spec.window is None]
        # A sequence alone can grow until a full-attention group runs out (a window group
        # holds at most its window, plus the step's blocks).
        self.capacity_tokens = num_blocks * block_size if full else model.config["max_position_embeddings"]
        self.max_model_len = min(model.config["max_position_embeddings"], self.capacity_tokens)

    # ---- requests ----------------------------------------------------------------------

    def admit(
        self, seq_id: str, token_ids: Sequence[int], max_new_tokens: int | None, *, tenant_salt: str = ""
    ) -> Admission | None:
        """The coordinator's admission, then the state restore of a hit (a checkpoint copied
        into the live slot) or a fresh state."""
        if max_new_tokens is not None and max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        adm = self.cache.admit(seq_id, token_ids, max_new_tokens, tenant_salt=tenant_salt)
        if adm is None:
            return None
        if self.cache.recurrent_groups:
            live, src = self.cache.state_slot(seq_id), self.cache.restore_source(seq_id)
            if src is None:
                self.attention.recurrent.reset_state(live)
            else:
                self.attention.recurrent.copy_state(src, live)
        return adm

    def reserve(self, seq_ids: Sequence[str], num_new_tokens: Sequence[int]) -> bool:
        return self.cache.reserve_step(seq_ids, num_new_tokens)

    def append_tokens(self, seq_id: str, token_ids: Sequence[int]) -> None:
        self.cache.append_token_ids(seq_id, token_ids)

    def _plan(self, seq_id: str, start: int, num_tokens: int) -> ChunkPlan:
        cache = self.cache
        end = start + num_tokens
        attn = {}
        for g in cache.attention_groups:
            first, ids = cache.first_block(seq_id, g.name), cache.block_ids(seq_id, g.name)
            attn[g.name] = self.attention.groups[g.name].plan_chunk(start, end, g.spec.first_needed(start), first, ids)
        state_slot = cache.state_slot(seq_id) if cache.recurrent_groups else None
        checkpoints = tuple(cache.checkpoints(seq_id)) if cache.recurrent_groups else ()
        return ChunkPlan(start, num_tokens, attn, state_slot, checkpoints)

    def run(self, work: Sequence[tuple[str, list[int], int]]) -> list[Tensor]:
        """One forward over reserved chunks (seq id, token ids, start): logits
        [len(token ids), vocab] of every chunk position."""
        for group, copies in self.cache.take_copies().items():
            self.attention.groups[group].copy_blocks([(c.src, c.dst) for c in copies])
        for seq_id, ids, start in work:
            end = self.cache.num_reserved_tokens(seq_id)
            if start != self.cache.num_computed_tokens(seq_id) or start + len(ids) != end:
                raise ValueError(f"sequence {seq_id!r}: chunk [{start}, {start + len(ids)}) is not its reservation")
        plans = [self._plan(seq_id, start, len(ids)) for seq_id, ids, start in work]
        flat = [t for _, ids, _ in work for t in ids]
        logits = self.model.forward_paged(flat, plans, self.attention)
        out, offset = [], 0
        for _, ids, _ in work:
            out.append(logits[offset : offset + len(ids)])
            offset += len(ids)
        return out

    def execute(self, chunks: Sequence[ScheduledChunk]) -> Tensor:
        logits = self.run([(c.seq_id, c.token_ids, c.start) for c in chunks])
        rows = [lg[-1] for c, lg in zip(chunks, logits, strict=True) if c.needs_logits]
        return torch.stack(rows) if rows else torch.zeros(0, self.vocab_size, dtype=self.model.dtype)

    def commit(self, seq_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]) -> None:
        self.cache.commit_step(seq_ids, num_tokens, next_token_ids)

    def fork(self, parent_id: str, child_id: str) -> bool:
        if not self.cache.fork(parent_id, child_id):
            return False
        if self.cache.recurrent_groups:
            self.attention.recurrent.copy_state(self.cache.state_slot(parent_id), self.cache.state_slot(child_id))
        return True

    def release(self, seq_id: str, reason: ReleaseReason) -> bool:
        return self.cache.release(seq_id, reason)

    def num_computed_tokens(self, seq_id: str) -> int:
        return self.cache.num_computed_tokens(seq_id)

    def num_allocations(self) -> int:
        return sum(g.pool.num_allocated for g in self.cache.groups.values())

    def kv_read_bytes(self, num_context_tokens: int) -> int:
        """One query's reads: every attention layer's K/V over its visible keys, and every
        recurrent layer's state."""
        total = 0
        for g in self.cache.attention_groups:
            per_token = self.attention.groups[g.name].bytes_per_token  # all the group's layers, K and V
            window = g.spec.window
            total += per_token * (num_context_tokens if window is None else min(window, num_context_tokens))
        if self.cache.recurrent_groups:
            total += self.attention.recurrent.bytes_per_slot
        return total

    def usage(self) -> CacheUsage:
        return self.cache.usage()

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    def cache_stats(self) -> dict[str, float]:
        """The report's figures (`kvpool run`), from the coordinator and the backends' tensors:
        num_blocks counts the blocks of every attention group's pool (a block holds its
        group's layers); kv_capacity_bytes is those pools' K/V plus the recurrent state
        slots; the prefix figures are the coordinator's first-admission counters."""
        cache, stats = self.cache, self.cache.stats
        kv_bytes = sum(g.kv.numel() * g.kv.element_size() for g in self.attention.groups.values())
        recurrent = self.attention.recurrent
        state_bytes = recurrent.state.numel() * recurrent.state.element_size() if cache.recurrent_groups else 0
        pools = {g.pool: None for g in cache.groups.values()}  # each distinct pool once
        out: dict[str, float] = {
            "kv_capacity_tokens": float(self.capacity_tokens),
            "kv_capacity_bytes": float(kv_bytes + state_bytes),
            "block_size": float(self.block_size),
            "num_blocks": float(cache.num_blocks),
            "state_slots": float(sum(g.pool.num_blocks for g in cache.recurrent_groups)),
            "state_slot_bytes": float(recurrent.bytes_per_slot if cache.recurrent_groups else 0),
            "prefix_queried_tokens": float(stats.num_queried_tokens),
            "prefix_hit_tokens": float(stats.num_hit_tokens),
            "prefix_hit_rate": stats.hit_rate,
            "readmitted_hit_tokens": float(stats.num_readmitted_hit_tokens),
            "hash_collisions": float(sum(pool.num_collisions for pool in pools)),
            "hit_tokens": float(stats.num_hit_tokens),
        }
        for name, held in cache.group_held_blocks().items():
            out[f"{name}_held"] = float(held)
        return out

    def tier_reports(self) -> dict[str, dict[str, object]]:
        """{}: the hybrid runner has no host, disk or Redis tier (`kvpool run` refuses their flags)."""
        return {}
