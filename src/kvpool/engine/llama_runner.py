"""A Llama model on the paged KV pool, behind the ModelRunner protocol."""

from __future__ import annotations

from typing import Sequence

import torch

from kvpool.attention.paged import paged_attention, plan_step
from kvpool.cache import CacheDescriptor, KVCacheManager
from kvpool.engine.runner import Admitted, ScheduledChunk
from kvpool.models.llama import LlamaModel
from kvpool.storage.kv import PagedKVStorage


class LlamaRunner:
    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        descriptor: CacheDescriptor,
        *,
        enable_prefix_caching: bool = True,
        decode_path: str = "bags",
    ):
        cfg = model.config
        self.model = model
        self.manager = KVCacheManager(num_blocks, block_size, descriptor, enable_prefix_caching=enable_prefix_caching)
        self.storage = PagedKVStorage(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device
        )
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        self.capacity_tokens = num_blocks * block_size
        self.max_model_len = min(cfg.max_position, self.capacity_tokens)
        self.decode_path = decode_path  # "bags" or "padded" (attention/paged.py)
        self.scale = cfg.head_dim**-0.5
        self.last_decode_path: str | None = None  # the path the last step's decodes took

    # ---- cache bookkeeping (pure Python, through the manager) ---------------------

    def admit(self, seq_id: str, token_ids: Sequence[int], max_new_tokens: int) -> Admitted | None:
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        num_cached = self.manager.lookup_prefix(token_ids)
        n = min(max_new_tokens, len(token_ids) - num_cached)
        admission = self.manager.admit(seq_id, token_ids, n)
        if admission is None:
            return None
        # The lookup and the admission agree: nothing ran between them.
        assert admission.num_cached_tokens == num_cached
        return Admitted(num_cached, n)

    def reserve(self, seq_id: str, num_new_tokens: int) -> bool:
        return self.manager.reserve(seq_id, num_new_tokens) is not None

    def append_tokens(self, seq_id: str, token_ids: Sequence[int]) -> None:
        self.manager.append_token_ids(seq_id, token_ids)

    def commit(self, seq_id: str, num_tokens: int) -> None:
        self.manager.commit(seq_id, num_tokens)

    def fork(self, parent_id: str, child_id: str) -> None:
        self.manager.fork(parent_id, child_id)

    def release(self, seq_id: str, reason: str) -> None:
        if reason == "finish":
            self.manager.finish(seq_id)
        elif reason == "cancel":
            self.manager.cancel(seq_id)
        elif reason == "preempt":
            self.manager.preempt(seq_id)
        else:
            raise ValueError(f"unknown release reason {reason!r}")

    def num_computed_tokens(self, seq_id: str) -> int:
        return self.manager.num_computed_tokens(seq_id)

    def check_integrity(self) -> None:
        self.manager.check_integrity()

    def cache_stats(self) -> dict[str, float]:
        m = self.manager
        used_blocks = m.num_blocks - m.num_free_blocks
        return {
            "kv_capacity_tokens": self.capacity_tokens,
            "kv_capacity_bytes": self.storage.num_bytes,
            "block_size": self.block_size,
            "num_blocks": m.num_blocks,
            "used_blocks": used_blocks,
            "bytes_per_token": self.storage.bytes_per_block / self.block_size,
            "prefix_queried_tokens": m.stats.num_queried_tokens,
            "prefix_hit_tokens": m.stats.num_hit_tokens,
        }

    def used_tokens(self) -> tuple[int, int]:
        """(tokens held by live sequences, slots in their blocks): for fragmentation."""
        m = self.manager
        held = sum(m.num_computed_tokens(r) for r in m.request_ids)
        slots = sum(len(m.block_ids(r)) for r in m.request_ids) * self.block_size
        return held, slots

    # ---- the forward ---------------------------------------------------------------

    def execute(self, chunks: Sequence[ScheduledChunk], all_logits: bool = False) -> torch.Tensor:
        """Run one step; logits [num chunks with needs_logits, vocab] (or every token's, [N, vocab])."""
        m = self.manager
        device = self.model.device
        self.storage.apply_copies(m.take_copies())  # COW copies before anything writes
        token_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        logit_rows: list[int] = []
        for c in chunks:
            n = len(c.token_ids)
            assert n > 0 and c.start == m.num_computed_tokens(c.seq_id), "chunks continue the computed prefix"
            token_ids.extend(c.token_ids)
            positions.extend(range(c.start, c.start + n))
            slot_mapping.extend(m.slot_mapping(c.seq_id, c.start, c.start + n))
            q_lens.append(n)
            ctx_lens.append(c.start + n)
            if c.needs_logits:
                logit_rows.append(len(token_ids) - 1)
        csr = m.csr([c.seq_id for c in chunks], ctx_lens)
        cfg = self.model.config
        plan = plan_step(
            q_lens, ctx_lens, slot_mapping, csr.indptr, csr.indices, self.block_size, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, device, self.model.dtype, self.decode_path,
        )  # fmt: skip
        if plan.decode is not None:
            self.last_decode_path = "bags" if plan.decode.bags is not None else "padded"
        storage = self.storage
        write_index = storage.write_index(plan.block_idx, plan.offset_idx)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            storage.write(layer, write_index, k, v)
            return paged_attention(q, storage.k[layer], storage.v[layer], plan, self.scale)

        ids_t = torch.tensor(token_ids, dtype=torch.long, device=device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=device)
        hidden = self.model.forward(ids_t, pos_t, attend)
        if all_logits:
            return self.model.logits(hidden)
        return self.model.logits(hidden[logit_rows])
