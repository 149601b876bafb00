"""Full and sliding-window attention over a token-slot pool (the tiny hybrid models).

One tensor per attention group holds every layer of the group, a token a row:
    kv [num_blocks * block_size, layers of the group, 2 (K, V), kv_heads, head_dim]
A chunk's plan (`AttnPlan`) names the slots it writes (its new positions) and the slots it
reads (every position it may see: from the window's first needed one, or 0), built from
the group's block table by `plan_chunk`. Attention is the plain masked softmax
(attention/hybrid_ops.py), the oracle's own math over the gathered rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from kvpool.attention.hybrid_ops import masked_attention


class AttnPlan(NamedTuple):
    """One chunk in one attention group: slots of the positions it writes [start, end) and
    of the positions it reads [read_start, end) (both int64 [n])."""

    write_slots: Tensor
    read_slots: Tensor
    read_start: int


class SlotAttentionBackend:
    """One attention group's K/V rows and its attention; window None: full attention."""

    name = "gather"

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        window: int | None,
    ) -> None:
        self.block_size, self.window = block_size, window
        self.kv = torch.zeros((num_blocks * block_size, num_layers, 2, num_kv_heads, head_dim), dtype=dtype)

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer of the group, one token."""
        return self.kv[0].numel() * self.kv.element_size()

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (src, dst), in order."""
        bs, kv = self.block_size, self.kv
        for src, dst in copies:
            kv[dst * bs : (dst + 1) * bs] = kv[src * bs : (src + 1) * bs]

    def plan_chunk(self, start: int, end: int, read_start: int, first_block: int, block_ids: list[int]) -> AttnPlan:
        """A chunk's slots: positions [start, end) written, [read_start, end) read; the
        group's table holds position p in block block_ids[p // block_size - first_block]."""
        bs = self.block_size

        def slots(lo: int, hi: int) -> Tensor:
            ids = [block_ids[p // bs - first_block] * bs + p % bs for p in range(lo, hi)]
            return torch.tensor(ids, dtype=torch.long)

        return AttnPlan(slots(start, end), slots(read_start, end), read_start)

    def attend(self, layer: int, plan: AttnPlan, q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """Write the chunk's k, v [n, KVH, hd] of group layer `layer` into its slots, then
        attend q [n, H, hd] (positions [start, start + n)) over its readable rows ->
        [n, H, hd]."""
        end = start + q.shape[0]
        kv = self.kv
        kv[plan.write_slots, layer, 0] = k
        kv[plan.write_slots, layer, 1] = v
        keys = kv[plan.read_slots, layer]  # [n_read, 2, KVH, hd]
        return masked_attention(
            q, keys[:, 0], keys[:, 1], torch.arange(start, end), torch.arange(plan.read_start, end), self.window
        )
