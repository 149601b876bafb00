"""`FullAttentionManager`: the coordinator (cache/coordinator.py) over one full-attention
group named "full" (cache/window.py, W = infinity) of MHA / GQA / MQA / MLA layers.

One request's token positions, against its block table (bs = block_size):

  [0, num_cached)              blocks found in the prefix cache at admission (shared, read-only)
  [num_cached, num_computed)   KV written and committed by this request
  [num_computed, num_reserved) writable slots: blocks exclusive to this request, unpublished
  [num_reserved, ...)          no slots yet

Reservations are block-granular (`exact_steps=False`: the coordinator's "Steps"). Besides
the coordinator's calls, the swap of a computed partial block at preemption (`tail_block`;
at readmission `tail_block_for_restore` and `restore_tail`) and two prefix queries for P/D
transfer (`prefix_blocks`, `chain_for`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from kvpool.cache.base import LowerTier
from kvpool.cache.chains import chain_units, held_copy
from kvpool.cache.coordinator import HybridCacheManager
from kvpool.cache.types import Admission, CacheDescriptor
from kvpool.cache.window import AttentionGroup, AttentionGroupSpec
from kvpool.pool import PrefixBlock


class FullAttentionManager(HybridCacheManager):
    """lower_tier: a tier below device memory (kvpool.tiers): admission takes the longest
    prefix across the device pool and the tier (`GroupAdmission.loads`, `complete_loads`), and
    every cached block the allocator evicts is recorded (`take_evicted`). record_published:
    every block that becomes a full cached block is recorded (`take_published`)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        descriptor: CacheDescriptor,
        *,
        enable_prefix_caching: bool = True,
        hash_algo: str = "xxh3_128",
        lower_tier: LowerTier | None = None,
        record_published: bool = False,
    ) -> None:
        super().__init__(
            [(AttentionGroupSpec("full", block_size), num_blocks)],
            descriptor,
            enable_prefix_caching=enable_prefix_caching,
            hash_algo=hash_algo,
            exact_steps=False,
            lower_tier=lower_tier,
            record_published=record_published,
        )
        self.group = cast(AttentionGroup, self.groups["full"])  # built from an AttentionGroupSpec

    # ---- swap: the computed partial block of a preempted request ---------------------------

    def tail_block(self, request_id: str) -> tuple[int, PrefixBlock, int] | None:
        """(block id, an unregistered prefix block for its content, tokens) of the request's
        computed partial block; None on a block boundary (or caching off)."""
        req = self._get(request_id)
        nc, bs = req.num_computed, self.block_size
        if not self.pool.enable_caching or nc % bs == 0:
            return None
        return (*self.group.partial_block(req.states["full"], req.token_ids, req.mm_items, nc - nc % bs, nc), nc % bs)

    def tail_block_for_restore(self, request_id: str, num_tokens: int) -> tuple[int, PrefixBlock] | None:
        """(block id, prefix block of its would-be content) for restoring `num_tokens`
        positions after the computed full blocks (`restore_tail`); None when they cannot be."""
        req = self._get(request_id)
        if self._restore_refusal(req, num_tokens) is not None:
            return None
        nc = req.num_computed
        return self.group.partial_block(req.states["full"], req.token_ids, req.mm_items, nc, nc + num_tokens)

    def _restore_refusal(self, req: Any, num_tokens: int) -> str | None:
        """Why `num_tokens` positions after the computed prefix cannot be restored, or None."""
        nc, bs = req.num_computed, self.block_size
        if req.num_loading or nc % bs or not 0 < num_tokens < bs or nc + num_tokens >= len(req.token_ids):
            return (
                f"request {req.request_id!r}: cannot restore {num_tokens} tokens after {nc} computed "
                f"({len(req.token_ids)} known, block size {bs})"
            )
        if nc + num_tokens > req.end:
            return f"request {req.request_id!r}: {num_tokens} restored tokens lie past its reservation"
        return None

    def restore_tail(self, request_id: str, num_tokens: int) -> Admission:
        """The runner has written the KV of the `num_tokens` positions after the computed
        full blocks (a swapped-out partial block, loaded back): they count as computed. Only
        before the first step, into the request's own fresh block, leaving a token to
        compute. Returns the admission the engine follows."""
        req = self._get(request_id)
        nc, bs = req.num_computed, self.block_size
        refusal = self._restore_refusal(req, num_tokens)
        if refusal is not None:
            raise ValueError(refusal)
        block_id = req.states["full"].block_ids[nc // bs]
        assert self.pool.refcount(block_id) == 1 and self.pool.block_hash(block_id) is None, "a fresh block"
        req.num_computed = nc + num_tokens
        if req.readmitted:
            self.stats.num_readmitted_hit_tokens += num_tokens
        else:
            self.stats.num_hit_tokens += num_tokens
        # the first step stays inside the admission's reservation (a block boundary past nc)
        n = min(req.budget, len(req.token_ids) - req.num_computed, req.end - req.num_computed)
        assert n > 0
        return Admission(req.num_computed, n, self._admission_parts(req))

    # ---- prefix queries ----------------------------------------------------------------------

    def prefix_blocks(self, token_ids: Sequence[int], *, tenant_salt: str = "") -> tuple[list[int], list[PrefixBlock]]:
        """The cached full blocks of `token_ids` from the first (all of them may match, unlike
        an admission's hit, which leaves a token to compute): their ids and prefix blocks.
        Changes nothing; the ids are valid until the pool next allocates."""
        chain = self.group.hits(self._root(tenant_salt), list(token_ids), ()).chain
        return [held_copy(self.pool, block) for block in chain], chain

    def chain_for(self, token_ids: Sequence[int], *, tenant_salt: str = "") -> list[PrefixBlock]:
        """The prefix blocks (hashes) the full blocks of `token_ids` have under this manager's
        descriptor and `tenant_salt`, cached or not (nothing is registered)."""
        n = len(token_ids) // self.block_size
        return chain_units(self.pool, self._root(tenant_salt), list(token_ids), (), self.block_size, 0, n)
