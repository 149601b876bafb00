"""The recurrent layers' state update (the gated delta rule, attention/hybrid_ops.py) on
state slots: one live state per request and checkpoint slots, each holding every
recurrent layer's matrix.

    state [num_slots, recurrent layers, heads, head_dim (v), head_dim (k)]

A chunk advances its request's live state from where the previous chunk left it and
copies it into each checkpoint slot the cache asked for, at that position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvpool.attention.hybrid_ops import delta_rule


class RecurrentBackend:
    name = "delta-rule"

    def __init__(self, num_layers: int, num_slots: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        shape = (num_slots if num_layers else 0, num_layers, num_heads, head_dim, head_dim)
        self.state = torch.zeros(shape, dtype=dtype)

    @property
    def bytes_per_slot(self) -> int:
        return self.state[0].numel() * self.state.element_size()

    def copy_state(self, src: int, dst: int) -> None:
        self.state[dst] = self.state[src]

    def reset_state(self, slot: int) -> None:
        self.state[slot].zero_()

    def update(
        self,
        layer: int,
        state_slot: int,
        checkpoints: Sequence[tuple[int, int]],
        start: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        beta: Tensor,
        g: Tensor,
    ) -> Tensor:
        """Recurrent layer `layer` (its index among the recurrent layers) over a chunk at
        positions [start, start + n): q, k, v [n, H, hd], beta, g [n, H]. checkpoints:
        (position b, slot): the state after b tokens goes to that slot. Returns [n, H, hd]."""
        live = self.state[state_slot, layer]
        snaps = {b - start - 1: self.state[slot, layer] for b, slot in checkpoints}
        return delta_rule(q, k, v, beta, g, live, snaps)
